"""Rank 0's side of a training run: the pure :class:`~reflow_hpc.core.coordinator.Coordinator` between
the message pump and the run directory.

Plumbing only. Each worker message goes to the coordinator event of its type (the ``handlers``
table); the commands the coordinator returns go to the worker they name, as they are. Around that,
the few things that touch files: the coordinator's state is restored from the newest checkpoint,
``topology.json`` is written at the start, the step records become metrics
(:class:`~reflow_hpc.metrics.StepMetrics`, to JSONL, the progress line and TensorBoard), and
``summary.json`` is written at the end.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, Callable

from ..config import Config, to_dict
from ..coordination import coordinator_settings, new_coordinator
from ..core.coordinator import Coordinator
from ..core.index import RecoveredSample
from ..core.modes import rules
from ..core.scheduling import EngineLoad
from ..metrics import MetricsSink, StepMetrics
from .eventlog import EventWriter
from .telemetry import step_metrics as gpu_step_metrics
from .messages import (CheckpointWritten, EngineReport, Heartbeat, Hello, Ready, SamplesFailed, SamplesFinished,
                       ShardsFlushed, StepDone, Switched, SyncDone)

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

Outgoing = list[tuple[int, Any]]


def pools(cfg: Config) -> tuple[list[int], list[int]]:
    """(trainer ranks, rollout ranks) of the fixed split: trainers first. A tensor-parallel rollout
    instance (s_R > 1) is its first rank to the coordinator; the others follow it
    (rollout/tensor_parallel.py)."""
    w = cfg.resources.workers
    if rules(cfg.reflow.mode).colocated:
        return list(range(w)), list(range(w))
    n_t = cfg.resources.trainer_replicas * cfg.resources.trainer_shard_size
    return list(range(n_t)), list(range(n_t, w, cfg.resources.rollout_tp_size))


def build_coordinator(cfg: Config, resume_from: Path | None = None) -> Coordinator:
    """The coordinator a config describes, restored from ``resume_from`` (a checkpoint directory) if given."""
    trainers, rollouts = pools(cfg)
    coordinator = new_coordinator(cfg, coordinator_settings(cfg), trainers=trainers, rollouts=rollouts,
                                  world=cfg.resources.workers, resume_from=str(resume_from) if resume_from else None)
    if resume_from is not None:
        coordinator.load_state_dict(json.loads((resume_from / "extra" / "coordinator.json").read_text()))
    return coordinator


class TrainingSide:
    """What the coordinator thread runs during a training run (see the module docstring)."""

    def __init__(self, cfg: Config):
        from ..train.checkpoint import latest_checkpoint
        self.cfg = cfg
        self.resume_from = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint.resume else None
        self.coordinator = build_coordinator(cfg, self.resume_from)
        self.metrics = MetricsSink(cfg.run_dir, tensorboard=cfg.metrics.tensorboard,
                                   append=self.resume_from is not None)
        self.step_metrics = StepMetrics(cfg.reflow.mode)
        self.gpu: dict[int, dict] = {}          # rank -> its GPU's latest telemetry (heartbeats)
        # The event log: every index event, appended as JSON lines by a thread of its own (schema:
        # docs/storage.md).
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventWriter(cfg.run_dir / "events.jsonl", append=self.resume_from is not None) \
            if cfg.run.event_log else None
        # CPU time of the coordinator thread (thread_time: waiting for the GIL is not work): handing the
        # events to the writer, and everything it does for a message or a tick.
        self.event_seconds = 0.0
        self.busy_seconds = 0.0
        self.started_at = 0.0
        self.summary: dict[str, Any] = {}
        c = self.coordinator
        self.handlers: dict[type, Callable[[int, Any, float], list]] = {
            Heartbeat: self._heartbeat,
            Ready: self._ready,
            SamplesFinished: self._samples_finished,
            SamplesFailed: self._samples_failed,
            StepDone: lambda w, m, now: c.step_done(w, m.step, stats=m.stats, idle_s=m.idle_s, fetch_s=m.fetch_s,
                                                    now=now),
            SyncDone: lambda w, m, now: c.sync_done(w, m.version, seconds=m.seconds, resumed=m.resumed, now=now),
            ShardsFlushed: lambda w, m, now: c.shards_flushed(w, m.tag, m.manifest, now=now, partials=m.partials),
            CheckpointWritten: lambda w, m, now: c.checkpoint_written(w, m.tag, m.path, now=now),
            Switched: lambda w, m, now: c.switched(w, handed_off=m.handed_off, seconds=m.seconds, now=now),
        }
        self.hellos: list[Hello] = []
        self.handshake_s = 0.0
        self.setup_costs: list[tuple[int, float]] = []      # (process groups, seconds) of every rank

    def request_stop(self, signum: int = 0, _frame: Any = None) -> None:
        """Signal handler (rank 0 main thread): finish the current step, checkpoint, stop."""
        self.coordinator.request_stop()

    # ------------------------------------------------------------------------------ the pump's hooks

    def on_start(self, hellos: list[Hello], handshake_s: float, now: float) -> Outgoing:
        from .selfcheck import write_topology
        c = self.coordinator
        self.started_at = now
        self.hellos, self.handshake_s = hellos, handshake_s
        write_topology(self.cfg, hellos, None, handshake_s, c.roles())
        if self.resume_from is not None:
            print(f"coordinator: resuming from {self.resume_from} (step {c.steps_done}, version "
                  f"{c.index.version})", flush=True)
            from ..train.checkpoint import resume_changes
            _, free = resume_changes(self.resume_from, to_dict(self.cfg))
            if free:
                print("coordinator: config changed since that checkpoint: "
                      + ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in free), flush=True)
        return self._out(c.begin(now))

    def on_message(self, source: int, msg: Any, now: float) -> Outgoing:
        t0 = time.thread_time()
        handler = self.handlers.get(type(msg))
        if handler is None:
            raise RuntimeError(f"rank 0: coordinator: unexpected {type(msg).__name__} from rank {source}")
        self.coordinator.heard(source, now)
        out = self._out(handler(source, msg, now))
        self.busy_seconds += time.thread_time() - t0
        return out

    def on_tick(self, now: float) -> Outgoing:
        t0 = time.thread_time()
        c = self.coordinator
        before = c.stopped_early
        out = c.tick(now)
        if c.stopped_early != before:
            print(f"coordinator: {c.stopped_early}: finishing the current step and checkpointing", flush=True)
        out = self._out(out)
        self.busy_seconds += time.thread_time() - t0
        return out

    def done(self) -> bool:
        return self.coordinator.done

    # ------------------------------------------------------------------------------ handlers

    def _heartbeat(self, source: int, msg: Heartbeat, now: float) -> list:
        if msg.gpu:
            self.gpu[source] = msg.gpu
        self.coordinator.rollout_progress(source, idle_s=msg.idle_s, generated_tokens=msg.generated_tokens)
        return self._load(source, msg.load, now)

    def _load(self, source: int, load: EngineReport | None, now: float) -> list:
        if load is None:
            return []
        return self.coordinator.engine_load(source, EngineLoad(load.kv_tokens_used, load.kv_tokens_budget,
                                                               load.preemptions, load.running, load.queued), now)

    def _ready(self, source: int, msg: Ready, now: float) -> list:
        inventory = [RecoveredSample(s["sample_id"], s["group_id"], s["prompt_id"], source, s["reward"],
                                     s["min_version"], s["max_version"], s["loss_tokens"], s.get("location"))
                     for s in msg.inventory]
        self.setup_costs.append((msg.groups, msg.groups_s))
        out = self.coordinator.ready(source, inventory, msg.lost, now)
        if self.coordinator.phase != "setup" and self.resume_from is not None:
            g = self.coordinator.index.gauges()
            print(f"coordinator: buffer after resume: {g['buffer/ready']} ready, {g['buffer/replay']} replay, "
                  f"{self.coordinator.recovered} recovered from shards, {g['buffer/lost']} lost, "
                  f"{g['buffer/aborted']} aborted", flush=True)
        return out

    def _samples_finished(self, source: int, msg: SamplesFinished, now: float) -> list:
        c = self.coordinator
        c.rollout_progress(source, idle_s=msg.idle_s, generated_tokens=msg.generated_tokens)
        out: list = []
        for s in msg.samples:
            out += c.sample_finished(source, s.sample_id, reward=s.reward, min_version=s.min_version,
                                     max_version=s.max_version, loss_tokens=s.loss_tokens,
                                     finish_reason=s.finish_reason, location=s.location,
                                     total_tokens=s.total_tokens, now=now)
        return out + self._load(source, msg.load, now)

    def _samples_failed(self, source: int, msg: SamplesFailed, now: float) -> list:
        out: list = []
        for sid in msg.sample_ids:
            out += self.coordinator.sample_failed(source, sid, now=now)
        print(f"coordinator: rank {source}: {len(msg.sample_ids)} sample(s) failed: {msg.error}", flush=True)
        return out

    # ------------------------------------------------------------------------------ helpers

    def _write_events(self) -> None:
        c = self.coordinator
        if not c.events:
            return
        t0 = time.perf_counter()      # nothing in between can wait for the GIL: wall time is its CPU time
        if self.events is not None:
            self.events.put(c.events)
        c.events = []
        self.event_seconds += time.perf_counter() - t0

    def _out(self, commands: list) -> Outgoing:
        c = self.coordinator
        self._write_events()
        for rec in c.completed:
            record = self.step_metrics(rec)
            record.update(gpu_step_metrics(self.gpu))
            self.metrics.write(record)
            self.metrics.progress(record)
            for sw in rec.switches:
                print(f"coordinator: after step {sw['step']} the pools are {sw['trainers']} trainer(s), "
                      f"{sw['rollouts']} rollout worker(s) (switch {sw['seconds']:.2f} s)", flush=True)
            if rec.switches:
                from .selfcheck import write_topology
                write_topology(self.cfg, self.hellos, None, self.handshake_s, c.roles(),
                               timeline=[{"step": step, "trainer_replicas": n} for step, n in c.placements])
        c.completed.clear()
        for tag, _, path in c.checkpoints_written:
            print(f"coordinator: checkpoint {path} written", flush=True)
            if self.events is not None:
                self.events.flush()          # a checkpoint's events are on disk with it
        c.checkpoints_written.clear()
        if c.done and not self.summary:
            self._write_events()
            log = {}
            if self.events is not None:
                self.events.close()
                log = {"events": self.events.events, "coordinator_cpu_seconds": self.busy_seconds,
                       "handover_cpu_seconds": self.event_seconds, "writer_cpu_seconds": self.events.cpu_seconds}
            self.summary = {**c.summary(), "wall_seconds": time.time() - self.started_at, "event_log": log,
                            "process_groups": max((n for n, _ in self.setup_costs), default=0),
                            "process_groups_seconds": max((t for _, t in self.setup_costs), default=0.0)}
            self.metrics.close()
            (self.cfg.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        return [(cmd.worker, cmd) for cmd in commands]
