"""Dr. GRPO (Liu et al. 2025, Understanding R1-Zero-Like Training: A Critical Perspective).

GRPO without its two biases: no division by the group's reward std, and no per-sequence length
normalisation — the token sum is divided by a constant, the largest response length:

    A_i = r_i - mean(r)                                          (estimator group_centre)
    ℓ_t = -min(ρ_t A_i, clip(ρ_t, 1 - clip_low, 1 + clip_high) A_i)
    L   = Σ_i Σ_t ℓ_it / (B · L_max)     (seq_mean_token_sum_norm, L_max = rollout.max_new_tokens)

Replay: as grpo; the kept advantage is the centred reward, with no std to rescale it.
"""

from __future__ import annotations

from .grpo import GRPO


class DrGRPO(GRPO):
    advantage = "group_centre"
    loss_agg = "seq_mean_token_sum_norm"
