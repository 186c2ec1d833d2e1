"""DAPO (Yu et al. 2025, DAPO: An Open-Source LLM Reinforcement Learning System at Scale).

GRPO's surrogate with clip-higher (a wider upper clip, ``algorithm.dapo_clip_high`` = 0.28 by
default) and token-level aggregation over the whole batch:

    ℓ_t = -min(ρ_t A_i, clip(ρ_t, 1 - clip_low, 1 + dapo_clip_high) A_i)
    L   = Σ_i Σ_t ℓ_it / Σ_i |y_i|                                 (token_mean)

DAPO's dynamic sampling (dropping groups whose rewards are all equal) and overlong reward shaping
act on samples and rewards, not on the loss; they are not part of this objective.

Replay: as grpo (the clip-higher bound applies to replayed tokens too). Dynamic sampling drops
uninformative groups before they are ever trained, so only samples of informative groups are
replayed.
"""

from __future__ import annotations

from typing import Any

from .grpo import GRPO


class DAPO(GRPO):
    advantage = "group_norm"
    loss_agg = "token_mean"

    def __init__(self, alg: Any):
        super().__init__(alg)
        self.clip_high = float(alg.dapo_clip_high)
