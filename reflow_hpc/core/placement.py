"""Rollout/trainer placement (paper §6.2, Algorithm 1): how many workers train and how many generate.

Producer–consumer model. Rollout workers produce samples; trainers consume ``b`` per step, of which
at least ``(1−σ)·b`` must be unused (fresh), and more when replay cannot fill its ``σ·b`` slots: at a
small δ a trained sample is often evicted as too stale before it can be replayed. Over each window
(one step) the planner measures:

- ``produced``: fresh samples that finished in the window, ``n_R`` rollout workers;
- ``step_s``: the window's wall time; ``idle_T``: the fraction of it the trainers waited for a batch;
  ``idle_R``: the fraction the rollout workers had nothing to generate;
- ``r``: the replay samples the next batch can draw (the replay pool after the step, at most σ·b).

Waiting is not capacity. A trainer that starved for data, or a rollout worker blocked by the
dispatch window or the staleness bound, would have done more, so the planner corrects for it::

    p = produced / (n_R · step_s · (1 − idle_R))      fresh samples per second of one busy rollout worker
    t = step_s · (1 − idle_T) · n_T                    compute seconds of one step on one trainer replica

Both are smoothed over windows with an exponential moving average of weight ``ema_alpha``; ``p`` as
the ratio of the smoothed numerator and denominator, not as a smoothed ratio. A window in which the
rollout workers were idle almost throughout tells little about their rate, and dividing by its sliver
of busy time would inflate ``p`` a hundredfold on the samples that happened to finish in it (4 CPU
ranks: log mismatches of 5–7, that is a supply predicted 150–1,000 times too large, for the rest of
the run). As a ratio of sums such a window weighs by the busy time it had.

Usable, not produced. A fresh sample counts only if it is still within δ when a step trains it, and
how many are depends on the split: a sample that takes ``g`` seconds from dispatch to finish spans
``g / step`` versions, so the faster a split steps, the more of the long tail arrives too stale. Per
window the planner folds in, by response-length bucket (powers of two of tokens), how many fresh
samples finished and their mean production time ``g_k`` (smoothed like ``p``); and, from the fresh
samples the step trained, the offset ``c`` = mean(staleness − g / step) (smoothed): the weight-sync
lag, where in a step a sample started, and its wait in the pool. Staleness at training is modelled
as ``floor(g / step + U) + c``, ``U`` uniform on [0, 1) (its mean less ``g / step`` is then ``c``),
so a sample of bucket ``k`` is usable with probability ``clamp(δ + 1 − c − g_k / step, 0, 1)``; the
usable fraction ``u(step)`` is the buckets' mean weighted by their counts (1 when the mode has no
staleness bound, or before anything was measured).

The batch's composition. A split does not train the batch another split trains: the more fresh samples
finish during a step, the more of its ``b`` slots they take (at least ``b − r``, at most ``b``), and
the fewer replays fill; fresh and replayed samples differ in length, and fresh ones by the split too
(a faster step loses more of the long tail to δ). So ``T`` is not ``t / n_T'`` but a step's tokens
times the compute per token: from each trained batch the planner smooths the replica compute seconds
per token (``t`` over the batch's response tokens plus ``b`` × the mean prompt tokens of the fresh
production), the mean response tokens of its fresh and of its replayed samples, and predicts for a
step of ``step`` seconds at a split that finishes ``A = p·n_R'·step·u(step)`` usable fresh samples in it::

    f = min(b, max(A, b − r))                 fresh samples in the batch
    T = cost · (b·prompt + f·L_fresh(step) + (b − f)·L_replay) / n_T'

``L_fresh`` is the measured mean scaled by the ratio of the usable buckets' mean lengths at ``step``
and at the step time it was measured at. (4 CPU ranks, ``cpu_drift.toml``: moving from n_T = 3 to 2
took a step from 1,029–1,080 tokens to 1,356, fresh samples filling the slots replays had, and a
trainer replica's compute per step 2.1× where ``t / n_T'`` predicted 1.5×.) Before a batch was
measured, and in tests that give none, ``T = t / n_T'``.

Feasible placements are every ``(n_T, n_R)`` with ``n_T·s_T + n_R·s_R = W``, ``n_T ≥ 1`` and
``n_R ≥ 1`` (``s_T``, ``s_R``: workers per trainer replica and per rollout instance). For each the
rates are extrapolated linearly (data-parallel replicas; independent engines, so ``g_k`` and ``c``
stay) to a predicted step time, the fixed point of::

    step'(n_T) = E[max(T, S)],  T ≈ t / n_T' (but see the batch's composition),  S ≈ (b − r) / (p · n_R' · u(step'))

(``r`` smoothed like ``p`` and ``t``; ``u`` grows with the step time, so the fixed point is unique and
found by bisection), and the placement that steps fastest is proposed (ties: the current placement,
then more rollout workers). A step waits for the later of its trainers and its fresh supply, and
both jitter from step to step (the length mix, group completion), so the maximum of the means
underestimates it most where the two are balanced (4 CPU ranks at n_T = 3: predicted 0.56–0.68 s
against 0.69–0.78 s measured). ``T`` and ``S`` are taken as independent normals with the coefficients
of variation measured per window (from smoothed first and second moments of trainer compute ``t``
and of the per-window production rate for ``S``, kept apart from the plan's rates; the first window after a switch, which
refills the pipeline, is left out) and kept across splits: a step needs the same ``b − r`` fresh
samples whatever the split, so their count, which sets the relative spread, does not change.
``E[max]`` is Clark's (1961) exact mean of the maximum of two normals. It is applied only when (1) at least ``cooldown_steps`` steps passed
since the last change, and (2) it is predicted to step faster by more than ``margin`` in log
(hysteresis: noise around a balance point does not move workers back and forth).

Each window reports the coverage the planner predicted for it — its rates and ``u`` from before the
window, applied to the window's busy rollout time and step time — beside the one observed: fresh
samples finished × (1 − the share of the window's fresh fates that were evictions as too stale);
and the step time it predicted for the split in force.

The paper's Algorithm 1 proposes the placement of the smallest mismatch ``|log(coverage' / (b − r))|``,
``coverage' = p · n_R' · t / n_T' · u(t / n_T')`` the usable fresh samples produced during one
trainer-bound step. It is
kept as the reported balance of the placement in force (``placement/mismatch``), not as the choice:
it scores an oversupply and an undersupply of equal log size alike, though they step at different
speeds. On 4 CPU ranks it moved 2:2 → 3:1, where its one rollout worker starved three trainers,
with the same predicted step time (0.400 s against 0.405 s); and near a balance point a noise of a
few percent in ``p·t`` flips which side it prefers by more than its margin.

Starvation ceiling. The model balances mean rates, but a step needs its fresh samples when it
starts: near the balance point the fresh supply of some steps falls short (group completion, the
length mix, a greedy batch that took every fresh sample after a wait), and all trainers wait. The
rollout rate measured below saturation also underestimates capacity (production is capped by the
``b_max`` window), so the planner approaches the balance point from the trainer side and can pass
the best split. Hence: when, over the latest ``cooldown_steps`` windows at a placement (its first,
which refills the pipeline, left out), the trainers waited on average more than ``starve_idle`` of
the step while the rollout workers were busy (mean idle below ``starve_idle``), their mean step time
is what its fresh supply allows. Only the latest windows count, because a workload drifts: on
``cpu_drift`` the chains lengthen through the run, and a mean over every window since the pool
arrived kept the early, unstarved steps in it and held the pool at 3 trainers until steps 19–33 of 60
(three runs); judged by the latest windows it left at steps 17–28. If the next placement with fewer
trainer replicas, ``k``, would step faster even when bound by its trainers (``t / k`` below that mean), the
placement has too many trainers: the planner moves at once (no margin needed) to the best placement
with at most ``k``, and proposes no more than ``k`` trainer replicas until the predicted fresh
coverage of every placement (∝ ``p·t``) has grown by more than ``2·margin`` (in log) since then, that
is until the workload changed in favour of training.

A move must pay for its switch: it is made only when the time it is predicted to save over the steps
left in the run, ``(step'(current) − step'(proposed)) · steps_left``, exceeds the cost of one switch:
``switch_cost_s``, or the wall time of the run's latest switch when that was longer. The setting is a
floor because the wall time misses most of the cost: the pipeline drains before a switch and refills
after it (4 CPU ranks: switches of 0.03–0.09 s, but the step after one took 0.99 s against 0.4 s). A
retreat from a starved placement is exempt from both the margin and the switch cost: its saving was
measured, and the linear rates are what misjudged that placement in the first place. It still
has to pay for its switch, with that measured saving: late in a run no retreat is worth one (4 CPU
ranks, 60 steps: retreats at steps 46 and 55 cost runs 8–25 % against the split they left).

Measured beats predicted. When the pool leaves a placement after at least ``cooldown_steps − 1`` windows
past its first, the planner keeps the mean step time of the latest ``cooldown_steps`` of them, with the
supply it predicted then (∝ p·t). It does not move back to a placement whose kept step time is no faster
than the mean of the latest ``cooldown_steps`` windows at the one in force, as long as that supply has
moved by at most ``2·margin`` (in log) since, in either direction. Without this rule the coding workload
(4 CPU ranks) flapped between 2 and 3 trainers, four moves in 37 steps: at 3 its trainers starved
(5.2–5.7 s a step), and the starvation rule retreated to 2, predicted at 5.1 s a step, where the run had
already measured 7.0–7.9 s (a replica's compute per token was 10–15 % higher there, 16 sequences per
micro-batch padded to the longest against 10–11, and the model missed more than that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class PlacementSettings:
    elastic: bool = True
    workers: int = 4                 # W
    replica_size: int = 1           # s_T
    rollout_tp: int = 1              # s_R
    min_trainers: int = 1
    min_rollouts: int = 1
    batch_size: int = 32             # b
    sigma: float = 0.5
    ema_alpha: float = 0.3
    cooldown_steps: int = 5
    margin: float = 0.15             # log of the predicted step time
    starve_idle: float = 0.05        # trainer wait (fraction of a step) that marks a placement as starved
    switch_cost_s: float = 10.0      # the least a switch is taken to cost (module docstring)
    delta: int | None = None         # δ of the index (None: no staleness bound, every fresh sample usable)


@dataclass(frozen=True)
class Window:
    """What one step showed (raw values; the corrections are the planner's)."""
    produced: int                    # fresh samples finished in the window
    step_s: float
    idle_trainer: float              # fraction of the window
    idle_rollout: float
    replay_supply: float | None = None   # replay samples the next batch can draw (None: the σ·b it may)
    production: Sequence[tuple[int, float, int]] = ()   # (response tokens, seconds dispatch → finish, prompt tokens)
                                                        # per fresh sample
    trained_fresh: Sequence[tuple[int, float]] = ()   # (staleness, production seconds) per fresh sample trained
    evicted_unused: int = 0              # fresh samples that ended as too stale in the window, never trained
    trained: Sequence[tuple[bool, int]] = ()   # (replayed, response tokens) per sample of the step's batch


class PlacementPlanner:
    """See the module docstring. ``current`` is the number of trainer replicas in force."""

    def __init__(self, settings: PlacementSettings, n_trainers: int):
        self.s = settings
        self.current = n_trainers
        self.rate: float | None = None      # p: produced ÷ busy worker-seconds, each smoothed
        self._produced: float | None = None  # smoothed fresh samples per window
        self._busy: float | None = None     # smoothed busy rollout worker-seconds per window
        self.train_s: float | None = None   # t, smoothed
        self.supply: float | None = None    # r, replay samples a batch can draw, smoothed
        self.steps_since_change = 0
        self.last_mismatch = math.nan
        self.proposed = n_trainers
        self.ceiling: int | None = None  # most trainer replicas the planner may propose (starvation ceiling)
        self.ceiling_rates = (0.0, 0.0)  # (p, t) when the ceiling was set
        self._here: list[tuple[float, float, float]] = []   # (idle_T, idle_R, step_s) of the latest windows here
        self.measured: dict[int, tuple[float, float]] = {}   # n_T → (mean step s when it was left, p·t then)
        self.switch_s = settings.switch_cost_s   # what a switch costs: the setting, or the latest measured if longer
        self.buckets: dict[int, list[float]] = {}   # length bucket -> [samples, Σ production s, Σ tokens], smoothed
        self.batch_cost = BatchCost()       # compute per token and the batch's lengths (the split's composition)
        self.offset: float | None = None    # c: staleness − g / step of trained fresh samples, smoothed
        self.window_s: float | None = None  # step time, smoothed (what c is measured against)
        self.last_coverage = (math.nan, math.nan)   # (predicted, observed) usable fresh samples of the latest window
        self.last_step_predicted = math.nan  # the step time predicted for the split in force before the window
        self._jitter_t: list[float] | None = None   # [mean, mean square] of t per window, smoothed
        self._jitter_p: list[float] | None = None   # the same of the per-window production rate

    # -- feasible placements ------------------------------------------------------------------

    def feasible(self) -> list[int]:
        """Trainer replica counts n_T of every feasible placement."""
        s = self.s
        out = []
        for n_t in range(s.min_trainers, s.workers // s.replica_size + 1):
            rest = s.workers - n_t * s.replica_size
            if rest >= 0 and rest % s.rollout_tp == 0 and rest // s.rollout_tp >= s.min_rollouts:
                out.append(n_t)
        return out

    def rollouts(self, n_t: int) -> int:
        return (self.s.workers - n_t * self.s.replica_size) // self.s.rollout_tp

    # -- the window ---------------------------------------------------------------------------

    def observe(self, w: Window, steps_left: int | None = None) -> int | None:
        """One step's window; returns the new n_T when the placement should change now, else None.
        ``steps_left``: optimizer steps the run has still to take (None: unbounded, no switch is too dear)."""
        self.steps_since_change += 1
        n_t = self.current
        self.last_step_predicted = self.step_time(n_t)
        predicted = self._busy_s(w, n_t) * self.rate * self.usable(w.step_s) if self.rate is not None else math.nan
        self._measure(w, n_t)
        self.last_coverage = (predicted, self._observed_coverage(w))
        starved_step_s = self._starved(w)
        if self.ceiling is not None and self._rates_moved():
            self.ceiling = None
        if self.rate is None or self.train_s is None:    # no rollout worker was busy yet: nothing to plan with
            self.proposed = n_t
            return None
        times, above = self._propose(n_t, starved_step_s, self.rate, self.train_s)
        if not self.s.elastic or self.proposed == self.current:
            return None
        if self.steps_since_change < self.s.cooldown_steps:
            return None
        if not above and not math.log(times[n_t] / times[self.proposed]) > self.s.margin:
            return None
        measured_here = self._recent_step_s()
        here = measured_here if above and measured_here is not None else times[n_t]   # measured when starved
        there = self.measured_step(self.proposed)
        if there is not None and measured_here is not None and there >= measured_here:
            return None                                 # measured slower there than here
        saving = here - times[self.proposed]            # seconds per step
        if steps_left is not None and not saving * steps_left > self.switch_s:
            return None
        return self.proposed

    def _busy_s(self, w: Window, n_t: int) -> float:
        """Busy rollout worker-seconds of the window."""
        return self.rollouts(n_t) * w.step_s * (1.0 - min(max(w.idle_rollout, 0.0), 1.0))

    def _observed_coverage(self, w: Window) -> float:
        """Fresh samples of the window that were usable: produced × (1 − stale share of fresh fates)."""
        fates = len(w.trained_fresh) + w.evicted_unused
        return w.produced * (1.0 - w.evicted_unused / fates) if fates else float(w.produced)

    def _measure(self, w: Window, n_t: int) -> None:
        """Fold the window into the smoothed rates p, t and r, the production times by length bucket and
        the staleness offset c (module docstring)."""
        busy = self._busy_s(w, n_t)
        t = w.step_s * (1.0 - min(w.idle_trainer, 0.999)) * n_t
        a = self.s.ema_alpha
        self._measure_staleness(w, a)
        self._measure_jitter(w, t, busy, a)
        self._produced = w.produced if self._produced is None else a * w.produced + (1 - a) * self._produced
        self._busy = busy if self._busy is None else a * busy + (1 - a) * self._busy
        if self._busy > 0:
            self.rate = self._produced / self._busy
        self.train_s = t if self.train_s is None else a * t + (1 - a) * self.train_s
        self.batch_cost.observe(w, t, self.window_s, a)
        if w.replay_supply is not None:
            r = min(w.replay_supply, self.s.sigma * self.s.batch_size)
            self.supply = r if self.supply is None else a * r + (1 - a) * self.supply

    def _measure_jitter(self, w: Window, t: float, busy: float, a: float) -> None:
        """Fold the window's t and production rate into smoothed first and second moments of their own,
        kept apart from the rates the plan uses: those are seeded by the run's first window, which
        refills the pipeline (trainers idle almost throughout, so t near 0), and a deviation measured
        from such a mean is hundreds of times the mean, a squared coefficient of variation that took
        the rest of a 60-step run to decay (predicted steps of 38 s against 0.4 s measured). A window
        with less than half the usual busy rollout time gives no rate worth comparing (the
        ratio-of-sums argument)."""
        if self.steps_since_change <= 1:
            return                       # the first window at a placement refills the pipeline
        self._jitter_t = _fold_moments(self._jitter_t, t, a)
        if busy > 0 and self._busy and busy >= 0.5 * self._busy:
            self._jitter_p = _fold_moments(self._jitter_p, w.produced / busy, a)

    @property
    def cv2_train(self) -> float:
        """Squared coefficient of variation of t per window, smoothed."""
        return _cv2(self._jitter_t)

    @property
    def cv2_supply(self) -> float:
        """Squared coefficient of variation of the per-window production rate, smoothed."""
        return _cv2(self._jitter_p)

    def _measure_staleness(self, w: Window, a: float) -> None:
        self.window_s = w.step_s if self.window_s is None else a * w.step_s + (1 - a) * self.window_s
        if self.s.delta is None:
            return
        seen: dict[int, list[float]] = {}
        for tokens, g, _ in w.production:
            b = seen.setdefault(max(int(tokens), 1).bit_length(), [0.0, 0.0, 0.0])
            b[0] += 1
            b[1] += g
            b[2] += tokens
        for k in set(self.buckets) | set(seen):
            old, new = self.buckets.get(k, [0.0, 0.0, 0.0]), seen.get(k, [0.0, 0.0, 0.0])
            self.buckets[k] = [a * x + (1 - a) * y for x, y in zip(new, old)]
        if w.trained_fresh and self.window_s > 0:
            c = sum(st - g / self.window_s for st, g in w.trained_fresh) / len(w.trained_fresh)
            self.offset = c if self.offset is None else a * c + (1 - a) * self.offset

    def usable(self, step_s: float) -> float:
        """u(step): the share of fresh samples still within δ when trained, at this step time (docstring)."""
        if self.s.delta is None or self.offset is None or not self.buckets or not step_s > 0:
            return 1.0
        room = self.s.delta + 1.0 - self.offset
        total = sum(b[0] for b in self.buckets.values())
        if total <= 0:
            return 1.0
        return sum(n * min(max(room - g / n / step_s, 0.0), 1.0) for n, g, _ in self.buckets.values() if n > 0) / total

    def _usable_length(self, step_s: float) -> float:
        """Mean response tokens of the fresh samples still within δ at this step time (by bucket)."""
        if self.s.delta is None or self.offset is None or not step_s > 0:
            return math.nan
        room = self.s.delta + 1.0 - self.offset
        weights = [(n * min(max(room - g / n / step_s, 0.0), 1.0), tokens / n)
                   for n, g, tokens in self.buckets.values() if n > 0]
        total = sum(u for u, _ in weights)
        return sum(u * length for u, length in weights) / total if total > 0 else math.nan

    def trainer_s(self, n_t: int, step_s: float, arrivals: float) -> float:
        """Compute time of one step on ``n_t`` trainer replicas when ``arrivals`` usable fresh samples
        finish in a step of ``step_s``: the batch takes them (at least the fresh target, at most ``b``)
        and replays fill the rest (module docstring). Without a measured compute per token, ``t / n_t``."""
        if self.train_s is None:
            return math.nan
        cost = self.batch_cost
        if not cost.known:
            return self.train_s / n_t
        fresh = min(float(self.s.batch_size), max(arrivals, self.fresh_target()))
        scale = 1.0                       # the usable lengths change with the step time; the batch gives the level
        if cost.measured_at is not None:
            here, there = self._usable_length(cost.measured_at), self._usable_length(step_s)
            if here > 0 and there > 0:
                scale = there / here
        return cost.compute_s(self.s.batch_size, fresh, scale) / n_t

    def _propose(self, n_t: int, starved_step_s: float | None, rate: float,
                 train_s: float) -> tuple[dict[int, float], bool]:
        """Sets the starvation ceiling, the mismatch and the proposed n_T; returns the predicted step time
        of every placement considered, and whether the current one is above the ceiling."""
        everything = self.feasible()
        fewer = [k for k in everything if k < n_t]
        if starved_step_s is not None and fewer and self._trainer_bound(max(fewer), starved_step_s) < starved_step_s:
            self.ceiling = max(fewer)
            self.ceiling_rates = (rate, train_s)
        feasible = [k for k in everything if self.ceiling is None or k <= self.ceiling or k == n_t]
        times = {k: self.step_time(k) for k in feasible}
        self.last_mismatch = self.mismatch(n_t)
        above = self.ceiling is not None and n_t > self.ceiling
        self.proposed = min((k for k in times if not above or k != n_t),
                            key=lambda k: (times[k], k != self.current, k), default=n_t)
        return times, above

    def _trainer_bound(self, n_t: int, step_s: float) -> float:
        """Compute time of a step of ``step_s`` on ``n_t`` replicas, with that split's fresh supply."""
        arrivals = (self.rate or 0.0) * self.rollouts(n_t) * step_s * self.usable(step_s)
        return self.trainer_s(n_t, step_s, arrivals)

    def step_time(self, n_t: int) -> float:
        """Predicted step time of the placement with ``n_t`` trainer replicas (module docstring)."""
        if self.rate is None or self.train_s is None:
            return math.nan
        supply, need = self.rate * self.rollouts(n_t), self.fresh_target()
        if supply <= 0:
            return math.inf

        def train(step: float) -> float:
            return self.trainer_s(n_t, step, supply * step * self.usable(step))

        def gap(step: float) -> float:           # increasing in step: the fixed point is its root
            u = self.usable(step)
            return step - expected_max(train(step), self.cv2_train, need / (supply * u) if u > 0 else math.inf,
                                       self.cv2_supply)

        floor = self.train_s / n_t
        for _ in range(8):                       # trainer-bound: the step whose batch takes that long (it
            floor = train(floor)                 # grows with the fresh samples a longer step gathers)
        if gap(floor) >= 0:
            return floor                         # trainer-bound, without jitter
        lo, hi = 0.0, max(floor, need / supply) * 2
        while gap(hi) < 0:
            lo, hi = hi, hi * 2
            if hi > 1e9 * max(floor, 1e-9):
                return math.inf                  # no step is slow enough to keep its samples within δ
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
        return hi

    def _starved(self, w: Window) -> float | None:
        """The mean step time at this placement if its trainers waited for data while the rollout workers
        were busy (module docstring), else None."""
        if self.steps_since_change <= 1:
            return None                  # the first window at a placement refills the pipeline
        self._here = (self._here + [(w.idle_trainer, w.idle_rollout, w.step_s)])[-self.s.cooldown_steps:]
        n = len(self._here)
        if n < self.s.cooldown_steps:
            return None
        idle_t, idle_r = sum(x[0] for x in self._here) / n, sum(x[1] for x in self._here) / n
        return self._recent_step_s() if idle_t > self.s.starve_idle and idle_r < self.s.starve_idle else None

    def _recent_step_s(self) -> float | None:
        """Mean step time of the latest ``cooldown_steps`` windows at this placement (after its first)."""
        return sum(x[2] for x in self._here) / len(self._here) if self._here else None

    def _supply_shift(self, p_t: float) -> float | None:
        """log of the supply a placement predicts now (∝ p·t) over ``p_t``; None when either is unknown."""
        if p_t <= 0 or not self.rate or not self.train_s:
            return None
        return math.log(self.rate * self.train_s / p_t)

    def _rates_moved(self) -> bool:
        """Has the supply a placement predicts (∝ p·t) grown by more than 2·margin since the ceiling?"""
        shift = self._supply_shift(self.ceiling_rates[0] * self.ceiling_rates[1])
        return shift is None or shift > 2 * self.s.margin

    def measured_step(self, n_t: int) -> float | None:
        """The mean step time measured at the placement with ``n_t`` trainer replicas when the pool last
        left it, while the supply a placement predicts (∝ p·t) is still within 2·margin (in log) of what
        it was then; else None."""
        if n_t not in self.measured:
            return None
        step_s, p_t = self.measured[n_t]
        shift = self._supply_shift(p_t)
        return step_s if shift is not None and abs(shift) <= 2 * self.s.margin else None

    def applied(self, n_t: int, switch_s: float | None = None) -> None:
        """The placement changed to ``n_t`` trainer replicas, the switch taking ``switch_s`` seconds of wall
        time (None: not measured, as on a restore); rates are re-measured from here."""
        if switch_s is not None:
            self.switch_s = max(self.s.switch_cost_s, switch_s)
        recent = self._recent_step_s()
        if n_t != self.current and len(self._here) >= self.s.cooldown_steps - 1 and recent and self.rate and self.train_s:
            self.measured[self.current] = (recent, self.rate * self.train_s)
        self.current = n_t
        self.steps_since_change = 0
        self._here = []

    def mismatch(self, n_t: int) -> float:
        """|log(predicted fresh coverage / target)| of the placement with ``n_t`` trainer replicas."""
        if self.rate is None or self.train_s is None:
            return math.nan
        step = self.train_s / n_t
        coverage = self.rate * self.rollouts(n_t) * step * self.usable(step)
        return abs(math.log(max(coverage, 1e-12) / self.fresh_target()))

    def fresh_target(self) -> float:
        """Fresh samples a step needs: b less what replay can supply (σ·b at most; less when δ evicts
        trained samples before they can be replayed, as at δ = 1)."""
        b = self.s.batch_size
        supply = self.s.sigma * b if self.supply is None else self.supply
        return max(b - supply, 1.0)


class BatchCost:
    """What a step's batch costs to train, from the batches trained so far: replica compute seconds per
    token (prompt and response), and the mean response tokens of its fresh and its replayed samples and
    the mean prompt tokens, each smoothed as a ratio of sums (module docstring: the batch's composition)."""

    def __init__(self) -> None:
        self.prompt: float | None = None           # mean prompt tokens of fresh production
        self.fresh: list[float] | None = None      # [Σ response tokens, samples] of trained fresh samples
        self.replay: list[float] | None = None     # the same of trained replayed samples
        self.cost: list[float] | None = None       # [t, the batch's tokens] per window
        self.measured_at: float | None = None      # the (smoothed) step time of the latest fresh lengths

    @property
    def known(self) -> bool:
        return self.cost is not None and self.fresh is not None and self.cost[1] > 0 and self.fresh[1] > 0

    def observe(self, w: Window, t: float, step_s: float | None, a: float) -> None:
        """Fold one window's batch in; ``t``: its replica compute seconds. A window whose trainers waited
        throughout (the run's first) tells nothing of the cost."""
        if w.production:
            prompt = sum(p for _, _, p in w.production) / len(w.production)
            self.prompt = prompt if self.prompt is None else a * prompt + (1 - a) * self.prompt
        if not w.trained:
            return
        fresh = [n for replayed, n in w.trained if not replayed]
        replay = [n for replayed, n in w.trained if replayed]
        if fresh:
            self.fresh = _fold_sum(self.fresh, sum(fresh), len(fresh), a)
            self.measured_at = step_s
        if replay:
            self.replay = _fold_sum(self.replay, sum(replay), len(replay), a)
        tokens = sum(n for _, n in w.trained) + len(w.trained) * (self.prompt or 0.0)
        if t > 0 and tokens > 0 and w.idle_trainer < 0.999:
            self.cost = _fold_sum(self.cost, t, tokens, a)

    def compute_s(self, b: int, fresh: float, fresh_scale: float = 1.0) -> float:
        """Replica compute seconds of a batch of ``b`` samples, ``fresh`` of them fresh (their mean length
        scaled by ``fresh_scale``), the rest replayed."""
        assert self.cost is not None and self.fresh is not None
        fresh_len = self.fresh[0] / self.fresh[1] * fresh_scale
        replay_len = self.replay[0] / self.replay[1] if self.replay and self.replay[1] > 0 else fresh_len
        tokens = b * (self.prompt or 0.0) + fresh * fresh_len + (b - fresh) * replay_len
        return self.cost[0] / self.cost[1] * tokens


def _fold_sum(m: list[float] | None, total: float, count: float, a: float) -> list[float]:
    """[Σ, count] smoothed alike, so that their ratio weighs each window by its count."""
    if m is None:
        return [total, count]
    return [a * total + (1 - a) * m[0], a * count + (1 - a) * m[1]]


def _fold_moments(m: list[float] | None, x: float, a: float) -> list[float]:
    if m is None:
        return [x, x * x]
    return [a * x + (1 - a) * m[0], a * x * x + (1 - a) * m[1]]


def _cv2(m: list[float] | None) -> float:
    if m is None or not m[0] > 0:
        return 0.0
    return max(m[1] / (m[0] * m[0]) - 1.0, 0.0)


def expected_max(m1: float, cv2_1: float, m2: float, cv2_2: float) -> float:
    """E[max(X1, X2)] of independent normals with means ``m`` and squared coefficients of variation
    ``cv2`` (Clark 1961); the maximum of the means when neither varies."""
    if math.isinf(m1) or math.isinf(m2):
        return math.inf
    theta = math.sqrt(cv2_1 * m1 * m1 + cv2_2 * m2 * m2)
    if theta <= 1e-12 * max(m1, m2, 1e-12):
        return max(m1, m2)
    alpha = (m1 - m2) / theta
    cdf = 0.5 * (1.0 + math.erf(alpha / math.sqrt(2.0)))
    pdf = math.exp(-0.5 * alpha * alpha) / math.sqrt(2.0 * math.pi)
    return m1 * cdf + m2 * (1.0 - cdf) + theta * pdf
