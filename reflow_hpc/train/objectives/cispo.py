"""CISPO (MiniMax-M1, 2025: Scaling Test-Time Compute Efficiently with Lightning Attention).

Clips the importance weight instead of the update: the weight is clipped and its gradient stopped,
so every token — also one whose ratio left the trust region — keeps the gradient of its log-prob:

    ρ_t = π(y_t) / π_old(y_t)
    ℓ_t = -sg(min(ρ_t, ε_max)) · A_i · log π(y_t)       (ε_max = algorithm.cispo_clip_high, 5 as in
                                                          ScaleRL, Khatri et al. 2025)
    L   = Σ_i Σ_t ℓ_it / Σ_i |y_i|                        (token_mean)

The paper leaves the weight's lower bound open, as TRL's ``loss_type = "cispo"`` does, so a token with a
negative advantage keeps being pushed down however far its probability has already fallen. Here such a
token gets no gradient once ρ_t < 1 - ε_low (``algorithm.cispo_clip_low``, 0.2): the token mask M_t of
MiniMax-M1's unified form, PPO's trust region on that side only. Without it (``cispo_clip_low = 1``) the
main job's eval reward ended 0.07 below grpo's over 3 seeds, its entropy did not fall and its
well-formed answers became fewer (docs/results.md); positive-advantage tokens keep CISPO's gradient.

Replay: the stop-gradient weight min(ρ_t, ε_max) takes each token's ratio against its own recorded
behaviour log-prob; a replayed token with a large ratio is capped at ε_max but still contributes its
gradient (no token is clipped away), so CISPO keeps learning from old samples where PPO's clip would
drop them. The advantage and the weight τ·ω_i / Z are as in grpo.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Objective, PgTerms, token_ratio


class CISPO(Objective):
    advantage = "group_norm"
    loss_agg = "token_mean"

    def __init__(self, alg: Any):
        super().__init__(alg)
        self.clip_high = float(alg.cispo_clip_high)
        self.clip_low = float(alg.cispo_clip_low)

    def per_token_loss(self, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                       adv: torch.Tensor) -> PgTerms:
        ratio = token_ratio(logp, old_logp, mask)
        weight = torch.clamp(ratio, max=self.clip_high).detach()
        # log π of a padding position may be anything; it is masked out, but must not make NaNs
        masked = (adv < 0) & (ratio < 1.0 - self.clip_low)
        live = mask & ~masked
        pg = -weight * adv * torch.where(live, logp, torch.zeros_like(logp))
        return PgTerms(pg, ratio, masked | (ratio > self.clip_high))
