"""Rank 0's side of a training run: the pure :class:`~reflow_hpc.core.coordinator.Coordinator` between
the message pump and the run directory.

Plumbing only. Each worker message becomes the coordinator event of its type (the ``events`` table,
:mod:`reflow_hpc.core.events`) and goes to ``Coordinator.handle``; the commands in what it returns
(:class:`~reflow_hpc.core.outputs.Outputs`) go to the worker they name, as they are. Around that, the
few things that touch files: the coordinator's state is restored from the newest checkpoint,
``topology.json`` is written at the start and after role switches, the event-log lines go to
``events.jsonl``, the step records become metrics (:class:`~reflow_hpc.metrics.StepMetrics`, to JSONL,
the progress line and TensorBoard), and ``summary.json`` is written at the end. Nothing of the
coordinator is read but its outputs and ``summary()``.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, Callable

from ..config import Config, to_dict
from ..assembly import coordinator_settings, new_coordinator
from ..core import events as ev
from ..core.coordinator import Coordinator
from ..core.index import RecoveredSample
from ..core.modes import rules
from ..core.outputs import Outputs
from ..core.scheduling import EngineLoad
from ..metrics import MetricsSink, StepMetrics
from ..private import private_dir, write_atomic
from .eventlog import EventWriter
from ..rollout.tool_executor import step_metrics as tool_step_metrics
from .telemetry import step_metrics as gpu_step_metrics
from .messages import (DONE, CheckpointWritten, EngineReport, Heartbeat, Hello, Ready, SamplesFailed, SamplesFinished,
                       TrajectoriesFlushed, StepDone, Switched, WeightsLoaded)

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

# The longest the coordinator waits for the event log (flush, close, a full queue), as a fraction of
# run.timeout_s: while it waits no heartbeat goes out, and a worker ends the job once the coordinator has
# been silent for run.timeout_s. Half of that lets the log's own error, naming the file, end it first.
EVENT_LOG_WAIT = 0.5

Outgoing = list[tuple[int, Any]]


def pools(cfg: Config) -> tuple[list[int], list[int]]:
    """(trainer ranks, rollout ranks) at the start: trainers first. A tensor-parallel rollout instance
    (s_R > 1) is its first rank to the coordinator; the others follow it (rollout/tensor_parallel.py).
    Colocated, every rank trains and every instance's first rank generates."""
    w, tp = cfg.resources.workers, cfg.resources.rollout_tp_size
    if rules(cfg.reflow.mode).colocated:
        return list(range(w)), list(range(0, w, tp))
    n_t = cfg.resources.trainer_replicas * cfg.resources.trainer_shard_size
    return list(range(n_t)), list(range(n_t, w, tp))


def prompt_key(cfg: Config) -> Callable[[int], int] | None:
    """What identifies a prompt across epochs for ``algorithm.replay_advantage = "recompute"``: the task's
    prompt id (a file task's data row) of the dispatch index the coordinator numbers groups by. None —
    the dispatch index itself — when advantages are kept or the task draws a new prompt for every index."""
    if cfg.algorithm.replay_advantage != "recompute":
        return None
    from ..envs import make_task

    task = make_task(cfg)
    if task.size("train") is None:
        return None
    return lambda index: task.prompt(index, "train").prompt_id


def build_coordinator(cfg: Config, resume_from: Path | None = None) -> Coordinator:
    """The coordinator a config describes, restored from ``resume_from`` (a checkpoint directory) if given."""
    trainers, rollouts = pools(cfg)
    coordinator = new_coordinator(cfg, coordinator_settings(cfg), trainers=trainers, rollouts=rollouts,
                                  world=cfg.resources.workers, resume_from=str(resume_from) if resume_from else None,
                                  prompt_key=prompt_key(cfg))
    if resume_from is not None:
        coordinator.load_state_dict(json.loads((resume_from / "extra" / "coordinator.json").read_text()))
    return coordinator


class TrainingSide:
    """What the coordinator thread runs during a training run (see the module docstring)."""

    def __init__(self, cfg: Config):
        from ..train.checkpoint import latest_checkpoint
        from ..core.shaping import OverlongShaping
        self.cfg = cfg
        self.resume_from = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint.resume else None
        self.coordinator = build_coordinator(cfg, self.resume_from)
        self.metrics = MetricsSink(cfg.run_dir, tensorboard=cfg.metrics.tensorboard,
                                   append=self.resume_from is not None)
        self.step_metrics = StepMetrics(cfg.reflow.mode, overlong=OverlongShaping.of(cfg))
        self.gpu: dict[int, dict] = {}          # rank -> its GPU's latest telemetry (heartbeats)
        self.tools: dict[int, dict] = {}        # rank -> its tool executor's latest counts (heartbeats)
        # The event log: every index event, appended as JSON lines by a thread of its own (schema:
        # docs/storage.md). A write that fails or hangs ends the run through the coordinator's failure
        # path (EventLogError from put/flush/close); a rerun resumes from the newest checkpoint.
        private_dir(cfg.run_dir, what="run directory")
        self.events = EventWriter(cfg.run_dir / "events.jsonl", append=self.resume_from is not None,
                                  timeout_s=EVENT_LOG_WAIT * cfg.run.timeout_s) if cfg.run.event_log else None
        if self.events is not None and self.events.cut:
            print(f"coordinator: event log {self.events.path}: cut its unfinished last line ({self.events.cut} "
                  f"bytes, from a write that failed before this resume)", flush=True)
        # CPU time of the coordinator thread (thread_time: waiting for the GIL is not work): handing the
        # events to the writer, and everything it does for a message or a tick.
        self.event_seconds = 0.0
        self.busy_seconds = 0.0
        self.started_at = 0.0
        self.finished = False
        self.stop_asked = False                 # set by the signal handler, acted on by the coordinator thread
        self.signalled = ""                     # the stop signal's name, once one came
        self.summary: dict[str, Any] = {}
        # Each message as the coordinator event it reports.
        self.events_of: dict[type, Callable[[int, Any, float], Any]] = {
            Heartbeat: self._heartbeat,
            Ready: self._ready,
            SamplesFinished: lambda w, m, now: ev.SamplesFinished(w, now, m.samples, m.idle_s, m.generated_tokens,
                                                                  _load(m.load)),
            SamplesFailed: lambda w, m, now: ev.SamplesFailed(w, now, m.sample_ids, m.error),
            StepDone: lambda w, m, now: ev.StepDone(w, now, m.step, m.stats, m.idle_s, m.fetch_s),
            WeightsLoaded: lambda w, m, now: ev.WeightsLoaded(w, now, m.version, m.seconds, m.resumed),
            TrajectoriesFlushed: lambda w, m, now: ev.TrajectoriesFlushed(w, now, m.tag, m.manifest, m.partials),
            CheckpointWritten: lambda w, m, now: ev.CheckpointWritten(w, now, m.tag, m.path),
            Switched: lambda w, m, now: ev.Switched(w, now, m.handed_off, m.seconds),
        }
        self.hellos: list[Hello] = []
        self.handshake_s = 0.0
        self.setup_costs: list[tuple[int, float]] = []      # (process groups, seconds) of every rank

    def request_stop(self, signum: int = 0, _frame: Any = None) -> None:
        """Signal handler (rank 0 main thread): finish the current step, checkpoint, stop."""
        self.signalled = self.signalled or (signal.Signals(signum).name if signum else "a stop request")
        self.stop_asked = True

    # ------------------------------------------------------------------------------ the pump's hooks

    def on_start(self, hellos: list[Hello], handshake_s: float, now: float) -> Outgoing:
        from .selfcheck import write_topology
        c = self.coordinator
        self.started_at = now
        self.hellos, self.handshake_s = hellos, handshake_s
        summary = c.summary()
        write_topology(self.cfg, hellos, None, handshake_s, summary["roles"])
        if self.resume_from is not None:
            print(f"coordinator: resuming from {self.resume_from} (step {summary['steps']}, version "
                  f"{summary['version']})", flush=True)
            from ..train.checkpoint import resume_changes
            _, free = resume_changes(self.resume_from, to_dict(self.cfg))
            if free:
                print("coordinator: config changed since that checkpoint: "
                      + ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in free), flush=True)
        return self._out(c.handle(ev.Start(now)))

    def on_message(self, source: int, msg: Any, now: float) -> Outgoing:
        t0 = time.thread_time()
        event_of = self.events_of.get(type(msg))
        if event_of is None:
            raise RuntimeError(f"rank 0: coordinator: unexpected {type(msg).__name__} from rank {source}")
        out = self._out(self.coordinator.handle(event_of(source, msg, now)))
        self.busy_seconds += time.thread_time() - t0
        return out

    def on_tick(self, now: float) -> Outgoing:
        t0 = time.thread_time()
        out: Outgoing = []
        if self.stop_asked:
            self.stop_asked = False
            out += self._out(self.coordinator.handle(ev.Stop(now)))
        out += self._out(self.coordinator.handle(ev.Tick(now)))
        self.busy_seconds += time.thread_time() - t0
        return out

    def done(self) -> bool:
        return self.finished

    def stop_reason(self) -> str:
        return f"stopped by {self.signalled}" if self.signalled else DONE

    # ------------------------------------------------------------------------------ events

    def _heartbeat(self, source: int, msg: Heartbeat, now: float) -> ev.Heartbeat:
        if msg.gpu:
            self.gpu[source] = msg.gpu
        if msg.tools:
            self.tools[source] = msg.tools
        return ev.Heartbeat(source, now, msg.idle_s, msg.generated_tokens, _load(msg.load))

    def _ready(self, source: int, msg: Ready, now: float) -> ev.Ready:
        inventory = [RecoveredSample(s["sample_id"], s["group_id"], s["prompt_id"], source, s["reward"],
                                     s["min_version"], s["max_version"], s["loss_tokens"], s.get("location"))
                     for s in msg.inventory]
        self.setup_costs.append((msg.groups, msg.groups_s))
        return ev.Ready(source, now, inventory, msg.lost)

    # ------------------------------------------------------------------------------ outputs

    def _out(self, out: Outputs) -> Outgoing:
        if out.log:
            t0 = time.perf_counter()      # nothing in between can wait for the GIL: wall time is its CPU time
            if self.events is not None:
                self.events.put(out.log)
            self.event_seconds += time.perf_counter() - t0
        for line in out.notices:
            print(f"coordinator: {line}", flush=True)
        for rec in out.steps:
            record = self.step_metrics(rec)
            record.update(gpu_step_metrics(self.gpu))
            record.update(tool_step_metrics(self.tools))
            self.metrics.write(record)
            self.metrics.progress(record)
            for sw in rec.switches:
                print(f"coordinator: after step {sw['step']} the pools are {sw['trainers']} trainer(s), "
                      f"{sw['rollouts']} rollout worker(s) (switch {sw['seconds']:.2f} s)", flush=True)
            if rec.switches:
                from .selfcheck import write_topology
                summary = self.coordinator.summary()
                write_topology(self.cfg, self.hellos, None, self.handshake_s, summary["roles"],
                               timeline=[{"step": step, "trainer_replicas": n} for step, n in summary["placements"]])
        for tag, _, path in out.checkpoints:
            print(f"coordinator: checkpoint {path} written", flush=True)
            if self.events is not None:
                self.events.flush()          # a checkpoint's events are on disk with it
        if out.done and not self.finished:
            self._finish()
        return [(cmd.worker, cmd) for cmd in out.commands]

    def _finish(self) -> None:
        self.finished = True
        log = {}
        if self.events is not None:
            self.events.close()
            log = {"events": self.events.events, "coordinator_cpu_seconds": self.busy_seconds,
                   "handover_cpu_seconds": self.event_seconds, "writer_cpu_seconds": self.events.cpu_seconds}
        self.summary = {**self.coordinator.summary(), "wall_seconds": time.time() - self.started_at, "event_log": log,
                        "process_groups": max((n for n, _ in self.setup_costs), default=0),
                        "process_groups_seconds": max((t for _, t in self.setup_costs), default=0.0)}
        self.metrics.close()
        write_atomic(self.cfg.run_dir / "summary.json", json.dumps(self.summary, indent=2) + "\n")


def _load(load: EngineReport | None) -> EngineLoad | None:
    if load is None:
        return None
    return EngineLoad(load.kv_tokens_used, load.kv_tokens_budget, load.preemptions, load.running, load.queued,
                      load.waiting)
