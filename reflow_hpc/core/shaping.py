"""Overlong reward shaping (Yu et al. 2025, DAPO §3.4, "soft overlong punishment").

With L_max = ``rollout.max_new_tokens``, L_cache = ``algorithm.overlong_buffer`` and P =
``algorithm.overlong_penalty``, a response of |y| generated tokens gets::

    R_length(y) = 0                                   |y| ≤ L_max − L_cache
                  ((L_max − L_cache) − |y|) / L_cache · P     L_max − L_cache < |y| ≤ L_max
                  −P                                  L_max < |y|

added to the task's reward where a finished sample is scored, on its rollout worker
(:class:`reflow_hpc.rollout.episodes.EpisodeRunner`; the simulator adds it to its modelled rewards).
A pure function of the token count, here so that every layer that needs it (rollout, metrics,
simulator) can import it. |y| counts the tokens the model generated over
every turn of the sample — its loss tokens; tool observations are not the model's and do not count.
The task's own reward stays in the trajectory's ``meta["task_reward"]``; the step records report
both (``reward/mean`` shaped, ``reward/task_mean`` not), and evaluation scores the task's reward
alone. L_cache = 0 turns the shaping off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OverlongShaping:
    max_tokens: int      # L_max
    buffer: int          # L_cache (> 0)
    penalty: float       # P

    def __post_init__(self) -> None:
        if not 0 < self.buffer <= self.max_tokens or self.penalty < 0:
            raise ValueError(f"overlong shaping: buffer {self.buffer} must be in (0, {self.max_tokens}] and "
                             f"penalty {self.penalty} ≥ 0")

    def __call__(self, tokens: int) -> float:
        """R_length of a response of ``tokens`` generated tokens (module docstring)."""
        free = self.max_tokens - self.buffer
        if tokens <= free:
            return 0.0
        if tokens <= self.max_tokens:
            return (free - tokens) / self.buffer * self.penalty
        return -self.penalty

    @classmethod
    def of(cls, cfg: Any) -> "OverlongShaping | None":
        """The shaping a config asks for (``[algorithm]`` overlong_buffer, overlong_penalty and
        ``rollout.max_new_tokens``); None when the buffer is 0."""
        a = cfg.algorithm
        buffer = auto_buffer(a.name, cfg.rollout.max_new_tokens) if a.overlong_buffer < 0 else a.overlong_buffer
        if not buffer:
            return None
        return cls(cfg.rollout.max_new_tokens, buffer, float(a.overlong_penalty))


# DAPO's recipe shapes the last 4,096 of 20,480 tokens: a fifth of L_max.
AUTO_BUFFER_FRACTION = 0.2


def auto_buffer(objective: str, max_tokens: int) -> int:
    """``algorithm.overlong_buffer = -1`` (auto): a fifth of L_max for objective dapo, off otherwise."""
    return int(max_tokens * AUTO_BUFFER_FRACTION) if objective == "dapo" else 0
