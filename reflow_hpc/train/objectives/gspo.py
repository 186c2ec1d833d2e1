"""GSPO (Zheng et al. 2025, Group Sequence Policy Optimization).

One importance ratio per sequence, the length-normalised (geometric mean) token ratio, clipped at the
sequence level with its own, much narrower range (``algorithm.gspo_clip_low`` / ``gspo_clip_high``,
3e-4 / 4e-4 as in the paper):

    s_i = exp( (1/|y_i|) Σ_t log(π(y_it) / π_old(y_it)) )
    ℓ_i = -min(s_i A_i, clip(s_i, 1 - gspo_clip_low, 1 + gspo_clip_high) A_i)
    L   = (1/B) Σ_i ℓ_i                                  (seq_mean_token_mean: ℓ_i on every token of i)

∇s_i = s_i (1/|y_i|) Σ_t ∇log π(y_it): every token of a sequence gets the same weight.

Replay: the sequence ratio s_i is the geometric mean of the per-token ratios, each token against the
log-prob recorded when it was generated, so a sample whose tokens come from several versions still
has one well-defined s_i. A replayed sample's s_i drifts from 1 by its staleness; GSPO's narrow
sequence clip then zeroes its gradient more often than a fresh sample's (clip_fraction rises with
the replay fraction), which is the point of a sequence-level trust region. The advantage and the
weight τ·ω_i / Z are as in grpo.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Objective, PgTerms, ppo_clip


class GSPO(Objective):
    advantage = "group_norm"
    loss_agg = "seq_mean_token_mean"

    def __init__(self, alg: Any):
        super().__init__(alg)
        self.clip_low, self.clip_high = float(alg.gspo_clip_low), float(alg.gspo_clip_high)

    def per_token_loss(self, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                       adv: torch.Tensor) -> PgTerms:
        log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
        n = mask.to(logp.dtype).sum(-1, keepdim=True).clamp(min=1.0)
        s = torch.exp(log_ratio.sum(-1, keepdim=True) / n)           # [B, 1]
        return ppo_clip(s, adv, self.clip_low, self.clip_high)
