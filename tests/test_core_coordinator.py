"""The coordinator of the four modes, driven by a small discrete-event loop.

Rollout workers take `gen_time(sample)` per sample (long-tailed), generating up to `cap` at once;
trainers take a fixed time per step; syncs and checkpoints take fixed times. The loop feeds the
coordinator's commands back as events and checks the invariants of every mode, token by token:
every sample remembers the versions of the weights that generated its tokens.
"""

from __future__ import annotations

import heapq
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from reflow_hpc.core.commands import (Cancel, Checkpoint, Dispatch, Drop, Resume, SaveCheckpoint, Setup, Snapshot, Switch,
                                     Sync, Train)
from reflow_hpc.core.coordinator import Coordinator, Settings, Unresponsive
from reflow_hpc.core.index import build_index
from reflow_hpc.core.modes import MODES, ModeError, check, rules
from reflow_hpc.core.scheduling import SchedulingSettings


def reflow_section(mode, sigma, delta=1, b_max=0, sync_every=1):
    return SimpleNamespace(mode=mode, sigma=sigma, tau=0.5, delta=delta, b_max=b_max, sync_every=sync_every,
                           sampler="random", replay_filter="accept_all", reward_low=0.0, reward_high=1.0)


def make(mode, *, steps=6, b=8, n=4, workers=4, trainers=2, sigma=0.5, delta=1, sync_every=1, cap=16, seed=0,
         checkpoint_every=0, timeout_s=100.0, eval_every=0, time_budget_s=0.0, schedule=()):
    sigma = sigma if rules(mode).replays else 0.0
    index = build_index(reflow_section(mode, sigma, delta, 0, sync_every), group_size=n, batch_size=b, seed=seed)
    ranks = list(range(workers))
    colocated = rules(mode).colocated
    tr = ranks if colocated else ranks[:trainers]
    ro = ranks if colocated else ranks[trainers:]
    s = Settings(rules=rules(mode), steps=steps, sync_every=sync_every, cap_max=cap,
                 scheduling=SchedulingSettings(queue=0), checkpoint_every=checkpoint_every, timeout_s=timeout_s,
                 setup_timeout_s=timeout_s, eval_every=eval_every, time_budget_s=time_budget_s,
                 placement_schedule=tuple(schedule))
    return Coordinator(s, index, trainers=tr, rollouts=ro, world=workers)


def simulate(mode, *, train_time=1.0, seed=0, **kw):
    rng = random.Random(seed)
    c = make(mode, seed=seed, **kw)
    index, ranks = c.index, c.workers
    now = 0.0
    queue: list = []
    seq = 0
    version_of = {w: 0 for w in ranks}          # weights each worker generates with
    loads = {w: 0 for w in ranks}               # weights it will hold once its queued commands ran
    token_versions: dict[int, set] = {}
    busy_until = {w: 0.0 for w in ranks}
    log = {"batches": [], "trained_versions": [], "syncs": [], "checkpoints": [], "max_outstanding": 0,
           "train_overlap_gen": False, "setups": [], "snapshots": [], "switches": [], "handed_off": [],
           "resumed": [], "finished_on": {}}
    training = set()
    in_flight: dict[int, set] = {w: set() for w in ranks}     # samples each worker is generating
    rollouts = set(ranks if rules(mode).colocated else ranks[kw.get("trainers", 2):])
    before = [set(rollouts)]                                  # the rollout pool before a switch round

    def push(t, kind, *args):
        nonlocal seq
        heapq.heappush(queue, (t, seq, kind, args))
        seq += 1

    def run(cmds):
        for cmd in cmds:
            if isinstance(cmd, Setup):
                log["setups"].append(cmd)
                push(now + 0.1, "ready", cmd.worker)
            elif isinstance(cmd, Dispatch):
                assert cmd.worker in rollouts, f"dispatch to rank {cmd.worker}, not a rollout worker"
                for s in cmd.samples:
                    start = max(now, busy_until[cmd.worker]) if rules(mode).batch_level else now
                    d = rng.choice([0.2, 0.3, 0.4, 2.5])          # long tail
                    token_versions[s.sample_id] = {loads[cmd.worker]}    # commands run in order
                    in_flight[cmd.worker].add(s.sample_id)
                    push(start + d, "finish", cmd.worker, s.sample_id)
                    if cmd.worker in training:
                        log["train_overlap_gen"] = True
            elif isinstance(cmd, Switch):
                if set(cmd.rollouts) != rollouts:              # the first Switch of a round
                    before[:] = [set(rollouts)]
                handed = []
                if cmd.worker in before[0] and cmd.worker not in cmd.rollouts:    # leaves rollout: hands over
                    handed = sorted(in_flight[cmd.worker])
                    in_flight[cmd.worker].clear()
                    log["handed_off"] += handed
                push(now + 0.1, "switched", cmd.worker, handed)
                log["switches"].append((now, cmd.worker, cmd.trainers, cmd.rollouts))
                rollouts.clear()
                rollouts.update(cmd.rollouts)
            elif isinstance(cmd, Resume):
                assert cmd.worker in rollouts
                for s in cmd.samples:
                    token_versions[s.sample_id].add(loads[cmd.worker])    # continues under its weights
                    in_flight[cmd.worker].add(s.sample_id)
                    log["resumed"].append((s.sample_id, cmd.source, cmd.worker))
                    push(now + rng.choice([0.1, 0.3, 1.0]), "finish", cmd.worker, s.sample_id)
            elif isinstance(cmd, Train):
                assert rules(mode).colocated or cmd.worker not in rollouts
                training.add(cmd.worker)
                assert cmd.samples
                log["trained_versions"].append((cmd.step, cmd.version,
                                                [token_versions[s.sample_id] for s in cmd.samples]))
                push(max(now, busy_until[cmd.worker]) + train_time, "step", cmd.worker, cmd.step)
            elif isinstance(cmd, Sync):
                loads[cmd.worker] = cmd.version
                push(now + 0.05, "sync", cmd.worker, cmd.version)
            elif isinstance(cmd, Checkpoint):
                push(now + 0.01, "flushed", cmd.worker, cmd.tag)
            elif isinstance(cmd, SaveCheckpoint):
                assert set(cmd.manifests) == {str(w) for w in ranks if w != cmd.worker}
                assert cmd.state["steps_done"] == cmd.step
                push(now + 0.02, "written", cmd.worker, cmd.tag)
            elif isinstance(cmd, Snapshot):
                log["snapshots"].append((cmd.step, cmd.version, cmd.elapsed_s, now))
            elif isinstance(cmd, (Drop, Cancel)):
                pass
        log["max_outstanding"] = max(log["max_outstanding"], index.outstanding)

    run(c.begin(now))
    while queue and not c.done:
        now, _, kind, args = heapq.heappop(queue)
        if kind == "ready":
            run(c.ready(args[0], [], [], now))
        elif kind == "finish":
            w, sid = args
            if sid not in in_flight[w]:
                continue                            # handed over to another worker
            in_flight[w].discard(sid)
            if sid not in index:
                continue
            log["finished_on"][sid] = w
            # a sync that happened while the sample was in flight adds the new version (partial rollout)
            vs = token_versions[sid] | {version_of[w]}
            token_versions[sid] = vs
            run(c.sample_finished(w, sid, reward=rng.random(), min_version=min(vs), max_version=max(vs),
                                  loss_tokens=rng.randint(1, 20), finish_reason="stop", now=now))
        elif kind == "step":
            training.discard(args[0])
            run(c.step_done(args[0], args[1], stats={"tokens": 1.0}, idle_s=0.0, fetch_s=0.0, now=now))
            for rec in c.completed:
                log["batches"].append(rec.batch)
                log.setdefault("records", []).append(rec)
            c.completed.clear()
        elif kind == "sync":
            version_of[args[0]] = args[1]
            log["syncs"].append((args[0], args[1]))
            run(c.sync_done(args[0], args[1], seconds=0.05, resumed=0, now=now))
        elif kind == "switched":
            w, handed = args
            run(c.switched(w, handed_off=handed, seconds=0.1, now=now))
        elif kind == "flushed":
            run(c.shards_flushed(args[0], args[1], {"rank": args[0]}, now=now))
        elif kind == "written":
            run(c.checkpoint_written(args[0], args[1], f"/ckpt/{args[1]}", now=now))
        run(c.tick(now))
        index.check_invariants()
    log["checkpoints"] = [(tag, step) for tag, step, _ in c.checkpoints_written]
    return c, index, log


def trained_staleness(log):
    """(step, staleness) of every trained token (each distinct token version of each sample)."""
    return [(step, version - v) for step, version, samples in log["trained_versions"] for vs in samples for v in vs]


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_runs_to_completion_with_invariants(mode):
    c, index, log = simulate(mode)
    assert c.done and c.steps_done == 6
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
    c, index, log = simulate("reflow", steps=6, sync_every=2, checkpoint_every=2)
    assert [t for t, _ in log["checkpoints"]] == ["step_000002", "step_000004", "step_000006"]
    assert index.version == 6
    assert sorted({v for _, v in log["syncs"]}) == [2, 4, 6]     # a sync publishes the trainer's version
    assert all(s <= 1 for _, s in trained_staleness(log))


def test_snapshots_for_evaluation_are_stamped_with_training_time():
    c, _, log = simulate("reflow", steps=7, eval_every=3)
    assert [(step, version) for step, version, _, _ in log["snapshots"]] == [(3, 3), (6, 6), (7, 7)]
    ready_at = 0.1                                       # every worker reported ready then
    assert all(elapsed == pytest.approx(now - ready_at) for _, _, elapsed, now in log["snapshots"])


def test_a_time_budget_ends_the_run_like_a_preemption():
    c, index, log = simulate("reflow", steps=1000, time_budget_s=5.0)
    assert c.done and 1 <= c.steps_done < 1000 and "time budget of 5 s spent" in c.stopped_early
    assert 5.0 <= c.train_seconds < 5.0 + 3 * 1.0                  # at most the step in flight, a sync, a save
    assert log["checkpoints"] == [(f"step_{c.steps_done:06d}", c.steps_done)]
    assert log["snapshots"][-1][0] == c.steps_done                # the trained policy is scored
    assert index.created == sum(index.terminal_counts().values())


@pytest.mark.parametrize("seed", range(4))
def test_role_switches_both_ways_lose_nothing_and_keep_the_guarantee(seed):
    """A schedule moves a rollout worker to training after step 3 and back after step 7; the samples it
    was generating finish on another rollout worker, with tokens of the versions that made them."""
    c, index, log = simulate("reflow", steps=10, trainers=2, seed=seed, train_time=0.3,
                             schedule=[(3, 3), (7, 2)])
    assert c.done and c.placements == [(3, 3), (7, 2)]
    assert c.trainers == [0, 1] and c.rollouts == [2, 3]
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
    c = make("reflow", steps=6, schedule=[(2, 3)])
    assert c.feasible_placements() == (2, 3)
    _, _, log = simulate("reflow", steps=6, schedule=[(2, 3)], seed=1)
    roles = [rec.roles for rec in log["records"]]
    assert roles[0] == {0: "trainer", 1: "trainer", 2: "rollout", 3: "rollout"}
    assert roles[-1] == {0: "trainer", 1: "trainer", 2: "trainer", 3: "rollout"}
    switches = [sw for rec in log["records"] for sw in rec.switches]
    assert [(sw["step"], sw["trainers"], sw["rollouts"]) for sw in switches] == [(2, 3, 1)]
    assert switches[0]["to_trainer_s"] == 0.1


def test_a_silent_worker_ends_the_run_naming_it():
    c = make("reflow", timeout_s=5.0)
    c.begin(0.0)
    for w in range(4):
        c.ready(w, [], [], 1.0)
    for w in (0, 1, 3):
        c.heard(w, 5.5)
    with pytest.raises(Unresponsive, match="rank 2"):
        c.tick(6.5)


def test_setup_waits_for_every_worker_within_its_bound():
    c = make("reflow", timeout_s=5.0)
    c.begin(0.0)
    c.ready(0, [], [], 1.0)
    assert c.tick(4.0) == [] and c.phase == "setup"
    with pytest.raises(Unresponsive, match=r"setup \(no ready from rank\(s\) 1, 2, 3\)"):
        c.tick(5.5)


@pytest.mark.parametrize("mode, key, kw", [
    ("sync", "reflow.sigma", dict(sigma=0.5)),
    ("one_step_off", "reflow.sigma", dict(sigma=0.25)),
    ("fully_async", "reflow.sigma", dict(sigma=0.5)),
    ("sync", "reflow.sync_every", dict(sync_every=2)),
    ("one_step_off", "reflow.sync_every", dict(sync_every=2)),
    ("sync", "reflow.b_max", dict(b_max=16)),
    ("one_step_off", "reflow.delta", dict(delta=0)),
    ("reflow", "reflow.delta", dict(delta=0, sync_every=2)),
    ("fully_async", "reflow.delta", dict(delta=1, sync_every=3)),
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
    delta = max(1, sync_every - 1)
    c, index, log = simulate(mode, steps=5, seed=seed, sigma=sigma, trainers=trainers, sync_every=sync_every,
                             delta=delta, train_time=train_time)
    assert c.done
    for batch in log["batches"]:
        assert batch.replay_fraction <= (sigma if r.replays else 0.0) + 1e-12
    assert all(r.staleness_ok(s, delta, step) for step, s in trained_staleness(log))
    index.check_accounting()
