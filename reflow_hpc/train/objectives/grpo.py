"""GRPO (Shao et al. 2024, DeepSeekMath): group-normalised advantages, PPO's clipped surrogate per token.

    A_i  = (r_i - mean(r)) / (std(r) + eps)                      (estimator group_norm)
    ρ_t  = π(y_t) / π_old(y_t)
    ℓ_t  = -min(ρ_t A_i, clip(ρ_t, 1 - clip_low, 1 + clip_high) A_i)   (dual clip: algorithm.clip_ratio_c)

Aggregated by ``token_mean`` over the whole batch unless ``algorithm.loss_agg`` says otherwise
(DeepSeekMath averages per sequence; token-mean is what DAPO and most frameworks run, and this
system's loss before objectives were selectable).

Replay (mode reflow, σ > 0): a replayed sample enters with the advantage its group gave it
(``algorithm.replay_advantage = keep``) or one recomputed against the newest group of its prompt
(``recompute``); each token's ratio is taken against the log-prob the engine recorded when that token
was generated, so the tokens of a partial rollout that span several versions each use their own
behaviour policy; its weight is τ·ω_i / Z. A replayed sample is one or more versions older than the
trainer's policy, so its ratios stray further from 1 and the clip binds more often (``is_cap``
corrects for the gap instead of clipping it away).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Objective, PgTerms, ppo_clip, token_ratio


class GRPO(Objective):
    advantage = "group_norm"
    loss_agg = "token_mean"

    def __init__(self, alg: Any):
        super().__init__(alg)
        self.clip_low, self.clip_high = float(alg.clip_low), float(alg.clip_high)
        self.clip_c = float(getattr(alg, "clip_ratio_c", 0.0))

    def per_token_loss(self, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                       adv: torch.Tensor) -> PgTerms:
        return ppo_clip(token_ratio(logp, old_logp, mask), adv, self.clip_low, self.clip_high, self.clip_c)
