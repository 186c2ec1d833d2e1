"""Unit tests of the replay-buffer index (reflow_hpc/core): one test per rule of core/index.py."""

from __future__ import annotations

import ast
import json
import math
import random
import subprocess
import sys

import pytest

from reflow_hpc.config import ReflowConfig
from reflow_hpc.core import (GAUGE_NAMES, TERMINAL_REASONS, AcceptAll, PoolSampler, RecoveredSample, ReplayFilter,
                             ReplayIndex, RewardBand, build_index, group_advantages, loss_weights, make_replay_filter,
                             make_sampler, max_replay_slots, min_unused, mixing_weight, mixing_weight_bound,
                             register_replay_filter, register_sampler)
from reflow_hpc.core.modes import ModeError
from reflow_hpc.core.sample import ROW_FIELDS, SampleRecord
from conftest import ROOT



def make_index(*, group_size=4, batch_size=8, sigma=0.5, tau=0.5, delta=1, b_max=None, sampler="random",
               replay_filter="accept_all", seed=0, **kw) -> ReplayIndex:
    return ReplayIndex(group_size=group_size, batch_size=batch_size, sigma=sigma, tau=tau, delta=delta,
                       b_max=b_max if b_max is not None else 4 * batch_size,
                       sampler=make_sampler(sampler) if isinstance(sampler, str) else sampler,
                       replay_filter=make_replay_filter(replay_filter) if isinstance(replay_filter, str)
                       else replay_filter, seed=seed, **kw)


def finish_group(idx: ReplayIndex, rewards, *, version=None, max_version=None, owner=1, tokens=10, prompt_id=0,
                 now=0.0):
    """Dispatch one group and finish every member; returns its sample ids."""
    g = idx.new_group(prompt_id, now=now)
    v = idx.version if version is None else version
    for sid, r in zip(g.sample_ids, rewards, strict=True):
        idx.finished(sid, owner=owner, reward=r, min_version=v, max_version=max_version if max_version is not None
                     else max(v, idx.version if version is None else v), loss_tokens=tokens, now=now)
    return g.sample_ids


def make_replay(idx: ReplayIndex, n_groups: int, rewards=(0.0, 1.0, 0.0, 1.0)):
    """Train n_groups groups once so that their samples sit in the replay pool."""
    for _ in range(n_groups):
        finish_group(idx, rewards)
    while idx.count("ready"):
        b = idx.compose_batch()
        assert b is not None and b.num_replay == 0
        idx.step_done(b)
    idx.check_invariants()


# ------------------------------------------------------------------------------------------------
# σ: batch composition
# ------------------------------------------------------------------------------------------------

def test_sigma_half_three_unused_is_not_ready_and_changes_nothing():
    idx = make_index(group_size=1, batch_size=8, sigma=0.5)
    make_replay(idx, 8, rewards=(0.5,))
    for _ in range(3):
        finish_group(idx, (0.5,))
    before = json.dumps(idx.state_dict())
    assert idx.compose_batch() is None
    assert json.dumps(idx.state_dict()) == before


def test_sigma_half_four_unused_gives_four_unused_and_four_replay():
    idx = make_index(group_size=1, batch_size=8, sigma=0.5, tau=0.5)
    make_replay(idx, 8, rewards=(0.5,))
    fresh = [finish_group(idx, (0.5,))[0] for _ in range(4)]
    b = idx.compose_batch()
    assert b is not None and len(b) == 8
    assert list(b.sample_ids[:4]) == fresh and b.is_replay == (False,) * 4 + (True,) * 4
    assert b.replay_fraction == 0.5 and b.alpha == pytest.approx(1 / 3)
    assert len(set(b.sample_ids)) == 8
    assert idx.count("training") == 8 and idx.count("replay") == 4
    idx.check_invariants()


def test_sigma_rounding_b10_sigma03_needs_seven_unused():
    assert max_replay_slots(10, 0.3) == 3 and min_unused(10, 0.3) == 7
    assert min_unused(8, 0.5) == 4 and min_unused(7, 0.5) == 4 and min_unused(5, 0.0) == 5
    idx = make_index(group_size=1, batch_size=10, sigma=0.3)
    make_replay(idx, 10, rewards=(0.5,))
    for _ in range(6):
        finish_group(idx, (0.5,))
    assert idx.compose_batch() is None
    finish_group(idx, (0.5,))
    b = idx.compose_batch()
    assert b.num_unused == 7 and b.num_replay == 3


def test_more_unused_than_batch_takes_no_replay_and_oldest_first():
    idx = make_index(group_size=2, batch_size=4, sigma=0.5, delta=2)
    make_replay(idx, 2, rewards=(0.0, 1.0))
    assert idx.count("replay") == 4
    idx.bump_version()
    new = finish_group(idx, (0.0, 1.0))                  # min version 1
    old = finish_group(idx, (0.0, 1.0), version=0)       # min version 0: older, finished later
    newest = finish_group(idx, (0.0, 1.0))
    b = idx.compose_batch()
    assert b.num_replay == 0
    assert list(b.sample_ids) == list(old) + list(new)
    assert b.staleness == (1, 1, 0, 0)
    assert idx.count("ready") == len(newest)


def test_not_ready_when_replay_pool_too_small():
    idx = make_index(group_size=1, batch_size=8, sigma=0.5)
    make_replay(idx, 8, rewards=(0.5,))
    idx.abort(list(idx.live_ids())[:6])         # leaves 2 replay samples
    assert idx.count("replay") == 2
    for _ in range(4):
        finish_group(idx, (0.5,))
    assert idx.compose_batch() is None          # 4 unused + 2 replay < 8
    finish_group(idx, (0.5,))
    finish_group(idx, (0.5,))
    b = idx.compose_batch()
    assert b.num_unused == 6 and b.num_replay == 2


def test_fixed_share_takes_the_fewest_unused_and_leaves_the_rest_for_the_next_step():
    # unused_first would take 8 of the 12 unused samples; fixed_share takes ceil(b(1-σ)) = 4, oldest
    # first, and the 8 left make the next two batches at once
    idx = make_index(group_size=1, batch_size=8, sigma=0.5, delta=3, batch_fill="fixed_share")
    make_replay(idx, 8, rewards=(0.5,))
    fresh = [finish_group(idx, (0.5,))[0] for _ in range(12)]
    b = idx.compose_batch()
    assert b.num_unused == 4 and b.num_replay == 4 and b.replay_fraction == 0.5
    assert list(b.sample_ids[:4]) == fresh[:4]
    assert idx.count("ready") == 8
    idx.check_invariants()
    idx.step_done(b)
    idx.bump_version()
    b2 = idx.compose_batch()
    assert list(b2.sample_ids[:4]) == fresh[4:8] and b2.num_replay == 4


def test_fixed_share_takes_more_unused_when_replay_is_short():
    idx = make_index(group_size=1, batch_size=8, sigma=0.5, batch_fill="fixed_share")
    make_replay(idx, 8, rewards=(0.5,))
    idx.abort(list(idx.live_ids())[:6])         # leaves 2 replay samples
    for _ in range(4):
        finish_group(idx, (0.5,))
    assert idx.compose_batch() is None          # 4 unused + 2 replay < 8, as under unused_first
    for _ in range(4):
        finish_group(idx, (0.5,))
    b = idx.compose_batch()
    assert b.num_unused == 6 and b.num_replay == 2


def test_fixed_share_takes_the_unused_samples_the_next_bump_would_evict():
    # 6 unused samples from version 0 expire at the bump to version 2 (δ = 1): the batch takes all 6,
    # oldest first, and replay fills only the 2 slots left; a fixed share of 4 would have wasted 2
    idx = make_index(group_size=1, batch_size=8, sigma=0.5, delta=1, batch_fill="fixed_share")
    make_replay(idx, 8, rewards=(0.5,))
    idx.bump_version()
    old = [finish_group(idx, (0.5,), version=0)[0] for _ in range(6)]
    new = [finish_group(idx, (0.5,))[0] for _ in range(4)]
    b = idx.compose_batch()
    assert list(b.sample_ids[:6]) == old and b.num_replay == 2 and b.replay_fraction == 0.25
    assert [idx.sample(s).state for s in new] == ["ready"] * 4
    idx.step_done(b)
    idx.bump_version()
    assert [idx.sample(s).state for s in new] == ["ready"] * 4 and idx.count("replay") == 0  # replay evicted
    assert idx.compose_batch() is None                            # 4 unused and no replay to fill 4 slots


def test_fixed_share_with_more_expiring_than_a_batch_takes_no_replay():
    idx = make_index(group_size=1, batch_size=4, sigma=0.5, delta=1, batch_fill="fixed_share")
    make_replay(idx, 4, rewards=(0.5,))
    idx.bump_version()
    old = [finish_group(idx, (0.5,), version=0)[0] for _ in range(6)]
    b = idx.compose_batch()
    assert list(b.sample_ids) == old[:4] and b.num_replay == 0


def test_fixed_share_with_sigma_zero_is_unused_first():
    idx = make_index(group_size=1, batch_size=4, sigma=0.0, batch_fill="fixed_share")
    for _ in range(6):
        finish_group(idx, (0.5,))
    b = idx.compose_batch()
    assert b.num_unused == 4 and b.num_replay == 0


def test_batch_fill_is_checked_and_kept_in_the_checkpoint():
    with pytest.raises(ValueError, match="batch_fill"):
        make_index(batch_fill="greedy")
    idx = make_index(batch_fill="fixed_share")
    assert ReplayIndex.from_state_dict(json.loads(json.dumps(idx.state_dict()))).batch_fill == "fixed_share"
    state = idx.state_dict()
    del state["params"]["batch_fill"]           # a checkpoint from before the key
    assert ReplayIndex.from_state_dict(state).batch_fill == "unused_first"


def test_sigma_zero_needs_full_unused_batch_and_ends_trained():
    idx = make_index(group_size=4, batch_size=8, sigma=0.0)
    finish_group(idx, (0, 1, 0, 1))
    assert idx.compose_batch() is None
    finish_group(idx, (0, 1, 1, 1))
    b = idx.compose_batch()
    rel = idx.step_done(b)
    assert {r.reason for r in rel} == {"trained"} and len(rel) == 8
    assert idx.terminal_counts()["trained"] == 8 and len(idx) == 0
    idx.check_invariants()


# ------------------------------------------------------------------------------------------------
# τ: loss weights and the mixing weight
# ------------------------------------------------------------------------------------------------

def test_loss_weights_numeric_example():
    w = loss_weights([False, False, True, True], [10, 20, 30, 40], 0.5)
    # w = [1, 1, .5, .5]; Z = (10 + 20 + 15 + 20) / 100 = 0.65
    assert w == pytest.approx([1 / 0.65, 1 / 0.65, 0.5 / 0.65, 0.5 / 0.65])
    assert sum(wi * n for wi, n in zip(w, [10, 20, 30, 40])) / 100 == pytest.approx(1.0, abs=1e-12)
    w = loss_weights([False, True], [10, 10], 0.5, base_weights=[2.0, 2.0])
    assert w == pytest.approx([4 / 3, 2 / 3])
    assert loss_weights([True, True], [0, 0], 0.5) == [0.5, 0.5]      # nothing to normalise


def test_mixing_weight_bound():
    assert mixing_weight(0.5, 0.5) == pytest.approx(1 / 3)
    assert mixing_weight_bound(0.5, 0.5) == pytest.approx(1 / 3)
    assert mixing_weight(0.0, 0.5) == 0.0
    assert mixing_weight(0.25, 1.0) == pytest.approx(0.25)
    for lam in (0.0, 0.1, 0.25, 0.5):
        assert mixing_weight(lam, 0.3) <= mixing_weight_bound(0.5, 0.3) + 1e-15


def test_batch_weights_use_replay_factor_and_base_weight():
    idx = make_index(group_size=1, batch_size=2, sigma=0.5, tau=0.25)
    finish_group(idx, (0.5,), tokens=30)
    finish_group(idx, (0.5,), tokens=30)
    idx.step_done(idx.compose_batch())                 # both 30-token samples → replay
    g = idx.new_group(1)
    idx.finished(g.sample_ids[0], owner=0, reward=0.5, min_version=0, max_version=0, loss_tokens=10, base_weight=2.0)
    b = idx.compose_batch()
    assert b.is_replay == (False, True) and b.loss_tokens == (10, 30)
    # w = [2, 0.25]; Z = (20 + 7.5) / 40
    z = 27.5 / 40
    assert b.loss_weights == pytest.approx((2 / z, 0.25 / z))


def test_one_unused_and_empty_replay_pool_is_not_a_batch():
    # b = 2, σ = 0.5: one unused sample and an empty replay pool is not a batch
    idx = make_index(group_size=1, batch_size=2, sigma=0.5)
    finish_group(idx, (0.5,))
    assert idx.compose_batch() is None
    finish_group(idx, (0.5,))
    assert len(idx.compose_batch()) == 2


# ------------------------------------------------------------------------------------------------
# δ: staleness
# ------------------------------------------------------------------------------------------------

def test_staleness_eviction_at_bump_delta_one():
    idx = make_index(group_size=2, batch_size=2, sigma=0.5, delta=1)
    make_replay(idx, 1, rewards=(0.0, 1.0))                 # 2 replay samples of version 0
    ready = finish_group(idx, (0.0, 1.0))                    # 2 unused ready samples of version 0
    g = idx.new_group(0)                                     # one group still generating
    assert idx.bump_version() == []                          # staleness 1 ≤ δ
    rel = idx.bump_version()                                 # staleness 2 > δ: unused and replay alike
    assert sorted(r.sample_id for r in rel) == [0, 1] + list(ready)
    assert all(r.reason == "evicted_stale" and r.has_payload and r.rank == 1 for r in rel)
    assert idx.terminal_counts()["evicted_stale"] == 4
    assert idx.gauges()["buffer/evicted_unused"] == 2        # the two ready ones were never trained
    assert idx.count("ready") == idx.count("replay") == 0 and idx.count("pending") == 2
    # pending samples are not evicted; one that finishes already too stale is evicted on arrival
    rel = idx.finished(g.sample_ids[0], owner=3, reward=1.0, min_version=0, max_version=2, loss_tokens=5)
    assert [(r.sample_id, r.reason, r.rank) for r in rel] == [(g.sample_ids[0], "evicted_stale", 3)]
    assert idx.gauges()["buffer/evicted_unused"] == 3
    # a partial rollout whose oldest token is recent enough stays
    assert idx.finished(g.sample_ids[1], owner=3, reward=0.0, min_version=1, max_version=2, loss_tokens=5) == []
    assert idx.count("ready") == 1
    idx.check_invariants()


def test_training_samples_survive_bump_and_are_checked_at_step_end():
    idx = make_index(group_size=2, batch_size=2, sigma=0.5, delta=1)
    finish_group(idx, (0.0, 1.0))
    b = idx.compose_batch()
    assert idx.bump_version() == [] and idx.bump_version() == []     # training: not evicted during the step
    assert idx.count("training") == 2
    rel = idx.step_done(b)
    assert [r.reason for r in rel] == ["evicted_stale", "evicted_stale"]
    assert idx.gauges()["buffer/evicted_unused"] == 0        # trained once before they went stale
    idx.check_invariants()


# ------------------------------------------------------------------------------------------------
# Groups and advantages
# ------------------------------------------------------------------------------------------------

def test_group_advantages_formula():
    a = group_advantages([1.0, 0.0, 1.0, 0.0], eps=1e-6)
    assert a == pytest.approx([0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)] * 2, rel=1e-12)
    assert group_advantages([1.0, 3.0], eps=1e-6, std_norm=False) == [-1.0, 1.0]
    assert group_advantages([2.0], eps=1e-6) == [0.0]
    assert group_advantages([1.0, 1.0, 1.0], eps=1e-6) == [0.0, 0.0, 0.0]


def test_group_becomes_ready_only_when_complete_with_a_failed_member():
    idx = make_index(group_size=4, batch_size=4, sigma=0.0)
    g = idx.new_group(9, worker=2)
    a, b, c, d = g.sample_ids
    for sid, r in ((a, 1.0), (b, 0.0), (c, 0.5)):
        idx.finished(sid, owner=2, reward=r, min_version=0, max_version=0, loss_tokens=4)
    assert idx.count("finished") == 3 and idx.count("ready") == 0
    rel = idx.failed(d)
    assert [(r.sample_id, r.reason, r.has_payload) for r in rel] == [(d, "failed", False)]
    assert idx.count("ready") == 3 and idx.count("finished") == 0
    adv = [idx.sample(s).advantage for s in (a, b, c)]
    assert adv == pytest.approx(group_advantages([1.0, 0.0, 0.5], eps=1e-6))
    idx.check_invariants()


def test_replay_samples_keep_their_advantage():
    idx = make_index(group_size=2, batch_size=2, sigma=0.5)
    ids = finish_group(idx, (0.0, 1.0))
    adv = {s: idx.sample(s).advantage for s in ids}
    idx.step_done(idx.compose_batch())
    g = idx.new_group(1)
    idx.finished(g.sample_ids[0], owner=0, reward=0.3, min_version=0, max_version=0, loss_tokens=1)
    idx.failed(g.sample_ids[1])
    b = idx.compose_batch()                      # 1 unused + 1 replay
    assert b.num_replay == 1
    rid = b.sample_ids[1]
    assert b.advantages[1] == adv[rid] and b.times_used[1] == 1


# ------------------------------------------------------------------------------------------------
# After the step: replay filter, trained / filtered
# ------------------------------------------------------------------------------------------------

def test_step_done_reward_band_filters():
    idx = make_index(group_size=4, batch_size=4, sigma=0.5, replay_filter=RewardBand(0.0, 1.0))
    ids = finish_group(idx, (0.0, 0.5, 1.0, 0.7))
    rel = idx.step_done(idx.compose_batch())
    assert sorted(r.sample_id for r in rel) == [ids[0], ids[2]] and {r.reason for r in rel} == {"filtered"}
    assert idx.count("replay") == 2 and idx.sample(ids[1]).times_used == 1
    assert idx.terminal_counts()["filtered"] == 2


def half_failed_group(idx):
    """A group of 4 with 2 finished (reward 0.9) and 2 failed: the next batch of 4 needs 2 replay samples."""
    g = idx.new_group(0)
    for sid in g.sample_ids[:2]:
        idx.finished(sid, owner=0, reward=0.9, min_version=0, max_version=0, loss_tokens=3)
    idx.failed(g.sample_ids[2])
    idx.failed(g.sample_ids[3])


def test_medium_reward_sampler_picks_only_inside_band():
    idx = make_index(group_size=4, batch_size=4, sigma=0.5, sampler=make_sampler(
        "medium_reward", ReflowConfig(reward_low=0.0, reward_high=1.0)))
    finish_group(idx, (0.0, 1.0, 0.0, 1.0))
    idx.step_done(idx.compose_batch())
    medium = finish_group(idx, (0.0, 0.5, 1.0, 0.2))
    idx.step_done(idx.compose_batch())
    assert idx.count("replay") == 8 and idx.sampler.available() == 2
    half_failed_group(idx)
    b = idx.compose_batch()                # 2 unused + the only 2 eligible replay samples
    assert b.num_replay == 2 and sorted(b.sample_ids[2:]) == [medium[1], medium[3]]
    assert sorted(b.rewards[2:]) == [0.2, 0.5]


def test_reward_variance_sampler_replays_only_samples_with_a_group_advantage():
    idx = make_index(group_size=4, batch_size=4, sigma=0.5, sampler=make_sampler("reward_variance"))
    finish_group(idx, (1.0, 1.0, 1.0, 1.0))          # all alike: advantage 0 each
    idx.step_done(idx.compose_batch())
    varied = finish_group(idx, (0.0, 1.0, 1.0, 0.0))
    idx.step_done(idx.compose_batch())
    assert idx.count("replay") == 8 and idx.sampler.available() == 4
    half_failed_group(idx)
    b = idx.compose_batch()
    assert b.num_replay == 2 and set(b.sample_ids[2:]) <= set(varied)
    assert all(idx.sample(s).advantage != 0.0 for s in b.sample_ids[2:])


def test_recency_sampler_replays_the_newest_versions_first_and_restores_its_picks():
    from reflow_hpc.core.samplers import RecencySampler
    s = RecencySampler()
    recs = [SampleRecord(sample_id=i, group_id=0, prompt_id=0, state="replay", min_version=v)
            for i, v in enumerate([0, 2, 1, 2, 0, 1, 2])]
    for r in recs:
        s.add(r)
    assert s.available() == 7
    rng = random.Random(3)
    first = s.pick(4, rng)
    assert len(set(first)) == 4 and {1, 3, 6} <= set(first) and (set(first) - {1, 3, 6}) <= {2, 5}
    s.remove(3)
    s.remove(99)                                      # never added: ignored
    assert s.available() == 6
    clone = RecencySampler()
    clone.load_state_dict(s.state_dict(), [r for r in recs if r.sample_id != 3])
    assert clone.pick(3, random.Random(7)) == s.pick(3, random.Random(7))
    assert sorted(RecencySampler().pick(0, rng)) == []


def test_reward_variance_sampler_is_refused_where_the_trainer_computes_advantages():
    from reflow_hpc.config import ConfigError, load
    with pytest.raises(ConfigError, match=r"reflow.sampler.*reward_variance.*objective ppo"):
        load(None, ["reflow.sampler=reward_variance", "algorithm.name=ppo"], check_files=False)


# ------------------------------------------------------------------------------------------------
# Registries
# ------------------------------------------------------------------------------------------------

def test_registry_errors_name_the_key_and_list_registered():
    with pytest.raises(ValueError, match=r'reflow.sampler = "nope": unknown replay sampler; registered: .*medium_reward.*random'):
        make_sampler("nope")
    with pytest.raises(ValueError, match=r'reflow.replay_filter = "nope": unknown replay filter; registered: accept_all.*reward_band'):
        make_replay_filter("nope")
    with pytest.raises(ValueError, match="already registered"):
        @register_sampler("random")
        class Other(PoolSampler):
            pass
    with pytest.raises(ValueError, match="already registered"):
        @register_replay_filter("accept_all")
        class Other2(AcceptAll):
            pass
    cfg = ReflowConfig(sampler="nope")
    with pytest.raises(ValueError, match="unknown replay sampler"):
        build_index(cfg, group_size=2, batch_size=4, seed=0)


@register_sampler("test_newest_first")
class NewestFirst(PoolSampler):
    """Test sampler: the most recently reinserted replay samples, deterministic."""

    def pick(self, k, rng):
        return self._pool[-k:][::-1]


@register_replay_filter("test_once")
class ReplayOnce(ReplayFilter):
    def accept(self, sample):
        return sample.times_used < 2


def test_custom_sampler_and_filter_selected_by_name():
    cfg = ReflowConfig(sampler="test_newest_first", replay_filter="test_once", sigma=0.5, b_max=0)
    idx = build_index(cfg, group_size=1, batch_size=2, seed=0)
    assert isinstance(idx.sampler, NewestFirst) and isinstance(idx.replay_filter, ReplayOnce)
    assert idx.b_max == 2
    a = finish_group(idx, (0.5,))[0]
    b = finish_group(idx, (0.5,))[0]
    idx.step_done(idx.compose_batch())              # a, b → replay (times_used 1)
    c = finish_group(idx, (0.5,))[0]
    batch = idx.compose_batch()
    assert batch.sample_ids == (c, b)               # newest replay sample, not a random one
    rel = idx.step_done(batch)
    assert [(r.sample_id, r.reason) for r in rel] == [(b, "filtered")]   # second use: filter declines
    assert idx.sample(a).state == "replay" and idx.sample(c).state == "replay"


@register_sampler("test_broken")
class Broken(PoolSampler):
    """Test sampler that violates the contract: the same id for every slot."""

    def pick(self, k, rng):
        return [self._pool[0]] * k


def test_bad_custom_sampler_is_reported():
    idx = make_index(group_size=1, batch_size=4, sigma=0.5, sampler=make_sampler("test_broken"))
    make_replay(idx, 4, rewards=(0.5,))
    for _ in range(2):
        finish_group(idx, (0.5,))
    with pytest.raises(RuntimeError, match='replay sampler "test_broken" returned'):
        idx.compose_batch()


# ------------------------------------------------------------------------------------------------
# b_max dispatch accounting
# ------------------------------------------------------------------------------------------------

def test_b_max_budget_whole_groups_and_window_at_step_start():
    idx = make_index(group_size=3, batch_size=6, sigma=0.0, b_max=8)
    assert idx.dispatch_budget == 8
    g1, g2 = idx.new_group(0), idx.new_group(1)
    assert idx.dispatch_budget == 2 and not idx.can_dispatch_group()
    with pytest.raises(ValueError, match=r"dispatch budget 2 < group size 3 \(b_max = 8, outstanding = 6\)"):
        idx.new_group(2)
    for sid in g1.sample_ids + g2.sample_ids[:2]:
        idx.finished(sid, owner=0, reward=0.0, min_version=0, max_version=0, loss_tokens=1)
    assert idx.dispatch_budget == 2             # finishing does not refill within a step
    idx.failed(g2.sample_ids[2])
    # 5 ready < 6: not ready, and nothing is outstanding, so a fresh window opens (no deadlock)
    assert idx.compose_batch() is None and idx.dispatch_budget == 8
    g3 = idx.new_group(3)
    assert idx.dispatch_budget == 5
    idx.new_group(4)
    assert idx.dispatch_budget == 2
    for sid in g3.sample_ids:
        idx.finished(sid, owner=0, reward=0.0, min_version=0, max_version=0, loss_tokens=1)
    assert idx.outstanding == 3
    assert len(idx.compose_batch()) == 6        # step starts: window = b_max − outstanding
    assert idx.dispatch_budget == 8 - 3
    idx.check_invariants()


def test_b_max_smaller_than_group_is_rejected():
    with pytest.raises(ValueError, match=r"b_max = 4: must be ≥ the group size 8"):
        make_index(group_size=8, b_max=4)
    with pytest.raises(ValueError, match=r"sigma = 1.0: must be in \[0, 1\)"):
        make_index(sigma=1.0)
    with pytest.raises(ValueError, match=r"tau = 0: must be in \(0, 1\]"):
        make_index(tau=0)


# ------------------------------------------------------------------------------------------------
# Failures, loss, abort, shutdown, accounting
# ------------------------------------------------------------------------------------------------

def test_worker_lost_fails_generation_loses_payloads_and_training_after_step():
    idx = make_index(group_size=2, batch_size=2, sigma=0.5)
    g = idx.new_group(0, worker=[5, 6])
    idx.finished(g.sample_ids[1], owner=6, reward=1.0, min_version=0, max_version=0, loss_tokens=1)
    g2 = idx.new_group(1)
    for sid in g2.sample_ids:
        idx.finished(sid, owner=5, reward=1.0, min_version=0, max_version=0, loss_tokens=1)
    b = idx.compose_batch()                     # g2 is complete; trains on rank 5's payloads
    g3 = idx.new_group(2)
    for sid in g3.sample_ids:
        idx.finished(sid, owner=5, reward=0.0, min_version=0, max_version=0, loss_tokens=1)
    rel = idx.worker_lost(5)
    got = sorted((r.sample_id, r.reason, r.has_payload) for r in rel)
    assert got == [(g.sample_ids[0], "failed", False), (g3.sample_ids[0], "lost", True),
                   (g3.sample_ids[1], "lost", True)]
    assert idx.sample(g.sample_ids[1]).state == "ready"        # its group completed
    rel = idx.step_done(b)
    assert {r.reason for r in rel} == {"lost"} and len(rel) == 2
    idx.check_invariants()


def test_lost_abort_shutdown_and_accounting_identity():
    idx = make_index(group_size=2, batch_size=2, sigma=0.5)
    ids = finish_group(idx, (0.0, 1.0))
    b = idx.compose_batch()
    assert idx.lost(ids[0])[0].reason == "lost"
    rel = idx.step_done(b)                          # the lost one is skipped
    assert len(rel) == 0 and idx.count("replay") == 1
    g = idx.new_group(0)
    idx.abort([g.sample_ids[0]])
    with pytest.raises(ValueError, match="finished: sample .* is not live \\(it already ended\\)"):
        idx.finished(g.sample_ids[0], owner=0, reward=0.0, min_version=0, max_version=0, loss_tokens=1)
    with pytest.raises(ValueError, match="unknown id"):
        idx.failed(10_000)
    with pytest.raises(ValueError, match="newer than the published version 0"):
        idx.finished(g.sample_ids[1], owner=0, reward=0.0, min_version=0, max_version=1, loss_tokens=1)
    with pytest.raises(ValueError, match="reward nan is not a finite number"):
        idx.finished(g.sample_ids[1], owner=0, reward=float("nan"), min_version=0, max_version=0, loss_tokens=1)
    idx.check_accounting()
    rel = idx.shutdown()
    assert {r.reason for r in rel} == {"aborted"} and len(idx) == 0
    t = idx.terminal_counts()
    assert t["lost"] == 1 and t["aborted"] == 3 and idx.created == 4 == sum(t.values())
    idx.check_invariants()


def test_gauges_have_stable_names():
    idx = make_index(group_size=2, batch_size=2)
    finish_group(idx, (0.0, 1.0))
    g = idx.gauges()
    assert tuple(g) == GAUGE_NAMES
    assert {f"buffer/{r}" for r in TERMINAL_REASONS} <= set(g)
    assert g["buffer/ready"] == 2 and g["version"] == 0 and g["buffer/created"] == 2


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------

def drive(idx: ReplayIndex, seed: int, events: int) -> list:
    """A reproducible random workload; returns what the index answered."""
    import random
    rng = random.Random(seed)
    log: list = []
    batches: list = []
    for t in range(events):
        now = float(t)
        gen = sorted(s for s in idx.live_ids() if idx.sample(s).state == "pending")
        x = rng.random()
        if x < 0.25 and idx.can_dispatch_group():
            log.append(("g", idx.new_group(rng.randrange(100), now=now).sample_ids))
        elif x < 0.6 and gen:
            sid = rng.choice(gen)
            if rng.random() < 0.05:
                log.append(("f", idx.failed(sid)))
            else:
                lo = max(0, idx.version - rng.randrange(3))
                log.append(("d", idx.finished(sid, owner=rng.randrange(4), reward=rng.choice([0.0, 0.5, 1.0]),
                                              min_version=lo, max_version=idx.version,
                                              loss_tokens=rng.randrange(1, 50), now=now, location=[sid, 0])))
        elif x < 0.8:
            b = idx.compose_batch(now=now)
            log.append(("b", b))
            if b is not None:
                batches.append(b)
        elif x < 0.93 and batches:
            log.append(("s", idx.step_done(batches.pop(0))))
        else:
            log.append(("v", idx.bump_version()))
    return log


def test_state_dict_round_trip_continues_identically():
    a = make_index(group_size=3, batch_size=6, sigma=0.5, delta=2, b_max=9, seed=7)
    drive(a, 1, 400)
    state = json.loads(json.dumps(a.state_dict()))        # through JSON: plain data only
    b = ReplayIndex.from_state_dict(state, resume=False)
    assert json.dumps(b.state_dict()) == json.dumps(a.state_dict())
    b.check_invariants()
    log_a, log_b = drive(a, 2, 400), drive(b, 2, 400)
    assert log_a == log_b
    assert any(k == "b" and v is not None and v.num_replay for k, v in log_a)     # replay picks were compared
    assert json.dumps(a.state_dict()) == json.dumps(b.state_dict())


def test_restore_with_resume_aborts_in_flight_and_returns_training_samples():
    a = make_index(group_size=2, batch_size=2, sigma=0.5, b_max=6)
    ids = finish_group(a, (0.0, 1.0))
    batch = a.compose_batch()
    g = a.new_group(0, worker=1)
    state = json.loads(json.dumps(a.state_dict()))
    b = make_index(group_size=2, batch_size=2, sigma=0.5, b_max=6)
    rel = b.load_state_dict(state)                            # resume=True
    assert sorted((r.sample_id, r.reason, r.has_payload) for r in rel) == [
        (g.sample_ids[0], "aborted", False), (g.sample_ids[1], "aborted", False)]
    assert b.terminal_counts()["aborted"] == 2 and b.outstanding == 0
    assert [b.sample(s).state for s in ids] == ["ready", "ready"]
    assert b.dispatch_budget == 6
    b.check_invariants()
    assert b.compose_batch().sample_ids == batch.sample_ids
    with pytest.raises(ValueError, match="fresh index"):
        b.load_state_dict(state)


def test_recover_unknown_shard_samples():
    a = make_index(group_size=2, batch_size=2, sigma=0.5, delta=1)
    finish_group(a, (0.0, 1.0))
    a.bump_version()
    a.bump_version()
    state = a.state_dict()              # version 2, ids 0..1 known
    b = ReplayIndex.from_state_dict(state, resume=True)
    rel = b.recover([
        RecoveredSample(5, 3, 7, owner=1, reward=1.0, min_version=2, max_version=2, loss_tokens=4, location=["s", 3]),
        RecoveredSample(4, 3, 7, owner=0, reward=0.0, min_version=1, max_version=2, loss_tokens=4),
        RecoveredSample(6, 4, 8, owner=0, reward=0.0, min_version=0, max_version=2, loss_tokens=4),   # too stale
        RecoveredSample(7, 4, 8, owner=0, reward=0.0, min_version=2, max_version=3, loss_tokens=4),   # newer than v
    ])
    assert sorted((r.sample_id, r.reason) for r in rel) == [(6, "evicted_stale"), (7, "evicted_stale")]
    assert b.count("ready") == 2 and b.sample(5).location == ["s", 3]
    assert b.sample(5).advantage > 0 > b.sample(4).advantage
    assert b.knows(7) and not b.knows(8)
    g = b.new_group(0)
    assert g.sample_ids[0] == 8 and g.group_id == 5
    with pytest.raises(ValueError, match="call recover before any new_group"):
        b.recover([])
    c = ReplayIndex.from_state_dict(state)
    with pytest.raises(ValueError, match="sample 1 is already known"):
        c.recover([RecoveredSample(1, 9, 0, owner=0, reward=0.0, min_version=2, max_version=2, loss_tokens=1)])
    b.check_invariants()


def test_restart_with_smaller_delta_evicts_at_load():
    a = make_index(group_size=2, batch_size=2, sigma=0.5, delta=3)
    finish_group(a, (0.0, 1.0))
    a.bump_version()
    a.bump_version()
    b = make_index(group_size=2, batch_size=2, sigma=0.5, delta=1)
    assert {r.reason for r in b.load_state_dict(a.state_dict())} == {"evicted_stale"}
    assert b.count("ready") == 0 and b.terminal_counts()["evicted_stale"] == 2
    b.check_invariants()


# ------------------------------------------------------------------------------------------------
# Construction, purity, tooling
# ------------------------------------------------------------------------------------------------

def test_build_index_from_config_modes():
    idx = build_index(ReflowConfig(mode="fully_async", sigma=0.0, b_max=0, sampler="medium_reward",
                                   reward_low=0.1, reward_high=0.9), group_size=4, batch_size=16, seed=3)
    assert idx.sigma == 0.0 and idx.b_max == 16 and idx.sampler.reward_low == 0.1
    with pytest.raises(ModeError, match="reflow.sigma = 0.5: mode fully_async trains every sample once"):
        build_index(ReflowConfig(mode="fully_async", sigma=0.5), group_size=4, batch_size=16, seed=3)
    idx = build_index(ReflowConfig(sigma=0.25, tau=0.3, delta=2, b_max=40, replay_filter="reward_band"),
                      group_size=4, batch_size=16, seed=3)
    assert (idx.sigma, idx.tau, idx.delta, idx.b_max) == (0.25, 0.3, 2, 40)
    assert isinstance(idx.replay_filter, RewardBand)


def test_numpy_scalars_are_accepted_and_stored_as_plain_numbers():
    np = pytest.importorskip("numpy")
    idx = make_index(group_size=2, batch_size=2)
    g = idx.new_group(np.int64(5), worker=np.int32(1))
    for sid in g.sample_ids:
        idx.finished(sid, owner=np.int64(1), reward=np.float32(0.5), min_version=np.int64(0),
                     max_version=np.int32(0), loss_tokens=np.int64(7), base_weight=np.float64(1.0))
    json.dumps(idx.state_dict())
    sid = idx.new_group(0).sample_ids[0]
    with pytest.raises(ValueError, match="loss_tokens 1.5 must be an integer"):
        idx.finished(sid, owner=0, reward=0.0, min_version=0, max_version=0, loss_tokens=1.5)


def test_sample_row_round_trip():
    rec = SampleRecord(3, 1, 2, "ready", 4, 5, 0.5, 1, 2, 10, 1.0, 0.3, 1, ["seg", 7], 1.0, 2.0, 9, False)
    assert SampleRecord.from_row(rec.to_row()).to_row() == rec.to_row()
    assert len(ROW_FIELDS) == len(rec.to_row())


def test_core_is_pure():
    forbidden = {"mpi4py", "torch", "h5py", "time", "threading", "socket", "asyncio", "datetime", "os", "reflow_hpc.config"}
    for path in sorted((ROOT / "reflow_hpc" / "core").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not any(name == f or name.startswith(f + ".") for f in forbidden), f"{path.name} imports {name}"


def test_index_docstring_states_the_rules():
    import reflow_hpc.core.index as m
    doc = m.__doc__
    for word in ("σ (sigma)", "τ (tau)", "δ (delta)", "b_max", "evicted_stale", "ceil(b(1-σ))", "staleness"):
        assert word in doc


def test_bench_index_runs_and_prints_json():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_index.py"), "--sizes", "2000",
                          "--rounds", "2", "--json"], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    row = result["sizes"]["2000"]
    for op in ("insert", "complete", "compose", "step_done", "evict"):
        assert row[op]["events_per_s"] > 0
    assert math.isfinite(result["min_events_per_s"])
