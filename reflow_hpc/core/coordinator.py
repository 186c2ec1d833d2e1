"""The coordinator: every decision of a training run, as one pure state machine (DESIGN §4).

One entrance, one exit: ``Coordinator.handle(event) -> Outputs``. Events (:mod:`reflow_hpc.core.events`)
are what the workers report and what the driver adds (the run starts, time passes, a stop is asked
for); :class:`~reflow_hpc.core.outputs.Outputs` carries the commands for the workers
(:mod:`reflow_hpc.core.commands`), the records of finished steps, the event-log lines, the checkpoints
written and notices. The MPI runtime (``runtime/training.py``) and the simulator (``sim/engine.py``)
feed it the same events and carry out the same commands; they read nothing else of it but
:meth:`Coordinator.summary`. It reads no clock (every event carries ``now``) and performs no I/O.

The decisions: when to dispatch which prompt to which rollout worker (:mod:`~reflow_hpc.core.dispatch`),
when a batch is composed and how it is split over the trainer ranks (:mod:`~reflow_hpc.core.steps`),
when weights are synced (:mod:`~reflow_hpc.core.weight_sync`), when a checkpoint is taken
(:mod:`~reflow_hpc.core.checkpointing`), when the pools change (:mod:`~reflow_hpc.core.elastic`) and
when the run ends. The policy version counts optimizer steps: it rises by one when a step ends, and a
sync publishes the current version. The replay-buffer rules (σ, τ, δ, groups, ``b_max``) live in the
index (:mod:`~reflow_hpc.core.index`), the rules of each mode in :mod:`~reflow_hpc.core.modes`, what
may move in which phase in :mod:`~reflow_hpc.core.phase`, and who must still answer in
:mod:`~reflow_hpc.core.liveness`.

Trainer replicas are ``s_T = replica_size`` workers each (FSDP2 parameter-shard groups of
consecutive ranks): each trainer rank trains its own share of a batch; the first replica's whole
parameter-shard group takes part in every weight sync (its first worker broadcasts, the others gather with it),
snapshot and checkpoint; placements count replicas. Rollout instances are ``s_R = rollout_tp``
consecutive ranks each (a tensor-parallel engine): the coordinator dispatches to, and hears samples
from, an instance's first rank, its *leader*; the other ranks follow their leader's engine calls.
Colocated, every rank trains and every instance's leader generates.

Modes (DESIGN §9)
-----------------
``reflow``
    Split pools. Rollout workers stream samples (whole groups per dispatch) under the ``b_max``
    budget and each worker's dispatch cap; the trainer starts a step as soon as the index can
    compose a batch by the σ rule; weights are broadcast from the first trainer to every rollout
    worker, which hold their in-flight requests and resume them under the new weights (partial
    rollout). Replayed samples weigh τ. The elastic pool and adaptive generation scheduling act.
``fully_async``
    The same without replay (σ = 0), on a static split.
``one_step_off``
    Split pools, batch-level: one batch is dispatched per step, so rollout generates batch k+1
    while the trainer trains on batch k. A sync waits until the rollout workers have nothing in
    flight (no partial rollouts).
``sync``
    Colocated: every worker generates its share of a batch, then every worker trains its share,
    then each loads its own new weights (no broadcast). Generation never overlaps training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import events as ev
from .checkpointing import Checkpointing, checkpoint_tag
from .commands import Snapshot
from .dispatch import Dispatcher
from .elastic import ElasticPool
from .index import Release, ReplayIndex
from .liveness import Liveness, Unresponsive
from .modes import ModeRules
from .outputs import Outputs
from .phase import Phase
from .placement import PlacementSettings
from .resume import Resumed
from .scheduling import EngineLoad, GenerationScheduler, SchedulingSettings
from .steps import TrainingStep
from .weight_sync import WeightSyncRound

__all__ = ["Coordinator", "Settings", "Unresponsive"]

COORDINATOR_STATE_FORMAT = 1


@dataclass(frozen=True)
class Settings:
    """What the coordinator needs of the config, as plain values (built by ``reflow_hpc.assembly``)."""
    rules: ModeRules
    steps: int                   # optimizer steps of the run
    sync_every: int              # steps between weight syncs
    cap_max: int                 # engine slots of a rollout worker (rollout.max_concurrency)
    kv_budget: int = 16384       # KV budget of a rollout worker in tokens, until its engine reports one
    scheduling: SchedulingSettings = SchedulingSettings()
    placement: PlacementSettings | None = None   # the planner's settings; None: the split never changes
    placement_schedule: tuple[tuple[int, int], ...] = ()   # (after step, trainer replicas): switches forced
    checkpoint_every: int = 0    # steps between checkpoints (0: only at the end)
    timeout_s: float = 120.0     # a worker silent this long ends the run
    setup_timeout_s: float = 240.0   # the same before every worker is ready (models load, groups join)
    eval_every: int = 0          # steps between weight snapshots for evaluation (0: only the last step's)
    time_budget_s: float = 0.0   # stop as at a preemption once the run trained this long (0: no budget)
    event_log: bool = True       # record every index event in ``Outputs.log``
    replica_size: int = 1        # s_T: workers per trainer replica (its parameter shards); trainers are whole replicas
    rollout_tp: int = 1          # s_R: workers per rollout instance; rollout workers are the instances' first ranks
    check_invariants: bool = False   # check every index invariant after every event (tests; a full scan)


@dataclass
class Progress:
    """How far the run is, in steps and in training time."""
    steps: int                   # the run's steps (lowered by an early stop)
    done: int = 0                # steps done
    stop: str = ""               # a stop asked for and not acted on yet (its reason)
    stopped_early: str = ""      # why the run ends before its steps, if it does
    started_at: float = 0.0      # when every worker was ready
    elapsed_before: float = 0.0  # training time of the process sets before a resume
    train_seconds: float = 0.0   # training time of the whole run, once finished
    snapshot_step: int = 0       # the last step whose weights were snapshotted

    def elapsed(self, now: float, started: bool) -> float:
        """Training time at ``now``: this process set's (once ``started``), plus the earlier ones' before a resume."""
        return self.elapsed_before + max(0.0, now - self.started_at) if started else self.elapsed_before

    def summary(self) -> dict[str, Any]:
        return {"steps": self.done, "steps_target": self.steps, "train_seconds": self.train_seconds,
                "stopped_early": self.stopped_early}

    def snapshot_due(self) -> bool:
        """Weights are snapshotted for evaluation once per step; step 0 is the warm start, which the run scores
        before it starts."""
        due = self.done and self.done != self.snapshot_step
        self.snapshot_step = self.done
        return bool(due)

    def check_budget(self, now: float, budget: float) -> None:
        """Once the run trained ``budget`` seconds (0: no budget), it stops as at a preemption."""
        if budget and not self.stopped_early and self.elapsed(now, True) >= budget:
            self.stop = f"time budget of {budget:g} s spent"

    def stopping(self, training: bool) -> list[str]:
        """Act on the stop asked for: the run ends after the step in flight (``training``); the notice to
        give, the first time."""
        notices = [] if self.stopped_early else [f"{self.stop}: finishing the current step and checkpointing"]
        self.stopped_early, self.stop = self.stopped_early or self.stop, ""
        self.steps = min(self.steps, self.done + (1 if training else 0))
        return notices


class Coordinator:
    """Construct, optionally :meth:`load_state_dict`, then :meth:`handle` a Start and what follows. Below: the
    entrance and the queries, the events, then the decisions in the precedence of :mod:`~reflow_hpc.core.phase`."""

    def __init__(self, settings: Settings, index: ReplayIndex, *, trainers: list[int], rollouts: list[int],
                 world: int, resume_from: str | None = None):
        _check_pools(settings, index, trainers, rollouts, world)
        self.settings, self.rules, self.index = settings, settings.rules, index
        workers = list(range(world))
        self.pool = ElasticPool(workers, trainers, rollouts, replica_size=settings.replica_size, tp=settings.rollout_tp,
                                planner=settings.placement, schedule=settings.placement_schedule)
        self.dispatcher = Dispatcher(workers, GenerationScheduler(
            settings.scheduling, list(rollouts), cap_max=settings.cap_max, kv_budget=settings.kv_budget))
        self.training = TrainingStep(workers, production=self.pool.planner is not None)
        self.weight_sync = WeightSyncRound()
        self.checkpoints = Checkpointing(settings.checkpoint_every)
        self.liveness = Liveness(workers, timeout_s=settings.timeout_s, setup_timeout_s=settings.setup_timeout_s)
        self.resumed = Resumed(resume_from)
        self.progress = Progress(settings.steps)
        self.phase = Phase.NEW
        self._out = Outputs(self.phase)
        self._handlers: dict[type, tuple[Callable[[Any], None], bool]] = {    # and: from a worker (alive)?
            t: (getattr(self, name), t in _FROM_WORKERS) for t, name in _HANDLERS.items()}

    def handle(self, event: Any) -> Outputs:
        """Everything ``event`` leads to (module docstring)."""
        out = self._out = Outputs(self.phase)
        entry = self._handlers.get(type(event))
        if entry is None:
            raise TypeError(f"coordinator: no event {type(event).__name__} (events: reflow_hpc.core.events)")
        handler, from_worker = entry
        if from_worker:
            self.liveness.heard(event.worker, event.now)
        handler(event)
        if self.settings.check_invariants:
            self.index.check_invariants()
        out.phase = self.phase
        return out

    def summary(self) -> dict[str, Any]:
        """The run's figures so far (at the end: the driver adds wall time and evaluation)."""
        accounting = self.index.accounting()
        return {**self.progress.summary(), "version": self.index.version, "mode": self.rules.mode,
                "phase": self.phase.value, **self.training.summary(), "buffer": self.index.gauges(),
                "finish_reasons": dict(self.dispatcher.finish_reasons),
                "partial_rollouts": self.weight_sync.partial_rollouts, **self.pool.summary(),
                **self.checkpoints.summary(), **self.resumed.summary(),
                "accounting_ok": accounting["ok"], "accounting": accounting}

    def state_dict(self) -> dict[str, Any]:
        """The coordinator's part of a checkpoint (plain JSON-able data)."""
        return {"format": COORDINATOR_STATE_FORMAT, "index": self.index.state_dict(), "steps_done": self.progress.done,
                "next_prompt": self.dispatcher.next_prompt, "version": self.index.version,
                "history": {"fresh_rewards": list(self.training.fresh_rewards),
                            "elapsed_s": self.progress.elapsed(self.training.last_step_end, self.phase.started),
                            "placements": [list(p) for p in self.pool.placements]},
                "finish_reasons": dict(self.dispatcher.finish_reasons), "trainer_replicas": self.pool.replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint's state: samples in flight end as aborted (but those it saved go on), the
        rest is pooled again, to be reconciled with the workers' trajectory shards once they are ready."""
        if state.get("format", COORDINATOR_STATE_FORMAT) != COORDINATOR_STATE_FORMAT:
            raise ValueError(f"coordinator state: format {state.get('format')!r}, expected {COORDINATOR_STATE_FORMAT}")
        history, p = state.get("history", {}), self.progress
        self.resumed.load(self.index, state["index"], state.get("partials", []))
        p.done = p.snapshot_step = state["steps_done"]        # its last step was scored by the run that saved it
        p.elapsed_before = float(history.get("elapsed_s", 0.0))
        self.dispatcher.restore(state["next_prompt"], state.get("finish_reasons", {}))
        self.training.fresh_rewards = list(history.get("fresh_rewards", []))
        self.checkpoints.tag = checkpoint_tag(p.done) if p.done else ""
        self.pool.restore(history.get("placements", []), state.get("trainer_replicas", self.pool.replicas),
                          self.dispatcher.generation, colocated=self.rules.colocated)

    def _start(self, e: ev.Start) -> None:
        self.phase = Phase.SETUP
        self.liveness.start(e.now)
        self._out.commands += self.pool.setup(self.rules.colocated, self.index.version, self.resumed.path)

    def _ready(self, e: ev.Ready) -> None:
        resumed = self.resumed
        resumed.shards[e.worker] = (e.inventory, e.lost)
        if not self.liveness.report_ready(e.worker):
            return
        resumed.reconcile(self.index)
        self.phase = Phase.RUNNING
        self._log(e.now, "start", step=self.progress.done, resume_from=resumed.path,
                  recovered=len(resumed.recovered_ids), recovered_ids=resumed.recovered_ids,
                  trainers=list(self.pool.trainers), rollouts=list(self.pool.rollouts))
        self._log_ends(e.now, resumed.take_releases())   # how every sample ended, across a restart too
        self.progress.started_at = self.training.last_step_end = e.now
        self._out.commands += self.dispatcher.redispatch(resumed.partials, -1, self.index, self.pool.rollouts,
                                                         e.now, self._log)
        if self.progress.done >= self.progress.steps:
            self._finish(e.now)
        else:
            self._advance(e.now)
        if resumed.path is not None:
            self._out.add("notices", resumed.notice(self.index.gauges()))

    def _tick(self, e: ev.Tick) -> None:
        self.liveness.check(e.now, setup=self.phase is Phase.SETUP, running=self.phase.started)
        if self.phase.started:
            self.progress.check_budget(e.now, self.settings.time_budget_s)
            if self.progress.stop:
                self._stop(e.now)

    def _stop_requested(self, e: ev.Stop) -> None:
        self.progress.stop = self.progress.stop or e.reason
        if self.phase.started:
            self._stop(e.now)

    def _stop(self, now: float) -> None:
        """Finish the step in flight, sync, checkpoint (with what is being generated), end."""
        p, training = self.progress, self.training.batch is not None
        for notice in p.stopping(training):
            self._out.add("notices", notice)
        if not training:
            self._snapshot(now)              # the policy the run ends with is scored (no step will end)
            if p.done % self.settings.sync_every != 0:
                self.weight_sync.request()   # checkpointed weights must match the version
        self._advance(now)

    def _heartbeat(self, e: ev.Heartbeat) -> None:
        self.training.progress(e.worker, e.idle_s, e.generated_tokens)
        self._engine_load(e.worker, e.load, e.now)

    def _engine_load(self, worker: int, load: EngineLoad | None, now: float) -> None:
        cap = self.dispatcher.load(worker, load, now) \
            if load is not None and worker in self.pool.rollouts and not self.rules.colocated else None
        if cap is not None:
            self._out.commands.append(cap)
            self._advance(now)                   # a higher cap admits more

    def _samples_finished(self, e: ev.SamplesFinished) -> None:
        worker, now, samples, idle_s, generated, load = e
        self.training.progress(worker, idle_s, generated, samples, self.index, now)
        log, finished = self.settings.event_log, self.dispatcher.finished
        for s in samples:
            if log:                              # (the arguments alone cost a simulated sample ~10 %)
                sid, reward, lo, hi, tokens, reason, location, _ = s
                self._log(now, "finish", id=sid, w=worker, reward=reward, span=[lo, hi], tokens=tokens, reason=reason,
                          loc=location)
            releases = finished(worker, s, self.index, now)
            if releases is None:
                continue                         # it had ended while in flight
            self.training.produced += 1
            if releases:
                self._releases(now, releases)
            self._advance(now)
        if load is not None:
            self._engine_load(worker, load, now)

    def _samples_failed(self, e: ev.SamplesFailed) -> None:
        for sid in e.sample_ids:
            self._log(e.now, "failed", id=sid, w=e.worker)
            self._releases(e.now, self.dispatcher.failed(sid, self.index, e.now))
            self._advance(e.now)
        self._out.add("notices", f"rank {e.worker}: {len(e.sample_ids)} sample(s) failed: {e.error}")

    def _step_done(self, e: ev.StepDone) -> None:
        batch = self.training.reported(e.worker, e.step, e.stats, e.idle_s, e.fetch_s)
        if batch is None:
            return
        now, p, pool = e.now, self.progress, self.pool
        self._log(now, "train", step=batch.step)
        self._releases(now, self.index.step_done(batch))
        self._releases(now, self.index.bump_version())       # the trainer's weights are one step newer
        p.done += 1
        rec = self.training.record(batch, now, pool.rollouts, sync_seconds=self.weight_sync.last_seconds,
                                   partial_rollouts=self.weight_sync.partial_rollouts, gauges=self.index.gauges(),
                                   concurrency_caps=self.dispatcher.caps(pool.rollouts), roles=pool.roles(),
                                   finish_reasons=dict(self.dispatcher.finish_reasons))
        self._out.add("steps", rec)
        pool.plan(rec, steps_done=p.done, steps=p.steps, replays=self.rules.replays)
        every = self.settings.eval_every
        if (every and p.done % every == 0) or p.done >= p.steps:
            self._snapshot(now)
        if p.done % self.settings.sync_every == 0 or p.done >= p.steps:
            self.weight_sync.request()
        self._advance(now)

    def _weights_loaded(self, e: ev.WeightsLoaded) -> None:
        if self.weight_sync.loaded(e.worker, e.version, e.seconds, e.resumed):
            self._log(e.now, "synced", seconds=self.weight_sync.last_seconds)
        self._advance(e.now)

    def _switched(self, e: ev.Switched) -> None:
        pool = self.pool
        if pool.switched(e.worker, list(e.handed_off), e.seconds):
            record = pool.finish_switch(self.progress.done, e.now)
            self._log(e.now, "switched", seconds=record["seconds"], handed_off=record["handed_off"])
            self.training.switches.append(record)
            self.phase = Phase.RUNNING
            self._maybe_sync(e.now)              # before any resumed sample generates: current weights first
            self._out.commands += [self.dispatcher.cap(w) for w in pool.new_rollouts()]   # an old cap may stay
            for source, ids in pool.take_handed_off():
                self._out.commands += self.dispatcher.redispatch(ids, source, self.index, pool.rollouts, e.now,
                                                                 self._log)
        self._advance(e.now)

    def _flushed(self, e: ev.TrajectoriesFlushed) -> None:
        self.checkpoints.flushed(e.worker, e.tag, e.manifest, list(e.partials))
        self._advance(e.now)

    def _written(self, e: ev.CheckpointWritten) -> None:
        c = self.checkpoints.written(e.worker, e.tag, e.path, stopped_early=bool(self.progress.stopped_early),
                                     steps=self.progress.steps, index=self.index)
        if c is not None:
            self.phase = Phase.RUNNING
            self._out.add("checkpoints", (c.tag, c.step, c.path))
            self._log(e.now, "checkpoint", step=c.step, tag=c.tag, path=c.path)
            self._advance(e.now)

    def _advance(self, now: float) -> None:   # (hot: after most events; the cheap tests come first)
        sync, phase, colocated, training = self.weight_sync, self.phase, self.rules.colocated, self.training
        if phase is _RUNNING and self.pool.pending is not None and self._switch(now):
            return
        if phase is not _RUNNING and phase is not _CHECKPOINTING:
            return                               # not started, switching or finished: nothing moves
        if sync.due:
            self._maybe_sync(now)
        if self.phase is _CHECKPOINTING:
            self._out.commands += self.checkpoints.progress()
            return                               # a consistent snapshot: nothing moves meanwhile
        if colocated and sync.in_flight:
            return                               # colocated loads finish first
        if training.batch is None and not sync.due and self._maybe_checkpoint(now):
            return
        if self.progress.done >= self.progress.steps:
            if not sync.due and not sync.in_flight and training.batch is None:
                self._finish(now)
            return
        if training.batch is None and not (colocated and self.index.outstanding):
            self._out.commands += training.compose(self.index, self.pool.trainers, now,
                                                   self._log if self.settings.event_log else None)
        if not (colocated and training.batch is not None) and self.index.can_dispatch_group():
            self._out.commands += self.dispatcher.dispatch(self.index, self.pool.rollouts, now,
                                                           self._log if self.settings.event_log else None)

    def _switch(self, now: float) -> bool:
        """At a sync point (a sync is due, nothing trains or syncs): change the pools."""
        if not self.weight_sync.due or self.training.batch is not None or self.weight_sync.in_flight:
            return False
        switches = self.pool.start_switch(self.index.version, now, self.dispatcher.generation)
        if switches:
            self.phase = Phase.SWITCHING
            self._out.commands += switches
            self._log(now, "switch", trainers=list(self.pool.trainers), rollouts=list(self.pool.rollouts))
        return bool(switches)

    def _maybe_sync(self, now: float) -> None:
        if self.training.batch is not None or not self.weight_sync.can_start(
                waiting=not self.rules.partial_rollouts and self.index.outstanding > 0):
            return                               # (without partial rollouts it waits for the batch in flight)
        commands, group = self.weight_sync.start(self.index.version, self.pool.trainers, self.pool.rollouts,
                                                 replica_size=self.pool.replica_size, colocated=self.rules.colocated)
        self._log(now, "sync", group=group)
        self._out.commands += commands

    def _maybe_checkpoint(self, now: float) -> bool:   # (between steps: no batch trains, no sync is due)
        p, pool, checkpoints = self.progress, self.pool, self.checkpoints
        if not checkpoints.due(p.done, p.steps):
            return False
        # A run that stops early keeps what is being generated: it is saved in phase 1.
        partials = bool(p.done >= p.steps and p.stopped_early and self.index.outstanding)
        self.phase = Phase.CHECKPOINTING
        self._out.commands += checkpoints.begin(p.done, pool.trainers[:pool.replica_size], self.state_dict,
                                                partials=partials, workers=pool.trainers + pool.rollouts,
                                                rollouts=pool.rollouts)
        self._log(now, "checkpoint_begin", step=p.done, tag=checkpoints.tag, partials=partials)
        return True

    def _snapshot(self, now: float) -> None:
        if self.progress.snapshot_due():               # the first replica gathers, its first worker saves
            elapsed = self.progress.elapsed(now, self.phase.started)
            self._out.commands += [Snapshot(w, self.progress.done, self.index.version, elapsed)
                                   for w in self.pool.trainers[:self.pool.replica_size]]

    def _finish(self, now: float) -> None:
        self.progress.train_seconds = self.progress.elapsed(now, True)
        # A run that stops early keeps its live samples in the final checkpoint (the buffered ones and the
        # partial responses saved in it): the resumed run continues them and the event log ends them there.
        self._releases(now, self.index.abort([s for s in self.index.live_ids() if s not in self.checkpoints.kept]))
        self.dispatcher.abandon()
        self.phase = Phase.FINISHED
        self.index.check_accounting()

    def _log(self, now: float, event: str, **fields: Any) -> None:
        """One line of the event log (``events.jsonl``; schema in docs/storage.md)."""
        if self.settings.event_log:
            self._out.add("log", {"t": now, "e": event, "v": self.index.version, **fields})

    def _log_ends(self, now: float, releases: list[Release]) -> None:
        if self.settings.event_log:
            for rel in releases:
                self._log(now, "end", id=rel.sample_id, reason=rel.reason, w=rel.rank)

    def _releases(self, now: float, releases: list[Release]) -> None:
        self._log_ends(now, releases)
        self._out.commands += self.dispatcher.release(releases, cancel=self.phase is not Phase.FINISHED)


_HANDLERS = {ev.Start: "_start", ev.Tick: "_tick", ev.Stop: "_stop_requested", ev.Heartbeat: "_heartbeat",
             ev.Ready: "_ready", ev.SamplesFinished: "_samples_finished", ev.SamplesFailed: "_samples_failed",
             ev.StepDone: "_step_done", ev.WeightsLoaded: "_weights_loaded", ev.Switched: "_switched",
             ev.TrajectoriesFlushed: "_flushed", ev.CheckpointWritten: "_written"}
_FROM_WORKERS = frozenset(ev.WORKER_EVENTS)
_RUNNING, _CHECKPOINTING = Phase.RUNNING, Phase.CHECKPOINTING


def _check_pools(settings: Settings, index: ReplayIndex, trainers: list[int], rollouts: list[int],
                 world: int) -> None:
    rules, s, tp, ranks = settings.rules, settings.replica_size, settings.rollout_tp, list(range(world))
    if not trainers or not rollouts:
        raise ValueError("the coordinator needs at least one trainer and one rollout worker")
    if rules.colocated and (sorted(trainers) != ranks or sorted(rollouts) != ranks[::tp]):
        raise ValueError(f"mode {rules.mode} is colocated: every rank trains and every instance of {tp} rank(s) "
                         f"generates on its first")
    if settings.cap_max + settings.scheduling.queue < index.group_size:
        raise ValueError(f"a rollout worker holds at most {settings.cap_max + settings.scheduling.queue} samples "
                         f"< group size {index.group_size}: no group could be dispatched")
    if s < 1 or len(trainers) % s:
        raise ValueError(f"{len(trainers)} trainer ranks are not whole replicas of s_T = {s} shards")
    elastic = settings.placement is not None or settings.placement_schedule
    if elastic and (rules.colocated or list(trainers) != ranks[:len(trainers)]
                    or list(rollouts) != ranks[len(trainers)::tp]):
        raise ValueError("an elastic pool needs split pools: trainers first, then rollout instances")
    for step, n in settings.placement_schedule:
        if not 1 <= n * s < world or (world - n * s) % tp:
            raise ValueError(f"placement schedule {step}:{n}: {n} trainer replicas of {s} shards need {n * s} of "
                             f"the {world} workers and must leave at least one rollout worker, in whole "
                             f"instances of {tp}")

