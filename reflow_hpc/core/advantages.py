"""GRPO group-normalised advantages.

For the finished members of one group with rewards r_1..r_m:

    A_i = (r_i - mean(r)) / (std(r) + eps)      (std_norm = True)
    A_i =  r_i - mean(r)                        (std_norm = False)

std is the population standard deviation (divides by m), so a group with one finished member, or
with equal rewards, gets advantages of 0 instead of a division by zero.
"""

from __future__ import annotations

import math
from typing import Sequence


def group_advantages(rewards: Sequence[float], *, eps: float, std_norm: bool = True) -> list[float]:
    m = len(rewards)
    if m == 0:
        return []
    mean = math.fsum(rewards) / m
    centred = [r - mean for r in rewards]
    if not std_norm:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / m)
    scale = 1.0 / (std + eps)
    return [c * scale for c in centred]
