"""The pipeline state machine of the four modes, driven by a small discrete-event loop.

Rollout workers take `gen_time(sample)` per sample (long-tailed), generating up to `cap` at once;
trainers take a fixed time per step; syncs and checkpoints take fixed times. The loop feeds the
pipeline's commands back as events and checks the invariants of every mode.
"""

from __future__ import annotations

import heapq
import random

import pytest
from hypothesis import given, settings, strategies as st

from reflow_hpc.core.commands import Cancel, Checkpoint, Dispatch, Drop, Sync, Train
from reflow_hpc.core.index import build_index
from reflow_hpc.core.pipeline import Pipeline


class Settings:
    def __init__(self, sigma, tau=0.5, delta=1, b_max=0, sampler="random", replay_filter="accept_all"):
        self.sigma, self.tau, self.delta, self.b_max = sigma, tau, delta, b_max
        self.sampler, self.replay_filter = sampler, replay_filter
        self.reward_low, self.reward_high = 0.0, 1.0


def simulate(mode, *, steps=6, b=8, n=4, workers=4, trainers=2, sigma=0.5, delta=1, sync_every=1, cap=16,
             train_time=1.0, seed=0, checkpoint_every=0):
    rng = random.Random(seed)
    sigma = sigma if mode == "reflow" else 0.0
    b_max = b if mode in ("sync", "one_step_off") else 0
    index = build_index(Settings(sigma, delta=max(delta, 1) if mode == "one_step_off" else delta, b_max=b_max),
                        group_size=n, batch_size=b, seed=seed)
    ranks = list(range(workers))
    tr = ranks if mode == "sync" else ranks[:trainers]
    ro = ranks if mode == "sync" else ranks[trainers:]
    p = Pipeline(mode=mode, index=index, trainers=tr, rollouts=ro, steps=steps, sync_every=sync_every,
                 worker_cap=cap, checkpoint_every=checkpoint_every)
    now = 0.0
    queue: list = []
    seq = 0
    version_of = {w: 0 for w in ranks}          # weights each worker generates with
    token_versions: dict[int, set] = {}
    busy_until = {w: 0.0 for w in ranks}
    log = {"batches": [], "syncs": [], "checkpoints": [], "max_outstanding": 0, "train_overlap_gen": False}
    training = set()

    def push(t, kind, *args):
        nonlocal seq
        heapq.heappush(queue, (t, seq, kind, args))
        seq += 1

    def run(cmds):
        for c in cmds:
            if isinstance(c, Dispatch):
                for s in c.samples:
                    start = max(now, busy_until[c.worker]) if mode in ("sync", "one_step_off") else now
                    d = rng.choice([0.2, 0.3, 0.4, 2.5])          # long tail
                    token_versions[s.sample_id] = {version_of[c.worker]}
                    push(start + d, "finish", c.worker, s.sample_id)
                    if c.worker in training:
                        log["train_overlap_gen"] = True
            elif isinstance(c, Train):
                training.add(c.worker)
                assert sum(1 for _ in c.items) > 0
                push(max(now, busy_until[c.worker]) + train_time, "step", c.worker, c.step)
            elif isinstance(c, Sync):
                push(now + 0.05, "sync", c.worker, c.version)
            elif isinstance(c, Checkpoint):
                push(now + 0.01, "ckpt", c.worker, c.tag)
            elif isinstance(c, (Drop, Cancel)):
                pass
        log["max_outstanding"] = max(log["max_outstanding"], index.outstanding)

    run(p.start(now))
    while queue and not p.done:
        now, _, kind, args = heapq.heappop(queue)
        if kind == "finish":
            w, sid = args
            if sid not in index:
                continue
            # a sync that happened while the sample was in flight adds the new version (partial rollout)
            vs = token_versions[sid] | {version_of[w]}
            run(p.sample_finished(w, sid, reward=rng.random(), min_version=min(vs), max_version=max(vs),
                                  loss_tokens=rng.randint(1, 20), now=now))
        elif kind == "step":
            training.discard(args[0])
            run(p.step_done(args[0], args[1], now=now))
            for rec in p.completed:
                log["batches"].append(rec.batch)
            p.completed.clear()
        elif kind == "sync":
            version_of[args[0]] = args[1]
            log["syncs"].append((args[0], args[1]))
            run(p.sync_done(args[0], args[1], now=now))
        elif kind == "ckpt":
            run(p.checkpoint_done(args[0], args[1], now=now))
        index.check_invariants()
    log["checkpoints"] = list(p.checkpoints_done)
    return p, index, log


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async", "reflow"])
def test_every_mode_runs_to_completion_with_invariants(mode):
    p, index, log = simulate(mode)
    assert p.done and p.steps_done == 6
    assert len(log["batches"]) == 6
    for batch in log["batches"]:
        assert len(batch) == 8 and len(set(batch.sample_ids)) == 8
        assert batch.replay_fraction <= (0.5 if mode == "reflow" else 0.0)
        assert max(batch.staleness) <= 1
    assert log["max_outstanding"] <= 8
    assert index.version == 6
    index.check_accounting()
    assert index.created == sum(index.terminal_counts().values())      # nothing live at the end
    assert log["checkpoints"] == [("step_000006", 6)]


def test_sync_mode_never_overlaps_generation_with_training():
    _, _, log = simulate("sync")
    assert not log["train_overlap_gen"]
    assert all(max(b.staleness) == 0 for b in log["batches"])


def test_one_step_off_trains_one_version_behind_without_partial_rollouts():
    _, _, log = simulate("one_step_off", steps=5)
    assert [max(b.staleness) for b in log["batches"]] == [0, 1, 1, 1, 1]
    # every batch after the first was generated entirely by one older version
    assert all(set(b.staleness) == {1} for b in log["batches"][1:])


def test_reflow_replays_and_fully_async_does_not():
    _, _, ref = simulate("reflow", steps=10, train_time=0.3)
    _, _, fa = simulate("fully_async", steps=10, train_time=0.3)
    assert any(b.num_replay for b in ref["batches"])
    assert not any(b.num_replay for b in fa["batches"])


def test_periodic_checkpoints_and_sync_every():
    p, index, log = simulate("reflow", steps=6, sync_every=2, checkpoint_every=2)
    assert [t for t, _ in log["checkpoints"]] == ["step_000002", "step_000004", "step_000006"]
    assert index.version == 3


@settings(max_examples=40, deadline=None)
@given(mode=st.sampled_from(["sync", "one_step_off", "fully_async", "reflow"]), seed=st.integers(0, 10_000),
       sigma=st.sampled_from([0.25, 0.5, 0.75]), trainers=st.integers(1, 2), sync_every=st.integers(1, 3))
def test_random_runs_keep_bounds(mode, seed, sigma, trainers, sync_every):
    p, index, log = simulate(mode, steps=5, seed=seed, sigma=sigma, trainers=trainers, sync_every=sync_every)
    assert p.done
    for batch in log["batches"]:
        assert batch.replay_fraction <= (sigma if mode == "reflow" else 0.0) + 1e-12
        assert max(batch.staleness) <= (1 if mode == "one_step_off" else 1)
    index.check_accounting()
