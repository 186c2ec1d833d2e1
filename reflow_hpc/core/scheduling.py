"""Adaptive generation scheduling (paper §6.1): a slow controller of each rollout worker's concurrency
cap and a fast, token-aware admission rule for dispatch. Pure: observations arrive with their time.

Slow controller (every ``control_interval_s`` of a worker's reports)
    Each rollout worker i reports its engine's KV utilisation ``u = kv_tokens_used / kv_tokens_budget``
    and its cumulative preemption count. The controller keeps exponential moving averages with
    weight ``α`` (``ema_alpha``)::

        û_i ← α·u_i + (1−α)·û_i            ΔP̂_i ← α·ΔP_i + (1−α)·ΔP̂_i

    where ΔP_i is the number of preemptions since the previous control step. Then, first rule that
    matches (an AIMD law, as congestion control)::

        ΔP̂_i > preemption_limit   →  cap_i ← max(cap_min, ⌊cap_i · decrease⌋)    KV congestion: back off
        û_i  < util_low          →  cap_i ← min(cap_max, cap_i + increase)     under-used: admit more
        û_i  > util_high         →  cap_i ← max(cap_min, cap_i − 1)            near full: trim
        otherwise                →  cap_i unchanged

    ``cap_max`` is the engine's slot count (``rollout.max_concurrency``); the cap is what the engine
    may run at once and what the ``rollout/concurrency_cap/<rank>`` metric reports.

Fast dispatcher (every dispatch)
    A request r (a GRPO group of n samples: their KV footprint is predicted together) may go to
    worker i only if::

        (T_pred_i + T̂(r)) / Budget_i ≤ ρ

    where ``Budget_i`` is the worker's KV budget in tokens, ``T̂(r) = n · L̂`` with ``L̂`` an
    exponential moving average (weight ``ema_alpha``) of the tokens (prompt + response) of finished
    samples, seeded with ``initial_tokens`` before any finished, and ``T_pred_i`` the predicted
    tokens of the samples already dispatched to i and not finished (each counted at ``L̂``). Among
    the workers that admit r, it goes to the one with the smallest ratio (ties: fewest samples
    outstanding, then the lowest rank), which balances load. A worker also never holds more than
    ``cap_i + queue`` samples (the engine's running slots plus a queue that keeps it busy between
    dispatches). Both rules bind only once a worker holds work: an idle worker always takes a group,
    or a group larger than a cap or a budget could never run. Samples a worker reported waiting for a
    tool call or a reward hold no engine slot and no KV cache, so neither rule counts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class SchedulingSettings:
    adaptive: bool = True            # False: caps stay at cap_max, admission by count only
    ema_alpha: float = 0.3
    control_interval_s: float = 2.0
    util_low: float = 0.6
    util_high: float = 0.85
    preemption_limit: float = 0.5    # smoothed preemptions per control step
    increase: int = 2
    decrease: float = 0.7
    cap_min: int = 1
    rho: float = 0.95
    queue: int = 32                  # samples a worker may hold beyond its cap
    initial_tokens: float = 64.0     # L̂ before any sample finished


@dataclass
class EngineLoad:
    """A rollout worker's engine as it reported it (raw values; verdicts are the controller's)."""
    kv_tokens_used: int
    kv_tokens_budget: int
    preemptions: int                 # cumulative
    running: int
    queued: int
    waiting: int = 0                 # samples waiting for a tool call or a reward, outside the engine


class GenerationScheduler:
    """Concurrency caps and admission for a set of rollout workers (module docstring)."""

    def __init__(self, settings: SchedulingSettings, workers: list[int], *, cap_max: int, kv_budget: int):
        self.s = settings
        self.cap_max = cap_max
        self.caps = {w: cap_max for w in workers}
        self.budget = {w: kv_budget for w in workers}
        self.util = {w: 0.0 for w in workers}
        self.preempt_rate = {w: 0.0 for w in workers}
        self.waiting = {w: 0 for w in workers}     # samples outside the engine, as last reported
        self._last_preemptions = {w: 0 for w in workers}
        self._last_control: dict[int, float | None] = {w: None for w in workers}
        self.predicted_tokens = float(settings.initial_tokens)

    # -- inbound ------------------------------------------------------------------------------

    def add_worker(self, w: int) -> None:
        """A worker joined the rollout pool (a role switch): it starts at the full cap."""
        self.caps.setdefault(w, self.cap_max)
        self.budget.setdefault(w, next(iter(self.budget.values()), 0))
        self.util.setdefault(w, 0.0)
        self.preempt_rate.setdefault(w, 0.0)
        self.waiting.setdefault(w, 0)
        self._last_preemptions.setdefault(w, 0)
        self._last_control.setdefault(w, None)

    def remove_worker(self, w: int) -> None:
        for d in (self.caps, self.budget, self.util, self.preempt_rate, self.waiting, self._last_preemptions,
                  self._last_control):
            d.pop(w, None)

    def observe(self, w: int, load: EngineLoad, now: float) -> bool:
        """A load report of worker ``w``; returns True when its cap changed (a control step ran)."""
        if w not in self.caps:
            return False
        if load.kv_tokens_budget > 0:
            self.budget[w] = load.kv_tokens_budget
        self.waiting[w] = load.waiting
        last = self._last_control[w]
        if last is not None and now - last < self.s.control_interval_s:
            return False
        self._last_control[w] = now
        a = self.s.ema_alpha
        u = load.kv_tokens_used / load.kv_tokens_budget if load.kv_tokens_budget else 0.0
        dp = max(0, load.preemptions - self._last_preemptions[w])
        self._last_preemptions[w] = load.preemptions
        if last is None:                       # the first report seeds the averages
            self.util[w], self.preempt_rate[w] = u, float(dp)
        else:
            self.util[w] = a * u + (1 - a) * self.util[w]
            self.preempt_rate[w] = a * dp + (1 - a) * self.preempt_rate[w]
        if not self.s.adaptive:
            return False
        old = self.caps[w]
        if self.preempt_rate[w] > self.s.preemption_limit:
            new = max(self.s.cap_min, int(old * self.s.decrease))
        elif self.util[w] < self.s.util_low:
            new = min(self.cap_max, old + self.s.increase)
        elif self.util[w] > self.s.util_high:
            new = max(self.s.cap_min, old - 1)
        else:
            new = old
        self.caps[w] = new
        return new != old

    def finished(self, tokens: int) -> None:
        """A sample finished with ``tokens`` (prompt + response): update the length prediction."""
        a = self.s.ema_alpha
        self.predicted_tokens = a * tokens + (1 - a) * self.predicted_tokens

    # -- the dispatcher -----------------------------------------------------------------------

    def choose(self, outstanding: dict[int, int], group_size: int,
               workers: Iterable[int] | None = None) -> int | None:
        """The worker a group of ``group_size`` samples goes to, or None when no worker admits it.
        ``outstanding`` is the samples dispatched to each rollout worker and not finished; ``workers``
        the candidates, in order (default: every worker of ``outstanding``)."""
        # (Called once per finished sample: the settings are read once per call.)
        caps, cap_max, budgets, room = self.caps, self.cap_max, self.budget, self.s.queue
        tokens = self.predicted_tokens
        need = group_size * tokens
        gate = self.s.rho if self.s.adaptive else math.inf
        best, best_key = None, None
        waiting = self.waiting
        for w in outstanding if workers is None else workers:
            n = max(0, outstanding[w] - waiting.get(w, 0))
            # An idle worker always takes a group: no cap or budget may leave the pool with nothing to do.
            if n and n + group_size > caps.get(w, cap_max) + room:
                continue
            budget = budgets.get(w) or 0
            ratio = (n * tokens + need) / budget if budget else 0.0
            if n and ratio > gate:
                continue
            key = (ratio, n, w)
            if best_key is None or key < best_key:
                best, best_key = w, key
        return best

    def gauges(self) -> dict[str, float]:
        out: dict[str, float] = {"scheduler/predicted_tokens": self.predicted_tokens}
        for w in sorted(self.caps):
            out[f"rollout/concurrency_cap/{w}"] = self.caps[w]
            out[f"rollout/kv_util_ema/{w}"] = self.util[w]
        return out
