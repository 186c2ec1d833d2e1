"""RLOO (Ahmadian et al. 2024, Back to Basics: Revisiting REINFORCE Style Optimization for Learning
from Human Feedback in LLMs; Kool et al. 2019): the baseline of a sample is the mean reward of the
*other* samples of its group, which keeps the estimator unbiased:

    A_i = r_i - (1/(m-1)) Σ_{j≠i} r_j = m/(m-1) · (r_i - mean(r))   (estimator leave_one_out)
    ℓ_t = -min(ρ_t A_i, clip(ρ_t, 1 - clip_low, 1 + clip_high) A_i)  (REINFORCE when on-policy: ρ = 1)
    L   = Σ_i Σ_t ℓ_it / Σ_i |y_i|                                   (token_mean)

Replay: as grpo; the kept advantage is the leave-one-out difference computed over the whole group
when it completed (``recompute`` takes the newest group's mean as the baseline instead).
"""

from __future__ import annotations

from .grpo import GRPO


class RLOO(GRPO):
    advantage = "leave_one_out"
    loss_agg = "token_mean"
