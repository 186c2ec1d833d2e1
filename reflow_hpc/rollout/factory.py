"""Building a rollout engine and its default sampling parameters from the ``[rollout]`` section.

``rollout.engine = "torch"`` builds the embedded engine; ``"vllm"`` builds vLLM's, which needs vLLM
installed in the running Python (``tools/vllm_env.sh`` builds a CPU one) and ``rollout.top_p = 1``.
The rules of the ``[rollout]`` keys are ``config``'s; an engine checks its limits again against its
model (``engine.check_limits``).
"""

from __future__ import annotations

import importlib.util

from ..config import ConfigError, RolloutConfig
from .engine import Engine, SamplingParams


def build_engine(model, cfg: RolloutConfig, *, device: str = "cpu", seed: int = 0, version: int = 0,
                 tp: int = 1) -> Engine:
    """The engine named by ``cfg.engine`` over ``model`` (a ``transformers`` causal LM), on ``device``;
    ``tp`` > 1 (vLLM only): this rank is one of an instance's ``tp`` tensor-parallel ranks.

    ``seed`` should be the run's seed on every worker: with globally unique request ids, a sample's
    tokens then do not depend on which worker generated it.
    """
    if cfg.engine == "torch":
        if tp != 1:
            raise ConfigError("resources.rollout_tp_size", tp, "the torch engine runs one model per rank: only 1")
        from .torch_engine import TorchEngine
        return TorchEngine.from_config(model, cfg, device=device, seed=seed, version=version)
    if cfg.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine", "vllm", "vLLM is not installed in this Python; build its environment "
                                                      "with tools/vllm_env.sh and run from .venv-vllm/bin/python")
        from .vllm_engine import VllmEngine
        return VllmEngine.from_config(model, cfg, device=str(device), seed=seed, version=version, tp=tp)
    raise ConfigError("rollout.engine", cfg.engine, "must be torch or vllm")


def sampling_params(cfg: RolloutConfig, stop_ids: tuple[int, ...] = (), seed: int | None = None) -> SamplingParams:
    """Sampling parameters of a sample from the config (stop ids come from the task's tokenizer)."""
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                          stop_ids=tuple(int(s) for s in stop_ids), seed=seed)
