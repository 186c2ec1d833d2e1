"""The coordinator of the four modes, driven by the simulator (``reflow_hpc.sim``) with a unit cost model.

Rollout workers take 10 ms per token and every sample has 20, 30, 40 or 250 tokens (a long tail:
0.2–2.5 s), at most `cap` at once; trainers take a fixed time per step; syncs, switches and checkpoints
take fixed times. The simulator feeds the coordinator's commands back as events, exactly as the MPI
runtime does, and every sample keeps the versions of the weights that generated its tokens, so the
invariants of every mode are checked token by token.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from reflow_hpc.config import Config
from reflow_hpc.core import events as ev
from reflow_hpc.core.commands import (Dispatch, FlushTrajectories, Resume, Setup, Snapshot, Switch, SyncWeights, Train,
                                      WriteCheckpoint)
from reflow_hpc.core.coordinator import Coordinator, Settings, Unresponsive
from reflow_hpc.core.index import build_index
from reflow_hpc.core.modes import MODES, ModeError, check, rules
from reflow_hpc.core.scheduling import SchedulingSettings
from reflow_hpc.sim.costs import Costs
from reflow_hpc.sim.engine import Simulation
from reflow_hpc.sim.lengths import SampleShape
from reflow_hpc.sim.workload import Placement


def reflow_section(mode, sigma, delta=1, b_max=0, sync_every=1):
    return SimpleNamespace(mode=mode, sigma=sigma, tau=0.5, delta=delta, b_max=b_max, sync_every=sync_every,
                           sampler="random", replay_filter="accept_all", reward_low=0.0, reward_high=1.0)


def make(mode, *, steps=6, b=8, n=4, workers=4, trainers=2, sigma=0.5, delta=1, sync_every=1, cap=16, seed=0,
         checkpoint_every=0, timeout_s=100.0, eval_every=0, time_budget_s=0.0, schedule=()):
    """(coordinator, its settings, its index, trainer ranks, rollout ranks)."""
    sigma = sigma if rules(mode).replays else 0.0
    index = build_index(reflow_section(mode, sigma, delta, 0, sync_every), group_size=n, batch_size=b, seed=seed)
    ranks = list(range(workers))
    colocated = rules(mode).colocated
    tr = ranks if colocated else ranks[:trainers]
    ro = ranks if colocated else ranks[trainers:]
    s = Settings(rules=rules(mode), steps=steps, sync_every=sync_every, cap_max=cap,
                 scheduling=SchedulingSettings(queue=0), checkpoint_every=checkpoint_every, timeout_s=timeout_s,
                 setup_timeout_s=timeout_s, eval_every=eval_every, time_budget_s=time_budget_s,
                 placement_schedule=tuple(schedule), check_invariants=True)
    return Coordinator(s, index, trainers=tr, rollouts=ro, world=workers), s, index, tr, ro


TOKEN_S = 0.01                       # one decode step, whatever the batch
LENGTHS = (20, 30, 40, 250)          # tokens: 0.2, 0.3, 0.4 and 2.5 s


class UnitLengths:
    """Each sample draws its length from LENGTHS and its reward uniformly (seeded per prompt)."""

    def __init__(self, seed):
        self.seed = seed

    def group(self, prompt_id, size, version=0):
        rng = random.Random(self.seed * 100_003 + prompt_id)
        return [SampleShape(8, (rng.choice(LENGTHS),), rng.random()) for _ in range(size)]


def unit_costs(cfg, train_time):
    """Decode: a constant TOKEN_S per step; prefill free; a step takes train_time; a sync 0.05 s; a role
    switch 0.1 s; nothing is ever short of KV cache."""
    return dataclasses.replace(
        Costs.from_config(cfg), params=0.0, layers=0, weight_bytes=0.0, kv_bytes=1e-9, memory=1e18,
        decode_base_s=TOKEN_S, decode_bw=1e30, decode_flops=1e30, prefill_base_s=0.0, prefill_flops=1e30,
        train_minibatches=1, train_update_overhead_s=train_time, logprob_recompute_modes=(),
        sync_base_s=0.05, sync_colocated_base_s=0.05, switch_fixed_s=0.1, switch_h2d_bw=1e30, switch_shard_bw=1e30)


def simulate(mode, *, train_time=1.0, seed=0, **kw):
    c, s, index, trainers, rollouts = make(mode, seed=seed, **kw)
    ranks = range(kw.get("workers", 4))
    cfg = Config()
    cfg.run.seed = seed
    cfg.reflow.delta = kw.get("delta", 1)
    cfg.rollout.max_new_tokens = max(LENGTHS)
    cfg.sim.setup_s = 0.1
    # The coordinator's timer runs after every event (with a time budget) and not in between: a budget that
    # expires while nothing happens is noticed at the next event (tests/unit/test_sim_engine.py shows why).
    cfg.sim.tick_s = 1e6
    cfg.trainer.time_budget_s = kw.get("time_budget_s", 0.0)
    place = Placement(len(ranks), tuple(trainers), tuple(rollouts), 1, 1, 1, rules(mode).colocated)
    log = {"batches": [], "trained_versions": [], "syncs": [], "checkpoints": [], "max_outstanding": 0,
           "train_overlap_gen": False, "setups": [], "snapshots": [], "switches": [], "handed_off": [],
           "resumed": []}
    rollouts = set(rollouts)

    def on_command(cmd, now):
        if isinstance(cmd, Setup):
            log["setups"].append(cmd)
        elif isinstance(cmd, Dispatch):
            assert cmd.worker in rollouts, f"dispatch to rank {cmd.worker}, not a rollout worker"
        elif isinstance(cmd, Switch):
            log["switches"].append((now, cmd.worker, cmd.trainers, cmd.rollouts))
            rollouts.clear()
            rollouts.update(cmd.rollouts)
        elif isinstance(cmd, Resume):
            assert cmd.worker in rollouts
            log["resumed"] += [(s.sample_id, cmd.source, cmd.worker) for s in cmd.samples]
        elif isinstance(cmd, Train):
            assert rules(mode).colocated or cmd.worker not in rollouts
            assert cmd.samples
        elif isinstance(cmd, SyncWeights):
            log["syncs"].append((cmd.worker, cmd.version))
        elif isinstance(cmd, Snapshot):
            log["snapshots"].append((cmd.step, cmd.version, cmd.elapsed_s, now))
        elif isinstance(cmd, WriteCheckpoint):
            log["partials"] = cmd.state.get("partials", [])
        log["max_outstanding"] = max(log["max_outstanding"], index.outstanding)

    def on_train(cmd, segments, now):
        # the token versions of every sample of this share: one entry per distinct version
        log["trained_versions"].append((cmd.step, cmd.version, [{v for v, n in segs if n > 0} for segs in segments]))

    sim = Simulation(cfg, c, s, place, lengths=UnitLengths(seed), costs=unit_costs(cfg, train_time),
                     on_command=on_command, on_train=on_train, timeline=True).run()
    log["records"] = sim.records
    log["batches"] = [rec.batch for rec in sim.records]
    log["handed_off"] = [sid for sid, _ in sim.handed_off]
    generating = [(a.start, a.end) for a in sim.timeline if a.kind == "generate"]
    training = [(a.start, a.end) for a in sim.timeline if a.kind == "train"]
    log["train_overlap_gen"] = any(g0 < t1 and t0 < g1 for g0, g1 in generating for t0, t1 in training)
    log["checkpoints"] = [(tag, step) for tag, step, _ in sim.checkpoints]
    log["events"] = sim.log
    return c.summary(), index, log


def trained_staleness(log):
    """(step, staleness) of every trained token (each distinct token version of each sample)."""
    return [(step, version - v) for step, version, samples in log["trained_versions"] for vs in samples for v in vs]


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_runs_to_completion_with_invariants(mode):
    c, index, log = simulate(mode)
    assert c["phase"] == "finished" and c["steps"] == 6
    assert len(log["batches"]) == 6
    assert {s.worker for s in log["setups"]} == set(range(4))
    for batch in log["batches"]:
        assert len(batch) == 8 and len(set(batch.sample_ids)) == 8
        assert batch.replay_fraction <= (0.5 if mode == "reflow" else 0.0)
        assert max(batch.staleness) <= 1
    assert log["max_outstanding"] <= 8 or not rules(mode).batch_level
    assert index.version == 6                               # the version counts optimizer steps
    index.check_accounting()
    assert index.created == sum(index.terminal_counts().values())      # nothing live at the end
    assert log["checkpoints"] == [("step_000006", 6)]


@pytest.mark.parametrize("mode", list(MODES))
def test_every_trained_token_keeps_the_mode_guarantee(mode):
    r = rules(mode)
    for seed in range(5):
        _, _, log = simulate(mode, steps=8, seed=seed, train_time=0.3 + 0.4 * seed)
        pairs = trained_staleness(log)
        assert pairs and all(r.staleness_ok(s, 1, step) for step, s in pairs), (seed, pairs)


def test_sync_mode_is_on_policy_and_never_overlaps_generation_with_training():
    _, _, log = simulate("sync")
    assert not log["train_overlap_gen"]
    assert {s for _, s in trained_staleness(log)} == {0}


def test_one_step_off_trains_exactly_one_step_behind_without_partial_rollouts():
    _, _, log = simulate("one_step_off", steps=5)
    assert [max(b.staleness) for b in log["batches"]] == [0, 1, 1, 1, 1]
    # every token of every batch after the first came from the weights one step older
    assert all(s == 1 for step, s in trained_staleness(log) if step > 0)
    assert all(len(vs) == 1 for _, _, samples in log["trained_versions"] for vs in samples)


def test_reflow_replays_and_fully_async_does_not():
    _, _, ref = simulate("reflow", steps=10, train_time=0.3)
    _, _, fa = simulate("fully_async", steps=10, train_time=0.3)
    assert any(b.num_replay for b in ref["batches"])
    assert not any(b.num_replay for b in fa["batches"])


def test_periodic_checkpoints_and_sync_every():
    c, index, log = simulate("reflow", steps=6, sync_every=2, delta=2, checkpoint_every=2)
    assert [t for t, _ in log["checkpoints"]] == ["step_000002", "step_000004", "step_000006"]
    assert index.version == 6
    assert sorted({v for _, v in log["syncs"]}) == [2, 4, 6]     # a sync publishes the trainer's version
    assert all(s <= 2 for _, s in trained_staleness(log))


def test_snapshots_for_evaluation_are_stamped_with_training_time():
    c, _, log = simulate("reflow", steps=7, eval_every=3)
    assert [(step, version) for step, version, _, _ in log["snapshots"]] == [(3, 3), (6, 6), (7, 7)]
    ready_at = 0.1                                       # every worker reported ready then
    assert all(elapsed == pytest.approx(now - ready_at) for _, _, elapsed, now in log["snapshots"])


def test_a_time_budget_ends_the_run_like_a_preemption():
    c, index, log = simulate("reflow", steps=1000, time_budget_s=5.0)
    done = c["steps"]
    assert c["phase"] == "finished" and 1 <= done < 1000 and "time budget of 5 s spent" in c["stopped_early"]
    assert 5.0 <= c["train_seconds"] < 5.0 + 3 * 1.0              # at most the step in flight, a sync, a save
    assert log["checkpoints"] == [(f"step_{done:06d}", done)]
    assert log["snapshots"][-1][0] == done                        # the trained policy is scored
    # What was being generated is saved with the checkpoint and stays pending for the resumed run, and so
    # does what was buffered: the run ends none of it, so the resumed run's log ends each sample once.
    assert index.outstanding == len(log["partials"]) > 0
    kept = set(index.live_ids())
    assert len(kept) == c["kept_in_checkpoint"] and set(log["partials"]) <= kept
    assert index.created == sum(index.terminal_counts().values()) + len(kept)
    ended = [e["id"] for e in log["events"] if e["e"] == "end"]
    assert len(ended) == len(set(ended)) == sum(index.terminal_counts().values()) and not kept & set(ended)


@pytest.mark.parametrize("seed", range(4))
def test_role_switches_both_ways_lose_nothing_and_keep_the_guarantee(seed):
    """A schedule moves a rollout worker to training after step 3 and back after step 7; the samples it
    was generating finish on another rollout worker, with tokens of the versions that made them."""
    c, index, log = simulate("reflow", steps=10, trainers=2, seed=seed, train_time=0.3,
                             schedule=[(3, 3), (7, 2)])
    assert c["phase"] == "finished" and c["placements"] == [[3, 3], [7, 2]]
    assert c["roles"] == {0: "trainer", 1: "trainer", 2: "rollout", 3: "rollout"}
    # Every worker was told each time, and the pools changed only at sync points (no batch in training).
    assert len(log["switches"]) == 8
    assert log["handed_off"], "the worker leaving rollout held nothing in flight"
    resumed = {sid: (src, dst) for sid, src, dst in log["resumed"]}
    for sid in log["handed_off"]:
        if sid in resumed:
            src, dst = resumed[sid]
            assert src == 2 and dst == 3                       # the only rollout worker left
    assert index.created == sum(index.terminal_counts().values())
    assert index.terminal_counts()["failed"] == index.terminal_counts()["lost"] == 0
    assert all(rules("reflow").staleness_ok(s, 1, step) for step, s in trained_staleness(log))


def test_every_step_record_names_every_rank_role_and_the_switches():
    c = make("reflow", steps=6, schedule=[(2, 3)])[0]
    assert {cmd.placements for cmd in c.handle(ev.Start(0.0)).commands} == {(2, 3)}
    _, _, log = simulate("reflow", steps=6, schedule=[(2, 3)], seed=1)
    roles = [rec.roles for rec in log["records"]]
    assert roles[0] == {0: "trainer", 1: "trainer", 2: "rollout", 3: "rollout"}
    assert roles[-1] == {0: "trainer", 1: "trainer", 2: "trainer", 3: "rollout"}
    switches = [sw for rec in log["records"] for sw in rec.switches]
    assert [(sw["step"], sw["trainers"], sw["rollouts"]) for sw in switches] == [(2, 3, 1)]
    assert switches[0]["to_trainer_s"] == 0.1


def test_a_silent_worker_ends_the_run_naming_it():
    c = make("reflow", timeout_s=5.0)[0]
    c.handle(ev.Start(0.0))
    for w in range(4):
        c.handle(ev.Ready(w, 1.0))
    for w in (0, 1, 3):
        c.handle(ev.Heartbeat(w, 5.5))
    with pytest.raises(Unresponsive, match="rank 2"):
        c.handle(ev.Tick(6.5))


def test_setup_waits_for_every_worker_within_its_bound():
    c = make("reflow", timeout_s=5.0)[0]
    c.handle(ev.Start(0.0))
    c.handle(ev.Ready(0, 1.0))
    out = c.handle(ev.Tick(4.0))
    assert out.commands == [] and out.phase.value == "setup"
    with pytest.raises(Unresponsive, match=r"setup \(no ready from rank\(s\) 1, 2, 3\)"):
        c.handle(ev.Tick(5.5))


@pytest.mark.parametrize("mode, key, kw", [
    ("sync", "reflow.sigma", dict(sigma=0.5)),
    ("one_step_off", "reflow.sigma", dict(sigma=0.25)),
    ("fully_async", "reflow.sigma", dict(sigma=0.5)),
    ("sync", "reflow.sync_every", dict(sync_every=2)),
    ("one_step_off", "reflow.sync_every", dict(sync_every=2)),
    ("sync", "reflow.b_max", dict(b_max=16)),
    ("one_step_off", "reflow.delta", dict(delta=0)),
    ("reflow", "reflow.delta", dict(delta=0, sync_every=2)),
    ("fully_async", "reflow.delta", dict(delta=2, sync_every=3)),
    ("reflow", "reflow.delta", dict(delta=1, sync_every=2)),
])
def test_settings_that_break_a_mode_guarantee_are_refused(mode, key, kw):
    args = dict(sigma=0.0, delta=1, b_max=8, batch_size=8, sync_every=1)
    args.update(kw)
    with pytest.raises(ModeError) as e:
        check(mode, **args)
    assert e.value.key == key


@settings(max_examples=40, deadline=None)
@given(mode=st.sampled_from(list(MODES)), seed=st.integers(0, 10_000), sigma=st.sampled_from([0.25, 0.5, 0.75]),
       trainers=st.integers(1, 2), sync_every=st.integers(1, 3), train_time=st.sampled_from([0.2, 1.0, 3.0]))
def test_random_runs_keep_the_guarantees(mode, seed, sigma, trainers, sync_every, train_time):
    r = rules(mode)
    sync_every = 1 if r.exact_staleness is not None else sync_every
    delta = sync_every
    c, index, log = simulate(mode, steps=5, seed=seed, sigma=sigma, trainers=trainers, sync_every=sync_every,
                             delta=delta, train_time=train_time)
    assert c["phase"] == "finished"
    for batch in log["batches"]:
        assert batch.replay_fraction <= (sigma if r.replays else 0.0) + 1e-12
    assert all(r.staleness_ok(s, delta, step) for step, s in trained_staleness(log))
    index.check_accounting()


def test_a_rollout_workers_late_sync_report_after_the_trainer_trained_on_is_accepted():
    """In a streaming mode the trainer that sent the weights carries on training at once; a rollout worker
    busy generating may report its load of version v after the trainer already made v + 1."""
    c = make("reflow", steps=4, b=4, n=4, workers=2, trainers=1, delta=2, sigma=0.0)[0]
    now = 0.0
    out = c.handle(ev.Start(now))
    queue = list(out.commands)
    for w in range(2):
        out = c.handle(ev.Ready(w, now))
        queue += out.commands
    rollout_version, late, reported_late = 0, [], 0

    def handle(event):
        nonlocal out
        out = c.handle(event)
        return out.commands

    while not out.done:
        now += 0.01
        if not queue:                                 # nothing else to happen: the late report arrives
            assert late, "the coordinator waits for nothing"
            w, v = late.pop(0)
            queue += handle(ev.WeightsLoaded(w, now, v, 0.01))
            continue
        cmd = queue.pop(0)
        if isinstance(cmd, Dispatch):
            done = [ev.FinishedSample(s.sample_id, float(s.sample_id % 2), rollout_version, rollout_version, 8, "stop")
                    for s in cmd.samples]
            queue += handle(ev.SamplesFinished(cmd.worker, now, done))
        elif isinstance(cmd, Train):
            queue += handle(ev.StepDone(cmd.worker, now, cmd.step, {}))
            reported_late += len(late)
            for w, v in late:                         # the rollout worker reports after the step
                queue += handle(ev.WeightsLoaded(w, now, v, 0.01))
            late = []
        elif isinstance(cmd, SyncWeights):
            if cmd.worker == cmd.src:
                queue += handle(ev.WeightsLoaded(cmd.worker, now, cmd.version, 0.01))
            else:
                rollout_version = cmd.version
                late.append((cmd.worker, cmd.version))
        elif isinstance(cmd, FlushTrajectories):
            queue += handle(ev.TrajectoriesFlushed(cmd.worker, now, cmd.tag, {}))
        elif isinstance(cmd, WriteCheckpoint):
            queue += handle(ev.CheckpointWritten(cmd.worker, now, cmd.tag, "/nowhere"))
    assert c.summary()["steps"] == 4 and reported_late >= 1
