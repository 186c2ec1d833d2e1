"""Learning-rate schedule: non-zero from the first update, linear warm-up, spans exactly trainer.steps."""

from __future__ import annotations

import math

import pytest
import torch

from reflow_hpc.config import ConfigError, TrainerConfig, load
from reflow_hpc.train.optim import build_optimizer, build_scheduler, lr_factor, schedule_factors


def _lrs_seen_by_updates(cfg: TrainerConfig) -> list[float]:
    """The learning rate each of the run's updates actually uses, through a real AdamW + scheduler."""
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer([("w", p)], cfg)
    sched = build_scheduler(opt, cfg)
    seen = []
    for _ in range(cfg.steps):
        seen.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    return seen


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
@pytest.mark.parametrize("steps,warmup", [(1, 0), (1, 1), (2, 0), (10, 0), (10, 3), (10, 10), (37, 5)])
def test_lr_is_never_zero_and_matches_the_factors(schedule, steps, warmup):
    cfg = TrainerConfig(steps=steps, warmup_steps=warmup, schedule=schedule, lr=3e-4, min_lr_ratio=0.1)
    seen = _lrs_seen_by_updates(cfg)
    assert len(seen) == steps
    assert all(lr > 0 for lr in seen), seen
    assert seen == pytest.approx([3e-4 * f for f in schedule_factors(cfg)], rel=1e-12)


def test_warmup_is_linear_and_starts_non_zero():
    cfg = TrainerConfig(steps=20, warmup_steps=4, schedule="constant", lr=1e-3)
    seen = _lrs_seen_by_updates(cfg)
    assert seen[:5] == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3])
    assert seen[-1] == pytest.approx(1e-3)


def test_cosine_spans_exactly_the_configured_steps():
    cfg = TrainerConfig(steps=12, warmup_steps=2, schedule="cosine", lr=1e-3, min_lr_ratio=0.1)
    seen = _lrs_seen_by_updates(cfg)
    assert seen[:3] == pytest.approx([0.5e-3, 1e-3, 1e-3])         # warm-up, then the peak
    assert seen[-1] == pytest.approx(1e-4, rel=1e-12)                 # the floor at the last update ...
    assert all(lr > 1e-4 * (1 + 1e-9) for lr in seen[:-1])            # ... and not before
    assert all(a >= b for a, b in zip(seen[2:], seen[3:]))            # non-increasing after warm-up
    mid = 2 + (12 - 1 - 2) / 2                                        # half-way: the mean of peak and floor
    assert lr_factor(int(mid), steps=12, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 2) / 9)))
    # Past the configured end (a run extended on resume) the floor is kept, never 0 and never a restart.
    assert lr_factor(50, steps=12, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1) == pytest.approx(0.1)


def test_zero_only_when_configured_so():
    cfg = TrainerConfig(steps=6, warmup_steps=0, schedule="cosine", lr=1e-3, min_lr_ratio=0.0)
    seen = _lrs_seen_by_updates(cfg)
    assert seen[-1] == 0.0 and all(lr > 0 for lr in seen[:-1])
    # A single update after warm-up runs at the peak even with a floor of 0.
    one = TrainerConfig(steps=3, warmup_steps=2, schedule="cosine", lr=1e-3, min_lr_ratio=0.0)
    assert _lrs_seen_by_updates(one) == pytest.approx([0.5e-3, 1e-3, 1e-3])


def test_bad_schedule_inputs_fail_clearly():
    with pytest.raises(ValueError, match="trainer.steps"):
        lr_factor(0, steps=0, warmup_steps=0, schedule="constant", min_lr_ratio=0.1)
    with pytest.raises(ValueError, match="trainer.warmup_steps"):
        build_scheduler(build_optimizer([("w", torch.nn.Parameter(torch.zeros(1)))], TrainerConfig()),
                        TrainerConfig(steps=3, warmup_steps=5))
    with pytest.raises(ConfigError, match="trainer.warmup_steps"):
        load(None, ["trainer.steps=3", "trainer.warmup_steps=5"], check_files=False)


def test_adamw_keys_and_decay_groups():
    cfg = TrainerConfig(weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)
    w, b = torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer([("w", w), ("b", b)], cfg)
    groups = {len(g["params"][0].shape): g for g in opt.param_groups}
    assert groups[2]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert groups[2]["betas"] == (0.8, 0.95) and groups[2]["eps"] == 1e-6
