"""Unit tests of the replay index's parts on their own: the pool (core/pool.py, core/pool_checks.py),
batch composition (core/composition.py, samplers.take_replay), the accounting (core/accounting.py), the
dispatch window (core/dispatch_window.py) and the checkpoint format (core/index_state.py)."""

from __future__ import annotations

import json
import random

import pytest

from reflow_hpc.core import GAUGE_NAMES, ReplayIndex, make_replay_filter, make_sampler, max_replay_slots
from reflow_hpc.core.accounting import Accounting
from reflow_hpc.core.composition import Composer
from reflow_hpc.core.dispatch_window import DispatchWindow
from reflow_hpc.core.filters import RewardBand
from reflow_hpc.core.index_state import STATE_FORMAT, check_format
from reflow_hpc.core.pool import Pool, Release
from reflow_hpc.core.pool_checks import check_pool
from reflow_hpc.core.sample import LIVE_STATES, SampleRecord
from reflow_hpc.core.samplers import RandomSampler, take_replay


def make_pool(*, delta=1, sampler=None) -> Pool:
    return Pool(delta=delta, sampler=sampler or RandomSampler(), accounts=Accounting())


def finish(pool: Pool, sid: int, *, reward=0.5, v=None, tokens=10) -> list[Release]:
    lo = pool.version if v is None else v
    return pool.finished(sid, owner=1, reward=reward, min_version=lo, max_version=pool.version, loss_tokens=tokens)


def ready_group(pool: Pool, rewards=(0.0, 1.0), v=None) -> tuple[int, ...]:
    g = pool.new_group(0, [-1] * len(rewards), 0.0)
    for sid, r in zip(g.sample_ids, rewards):
        finish(pool, sid, reward=r, v=v)
    return g.sample_ids


# ------------------------------------------------------------------------------------------------
# The pool
# ------------------------------------------------------------------------------------------------

def test_pool_group_becomes_ready_together_and_queues_by_min_version():
    pool = make_pool()
    pool.version = 2
    g = pool.new_group(7, [3, 4], 0.0)
    assert g.sample_ids == (0, 1) and pool.count["pending"] == 2 and pool.accounts.created == 2
    assert finish(pool, 1, reward=1.0, v=2) == []
    assert pool.samples[1].state == "finished" and 0 in pool.groups.get(0).members
    assert finish(pool, 0, reward=0.0, v=1) == []
    assert [pool.samples[s].state for s in (0, 1)] == ["ready", "ready"] and not pool.groups
    assert pool.samples[1].advantage > 0 > pool.samples[0].advantage
    assert [list(q) for _, q in sorted(pool.ready_by_version.items())] == [[0], [1]]
    taken = pool.take_ready(2)
    assert [r.sample_id for r in taken] == [0, 1]                    # oldest min version first
    pool.start_training(taken)
    assert pool.count["training"] == 2 and not pool.by_version[1] and not pool.ready_by_version
    check_pool(pool, pool.sampler)


def test_pool_end_names_the_rank_tells_the_sampler_and_counts():
    pool = make_pool()
    a, b = ready_group(pool)
    recs = pool.take_ready(2)
    pool.start_training(recs)
    assert pool.after_step([a, b], make_replay_filter("accept_all")) == []
    assert pool.sampler.available() == 2 and pool.accounts.trained == 2
    out: list[Release] = []
    pool.end(pool.samples[a], "aborted", out)
    assert out == [Release(a, 1, "aborted", True)] and a not in pool.sampler
    g = pool.new_group(1, [5, 6], 0.0)
    assert pool.end_live(g.sample_ids[0], ("pending",), "failed", "failed") == [
        Release(g.sample_ids[0], 5, "failed", False)]
    assert pool.accounts.ended["aborted"] == 1 and pool.accounts.ended["failed"] == 1
    with pytest.raises(ValueError, match=r"lost: sample 0 is not live \(it already ended\)"):
        pool.end_live(a, ("ready",), "lost", "lost")
    check_pool(pool, pool.sampler)


def test_pool_after_step_rules_in_order_and_training_counters():
    pool = make_pool(delta=1)
    ids = ready_group(pool, rewards=(0.0, 0.5, 1.0, 0.5))
    pool.start_training(pool.take_ready(4))
    pool.samples[ids[3]].owner_lost = True
    pool.version = 1
    out = pool.after_step(ids, RewardBand(0.0, 1.0))
    assert [(r.sample_id, r.reason) for r in out] == [(ids[0], "filtered"), (ids[2], "filtered"), (ids[3], "lost")]
    assert pool.samples[ids[1]].state == "replay" and pool.accounts.trained == 4
    pool.start_training([pool.samples[ids[1]]])
    pool.version = 2                           # staleness 2 > δ when the step ends: before the filter
    assert [(r.sample_id, r.reason) for r in pool.after_step([ids[1]], RewardBand(0.0, 1.0))] == [
        (ids[1], "evicted_stale")]
    assert pool.accounts.trained == 4 and pool.accounts.replayed == 1 and pool.accounts.evicted_unused == 0


def test_pool_after_step_without_a_filter_ends_trained_and_skips_ended_ids():
    pool = make_pool()
    a, b = ready_group(pool)
    pool.start_training(pool.take_ready(2))
    pool.end_live(b, ("training",), "lost", "lost")
    assert [(r.sample_id, r.reason) for r in pool.after_step([a, b], None)] == [(a, "trained")]
    with pytest.raises(ValueError, match="step_done: unknown sample 99"):
        pool.after_step([99], None)
    assert pool.accounts.trained == 1 and pool.accounts.replayed == 0


def test_pool_bump_evicts_whole_buckets_in_id_order():
    pool = make_pool(delta=1)
    old = ready_group(pool)
    pool.version = 1
    new = ready_group(pool)
    assert pool.bump() == [Release(old[0], 1, "evicted_stale", True), Release(old[1], 1, "evicted_stale", True)]
    assert [pool.samples[s].state for s in new] == ["ready", "ready"]
    assert pool.accounts.evicted_unused == 2 and not pool.by_version.get(0) and sorted(pool.ready_by_version) == [1]
    check_pool(pool, pool.sampler)


def test_pool_untrain_returns_unused_to_the_front_and_trained_to_replay():
    pool = make_pool()
    a, b = ready_group(pool)
    c, d = ready_group(pool)
    first = pool.take_ready(2)
    pool.start_training(first)
    pool.samples[b].times_used = 1
    for rec in reversed(first):
        pool.untrain(rec)
    assert pool.samples[a].state == "ready" and pool.samples[b].state == "replay" and b in pool.sampler
    assert [r.sample_id for r in pool.take_ready(3)] == [a, c, d]


def test_pool_checks_name_a_broken_structure():
    pool = make_pool()
    a, _ = ready_group(pool)
    pool.by_version[0].pop(a)
    with pytest.raises(AssertionError, match=f"sample {a} \\(ready\\): version bucket membership False"):
        check_pool(pool, pool.sampler)
    pool.by_version[0][a] = None
    pool.count["ready"] += 1
    with pytest.raises(AssertionError, match="state counts"):
        check_pool(pool, pool.sampler)


# ------------------------------------------------------------------------------------------------
# Batch composition
# ------------------------------------------------------------------------------------------------

def replay_pool(n: int) -> Pool:
    """A pool of ``n`` replay samples (groups of one) and nothing else."""
    pool = make_pool()
    for _ in range(n):
        ready_group(pool, rewards=(0.5,))
    pool.start_training(pool.take_ready(n))
    pool.after_step(range(n), make_replay_filter("accept_all"))
    return pool


@pytest.mark.parametrize("sigma, unused, replay, ready", [
    (0.5, 3, 8, False),      # 3 < ceil(8·0.5)
    (0.5, 4, 4, True),       # 4 unused + 4 replay
    (0.5, 4, 3, False),      # the sampler cannot fill the 4 slots
    (0.5, 9, 0, True),       # a full batch of unused samples needs no replay
    (0.3, 6, 8, True),       # b = 8, σ = 0.3: floor(2.4) = 2 replay slots, so 6 unused suffice
    (0.3, 5, 8, False),
    (0.0, 7, 8, False),      # σ = 0: no replay slot at all
])
def test_composer_ready_is_the_sigma_rule(sigma, unused, replay, ready):
    pool = replay_pool(replay)
    for _ in range(unused):
        ready_group(pool, rewards=(0.5,))
    composer = Composer(batch_size=8, sigma=sigma, tau=0.5, pool=pool, sampler=pool.sampler)
    assert composer.min_unused == 8 - max_replay_slots(8, sigma)
    assert composer.ready() is ready
    before = json.dumps({sid: rec.to_row() for sid, rec in pool.samples.items()})
    batch = composer.compose(now=1.0)
    assert (batch is not None) is ready
    if batch is None:
        assert json.dumps({sid: rec.to_row() for sid, rec in pool.samples.items()}) == before
    else:
        assert batch.num_unused == min(unused, 8) and len(batch) == 8 and composer.step == 1


def test_composer_batch_is_a_pure_function_of_the_records():
    composer = Composer(batch_size=4, sigma=0.5, tau=0.25, pool=make_pool(), sampler=RandomSampler())
    recs = [SampleRecord(i, 0, 0, "training", owner=i, reward=0.1 * i, min_version=v, max_version=2,
                         loss_tokens=n, base_weight=w, times_used=t, finished_at=1.0)
            for i, (v, n, w, t) in enumerate([(2, 10, 2.0, 0), (1, 30, 1.0, 0), (1, 20, 1.0, 1), (0, 40, 1.0, 3)])]
    b = composer.batch(recs, 2, 2, 5.0)
    # w = [2, 1, .25, .25]; Z = (20 + 30 + 5 + 10) / 100
    z = 65 / 100
    assert b.loss_weights == pytest.approx((2 / z, 1 / z, 0.25 / z, 0.25 / z), rel=1e-12)
    assert b.is_replay == (False, False, True, True) and b.staleness == (0, 1, 1, 2)
    assert b.replay_fraction == 0.5 and b.alpha == pytest.approx(0.25 * 0.5 / (0.5 + 0.25 * 0.5))
    assert b.queue_s == (4.0,) * 4 and b.owners == (0, 1, 2, 3) and b.times_used == (0, 0, 1, 3)
    assert composer.step == 0                   # only compose counts batches


def test_take_replay_holds_the_sampler_to_its_contract():
    pool = replay_pool(3)
    rng = random.Random(0)
    recs = take_replay(pool.sampler, 2, rng, pool.samples)
    assert len({r.sample_id for r in recs}) == 2 and pool.sampler.available() == 1

    class Repeats(RandomSampler):
        name = "repeats"

        def pick(self, k, rng):
            return [self._pool[0]] * k

    bad = Repeats()
    for rec in pool.samples.values():
        bad.add(rec)
    with pytest.raises(RuntimeError, match='replay sampler "repeats" returned'):
        take_replay(bad, 2, rng, pool.samples)


# ------------------------------------------------------------------------------------------------
# Accounting
# ------------------------------------------------------------------------------------------------

def live(**counts: int) -> dict[str, int]:
    return {**dict.fromkeys(LIVE_STATES, 0), **counts}


def test_accounting_report_holds_the_identity():
    acc = Accounting()
    acc.created, acc.trained, acc.replayed = 10, 5, 7
    acc.ended.update(evicted_stale=4, aborted=2)
    acc.evicted_unused = 1
    assert acc.report(live(ready=3, replay=1), 4) == {
        "created": 10, "live": 4, "ended": {"trained": 0, "filtered": 0, "evicted_stale": 4, "aborted": 2,
                                            "failed": 0, "lost": 0, "uninformative": 0},
        "evicted_unused": 1, "trained": 5, "replayed": 7, "ok": True, "why": ""}
    acc.check(live(ready=3, replay=1), 4)


@pytest.mark.parametrize("change, records, why", [
    (dict(created=11), 4, "created 11 != live 4 (4 records) + ended 6"),
    ({}, 5, "live 4 (5 records)"),
    (dict(evicted_unused=5), 4, "evicted_unused 5 outside [0, evicted_stale 4]"),
    (dict(trained=2), 4, "trained 2 outside [3 that ended after training, created 10]"),
    (dict(trained=11), 4, "trained 11 outside"),
    (dict(replayed=-1), 4, "replayed -1 < 0"),
])
def test_accounting_names_the_broken_check(change, records, why):
    acc = Accounting()
    acc.created, acc.trained = 10, 5
    acc.ended.update(evicted_stale=4, aborted=2)
    acc.evicted_unused = 1
    for k, v in change.items():
        setattr(acc, k, v)
    report = acc.report(live(ready=3, replay=1), records)
    assert not report["ok"] and why in report["why"]
    with pytest.raises(AssertionError, match="accounting: "):
        acc.check(live(ready=3, replay=1), records)


# ------------------------------------------------------------------------------------------------
# The dispatch window
# ------------------------------------------------------------------------------------------------

def test_dispatch_window_spends_opens_and_reopens_when_starving():
    count = dict.fromkeys(LIVE_STATES, 0)
    ready = [False]
    w = DispatchWindow(8, count, lambda: ready[0])
    assert w.budget() == 8
    w.spend(8, 6)
    count["pending"] = 6
    assert w.budget() == 2
    count["pending"] = 0
    assert w.budget() == 8                      # starving, nothing outstanding: a fresh window
    ready[0] = True
    assert w.budget() == 2                      # a batch is ready: the trainer will open one
    count["pending"] = 3
    w.open()
    assert w.left == 5
    w.check()
    w.restore(7)
    assert w.left == 5                          # never beyond b_max - outstanding
    w.left = 6
    with pytest.raises(AssertionError, match=r"dispatch budget 6 outside \[0, b_max - outstanding = 5\]"):
        w.check()
    count["pending"] = 9
    with pytest.raises(AssertionError, match="outstanding 9 > b_max 8"):
        w.check()


# ------------------------------------------------------------------------------------------------
# The checkpoint format and the gauges
# ------------------------------------------------------------------------------------------------

def test_state_dict_keeps_the_format_and_key_order():
    idx = ReplayIndex(group_size=1, batch_size=1, sigma=0.5, tau=0.5, delta=1, b_max=4,
                      sampler=make_sampler("random"), replay_filter=make_replay_filter("accept_all"))
    state = idx.state_dict()
    assert list(state) == ["format", "params", "version", "step", "next_sample_id", "next_group_id", "finish_seq",
                           "created", "terminal", "evicted_unused", "budget", "rng", "samples", "groups",
                           "ready_order", "replay_order", "sampler", "replay_filter", "trained", "replayed",
                           "fresh", "latest_groups"]
    assert state["format"] == STATE_FORMAT == 1
    with pytest.raises(ValueError, match="replay index state: format 2, expected 1"):
        check_format({**state, "format": 2})


def test_gauge_names_are_only_ever_added_at_the_end():
    first = ("buffer/ready", "buffer/replay", "buffer/training", "buffer/pending", "buffer/finished",
             "buffer/trained", "buffer/filtered", "buffer/evicted_stale", "buffer/aborted", "buffer/failed",
             "buffer/lost", "buffer/evicted_unused", "buffer/created", "dispatch/budget", "step", "version")
    assert GAUGE_NAMES[:len(first)] == first
    assert GAUGE_NAMES[len(first):] == ("buffer/trained_samples", "buffer/replayed_uses", "buffer/uninformative",
                                        "buffer/groups_completed", "buffer/groups_dropped", "buffer/groups_over_cap")

