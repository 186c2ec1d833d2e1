"""Group advantages: the estimators an objective (``algorithm.name``) chooses from by name.

For the finished members of one group with rewards r_1..r_m:

    group_norm:     A_i = (r_i - mean(r)) / (std(r) + eps)   (GRPO, Shao et al. 2024; std_norm = False
                    leaves A_i = r_i - mean(r))
    group_centre:   A_i =  r_i - mean(r)                     (Dr. GRPO, Liu et al. 2025: no std)
    leave_one_out:  A_i =  r_i - mean_{j≠i}(r_j) = m/(m-1) · (r_i - mean(r))
                    (RLOO, Ahmadian et al. 2024, "Back to Basics"; 0 for a group of one)
    none:           A_i =  0                                 (ppo: the trainer computes per-token GAE
                    advantages from its critic, reflow_hpc/train/objectives/ppo.py; the coordinator's
                    value is not read)

std is the population standard deviation (divides by m), so a group with one finished member, or
with equal rewards, gets advantages of 0 instead of a division by zero.
"""

from __future__ import annotations

import math
from typing import Sequence


ESTIMATORS = ("group_norm", "group_centre", "leave_one_out", "none")


def group_advantages(rewards: Sequence[float], *, eps: float, std_norm: bool = True,
                     estimator: str = "group_norm") -> list[float]:
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r}: allowed: " + ", ".join(ESTIMATORS))
    m = len(rewards)
    if m == 0:
        return []
    if estimator == "none":
        return [0.0] * m
    mean = math.fsum(rewards) / m
    centred = [r - mean for r in rewards]
    if estimator == "leave_one_out":
        if m == 1:
            return [0.0]       # no other member to be a baseline
        # r_i - (Σr - r_i)/(m-1), written from the centred values: exact for equal rewards
        return [c * m / (m - 1) for c in centred]
    if estimator == "group_centre" or not std_norm:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / m)
    scale = 1.0 / (std + eps)
    return [c * scale for c in centred]
