"""What-if replay: the run's recorded arrival stream through a fresh replay-buffer index.

``python -m reflow_hpc.analyze RUN --what-if reflow.sigma=0.25`` asks what the replay buffer would
have done under other σ, τ, δ, b_max, sampler or replay filter, given the samples the run actually
generated. The index is the real one (:func:`reflow_hpc.core.index.build_index`, built from the
run's own config with the overrides applied, same seed), so every rule — σ slots, oldest-first
unused samples, the sampler's draws from the index's seeded RNG, eviction at each version bump,
the b_max dispatch window — is the code the run used, not a model of it.

What is replayed (``events.jsonl``, one pass, in order):

- ``dispatch`` → :meth:`~ReplayIndex.new_group`; ``finish`` → :meth:`~ReplayIndex.finished`;
  ``failed`` → :meth:`~ReplayIndex.failed`. These are the arrival stream: which prompts went to
  which worker, and what came back, with reward, loss tokens and version span.
- The trainer. The run's trainer composed a batch at its first chance after its previous step ended
  (the coordinator tries after every arrival), unless a *block* held it back: a checkpoint round
  (from the end of the step before it to the ``checkpoint`` line), a role switch (``switch`` to
  ``switched``) or, colocated, a weight load (``sync`` to ``synced``). The replayed trainer does the
  same: it asks when its step ends, and again after every arrival, and composes at the first
  chance the index gives it. Each step then takes as long as the run's step k took (``compose`` to
  ``train``), and blocks last as long as the run's.
- ``compose`` lines are not inputs: they are what the replay is checked against.

Time. Under the run's own settings the replay composes at exactly the recorded points and nothing
moves. Under other settings the trainer may compose step k later (fewer batches ready) or earlier
than the run did; that offset (``lag``, seconds) shifts the end of step k and the blocks after it.
A dispatch the index refuses (its b_max window is spent) waits, in order, for the window to reopen;
the group's finishes then shift by the same delay (its generation took as long as recorded). Order
among events at equal shifted times follows the log.

Versions. A finished sample is taken as stale as it was when it finished in the run: its oldest
and newest token versions keep their distance from the trainer's version then (the rollout workers
lag the trainer by the sync pipeline, which a buffer setting does not change), clamped to
``[0, version]``. Under the run's settings this is the recorded span.

Validation. Under the run's own settings the replay must compose every recorded batch with the same
sample ids in the same step (``reproduces_run``); this is checked on every ``--what-if``, overrides
or not, since a what-if is only as good as a replay that reproduces the run.

Limits (reported, never silent): a run that resumed from a checkpoint is replayed up to its first
restart; a what-if cannot create samples the run never generated (a larger b_max or a hungrier
trainer finds no extra arrivals), and a dispatch still waiting at the end of the log is counted as
``not_dispatched``.

Plugins. The run directory is data, not code: the modules its config names in ``run.plugins`` are
never imported because the config says so. Only the modules the user names (``--plugin MODULE``)
are imported, as ``run.plugins`` of the config the replay builds. A recorded plugin not named is
reported (``plugins_not_imported``); the replay goes on without it when it needs it not (a plugin
task: the replay uses no task, so the default one stands in) and is skipped, with the reason, when
it does (the run's sampler or replay filter is not registered). A what-if the run directory cannot
support (no config, no event log, a config that does not load) is skipped the same way: damaged
data never stops the analysis; only a bad ``--what-if`` or ``--plugin`` is an error.
"""

from __future__ import annotations

import heapq
import json
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reflow_hpc.config import Config, ConfigError, dynamic_sampling, load, objective_traits
from reflow_hpc.core.index import Batch, ReplayIndex, build_index
from reflow_hpc.core.modes import rules

from .read import Unreadable, iter_jsonl, read_json, skip_patterns
from .stats import Block, EventStats, Step, Tally

# The keys a what-if may change: the replay buffer's (DESIGN §2) and its sampler and filter.
WHATIF_KEYS = ("reflow.sigma", "reflow.tau", "reflow.delta", "reflow.b_max", "reflow.batch_fill", "reflow.sampler",
               "reflow.replay_filter", "reflow.reward_low", "reflow.reward_high")

# Events the replay reads; the others are skipped unparsed (the skeleton of steps and blocks comes
# from the report's pass over the same file).
_SKIPPED = skip_patterns("end", "train", "sync", "synced", "checkpoint", "checkpoint_begin", "switch", "switched",
                         "resume")


class WhatIfError(Exception):
    """A what-if the user asked for wrongly (a key it cannot change, a plugin that does not import);
    the message says why in one line."""


class WhatIfSkipped(Exception):
    """A what-if the run directory cannot support (no config or event log, a recorded config that does
    not load, a plugin it needs that was not named); the analysis goes on and reports why."""


# ------------------------------------------------------------------------------------- the config

def run_config(run_dir: Path, bad: list[Unreadable]) -> tuple[dict, str]:
    """The run's config as a section dict, and where it came from: ``topology.json`` (written at
    the start of every run), else the newest checkpoint's ``extra/config.json``."""
    topo = read_json(run_dir / "topology.json", "topology.json", [])   # the report names it if unreadable
    if isinstance(topo, dict) and isinstance(topo.get("config"), dict):
        return topo["config"], "topology.json"
    try:
        ckpts = sorted((run_dir / "checkpoints").glob("step_*"), reverse=True)
    except OSError:
        ckpts = []
    for ckpt in ckpts:
        rel = str((ckpt / "extra" / "config.json").relative_to(run_dir))
        cfg = read_json(ckpt / "extra" / "config.json", rel, bad)
        if isinstance(cfg, dict):
            return cfg, rel
    raise WhatIfSkipped("the run's config is in neither topology.json nor a checkpoint's extra/config.json")


def recorded_plugins(config: dict) -> list[str]:
    """The modules the recorded config names in ``run.plugins`` (only its strings: it is data)."""
    run = config.get("run")
    plugins = run.get("plugins") if isinstance(run, dict) else None
    return [str(m)[:200] for m in plugins] if isinstance(plugins, list) else []


def build_config(config: dict, overrides: list[str] = (), plugins: list[str] = ()) -> Config:
    """A :class:`~reflow_hpc.config.Config` from a section dict (as ``to_dict`` writes it) plus
    ``section.key=value`` overrides, validated like a run's (files are not checked). Its
    ``run.plugins`` are ``plugins``, whatever the dict says: loading imports them."""
    config = {**config, "run": {**(config.get("run") or {}), "plugins": list(plugins)}}
    sets = [f"{sec}.{key}={json.dumps(value)}" for sec, keys in config.items() if isinstance(keys, dict)
            for key, value in keys.items()]
    return load(None, sets + list(overrides), check_files=False)


def check_overrides(overrides: list[str]) -> None:
    """Refuse a key the replay cannot change (anything but the replay buffer's settings)."""
    for o in overrides:
        key = o.split("=", 1)[0].strip()
        if "=" not in o or key not in WHATIF_KEYS:
            raise WhatIfError(f"--what-if {o!r}: expected key=value with key one of {', '.join(WHATIF_KEYS)}")


def make_index(cfg: Config) -> ReplayIndex:
    """The index a run with this config builds (runtime/training.py ``build_coordinator``; prompts matched
    by dispatch index for recomputed replay advantages)."""
    a = cfg.algorithm
    estimator, agg = objective_traits(cfg)
    return build_index(cfg.reflow, group_size=a.group_size, batch_size=cfg.trainer.batch_size, seed=cfg.run.seed,
                       adv_eps=a.adv_eps, adv_std_norm=a.adv_std_norm, adv_estimator=estimator,
                       per_sample_weights=agg == "seq_mean_token_mean", dynamic_sampling=dynamic_sampling(cfg),
                       max_gen_batches=a.max_gen_batches, replay_advantage=a.replay_advantage)


def settings_of(cfg: Config) -> dict[str, Any]:
    r = cfg.reflow
    return {"sigma": r.sigma, "tau": r.tau, "delta": r.delta, "b_max": r.b_max or cfg.trainer.batch_size,
            "batch_fill": r.batch_fill, "sampler": r.sampler, "replay_filter": r.replay_filter}


# ------------------------------------------------------------------------------------- the replay

@dataclass
class Outcome:
    """What one replay (or the run itself) did with the arrival stream."""
    label: str
    settings: dict[str, Any]
    steps: int = 0                      # batches composed
    trained: int = 0                    # samples in those batches
    replayed: int = 0                   # of which replay samples
    replay_fraction: float = math.nan   # mean over steps of replay samples / batch size
    evicted_unused: int = 0             # ended stale before any step trained on them: generation wasted
    created: int = 0
    staleness_mean: float = math.nan    # over trained samples
    staleness_max: int = 0
    trainer_waits: int | None = None    # compose attempts that found no batch
    steps_waited: int | None = None     # steps whose first attempt found no batch
    wait_s: float | None = None         # time from the end of a step (or block) to the next batch, summed
    deferred_groups: int = 0            # dispatches that waited for the b_max window
    not_dispatched: int = 0             # samples whose dispatch still waited at the end of the log
    terminal: dict[str, int] = field(default_factory=dict)
    live_at_end: int = 0
    staleness_hist: list[int] = field(default_factory=list)
    # Validation against the recorded batches.
    compared: bool = False
    matched_steps: int = 0
    first_mismatch: str | None = None
    stopped: str | None = None          # why the replay ended before the log did

    @property
    def reproduces(self) -> bool:
        return self.compared and self.first_mismatch is None and self.stopped is None and self.matched_steps > 0

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k not in ("compared",)}
        for k, v in out.items():
            if isinstance(v, float) and not math.isfinite(v):
                out[k] = None
        return out


class Replay:
    """One index driven by the recorded stream (module docstring): :meth:`feed` every line of the log
    in order, then :meth:`close` returns the :class:`Outcome`."""

    def __init__(self, label: str, index: ReplayIndex, settings: dict, *, plan: list[Step], blocks: list[Block],
                 colocated: bool, compare: bool):
        self.index, self.plan, self.colocated = index, plan, colocated
        self.out = Outcome(label, settings, compared=compare)
        self._compare = compare
        self._heap: list[tuple[float, int, int, str, Any]] = []
        self._seq = 0
        self._blocks_after: dict[int, list[Block]] = {}
        for b in blocks:
            if b.kind != "sync" or colocated:         # a split-pool sync does not hold the trainer back
                self._blocks_after.setdefault(b.after_step, []).append(b)
        self._k = 0                                   # the next step to compose
        self._batch: Batch | None = None
        self._lag: dict[int, float] = {}              # step -> its compose time minus the run's
        self._blocked = 0
        self._asking_since: float | None = None       # the trainer is free since then (None: not asking)
        self._missed = False                          # an attempt of this step found no batch
        self._started = False
        self._deferred: deque[tuple[float, int, dict]] = deque()   # dispatches waiting for the window
        self._waiting: set[int] = set()               # ids of deferred groups
        self._held: dict[int, list[tuple[float, int, dict]]] = {}  # their arrivals, until dispatched
        self._shift: dict[int, float] = {}            # sample id -> delay of its dispatch
        self._recorded: dict[int, list[int]] = {}     # step -> recorded ids, read before the replay composed it
        self._composed: dict[int, tuple[int, ...]] = {}   # step -> replayed ids, composed before the line
        self._stale = Tally("count")
        self._replay_fractions = 0.0
        self._waits = self._steps_waited = 0
        self._wait_s = 0.0
        for b in self._blocks_after.get(-1, []):
            self._push_block(b, 0.0, starts_now=False)

    # ------------------------------------------------------------------------------ the stream

    def feed(self, line: int, e: dict) -> None:
        if self.out.stopped is not None:
            return
        try:
            t = float(e["t"])
            self._release(t, line)
            kind = e.get("e")
            if kind == "dispatch":
                self._dispatch(t, line, e)
            elif kind in ("finish", "failed"):
                self._arrival(t, line, e)
            elif kind == "compose":
                self._check(int(e["step"]), e["ids"])
            elif kind == "start":
                self._start(t, line, e)
        except Exception as err:      # the log is data: whatever a line does to the index stops this replay
            self.out.stopped = f"line {line}: {err.__class__.__name__}: {err}"

    def close(self) -> Outcome:
        if self.out.stopped is None:
            try:
                self._release(math.inf, 0)
            except Exception as err:
                self.out.stopped = f"at the end of the log: {err.__class__.__name__}: {err}"
        o, g = self.out, self.index.gauges()
        o.created = g["buffer/created"]
        o.evicted_unused = g["buffer/evicted_unused"]
        o.terminal = {k[len("buffer/"):]: g[k] for k in ("buffer/trained", "buffer/filtered", "buffer/evicted_stale",
                                                          "buffer/failed", "buffer/lost")}
        o.live_at_end = len(self.index)
        o.not_dispatched = len(self._waiting)
        o.replay_fraction = self._replay_fractions / o.steps if o.steps else math.nan
        counts = self._stale.get("count")
        o.staleness_hist = [int(c) for c in counts]
        o.staleness_mean = float((counts * np.arange(len(counts))).sum() / counts.sum()) if counts.sum() else math.nan
        o.trainer_waits, o.steps_waited, o.wait_s = self._waits, self._steps_waited, self._wait_s
        if self._compare and o.first_mismatch is None and o.stopped is None and o.matched_steps < len(self.plan):
            o.first_mismatch = (f"the replay composed {o.matched_steps} of the run's {len(self.plan)} batches")
        return o

    def _push(self, t: float, line: int, kind: str, payload: Any) -> None:
        heapq.heappush(self._heap, (t, line, self._seq, kind, payload))
        self._seq += 1

    def _release(self, t: float, line: int) -> None:
        """Process the shifted events and trainer events due at or before (t, line)."""
        heap = self._heap
        while heap and (heap[0][0], heap[0][1]) <= (t, line):
            te, le, _, kind, payload = heapq.heappop(heap)
            if kind == "arrival":
                self._arrive(te, payload)
            elif kind == "step_end":
                self._step_end(te, payload)
            elif kind == "block_start":
                self._blocked += 1
            elif kind == "block_end":
                self._blocked -= 1
                self._attempt(te)
            if self.out.stopped is not None:
                return

    # ------------------------------------------------------------------------------ arrivals

    def _dispatch(self, t: float, line: int, e: dict) -> None:
        if self._deferred or not self.index.can_dispatch_group():
            self._deferred.append((t, line, e))
            self._waiting.update(e["ids"])
            self.out.deferred_groups += 1
            return
        self._new_group(e, 0.0)

    def _new_group(self, e: dict, delay: float) -> None:
        group = self.index.new_group(e["prompt"], worker=e["w"])
        if list(group.sample_ids) != list(e["ids"]):
            raise ValueError(f"the index created samples {list(group.sample_ids)[:4]}… for the run's "
                             f"{list(e['ids'])[:4]}…: the log lacks a dispatch")
        for sid in group.sample_ids:
            held = self._held.pop(sid, ())
            if delay:
                self._shift[sid] = delay
            for t, line, ev in held:
                self._push(t + delay, line, "arrival", ev)

    def _release_deferred(self, now: float) -> None:
        while self._deferred and self.index.can_dispatch_group():
            t, _, e = self._deferred.popleft()
            self._waiting.difference_update(e["ids"])
            self._new_group(e, max(0.0, now - t))

    def _arrival(self, t: float, line: int, e: dict) -> None:
        sid = e["id"]
        if sid in self._waiting:
            self._held.setdefault(sid, []).append((t, line, e))
        elif sid in self._shift:
            self._push(t + self._shift.pop(sid), line, "arrival", e)
        else:
            self._arrive(t, e)

    def _arrive(self, now: float, e: dict) -> None:
        sid, index = e["id"], self.index
        if e["e"] == "failed":
            if sid in index:
                index.failed(sid, now=now)
        elif sid not in index:
            return                             # it ended while in flight: the coordinator moves on
        else:
            lo, hi = e["span"]
            v_run, v = int(e["v"]), index.version
            if v != v_run:                     # as stale as it was in the run (module docstring)
                hi = min(max(v - (v_run - hi), 0), v)
                lo = min(max(v - (v_run - lo), 0), hi)
            index.finished(sid, owner=e["w"], reward=e["reward"], min_version=lo, max_version=hi,
                           loss_tokens=e["tokens"], now=now, location=e.get("loc"))
        self._attempt(now)
        self._release_deferred(now)

    # ------------------------------------------------------------------------------ the trainer

    def _start(self, t: float, line: int, e: dict) -> None:
        if self._started:
            self.out.stopped = (f"line {line}: the run resumed from {e.get('resume_from')}; the replay covers the "
                                f"process set before it")
            return
        self._started = True
        self._asking_since = t
        self._attempt(t)
        self._release_deferred(t)

    def _attempt(self, now: float) -> None:
        if self._asking_since is None or self._blocked or self._k >= len(self.plan):
            return
        index = self.index
        batch = None if self.colocated and index.outstanding else index.compose_batch(now=now)
        if batch is None:
            self._waits += 1
            self._missed = True
            return
        k, plan = self._k, self.plan[self._k]
        self._k += 1
        self._batch = batch
        self._wait_s += now - self._asking_since
        self._steps_waited += self._missed
        self._asking_since, self._missed = None, False
        lag = self._lag[k] = now - plan.compose_t
        o = self.out
        o.steps += 1
        o.trained += len(batch)
        o.replayed += batch.num_replay
        self._replay_fractions += batch.replay_fraction
        self._stale.add(list(batch.staleness))
        o.staleness_max = max(o.staleness_max, max(batch.staleness, default=0))
        if plan.train_line is not None:
            self._push(plan.train_t + lag, plan.train_line, "step_end", k)
        if self._compare:
            self._composed[k] = batch.sample_ids
            if k in self._recorded:
                self._check(k, self._recorded.pop(k))
        self._release_deferred(now)            # the step opened a new dispatch window

    def _step_end(self, now: float, k: int) -> None:
        index = self.index
        index.step_done(self._batch)
        index.bump_version()
        self._batch = None
        self._asking_since = now
        for b in self._blocks_after.get(k, []):
            # A block that began in the same coordinator call as the step's end begins with it.
            self._push_block(b, self._lag[k], starts_now=b.start_t == self.plan[k].train_t)
        self._attempt(now)
        self._release_deferred(now)

    def _push_block(self, b: Block, lag: float, *, starts_now: bool) -> None:
        if starts_now:
            self._blocked += 1
        else:
            self._push(b.start_t + lag, b.start_line, "block_start", None)
        if b.end_line >= 0:
            self._push(b.end_t + lag, b.end_line, "block_end", None)

    # ------------------------------------------------------------------------------ validation

    def _check(self, k: int, ids: list[int]) -> None:
        if not self._compare or self.out.first_mismatch is not None:
            return
        got = self._composed.pop(k, None)
        if got is None:
            self._recorded[k] = list(ids)     # the replay has not composed step k yet
            return
        got, ids = list(got), list(ids)
        if got == ids:
            self.out.matched_steps += 1
        else:
            diff = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
            self.out.first_mismatch = (f"step {k}: the run trained {len(ids)} samples, the replay composed "
                                       f"{len(got)}; first difference at position {diff}")
            self._recorded.clear()
            self._composed.clear()


# ------------------------------------------------------------------------------------- entry point

def _recorded_config(config: dict, source: str, plugins: list[str], missing: list[str],
                     notes: list[str]) -> tuple[Config, dict]:
    """The run's own config, built with only the user's plugins imported, and the section dict it was
    built from; raises WhatIfSkipped when the recorded config does not load, WhatIfError when a
    named plugin does not import."""
    why = f" (run.plugins of {source} names {', '.join(missing)}, not imported: name them with --plugin)" \
        if missing else ""
    try:
        try:
            return build_config(config, (), plugins), config
        except ConfigError as e:
            if e.key != "task.name" or not isinstance(config.get("task"), dict):
                raise
            # The replay runs no task: a task only a plugin registers is replaced by the default one.
            notes.append(f"what-if: the run's task {e.value!r} is not registered{why}; the replay needs no task")
            config = {k: v for k, v in config.items() if k != "task"}
            return build_config(config, (), plugins), config
    except ConfigError as e:
        if e.key == "run.plugins":
            raise WhatIfError(f"--plugin: {e}") from None
        raise WhatIfSkipped(f"the run's config ({source}) does not load: {e}{why}") from None
    except Exception as e:      # the recorded config is data: whatever it holds, the analysis goes on
        raise WhatIfSkipped(f"the run's config ({source}) does not load: {e.__class__.__name__}: {e}") from None


def run_outcome(events: EventStats, settings: dict) -> Outcome:
    """The run's own figures, from the event log. Its trainer waits are those of the replay under its
    settings: the log records the batches composed, not the attempts that found none."""
    plan = events.steps
    o = Outcome("run", settings, steps=len(plan), evicted_unused=events.evicted_unused, created=events.created)
    o.trained = sum(s.size for s in plan)
    o.replayed = sum(s.replay for s in plan)
    fractions = [s.replay / s.size for s in plan if s.size]
    o.replay_fraction = sum(fractions) / len(fractions) if fractions else math.nan
    o.staleness_mean = sum(s.stale_sum for s in plan) / o.trained if o.trained else math.nan
    o.staleness_max = max((s.stale_max for s in plan), default=0)
    unused, replay = (events.staleness[k].get("count") for k in ("unused", "replay"))
    hist = np.zeros(max(len(unused), len(replay)))
    hist[:len(unused)] += unused
    hist[:len(replay)] += replay
    o.staleness_hist = [int(x) for x in hist]
    return o


@dataclass
class WhatIf:
    """A what-if ready to replay: the run's config and the one with the overrides, both validated
    (built before the analysis reads anything, so that a bad key fails at once)."""
    run_dir: Path
    overrides: list[str]
    config_from: str
    base: Config
    other: Config

    @classmethod
    def prepare(cls, run_dir: Path, overrides: list[str], bad: list[Unreadable], plugins: list[str] = (),
                notes: list[str] | None = None) -> "WhatIf":
        """Raises WhatIfError for a wrong request, WhatIfSkipped when the run directory cannot support
        it (module docstring). ``notes`` receives one line per degradation (a plugin task replaced)."""
        check_overrides(overrides)
        config, source = run_config(run_dir, bad)
        missing = [m for m in recorded_plugins(config) if m not in plugins]
        base, config = _recorded_config(config, source, list(plugins), missing, notes if notes is not None else [])
        try:
            other = build_config(config, overrides, plugins)
            make_index(other)                  # the mode's rules may refuse the combination
        except (ConfigError, ValueError) as e:
            raise WhatIfError(f"--what-if: {e}") from None
        return cls(run_dir, list(overrides), source, base, other)

    @property
    def changed(self) -> bool:
        b, o = self.base.reflow, self.other.reflow
        return settings_of(self.other) != settings_of(self.base) or (b.reward_low, b.reward_high) != \
            (o.reward_low, o.reward_high)

    def run(self, events: EventStats) -> dict[str, Any]:
        """Replay ``events.jsonl`` under the run's settings (validation) and, when the overrides change
        any, under those too, in one pass. ``events``: the report's pass over the same log (the step
        and block skeleton, the run's own figures). Returns the JSON section ``what_if``."""
        kw = dict(plan=events.steps, blocks=events.blocks, colocated=rules(self.base.reflow.mode).colocated)
        own = settings_of(self.base)
        replays = [Replay("replay, run's settings", make_index(self.base), own, compare=True, **kw)]
        if self.changed:
            replays.append(Replay("what-if", make_index(self.other), settings_of(self.other), compare=False, **kw))
        for line, e in iter_jsonl(self.run_dir / "events.jsonl", "events.jsonl", [], skip=_SKIPPED):
            for r in replays:
                r.feed(line, e)
        outcomes = [r.close() for r in replays]
        run = run_outcome(events, own)
        run.trainer_waits, run.steps_waited, run.wait_s = (outcomes[0].trainer_waits, outcomes[0].steps_waited,
                                                           outcomes[0].wait_s)
        return {"config_from": self.config_from, "overrides": self.overrides, "changed": self.changed,
                "reproduces_run": outcomes[0].reproduces,
                "outcomes": [run.to_json()] + [o.to_json() for o in outcomes]}
