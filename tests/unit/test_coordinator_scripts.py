"""The coordinator, event by event: scripts of events in, the outputs expected (h11's style of test).

Each script drives ``Coordinator.handle`` by hand, without the simulator, and checks after every
event the commands in order (in a short form: :func:`short`), the phase, and where it matters the
event-log lines, the notices, the step records and the checkpoints written. Three ranks unless said
otherwise: rank 0 trains, ranks 1 and 2 generate; batches of 4 samples in groups of 2, so that one
``b_max`` window is two groups, one per rollout worker.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from reflow_hpc.core import events as ev
from reflow_hpc.core.coordinator import Coordinator, Settings
from reflow_hpc.core.index import build_index
from reflow_hpc.core.liveness import Unresponsive
from reflow_hpc.core.modes import rules
from reflow_hpc.core.scheduling import EngineLoad, SchedulingSettings


def coordinator(mode: str, *, workers: int = 3, trainers: int = 1, sigma: float = 0.0, delta: int = 1,
                steps: int = 2, **settings) -> Coordinator:
    section = SimpleNamespace(mode=mode, sigma=sigma, tau=0.5, delta=delta, b_max=0, sync_every=1, sampler="random",
                              replay_filter="accept_all", reward_low=0.0, reward_high=1.0)
    index = build_index(section, group_size=2, batch_size=4, seed=0)
    r, ranks = rules(mode), list(range(workers))
    tr, ro = (ranks, ranks) if r.colocated else (ranks[:trainers], ranks[trainers:])
    s = Settings(rules=r, steps=steps, sync_every=1, cap_max=4, scheduling=SchedulingSettings(queue=0),
                 check_invariants=True, **settings)
    return Coordinator(s, index, trainers=tr, rollouts=ro, world=workers)


def short(cmd) -> tuple:
    """A command as (kind, worker, what matters of it)."""
    kind, w = type(cmd).__name__, cmd.worker
    ids = tuple(s.sample_id for s in getattr(cmd, "samples", ()))
    return {"Dispatch": (kind, w, ids), "Train": (kind, w, getattr(cmd, "step", None), ids),
            "SyncWeights": (kind, w, getattr(cmd, "version", None), getattr(cmd, "src", None)),
            "Drop": (kind, w, getattr(cmd, "sample_ids", None)), "Cancel": (kind, w, getattr(cmd, "sample_ids", None)),
            "FlushTrajectories": (kind, w, getattr(cmd, "tag", None), getattr(cmd, "partials", None)),
            "WriteCheckpoint": (kind, w, getattr(cmd, "tag", None)), "Snapshot": (kind, w, getattr(cmd, "step", None)),
            "Switch": (kind, w, getattr(cmd, "trainers", None), getattr(cmd, "transfers", None)),
            "Resume": (kind, w, ids, getattr(cmd, "source", None)), "SetCap": (kind, w, getattr(cmd, "cap", None)),
            }.get(kind, (kind, w))


def finished(*ids: int, version: int = 0) -> list[ev.FinishedSample]:
    return [ev.FinishedSample(s, float(s % 2), version, version, 8, "stop") for s in ids]


def run(c: Coordinator, script: list) -> None:
    """``script``: (event, phase after it, the commands it gives, and optionally a dict of further
    expectations: ``log`` (the event kinds of its log lines), ``notices``, ``steps``, ``checkpoints``)."""
    for i, (event, phase, commands, *more) in enumerate(script):
        out = c.handle(event)
        where = f"event {i} ({type(event).__name__})"
        assert [short(x) for x in out.commands] == commands, where
        assert out.phase.value == phase, where
        for key, want in (more[0] if more else {}).items():
            got = {"log": [line["e"] for line in out.log], "notices": list(out.notices),
                   "steps": [rec.step for rec in out.steps], "checkpoints": list(out.checkpoints)}[key]
            assert got == want, f"{where}: {key}"


def start(c: Coordinator, workers: int = 3) -> list:
    """Start, and every worker ready but the last."""
    return [(ev.Start(0.0), "setup", [("Setup", w) for w in range(workers)])] + \
           [(ev.Ready(w, 0.1), "setup", []) for w in range(workers - 1)]


def test_a_streaming_run_from_dispatch_to_its_final_checkpoint():
    c = coordinator("fully_async")
    run(c, start(c) + [
        (ev.Ready(2, 0.1), "running", [("Dispatch", 1, (0, 1)), ("Dispatch", 2, (2, 3))],
         {"log": ["start", "dispatch", "dispatch"]}),
        # Half a batch: nothing to compose, and the b_max window is spent.
        (ev.SamplesFinished(1, 1.0, finished(0, 1)), "running", [], {"log": ["finish", "finish"]}),
        # The batch is complete: the trainer gets it, and a new window opens.
        (ev.SamplesFinished(2, 1.1, finished(2, 3)), "running",
         [("Train", 0, 0, (0, 1, 2, 3)), ("Dispatch", 1, (4, 5)), ("Dispatch", 2, (6, 7))],
         {"log": ["finish", "finish", "compose", "dispatch", "dispatch"]}),
        # The step ends: its samples end as trained (σ = 0), the weights of version 1 go to every rollout worker.
        (ev.StepDone(0, 2.0, 0, {}), "running",
         [("Drop", 1, (0, 1)), ("Drop", 2, (2, 3)), ("SyncWeights", 0, 1, 0), ("SyncWeights", 1, 1, 0), ("SyncWeights", 2, 1, 0)],
         {"log": ["train", "end", "end", "end", "end", "sync"], "steps": [0]}),
        (ev.WeightsLoaded(0, 2.1, 1), "running", []),
        (ev.WeightsLoaded(1, 2.1, 1), "running", []),
        (ev.WeightsLoaded(2, 2.1, 1), "running", [], {"log": ["synced"]}),
        (ev.SamplesFinished(1, 3.0, finished(4, 5)), "running", []),
        (ev.SamplesFinished(2, 3.1, finished(6, 7, version=1)), "running",
         [("Train", 0, 1, (4, 5, 6, 7)), ("Dispatch", 1, (8, 9)), ("Dispatch", 2, (10, 11))]),
        # The last step: the trained policy is snapshotted, synced, and the final checkpoint begins.
        (ev.StepDone(0, 4.0, 1, {}), "checkpointing",
         [("Drop", 1, (4, 5)), ("Drop", 2, (6, 7)), ("Snapshot", 0, 2), ("SyncWeights", 0, 2, 0), ("SyncWeights", 1, 2, 0),
          ("SyncWeights", 2, 2, 0), ("FlushTrajectories", 1, "step_000002", False), ("FlushTrajectories", 2, "step_000002", False)]),
        (ev.WeightsLoaded(0, 4.1, 2), "checkpointing", []),
        (ev.WeightsLoaded(1, 4.1, 2), "checkpointing", []),
        (ev.WeightsLoaded(2, 4.1, 2), "checkpointing", []),
        (ev.TrajectoriesFlushed(1, 4.2, "step_000002", {}), "checkpointing", []),
        # Phase 2 once every other worker flushed: the writer writes.
        (ev.TrajectoriesFlushed(2, 4.2, "step_000002", {}), "checkpointing", [("WriteCheckpoint", 0, "step_000002")]),
        # Written: the run ends, and what was still being generated is cancelled and accounted as aborted.
        (ev.CheckpointWritten(0, 4.3, "step_000002", "/ckpt"), "finished",
         [("Cancel", 1, (8, 9)), ("Cancel", 2, (10, 11))],
         {"checkpoints": [("step_000002", 2, "/ckpt")], "log": ["checkpoint", "end", "end", "end", "end"]}),
    ])
    s = c.summary()
    assert s["accounting_ok"] and s["accounting"]["ended"]["trained"] == 8 and s["accounting"]["ended"]["aborted"] == 4
    assert s["steps"] == 2 and s["version"] == 2


def test_colocated_sync_generates_then_trains_then_loads():
    c = coordinator("sync", workers=2, steps=1)
    run(c, start(c, 2) + [
        (ev.Ready(1, 0.1), "running", [("Dispatch", 0, (0, 1)), ("Dispatch", 1, (2, 3))]),
        (ev.SamplesFinished(0, 1.0, finished(0, 1)), "running", []),
        # Every worker trains a share of near-equal tokens.
        (ev.SamplesFinished(1, 1.1, finished(2, 3)), "running", [("Train", 0, 0, (0, 2)), ("Train", 1, 0, (1, 3))]),
        (ev.StepDone(0, 2.0, 0, {}), "running", []),
        # Each worker loads its own trainer's weights (no source): nothing else moves until they have.
        (ev.StepDone(1, 2.0, 0, {}), "running",
         [("Drop", 0, (0, 1)), ("Drop", 1, (2, 3)), ("Snapshot", 0, 1), ("SyncWeights", 0, 1, None), ("SyncWeights", 1, 1, None)]),
        (ev.WeightsLoaded(0, 2.1, 1), "running", []),
        (ev.WeightsLoaded(1, 2.1, 1), "checkpointing", [("FlushTrajectories", 1, "step_000001", False)]),
        (ev.TrajectoriesFlushed(1, 2.2, "step_000001", {}), "checkpointing", [("WriteCheckpoint", 0, "step_000001")]),
        (ev.CheckpointWritten(0, 2.3, "step_000001", "/ckpt"), "finished", []),
    ])


def test_a_role_switch_at_a_sync_point_hands_samples_over():
    """After step 1 the schedule wants 2 trainers: rank 1 leaves rollout, hands over what it generates, and
    receives the trainer state of rank 0; the weight sync then reaches the remaining rollout worker, and the
    held samples resume there."""
    c = coordinator("reflow", sigma=0.5, delta=2, steps=3, placement_schedule=((1, 2),))
    run(c, start(c) + [
        (ev.Ready(2, 0.1), "running", [("Dispatch", 1, (0, 1)), ("Dispatch", 2, (2, 3))]),
        (ev.SamplesFinished(1, 1.0, finished(0, 1)), "running", []),
        (ev.SamplesFinished(2, 1.1, finished(2, 3)), "running",
         [("Train", 0, 0, (0, 1, 2, 3)), ("Dispatch", 1, (4, 5)), ("Dispatch", 2, (6, 7))]),
        # A sync point with a new split pending: the switch comes first (core/phase.py), the trained samples
        # stay for replay (σ > 0).
        (ev.StepDone(0, 2.0, 0, {}), "switching", [("Switch", w, (0, 1), ((0, 1),)) for w in range(3)],
         {"log": ["train", "switch"]}),
        (ev.Switched(0, 2.5), "switching", []),
        (ev.Switched(1, 2.5, [4, 5], 0.1), "switching", []),
        (ev.Switched(2, 2.5), "running", [("SyncWeights", 0, 1, 0), ("SyncWeights", 2, 1, 0), ("Resume", 2, (4, 5), 1)],
         {"log": ["switched", "sync", "resume"]}),
    ])
    assert c.summary()["roles"] == {0: "trainer", 1: "trainer", 2: "rollout"}
    with pytest.raises(ValueError, match="sync_done: unexpected report of version 1 from rank 1"):
        c.handle(ev.WeightsLoaded(1, 2.6, 1))           # no longer a rollout worker


def test_a_stop_finishes_the_step_and_saves_what_is_being_generated():
    c = coordinator("fully_async", steps=10)
    run(c, start(c) + [
        (ev.Ready(2, 0.1), "running", [("Dispatch", 1, (0, 1)), ("Dispatch", 2, (2, 3))]),
        (ev.SamplesFinished(1, 1.0, finished(0, 1)), "running", []),
        (ev.SamplesFinished(2, 1.1, finished(2, 3)), "running",
         [("Train", 0, 0, (0, 1, 2, 3)), ("Dispatch", 1, (4, 5)), ("Dispatch", 2, (6, 7))]),
        # Asked mid-step: the run's last step is the one in flight.
        (ev.Stop(1.2, "preempted"), "running", [],
         {"notices": ["preempted: finishing the current step and checkpointing"]}),
        (ev.Stop(1.25, "preempted"), "running", [], {"notices": []}),     # said once
        (ev.StepDone(0, 2.0, 0, {}), "checkpointing",
         [("Drop", 1, (0, 1)), ("Drop", 2, (2, 3)), ("Snapshot", 0, 1), ("SyncWeights", 0, 1, 0), ("SyncWeights", 1, 1, 0),
          ("SyncWeights", 2, 1, 0), ("FlushTrajectories", 1, "step_000001", True), ("FlushTrajectories", 2, "step_000001", True)]),
        (ev.WeightsLoaded(0, 2.1, 1), "checkpointing", []),
        (ev.WeightsLoaded(1, 2.1, 1), "checkpointing", []),
        (ev.WeightsLoaded(2, 2.1, 1), "checkpointing", []),
        (ev.TrajectoriesFlushed(1, 2.2, "step_000001", {}, [4, 5]), "checkpointing", []),
        (ev.TrajectoriesFlushed(2, 2.2, "step_000001", {}, [6, 7]), "checkpointing",
         [("WriteCheckpoint", 0, "step_000001")]),
        # Nothing is aborted: the resumed run continues the saved samples.
        (ev.CheckpointWritten(0, 2.3, "step_000001", "/ckpt"), "finished", []),
    ])
    s = c.summary()
    assert (s["stopped_early"], s["steps"], s["saved_partials"], s["kept_in_checkpoint"]) == ("preempted", 1, 4, 4)
    assert s["accounting"]["ended"]["aborted"] == 0 and s["accounting"]["live"] == 4


def test_a_switch_pending_with_a_checkpoint_due_switches_first():
    """Precedence (core/phase.py): at a sync point a pending split goes before the checkpoint due then."""
    c = coordinator("reflow", sigma=0.5, delta=2, steps=4, placement_schedule=((1, 2),), checkpoint_every=1)
    script = start(c) + [
        (ev.Ready(2, 0.1), "running", [("Dispatch", 1, (0, 1)), ("Dispatch", 2, (2, 3))]),
        (ev.SamplesFinished(1, 1.0, finished(0, 1)), "running", []),
        (ev.SamplesFinished(2, 1.1, finished(2, 3)), "running",
         [("Train", 0, 0, (0, 1, 2, 3)), ("Dispatch", 1, (4, 5)), ("Dispatch", 2, (6, 7))]),
        (ev.StepDone(0, 2.0, 0, {}), "switching", [("Switch", w, (0, 1), ((0, 1),)) for w in range(3)]),
        (ev.Switched(0, 2.5), "switching", []),
        (ev.Switched(1, 2.5, [4, 5]), "switching", []),
        # The switch done, the sync starts, and the checkpoint's phase 1 starts beside it.
        (ev.Switched(2, 2.5), "checkpointing",
         [("SyncWeights", 0, 1, 0), ("SyncWeights", 2, 1, 0), ("Resume", 2, (4, 5), 1), ("FlushTrajectories", 1, "step_000001", False),
          ("FlushTrajectories", 2, "step_000001", False)]),
    ]
    run(c, script)


def test_a_congested_engine_gets_a_lower_cap():
    c = coordinator("reflow", sigma=0.5, delta=2, steps=3)
    run(c, start(c) + [(ev.Ready(2, 0.1), "running", [("Dispatch", 1, (0, 1)), ("Dispatch", 2, (2, 3))])])
    # Rank 1's engine is half full (the cap stays at its maximum), then preempts 9 requests within one control
    # interval: its cap falls to ⌊4·0.7⌋ = 2 (core/scheduling.py).
    run(c, [(ev.Heartbeat(1, 1.0, load=EngineLoad(500, 1000, 0, 2, 0)), "running", []),
            (ev.Heartbeat(1, 2.0, load=EngineLoad(500, 1000, 9, 2, 0)), "running", []),     # within the interval
            (ev.Heartbeat(1, 3.5, load=EngineLoad(500, 1000, 9, 2, 0)), "running", [("SetCap", 1, 2)])])
    # A colocated run has no rollout pool of its own to schedule: loads change nothing.
    s = coordinator("sync", workers=2)
    run(s, start(s, 2) + [(ev.Ready(1, 0.1), "running", [("Dispatch", 0, (0, 1)), ("Dispatch", 1, (2, 3))]),
                          (ev.Heartbeat(1, 1.0, load=EngineLoad(500, 1000, 0, 2, 0)), "running", []),
                          (ev.Heartbeat(1, 3.5, load=EngineLoad(500, 1000, 9, 2, 0)), "running", [])])


def test_reports_that_do_not_fit_are_refused_naming_the_rank():
    c = coordinator("fully_async")
    run(c, start(c) + [(ev.Ready(2, 0.1), "running", [("Dispatch", 1, (0, 1)), ("Dispatch", 2, (2, 3))])])
    with pytest.raises(ValueError, match="step_done: unexpected report of step 0 from rank 0"):
        c.handle(ev.StepDone(0, 1.0, 0, {}))            # no batch is training
    with pytest.raises(ValueError, match="checkpoint: unexpected shard manifest for step_000001 from rank 1"):
        c.handle(ev.TrajectoriesFlushed(1, 1.0, "step_000001", {}))
    with pytest.raises(ValueError, match="switch: unexpected report from rank 2"):
        c.handle(ev.Switched(2, 1.0))
    with pytest.raises(TypeError, match="no event str"):
        c.handle("hello")


def test_liveness_in_setup_and_while_running():
    c = coordinator("fully_async", timeout_s=5.0, setup_timeout_s=10.0)
    run(c, [(ev.Start(0.0), "setup", [("Setup", w) for w in range(3)]),
            (ev.Ready(0, 1.0), "setup", []),
            (ev.Tick(9.0), "setup", [])])
    with pytest.raises(Unresponsive, match=r"setup \(no ready from rank\(s\) 1, 2\)"):
        c.handle(ev.Tick(10.5))
    c = coordinator("fully_async", timeout_s=5.0)
    run(c, start(c) + [(ev.Ready(2, 0.1), "running", [("Dispatch", 1, (0, 1)), ("Dispatch", 2, (2, 3))]),
                       (ev.Heartbeat(0, 5.0), "running", []),
                       (ev.SamplesFinished(1, 5.0, finished(0, 1)), "running", []),
                       (ev.Tick(5.1), "running", [])])
    with pytest.raises(Unresponsive, match="watching rank 2"):
        c.handle(ev.Tick(5.2))


def test_failed_samples_end_once_and_the_window_reopens_when_nothing_is_left():
    c = coordinator("fully_async")
    run(c, start(c) + [
        (ev.Ready(2, 0.1), "running", [("Dispatch", 1, (0, 1)), ("Dispatch", 2, (2, 3))]),
        # Each ends as failed; the worker is told to stop it (it may still hold requests of it).
        (ev.SamplesFailed(1, 1.0, [0, 1], "engine crashed"), "running", [("Cancel", 1, (0,)), ("Cancel", 1, (1,))],
         {"log": ["failed", "end", "failed", "end"], "notices": ["rank 1: 2 sample(s) failed: engine crashed"]}),
        # Nothing can become ready from what is left in flight: once the last of it fails, a fresh window opens.
        (ev.SamplesFailed(2, 1.1, [2, 3], "engine crashed"), "running",
         [("Cancel", 2, (2,)), ("Cancel", 2, (3,)), ("Dispatch", 1, (4, 5)), ("Dispatch", 2, (6, 7))]),
    ])
    assert c.summary()["accounting"]["ended"]["failed"] == 4
