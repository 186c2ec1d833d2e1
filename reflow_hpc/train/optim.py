"""AdamW and the learning-rate schedule of the trainer (``[trainer]`` keys).

Schedule, for the optimizer update with 0-based index ``s`` of a run of ``S = trainer.steps`` steps
with ``W = trainer.warmup_steps`` warm-up steps and peak ``lr``:

- warm-up (``s < W``): ``lr · (s + 1) / W`` — linear, non-zero at the very first update, the
  peak at update ``W - 1``;
- then ``constant``: ``lr``; or ``cosine``: from ``lr`` at update ``W`` down to
  ``min_lr_ratio · lr`` at the last update ``S - 1``, following half a cosine;
- a single update after warm-up runs at the peak (a floor of 0 must not swallow the only update);
- past ``S - 1`` (a run extended on resume) the value of the last update is kept.

The factor is computed from the configured step count when the scheduler is built, never from a
count discovered later; it is 0 only when ``schedule = "cosine"`` and ``min_lr_ratio = 0``, and
then only at the last of two or more updates after warm-up.

Weight decay applies to matrices and embeddings (tensors of 2 or more dimensions), not to norm
scales or biases.
"""

from __future__ import annotations

import warnings

import math
from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:
    from ..config import TrainerConfig


def lr_factor(step: int, *, steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at 0-based update ``step`` (module docstring)."""
    if steps < 1:
        raise ValueError(f"trainer.steps = {steps}: the schedule needs at least one step")
    if not 0 <= warmup_steps <= steps:
        raise ValueError(f"trainer.warmup_steps = {warmup_steps}: must be in [0, trainer.steps = {steps}]")
    s = min(max(step, 0), steps - 1)
    if s < warmup_steps:
        return (s + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = steps - 1 - warmup_steps
        progress = 0.0 if span <= 0 else (s - warmup_steps) / span
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"trainer.schedule = {schedule!r}: allowed: constant, cosine")


def schedule_factors(cfg: "TrainerConfig") -> list[float]:
    """The factor of every update of the run, for checks and plots."""
    return [lr_factor(s, steps=cfg.steps, warmup_steps=cfg.warmup_steps, schedule=cfg.schedule,
                      min_lr_ratio=cfg.min_lr_ratio) for s in range(cfg.steps)]


def build_optimizer(params: Iterable[tuple[str, torch.nn.Parameter]], cfg: "TrainerConfig") -> torch.optim.AdamW:
    """AdamW over the named trainable parameters, decay on tensors of ≥ 2 dimensions only."""
    decay, no_decay = [], []
    for _, p in params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: "TrainerConfig") -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of the module docstring; call ``step()`` once after each optimizer update."""
    steps, warmup, schedule, floor = cfg.steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio
    lr_factor(0, steps=steps, warmup_steps=warmup, schedule=schedule, min_lr_ratio=floor)   # fail now, not later
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, steps=steps, warmup_steps=warmup, schedule=schedule, min_lr_ratio=floor))


def adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """The AdamW state of ``p`` (``step``, ``exp_avg``, ``exp_avg_sq``), created zero as AdamW would when
    there has been no update yet, so that replicas and checkpoints always hold the same tensors."""
    st = optimizer.state[p]
    if not st:
        st["step"] = torch.zeros((), dtype=torch.float32)
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def apply_update(optimizer: torch.optim.Optimizer, scheduler: Any, finite: bool) -> None:
    """One step of ``optimizer`` when the gradient norm was ``finite`` (else none: the update is skipped),
    the schedule moved either way, the gradients cleared."""
    if finite:
        optimizer.step()
        scheduler.step()
    else:
        with warnings.catch_warnings():   # torch warns when the schedule moves without an update
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
