"""Training (DESIGN §7): the GRPO loss (``loss``), AdamW and its schedule (``optim``), a trainer replica
(``trainer``), flat tensor buckets (``buckets``), the trainer → rollout weight sync (``weight_sync``)
and checkpoints (``checkpoint``). Import the modules themselves; this package imports nothing, so
that importing it stays cheap.
"""
