"""The coordinator: every decision of a training run, as one pure state machine (DESIGN §4).

Events in, commands out. The MPI runtime (``runtime/coordinator.py``) and the simulator feed it the
same events and carry out the same commands (:mod:`reflow_hpc.core.commands`); it reads no clock
(every event carries ``now``) and performs no I/O. It owns:

- **the decisions**: when to dispatch which prompt to which rollout worker, when a batch is
  composed and how it is split over the trainer replicas, when weights are synced, when a
  checkpoint is taken and when the run ends. The policy version counts optimizer steps: it rises
  by one when a step ends, and a sync publishes the current version (:mod:`reflow_hpc.core.modes`). The replay-buffer rules (σ, τ, δ, groups, ``b_max``)
  live in :class:`~reflow_hpc.core.index.ReplayIndex`; the rules of each mode in
  :mod:`reflow_hpc.core.modes`.
- **liveness**: every event names the worker it came from; a worker silent for ``timeout_s``
  (``setup_timeout_s`` before every worker reported ready) ends the run with
  :class:`Unresponsive` naming it.
- **the two-phase checkpoint** (:class:`CheckpointRound`): every worker but the writer flushes its
  shards and reports its manifest; then the writer (the first trainer) flushes its own, writes the
  model, the optimizer, the coordinator's state and every manifest, and reports the path. With
  sharded trainer replicas the other workers of the writer's replica get the same command and
  report too: they take part in gathering the model and the optimizer state.
- **the step records** (:class:`StepRecord`): what is known of each finished step, drained by the
  driver (``metrics.StepMetrics`` turns them into metrics).
- **trainer replicas of** ``s_T = trainer_shard`` **workers** (FSDP2 shard groups of consecutive
  ranks): each trainer rank trains its own share of a batch; the first replica's whole shard group
  takes part in every sync (its first worker broadcasts, the others gather with it), snapshot and
  checkpoint; placements count replicas.
- **the elastic pool** (split modes): which workers train and which generate. Trainers are the
  first ``n_T·s_T`` ranks (whole replicas), rollout workers the rest. After each step the placement planner
  (:mod:`reflow_hpc.core.placement`, or a fixed schedule) may ask for another ``n_T``; the switch
  happens at the next sync point (:meth:`_switch`): every worker gets a :class:`Switch`, a worker
  that leaves rollout hands its in-flight samples over (they are re-dispatched to the remaining
  rollout workers as :class:`Resume`, partial tokens and versions intact), a new trainer replica
  receives parameters and optimizer state from an existing one (each worker from the worker with
  its shard index), and the sync that follows gives
  the new rollout workers the current weights.
- **generation scheduling** (:mod:`reflow_hpc.core.scheduling`): each rollout worker's concurrency
  cap from its engine's load, and token-aware admission when dispatching.

Modes (DESIGN §9)
-----------------
``reflow``
    Split pools. Rollout workers stream samples (whole groups per dispatch) under the ``b_max``
    budget and each worker's dispatch cap; the trainer starts a step as soon as the index can
    compose a batch by the σ rule; weights are broadcast from the first trainer to every rollout
    worker, which hold their in-flight requests and resume them under the new weights (partial
    rollout). Replayed samples weigh τ.
``fully_async``
    The same without replay (σ = 0).
``one_step_off``
    Split pools, batch-level: one batch is dispatched per step, so rollout generates batch k+1
    while the trainer trains on batch k. A sync waits until the rollout workers have nothing in
    flight (no partial rollouts).
``sync``
    Colocated: every worker generates its share of a batch, then every worker trains its share,
    then each loads its own new weights (no broadcast). Generation never overlaps training.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from .commands import (Cancel, Checkpoint, Dispatch, DispatchedSample, Drop, Resume, SaveCheckpoint, SetCap, Setup,
                       Snapshot, Switch, Sync, Train, dispatched_samples, train_samples)
from .index import Batch, RecoveredSample, Release, ReplayIndex
from .modes import ModeRules
from .placement import PlacementPlanner, PlacementSettings, Window
from .sample import FINISHED, GENERATING, READY, REPLAY
from .scheduling import EngineLoad, GenerationScheduler, SchedulingSettings

COORDINATOR_STATE_FORMAT = 1


class Unresponsive(TimeoutError):
    """A worker sent nothing for too long; the message names it and what the coordinator waited for."""

    def __init__(self, worker: int, op: str, seconds: float):
        self.worker, self.op, self.seconds = worker, op, seconds
        super().__init__(f"rank 0: {op}: no answer from rank {worker} after {seconds:.1f} s")


@dataclass(frozen=True)
class Settings:
    """What the coordinator needs of the config, as plain values (built by the driver)."""
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
    event_log: bool = True       # record every index event in ``events`` (drained by the driver)
    trainer_shard: int = 1       # s_T: workers per trainer replica (one shard group); trainers are whole replicas


@dataclass
class ReplicaReport:
    """One trainer replica's report of a finished step."""
    worker: int
    stats: dict                  # trainer metrics of this replica
    idle_s: float                # time it waited for the batch
    fetch_s: float               # time it spent fetching payloads


@dataclass
class StepRecord:
    """What the coordinator knows about one finished step (the input of ``metrics.StepMetrics``)."""
    step: int                    # 0-based
    version: int                 # policy version the batch was composed under
    batch: Batch
    started_at: float            # end of the previous step (or the start of the run)
    composed_at: float
    done_at: float
    replicas: list[ReplicaReport]
    rollout_idle_s: float        # Σ over rollout workers of the time they had nothing to do in the step
    rollout_workers: int
    generated_tokens: int        # tokens generated by the rollout workers during the step
    sync_seconds: float | None   # the most recent completed sync (its slowest member), None before any
    partial_rollouts: int        # in-flight samples held and resumed at syncs so far
    concurrency_caps: dict[int, int]
    gauges: dict
    finish_reasons: dict[str, int]   # finished samples so far, by how generation ended
    roles: dict[int, str] = field(default_factory=dict)      # every rank's role during the step
    switches: list[dict] = field(default_factory=list)      # role switches that completed during the step
    produced: int = 0            # fresh samples that finished during the step
    placement_mismatch: float = float("nan")   # the planner's |log(coverage / target)| of the split in force


@dataclass
class CheckpointRound:
    """One two-phase checkpoint (module docstring)."""
    tag: str
    step: int
    writer: int
    state: dict                          # the coordinator's state when the round began
    flushing: set[int]                   # phase 1: workers whose shard manifest is still due
    manifests: dict[int, dict] = field(default_factory=dict)
    writing: bool = False                # phase 2: the writer was told to write
    unwritten: set[int] = field(default_factory=set)   # phase 2: the writer and its shard group, not yet done
    path: str = ""                       # where the writer wrote it
    partials: bool = False               # the run stops early: in-flight samples are saved into it
    saved: list[int] = field(default_factory=list)   # the samples the workers saved (phase 1)


class Coordinator:
    """See the module docstring. Construct, optionally :meth:`load_state_dict`, then :meth:`begin`."""

    def __init__(self, settings: Settings, index: ReplayIndex, *, trainers: list[int], rollouts: list[int],
                 world: int, resume_from: str | None = None):
        rules = settings.rules
        if not trainers or not rollouts:
            raise ValueError("the coordinator needs at least one trainer and one rollout worker")
        if rules.colocated and sorted(trainers) != sorted(rollouts):
            raise ValueError(f"mode {rules.mode} is colocated: trainers and rollout workers must be the same ranks")
        if settings.cap_max + settings.scheduling.queue < index.group_size:
            raise ValueError(f"a rollout worker holds at most {settings.cap_max + settings.scheduling.queue} samples "
                             f"< group size {index.group_size}: no group could be dispatched")
        self.settings, self.rules, self.index = settings, rules, index
        self.trainers, self.rollouts = list(trainers), list(rollouts)
        self.workers = list(range(world))
        self.shard = s = settings.trainer_shard
        if s < 1 or len(self.trainers) % s:
            raise ValueError(f"{len(self.trainers)} trainer ranks are not whole replicas of s_T = {s} shards")
        elastic = settings.placement is not None or settings.placement_schedule
        if elastic and (rules.colocated or self.trainers + self.rollouts != self.workers):
            raise ValueError("an elastic pool needs split pools: trainers first, then rollout workers")
        for step, n in settings.placement_schedule:
            if not 1 <= n * s < world:
                raise ValueError(f"placement schedule {step}:{n}: {n} trainer replicas of {s} shards need {n * s} of "
                                 f"the {world} workers and must leave at least one rollout worker")
        self.planner = PlacementPlanner(settings.placement, self.replicas) if settings.placement else None
        self.generation = GenerationScheduler(settings.scheduling, self.rollouts, cap_max=settings.cap_max,
                                              kv_budget=settings.kv_budget)
        self.pending_placement: int | None = None            # trainer replicas to switch to at the next sync point
        self.switching: set[int] = set()                     # workers that have not reported the switch done
        self.switch_started_at = 0.0
        self.switch_from: tuple[list[int], list[int]] = ([], [])
        self.handed_off: dict[int, list[int]] = {}          # leaving rollout worker -> samples it held
        self.switch_seconds: dict[str, float] = {}
        self.switches_done: list[dict] = []                  # for the next step record
        self.placements: list[tuple[int, int]] = []          # (step, trainer replicas) at every change
        self.handed_over = 0                                 # samples handed from a leaving rollout worker to another
        self.saved_partials: set[int] = set()                # in-flight samples saved into the final checkpoint
        self.kept_by_checkpoint: set[int] = set()            # live samples the resumed run continues (early stop)
        self.kept_partials: list[int] = []                   # the checkpoint's saved samples, to resume from it
        self.produced = 0                                    # fresh samples finished since the last step
        self.resume_from = resume_from
        self.steps = settings.steps
        self.steps_done = 0
        self.next_prompt = 0
        self.fresh_rewards: list[float] = []       # mean reward of each step's unused samples
        self.checkpoint_tag = ""                   # the newest checkpoint taken (or resumed from)
        # Decisions.
        self.outstanding = {w: 0 for w in self.workers}      # dispatched to w and not finished
        self.generating: dict[int, int] = {}                 # sample id -> worker
        self.batch: Batch | None = None
        self.batch_composed_at = 0.0
        self.batch_wait_s = 0.0
        self.waiting_replicas: set[int] = set()
        self.reports: list[ReplicaReport] = []
        self.trainer_idle_since: float | None = None
        self.want_sync = False
        self.syncing: set[int] = set()
        self.sync_version = 0                                # the version the sync in flight publishes
        self.sync_slowest = 0.0
        self.sync_seconds: float | None = None     # the last completed sync, as its slowest member measured it
        self.checkpoint: CheckpointRound | None = None
        self.phase = "new"                                   # new -> setup -> running -> finished
        # Liveness and what the step records need.
        self.reported_ready: dict[int, tuple[list, list]] = {}
        self.last_seen: dict[int, float] = {}
        self.setup_started_at = 0.0
        self.last_step_end = 0.0
        self.rollout_idle = {w: 0.0 for w in self.workers}   # cumulative, as reported
        self.idle_at_last_step = dict(self.rollout_idle)
        self.generated = {w: 0 for w in self.workers}        # cumulative generated tokens, as reported
        self.generated_at_last_step = 0
        self.partial_rollouts = 0
        self.finish_reasons: dict[str, int] = {}
        self.stop_requested = False
        self.stopped_early = ""                              # why the run ends before its steps, if it does
        self.snapshot_step = 0                               # the last step whose weights were snapshotted
        self.resume_releases: list[Release] = []             # samples a resume ended, logged at start
        self.recovered_ids: list[int] = []
        self.train_seconds = 0.0                             # training time of the whole run, once finished
        self.started_at = 0.0                                # when every worker was ready
        self.elapsed_before = 0.0                            # training time of the process sets before a resume
        self.completed: list[StepRecord] = []                # drained by the driver
        self.events: list[dict] = []                         # the event log, drained by the driver
        self.checkpoints_written: list[tuple[str, int, str]] = []   # (tag, step, path), drained by the driver
        self.recovered = 0

    # ------------------------------------------------------------------------------------------
    # State (checkpoints)
    # ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"format": COORDINATOR_STATE_FORMAT, "index": self.index.state_dict(), "steps_done": self.steps_done,
                "next_prompt": self.next_prompt, "version": self.index.version,
                "history": {"fresh_rewards": list(self.fresh_rewards), "elapsed_s": self._elapsed(self.last_step_end),
                            "placements": [list(p) for p in self.placements]},
                "finish_reasons": dict(self.finish_reasons), "trainer_replicas": self.replicas}

    def load_state_dict(self, state: dict) -> None:
        """Resume from a checkpoint's state: samples in flight then end as aborted, the rest is pooled again
        and reconciled with the workers' shards once they are ready."""
        if state.get("format", COORDINATOR_STATE_FORMAT) != COORDINATOR_STATE_FORMAT:
            raise ValueError(f"coordinator state: format {state.get('format')!r}, expected {COORDINATOR_STATE_FORMAT}")
        self.kept_partials = sorted(state.get("partials", []))
        self.resume_releases = self.index.load_state_dict(state["index"], resume=True, keep=self.kept_partials)
        self.steps_done, self.next_prompt = state["steps_done"], state["next_prompt"]
        self.fresh_rewards = list(state.get("history", {}).get("fresh_rewards", []))
        self.elapsed_before = float(state.get("history", {}).get("elapsed_s", 0.0))
        self.finish_reasons = dict(state.get("finish_reasons", {}))
        self.checkpoint_tag = _tag(self.steps_done) if self.steps_done else ""
        self.snapshot_step = self.steps_done                # scored by the run that saved it
        self.placements = [tuple(p) for p in state.get("history", {}).get("placements", [])]
        n_t = state.get("trainer_replicas", self.replicas)
        if not self.rules.colocated and n_t != self.replicas:             # the split in force at the checkpoint
            self._set_pools(n_t)
            if self.planner is not None:
                self.planner.applied(n_t)

    # ------------------------------------------------------------------------------------------
    # Inbound events
    # ------------------------------------------------------------------------------------------

    def begin(self, now: float) -> list[Any]:
        """Every worker is connected: tell each its role; they answer with :meth:`ready`."""
        self.phase = "setup"
        self.setup_started_at = now
        self.last_seen = {w: now for w in self.workers}
        return [Setup(w, tuple(self.trainers), tuple(self.rollouts), self.rules.colocated, self.index.version,
                      self.resume_from, self.feasible_placements()) for w in self.workers]

    def feasible_placements(self) -> tuple[int, ...]:
        """Trainer replica counts the pool may take (workers prepare a process group for each)."""
        if self.planner is not None:
            return tuple(self.planner.feasible())
        return tuple(sorted({self.replicas, *(n for _, n in self.settings.placement_schedule)}))

    def heard(self, worker: int, now: float) -> None:
        """Any message from ``worker`` (liveness)."""
        self.last_seen[worker] = now

    def rollout_progress(self, worker: int, *, idle_s: float, generated_tokens: int) -> None:
        """A worker's cumulative rollout idle time and generated tokens (heartbeats, finished samples)."""
        if idle_s > self.rollout_idle[worker]:          # (comparisons: it runs for every finished sample)
            self.rollout_idle[worker] = idle_s
        if generated_tokens > self.generated[worker]:
            self.generated[worker] = generated_tokens

    def engine_load(self, worker: int, load: EngineLoad, now: float) -> list[Any]:
        """A rollout worker's engine load: the slow controller may change its concurrency cap."""
        if worker not in self.rollouts or self.rules.colocated:
            return []
        if self.generation.observe(worker, load, now):
            out: list[Any] = [SetCap(worker, self.generation.caps[worker])]
            self._advance(out, now)            # a higher cap admits more
            return out
        return []

    def ready(self, worker: int, inventory: list[RecoveredSample], lost: list[int], now: float) -> list[Any]:
        """``worker`` built what its role needs; ``inventory`` / ``lost``: what its shards held at a resume."""
        self.heard(worker, now)
        self.reported_ready[worker] = (inventory, lost)
        if len(self.reported_ready) < len(self.workers):
            return []
        self._reconcile()
        self.phase = "running"
        self._log(now, "start", step=self.steps_done, resume_from=self.resume_from, recovered=self.recovered,
                  recovered_ids=self.recovered_ids, trainers=list(self.trainers), rollouts=list(self.rollouts))
        for rel in self.resume_releases:       # the log says how every sample ended, across a restart too
            self._log(now, "end", id=rel.sample_id, reason=rel.reason, w=rel.rank)
        self.resume_releases = []
        self.started_at = now
        self.trainer_idle_since = now
        self.last_step_end = now
        out: list[Any] = []
        self._resume_kept(out, now)
        if self.steps_done >= self.steps:
            self._finish(out, now)
            return out
        self._advance(out, now)
        return out

    def _resume_kept(self, out: list[Any], now: float) -> None:
        """The checkpoint saved these in-flight samples: continue them on the rollout workers."""
        per_worker: dict[int, list[DispatchedSample]] = {}
        groups: dict[int, list[int]] = {}
        for sid in self.kept_partials:
            if sid in self.index:
                groups.setdefault(self.index.sample(sid).group_id, []).append(sid)
        for ids in groups.values():                   # a group stays on one worker, as when dispatched
            worker = self.generation.choose({w: self.outstanding[w] for w in self.rollouts}, len(ids)) \
                or min(self.rollouts, key=lambda w: (self.outstanding[w], w))
            for sid in ids:
                rec = self.index.sample(sid)
                self.index.reassign(sid, worker)
                self.generating[sid] = worker
                self.outstanding[worker] += 1
                per_worker.setdefault(worker, []).append(DispatchedSample(sid, rec.group_id, rec.prompt_id))
        for worker, samples in sorted(per_worker.items()):
            out.append(Resume(worker, tuple(samples), -1))
            self._log(now, "resume", ids=[x.sample_id for x in samples], source=-1, w=worker)

    def sample_finished(self, worker: int, sample_id: int, *, reward: float, min_version: int, max_version: int,
                        loss_tokens: int, finish_reason: str, now: float, location: Any = None,
                        total_tokens: int = 0) -> list[Any]:
        """``total_tokens``: prompt + response (the KV footprint the scheduler predicts); 0 = loss_tokens."""
        out: list[Any] = []
        worker_of = self.generating.pop(sample_id, None)          # (_forget_generating, inlined)
        if worker_of is not None:
            self.outstanding[worker_of] -= 1
        self.finish_reasons[finish_reason] = self.finish_reasons.get(finish_reason, 0) + 1
        self.generation.finished(total_tokens or loss_tokens)
        if self.settings.event_log:              # (the arguments alone cost a simulated sample ~10 %)
            self._log(now, "finish", id=sample_id, w=worker, reward=reward, span=[min_version, max_version],
                      tokens=loss_tokens, reason=finish_reason, loc=location)
        if sample_id not in self.index:          # ended while in flight (shutdown, cancel)
            return out
        self.produced += 1
        releases = self.index.finished(sample_id, owner=worker, reward=reward, min_version=min_version,
                                       max_version=max_version, loss_tokens=loss_tokens, now=now, location=location)
        if releases:
            self._releases(now, releases, out)
        self._advance(out, now)
        return out

    def sample_failed(self, worker: int, sample_id: int, *, now: float) -> list[Any]:
        out: list[Any] = []
        self._forget_generating(sample_id)
        self._log(now, "failed", id=sample_id, w=worker)
        if sample_id in self.index:
            self._releases(now, self.index.failed(sample_id, now=now), out)
        self._advance(out, now)
        return out

    def step_done(self, worker: int, step: int, *, stats: dict, idle_s: float, fetch_s: float,
                  now: float) -> list[Any]:
        out: list[Any] = []
        if self.batch is None or step != self.batch.step or worker not in self.waiting_replicas:
            raise ValueError(f"step_done: unexpected report of step {step} from rank {worker}")
        self.waiting_replicas.discard(worker)
        self.reports.append(ReplicaReport(worker, stats, idle_s, fetch_s))
        if self.waiting_replicas:
            return out
        batch, self.batch = self.batch, None
        self._log(now, "train", step=batch.step)
        self._releases(now, self.index.step_done(batch), out)
        self._releases(now, self.index.bump_version(), out)       # the trainer's weights are one step newer
        self.steps_done += 1
        self._record_step(batch, now)
        self._plan(now)
        self.trainer_idle_since = now
        every = self.settings.eval_every
        if (every and self.steps_done % every == 0) or self.steps_done >= self.steps:
            self._snapshot(out, now)
        if self.steps_done % self.settings.sync_every == 0 or self.steps_done >= self.steps:
            self.want_sync = True
        self._advance(out, now)
        return out

    def sync_done(self, worker: int, version: int, *, seconds: float, resumed: int, now: float) -> list[Any]:
        out: list[Any] = []
        # The trainer that sent the weights may have trained on (streaming modes) before a slow rollout
        # worker reports: compare with the version published, not the current one.
        if worker not in self.syncing or version != self.sync_version:
            raise ValueError(f"sync_done: unexpected report of version {version} from rank {worker}")
        self.syncing.discard(worker)
        self.partial_rollouts += resumed
        self.sync_slowest = max(self.sync_slowest, seconds)
        if not self.syncing:
            self.sync_seconds = self.sync_slowest
            self._log(now, "synced", seconds=self.sync_slowest)
        self._advance(out, now)
        return out

    def switched(self, worker: int, *, handed_off: list[int], seconds: float, now: float) -> list[Any]:
        """``worker`` carried out the :class:`Switch`; ``handed_off``: samples it was generating and now
        holds for the remaining rollout workers to fetch."""
        out: list[Any] = []
        if worker not in self.switching:
            raise ValueError(f"switch: unexpected report from rank {worker}")
        self.switching.discard(worker)
        old_trainers, old_rollouts = self.switch_from
        if worker in old_rollouts and worker in self.trainers:
            direction = "to_trainer"
        elif worker in old_trainers and worker in self.rollouts:
            direction = "to_rollout"
        else:
            direction = ""
        if direction:
            self.switch_seconds[direction] = max(self.switch_seconds.get(direction, 0.0), seconds)
        if handed_off:
            self.handed_off[worker] = list(handed_off)
        if not self.switching:
            self._switch_done(out, now)
        self._advance(out, now)
        return out

    def shards_flushed(self, worker: int, tag: str, manifest: dict, *, now: float,
                       partials: list[int] = ()) -> list[Any]:
        """Phase 1 of a checkpoint: ``worker`` flushed its shards (and saved ``partials``, its in-flight
        samples, when the run stops early)."""
        out: list[Any] = []
        c = self.checkpoint
        if c is None or tag != c.tag or worker not in c.flushing:
            raise ValueError(f"checkpoint: unexpected shard manifest for {tag} from rank {worker}")
        c.flushing.discard(worker)
        c.manifests[worker] = manifest
        c.saved += list(partials)
        self._advance(out, now)
        return out

    def checkpoint_written(self, worker: int, tag: str, path: str, *, now: float) -> list[Any]:
        """Phase 2 of a checkpoint: the writer wrote it (``path``), or another worker of its replica took
        its part (``path`` empty)."""
        out: list[Any] = []
        c = self.checkpoint
        if c is None or tag != c.tag or worker not in c.unwritten or not c.writing:
            raise ValueError(f"checkpoint: unexpected report that {tag} was written, from rank {worker}")
        c.unwritten.discard(worker)
        if worker == c.writer:
            c.path = path
        if c.unwritten:
            return out
        path = c.path
        self.checkpoint = None
        self.saved_partials |= set(c.saved)
        if self.stopped_early and c.step >= self.steps:
            # The final round of an early stop: nothing has moved since its state was taken, so the live
            # samples now are the ones it holds, and the resumed run continues them.
            self.kept_by_checkpoint = set(self.index.live_ids())
        self.checkpoints_written.append((tag, c.step, path))
        self._log(now, "checkpoint", step=c.step, tag=tag, path=path)
        self._advance(out, now)
        return out

    def request_stop(self) -> None:
        """Stop early (preemption, time limit): finish the step in flight, sync, checkpoint, end. Acted on
        at the next :meth:`tick`."""
        self.stop_requested = True

    def tick(self, now: float) -> list[Any]:
        """Time passes: liveness, and a requested stop."""
        out: list[Any] = []
        if self.phase == "setup":
            missing = [w for w in self.workers if w not in self.reported_ready]
            if missing and now - self.setup_started_at > self.settings.setup_timeout_s:
                raise Unresponsive(missing[0], f"setup (no ready from rank(s) {', '.join(map(str, missing))})",
                                   self.settings.setup_timeout_s)
        elif self.phase == "running":
            silent = [w for w, t in self.last_seen.items() if now - t > self.settings.timeout_s]
            if silent:
                raise Unresponsive(silent[0], f"watching rank {silent[0]} (no message or heartbeat)",
                                   self.settings.timeout_s)
            budget = self.settings.time_budget_s
            if budget and not self.stopped_early and self._elapsed(now) >= budget:
                self.stop_requested = True                   # the training time is spent: end as at a preemption
                self.stopped_early = f"time budget of {budget:g} s spent"
            if self.stop_requested:
                self.stop_requested = False
                self.stopped_early = self.stopped_early or "stop requested"
                self.steps = min(self.steps, self.steps_done + (1 if self.batch is not None else 0))
                if self.batch is None:
                    self._snapshot(out, now)         # the policy the run ends with is scored (step_done won't)
                    if self.steps_done % self.settings.sync_every != 0:
                        self.want_sync = True        # checkpointed weights must match the version
                self._advance(out, now)
        return out

    # ------------------------------------------------------------------------------------------
    # Queries
    # ------------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.phase == "finished"

    def summary(self) -> dict:
        """End-of-run figures (the driver adds wall time and evaluation)."""
        rewards = [r for r in self.fresh_rewards if r == r]
        k = max(1, min(50, len(rewards) // 10))      # first and last tenth of the run
        return {"steps": self.steps_done, "version": self.index.version, "mode": self.rules.mode,
                "reward_first_steps": _mean(rewards[:k]), "reward_last_steps": _mean(rewards[-k:]),
                "buffer": self.index.gauges(), "finish_reasons": dict(self.finish_reasons),
                "partial_rollouts": self.partial_rollouts, "train_seconds": self.train_seconds,
                "placements": [list(p) for p in self.placements], "handed_over": self.handed_over,
                "saved_partials": len(self.saved_partials), "kept_in_checkpoint": len(self.kept_by_checkpoint),
                "resumed_partials": len(self.kept_partials),
                "stopped_early": self.stopped_early, "accounting_ok": True}

    # ------------------------------------------------------------------------------------------
    # Decisions
    # ------------------------------------------------------------------------------------------

    def _advance(self, out: list[Any], now: float) -> None:
        if self.phase != "running":
            return
        if self.switching:
            return                                   # the pools are changing: nothing moves meanwhile
        if self.pending_placement is not None and self._maybe_switch(out, now):
            return
        if self.want_sync:
            self._maybe_sync(out, now)
        if self.checkpoint is not None:
            self._checkpoint_progress(out)
            return                                   # a consistent snapshot: nothing moves meanwhile
        if self.syncing and self.rules.colocated:
            return                                   # colocated loads finish first
        if self._maybe_checkpoint(out, now):
            return
        if self.steps_done >= self.steps:
            if not self.want_sync and not self.syncing and self.batch is None:
                self._finish(out, now)
            return
        if self.batch is None:                       # (tested here too: this runs for every finished sample)
            self._maybe_train(out, now)
        self._dispatch(out, now)

    def _maybe_sync(self, out: list[Any], now: float) -> None:
        if not self.want_sync or self.syncing or self.batch is not None:
            return
        if not self.rules.partial_rollouts and self.index.outstanding > 0:
            return                                  # waits for the batch in flight: no partial rollouts
        self.want_sync = False
        v = self.sync_version = self.index.version
        self._log(now, "sync", group=[self.trainers[0], *self.rollouts] if not self.rules.colocated else self.rollouts)
        if self.rules.colocated:
            for w in self.rollouts:
                out.append(Sync(w, v, None, (w,)))
            self.syncing = set(self.rollouts)
        else:
            src = self.trainers[0]
            group = (src, *self.rollouts)
            # The other workers of the source's replica gather its full weights with it (sharded replicas).
            for w in (*self.trainers[1:self.shard], *group):
                out.append(Sync(w, v, src, group))
            self.syncing = set(group) | set(self.trainers[:self.shard])
        self.sync_slowest = 0.0

    def _snapshot(self, out: list[Any], now: float) -> None:
        # Once per step; step 0 is the warm start, which the run scores before it starts.
        if self.steps_done and self.steps_done != self.snapshot_step:
            self.snapshot_step = self.steps_done
            out.extend(Snapshot(w, self.steps_done, self.index.version, self._elapsed(now))
                       for w in self.trainers[:self.shard])       # the replica gathers, its first worker saves

    def _maybe_checkpoint(self, out: list[Any], now: float) -> bool:
        if self.batch is not None or self.want_sync:
            return False                             # (tested first: the trainer is busy at most calls)
        every = self.settings.checkpoint_every
        due_every = every and self.steps_done and self.steps_done % every == 0
        due_final = self.steps_done >= self.steps
        if not (due_every or due_final):
            return False
        tag = _tag(self.steps_done)
        if tag == self.checkpoint_tag:
            return False
        self.checkpoint_tag = tag
        writer = self.trainers[0]
        # A run that stops early keeps what is being generated: every rollout worker (the writer too, if it
        # generates) saves it in phase 1, so that nothing finishes after the state is taken in phase 2.
        partials = bool(due_final and self.stopped_early and self.index.outstanding)
        others = [w for w in sorted(set(self.trainers) | set(self.rollouts))
                  if w != writer or (partials and w in self.rollouts)]
        self.checkpoint = CheckpointRound(tag, self.steps_done, writer, self.state_dict(), set(others),
                                          partials=partials)
        self._log(now, "checkpoint_begin", step=self.steps_done, tag=tag, partials=partials)
        out.extend(Checkpoint(w, self.steps_done, tag, partials and w in self.rollouts) for w in others)
        self._checkpoint_progress(out)
        return True

    def _checkpoint_progress(self, out: list[Any]) -> None:
        c = self.checkpoint
        if c is not None and not c.flushing and not c.writing:
            c.writing = True
            if c.partials:
                # Every worker that generated handed its samples over and flushed: nothing finishes any
                # more, so the state now includes every finished sample (all in flushed shards).
                c.state = self.state_dict()
                c.state["partials"] = sorted(c.saved)
            # The writer's whole replica gathers the model and optimizer state; the writer writes them.
            c.unwritten = set(self.trainers[:self.shard]) | {c.writer}
            manifests = {str(w): m for w, m in sorted(c.manifests.items())}
            out.extend(SaveCheckpoint(w, c.step, c.tag, c.state, manifests) for w in sorted(c.unwritten))

    def _maybe_train(self, out: list[Any], now: float) -> None:
        if self.batch is not None:
            return
        if self.rules.colocated and self.index.outstanding > 0:
            return
        batch = self.index.compose_batch(now=now)
        if batch is None:
            return
        self.batch = batch
        self.batch_composed_at = now
        if self.settings.event_log:
            self._log(now, "compose", step=batch.step, ids=list(batch.sample_ids),
                      replay=[int(r) for r in batch.is_replay], weights=[round(w, 6) for w in batch.loss_weights],
                      stale=list(batch.staleness))
        self.batch_wait_s = now - (self.trainer_idle_since if self.trainer_idle_since is not None else now)
        self.waiting_replicas = set(self.trainers)
        self.reports = []
        total_tokens = sum(batch.loss_tokens)
        shares = _split_balanced(batch.loss_tokens, len(self.trainers))
        items = train_samples(batch.sample_ids, batch.owners, batch.advantages, batch.loss_weights, batch.is_replay,
                              batch.staleness)
        for replica, (worker, idx) in enumerate(zip(self.trainers, shares)):
            samples = tuple([items[i] for i in idx])
            out.append(Train(worker, batch.step, batch.version, samples, total_tokens, replica, len(self.trainers)))

    def _dispatch(self, out: list[Any], now: float) -> None:
        if self.rules.colocated and self.batch is not None:
            return                                   # colocated: no generation while training
        index = self.index
        if not index.can_dispatch_group():
            return                                   # (most calls: the window's budget is spent)
        n = index.group_size
        per_worker: dict[int, list[DispatchedSample]] = {}
        while index.can_dispatch_group():
            worker = self.generation.choose({w: self.outstanding[w] for w in self.rollouts}, n)
            if worker is None:
                break
            group = index.new_group(self.next_prompt, now=now, worker=worker)
            if self.settings.event_log:
                self._log(now, "dispatch", w=worker, group=group.group_id, prompt=group.prompt_id,
                          ids=list(group.sample_ids))
            self.next_prompt += 1
            self.outstanding[worker] += n
            self.generating.update(zip(group.sample_ids, repeat(worker)))
            per_worker.setdefault(worker, []).extend(dispatched_samples(group.sample_ids, group.group_id,
                                                                        group.prompt_id))
        for worker, samples in sorted(per_worker.items()):
            out.append(Dispatch(worker, tuple(samples)))

    # ------------------------------------------------------------------------------------------
    # The elastic pool
    # ------------------------------------------------------------------------------------------

    @property
    def replicas(self) -> int:
        """n_T: trainer replicas in force (each of ``trainer_shard`` workers)."""
        return len(self.trainers) // self.shard

    def _set_pools(self, n_replicas: int) -> None:
        n = n_replicas * self.shard
        self.trainers, self.rollouts = self.workers[:n], self.workers[n:]
        for w in self.workers:
            if w in self.rollouts:
                self.generation.add_worker(w)
            else:
                self.generation.remove_worker(w)

    def _plan(self, now: float) -> None:
        """After a step: does the placement planner (or the schedule) want another split?"""
        forced = [n for step, n in self.settings.placement_schedule if step == self.steps_done]
        if forced and forced[-1] != self.replicas:
            self.pending_placement = forced[-1]
        elif self.planner is not None and self.completed:
            rec = self.completed[-1]
            step_s = max(rec.done_at - rec.started_at, 1e-9)
            idle_t = _mean([r.idle_s for r in rec.replicas]) / step_s if rec.replicas else 0.0
            idle_r = rec.rollout_idle_s / (rec.rollout_workers * step_s) if rec.rollout_workers else 0.0
            new = self.planner.observe(Window(rec.produced, step_s, min(1.0, idle_t), min(1.0, idle_r),
                                              replay_supply=rec.gauges.get("buffer/replay", 0)
                                              if self.rules.replays else 0),
                                       steps_left=self.steps - self.steps_done)
            rec.placement_mismatch = self.planner.last_mismatch
            if new is not None and self.steps_done < self.steps:
                self.pending_placement = new

    def _maybe_switch(self, out: list[Any], now: float) -> bool:
        """At a sync point, with nothing in training: change the pools (module docstring)."""
        n_t = self.pending_placement
        if n_t is None or not self.want_sync or self.batch is not None or self.syncing or self.checkpoint:
            return False
        self.pending_placement = None
        if n_t == self.replicas:
            return False
        old_t, old_r = list(self.trainers), list(self.rollouts)
        self.switch_from = (old_t, old_r)
        self._set_pools(n_t)
        joining = [w for w in self.trainers if w not in old_t]
        # A joining replica's i-th worker gets the state of the i-th worker (the same shard) of an existing
        # replica, the replicas taken in turn; joining workers are whole replicas (the pools are prefixes).
        s, old_n = self.shard, len(old_t) // self.shard
        transfers = tuple((old_t[(i // s) % old_n * s + i % s], w) for i, w in enumerate(joining))
        for w in self.workers:
            out.append(Switch(w, tuple(self.trainers), tuple(self.rollouts), self.index.version, transfers))
        self._log(now, "switch", trainers=list(self.trainers), rollouts=list(self.rollouts))
        self.switching = set(self.workers)
        self.switch_started_at = now
        self.switch_seconds = {}
        self.handed_off = {}
        return True

    def _switch_done(self, out: list[Any], now: float) -> None:
        """Every worker switched: record it, sync the new rollout pool, re-dispatch what was handed off."""
        self.placements.append((self.steps_done, self.replicas))
        if self.planner is not None:
            self.planner.applied(self.replicas, now - self.switch_started_at)
        handed = sum(len(ids) for ids in self.handed_off.values())
        self.handed_over += handed
        self._log(now, "switched", seconds=now - self.switch_started_at, handed_off=handed)
        self.switches_done.append({"step": self.steps_done, "trainers": len(self.trainers),
                                   "rollouts": len(self.rollouts), "seconds": now - self.switch_started_at,
                                   "handed_off": handed, **{f"{k}_s": v for k, v in self.switch_seconds.items()}})
        self._maybe_sync(out, now)                   # before any resumed sample generates: current weights first
        old_rollouts = self.switch_from[1]
        for w in self.rollouts:
            if w not in old_rollouts:                # its engine may still hold an old cap
                out.append(SetCap(w, self.generation.caps[w]))
        for source, ids in sorted(self.handed_off.items()):
            per_worker: dict[int, list[DispatchedSample]] = {}
            for sid in ids:
                if sid not in self.index or self.index.sample(sid).state not in GENERATING:
                    continue                         # it ended meanwhile (cancelled, shut down)
                rec = self.index.sample(sid)
                worker = self.generation.choose({w: self.outstanding[w] for w in self.rollouts}, 1) \
                    or min(self.rollouts, key=lambda w: (self.outstanding[w], w))
                self._forget_generating(sid)
                self.index.reassign(sid, worker)
                self.generating[sid] = worker
                self.outstanding[worker] += 1
                per_worker.setdefault(worker, []).append(DispatchedSample(sid, rec.group_id, rec.prompt_id))
            for worker, samples in sorted(per_worker.items()):
                out.append(Resume(worker, tuple(samples), source))
                self._log(now, "resume", ids=[x.sample_id for x in samples], source=source, w=worker)
        self.handed_off = {}

    def roles(self) -> dict[int, str]:
        return {w: ("trainer+rollout" if w in self.trainers and w in self.rollouts else
                    "trainer" if w in self.trainers else "rollout") for w in self.workers}

    def _finish(self, out: list[Any], now: float) -> None:
        self.train_seconds = self._elapsed(now)
        # A run that stops early keeps its live samples in the final checkpoint (the buffered ones and the
        # partial responses saved in it): the resumed run continues them and the event log ends them there.
        live = [sid for sid in self.index.live_ids() if sid not in self.kept_by_checkpoint]
        self._releases(now, self.index.abort(live), out)
        self.generating.clear()
        self.phase = "finished"
        self.index.check_accounting()

    # ------------------------------------------------------------------------------------------
    # Resume
    # ------------------------------------------------------------------------------------------

    def _reconcile(self) -> None:
        """The restored index against what the workers found in their shards."""
        if self.resume_from is None:
            return
        recovered: list[RecoveredSample] = []
        present: set[int] = set()
        for _, (inventory, lost) in sorted(self.reported_ready.items()):
            for s in inventory:
                present.add(s.sample_id)
                if not self.index.knows(s.sample_id):
                    recovered.append(s)
            for sid in lost:
                if sid in self.index:
                    self.resume_releases += self.index.lost(sid)
        for sid in list(self.index.live_ids()):
            rec = self.index.sample(sid)
            if rec.state in (FINISHED, READY, REPLAY) and sid not in present:
                self.resume_releases += self.index.lost(sid)   # its shard is gone (another node, wiped scratch)
        if recovered:
            self.resume_releases += self.index.recover(recovered)
        self.recovered = len(recovered)
        self.recovered_ids = sorted(s.sample_id for s in recovered)
        self.index.check_accounting()

    # ------------------------------------------------------------------------------------------
    # Helpers
    # ------------------------------------------------------------------------------------------

    def _elapsed(self, now: float) -> float:
        """Training time of the run at ``now``: this process set's, plus the earlier ones' before a resume."""
        return self.elapsed_before + max(0.0, now - self.started_at) if self.phase == "running" else self.elapsed_before

    def _record_step(self, batch: Batch, now: float) -> None:
        idle = sum(max(0.0, self.rollout_idle[w] - self.idle_at_last_step.get(w, 0.0)) for w in self.rollouts)
        self.idle_at_last_step = dict(self.rollout_idle)
        generated = sum(self.generated.values())
        fresh = [r for r, rep in zip(batch.rewards, batch.is_replay) if not rep]
        self.fresh_rewards.append(_mean(fresh))
        self.completed.append(StepRecord(
            step=batch.step, version=batch.version, batch=batch, started_at=self.last_step_end,
            composed_at=self.batch_composed_at, done_at=now, replicas=self.reports,
            rollout_idle_s=idle, rollout_workers=len(self.rollouts),
            generated_tokens=generated - self.generated_at_last_step, sync_seconds=self.sync_seconds,
            partial_rollouts=self.partial_rollouts,
            concurrency_caps={w: self.generation.caps.get(w, self.settings.cap_max) for w in self.rollouts},
            gauges=self.index.gauges(), finish_reasons=dict(self.finish_reasons), roles=self.roles(),
            switches=self.switches_done, produced=self.produced))
        self.switches_done = []
        self.produced = 0
        self.reports = []
        self.generated_at_last_step = generated
        self.last_step_end = now

    def _forget_generating(self, sample_id: int) -> None:
        worker = self.generating.pop(sample_id, None)
        if worker is not None:
            self.outstanding[worker] -= 1

    def _log(self, now: float, event: str, **fields: Any) -> None:
        """One line of the event log (``events.jsonl``; schema in docs/storage.md)."""
        if self.settings.event_log:
            self.events.append({"t": now, "e": event, "v": self.index.version, **fields})

    def _releases(self, now: float, releases: list[Release], out: list[Any]) -> None:
        drop: dict[int, list[int]] = {}
        cancel: dict[int, list[int]] = {}
        log = self.settings.event_log
        for rel in releases:
            if log:
                self._log(now, "end", id=rel.sample_id, reason=rel.reason, w=rel.rank)
            if rel.rank < 0:
                continue
            if rel.has_payload:
                drop.setdefault(rel.rank, []).append(rel.sample_id)
            else:
                cancel.setdefault(rel.rank, []).append(rel.sample_id)
                self._forget_generating(rel.sample_id)
        for w, ids in sorted(drop.items()):
            out.append(Drop(w, tuple(ids)))
        if self.phase != "finished":
            for w, ids in sorted(cancel.items()):
                out.append(Cancel(w, tuple(ids)))


def _tag(step: int) -> str:
    return f"step_{step:06d}"


def _mean(xs: Any) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _split_balanced(loss_tokens: tuple[int, ...], parts: int) -> list[list[int]]:
    """Indices split into ``parts`` shares of near-equal token count (largest first, greedy; a heap keeps
    it O(n log p) for the simulator's thousand-worker runs)."""
    shares: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, 0, p) for p in range(parts)]                  # (load, count, part): ties go to the lower part
    for i in sorted(range(len(loss_tokens)), key=loss_tokens.__getitem__, reverse=True):   # stable, as ascending -n
        load, count, j = heap[0]
        shares[j].append(i)
        heapq.heapreplace(heap, (load + loss_tokens[i], count + 1, j))
    return [sorted(s) for s in shares]
