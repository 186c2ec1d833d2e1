"""reflow_hpc: replay-driven RL post-training of LLMs on Slurm (ReFlow)."""

__version__ = "0.1.0"
