"""Property tests of the replay-buffer index over random interleavings of events (hypothesis).

A rule-based state machine drives one index with random dispatches, starts, finishes (random
versions, rewards and token counts), failures, batches, finished steps, version bumps, aborts,
losses, lost workers, checkpoint round trips and restarts, and checks after every event:

- every batch: replay fraction ≤ σ, no duplicate, staleness ≤ δ, Σ w̃_i n_i / Σ n_i = 1 (1e-9),
  α ≤ τσ/(1-σ+τσ);
- right after a bump no finished/ready/replay sample is staler than δ (check_invariants);
- every sample ends at most once, with one reason, and created == live + Σ terminal;
- outstanding (pending) never exceeds b_max.

The same machine with the fresh-sample hooks on (dynamic sampling's ``informative_groups``, a
generation cap, ω from a plugin, recomputed replay advantages) checks besides: the unused samples of
every batch come from groups the filter kept (or let through over the cap), batches stay full, and
the samples dropped between two batches never exceed ``max_gen_batches · b``.

A seeded random workload (longer runs where batches do mix in replay samples) checks the same
batch properties; the pure functions get their own properties.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from reflow_hpc.core import (TERMINAL_REASONS, ReplayIndex, loss_weights, make_replay_filter, make_sampler,
                             max_replay_slots, mixing_weight, mixing_weight_bound)
from reflow_hpc.core.composition import BATCH_FILLS
from reflow_hpc.core.filters import RewardBand
from reflow_hpc.core.fresh import InformativeGroups, SampleWeight, register_fresh_filter, register_sample_weight
from reflow_hpc.core.samplers import MediumRewardSampler

REWARDS = st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0])
TAUS = st.sampled_from([0.1, 0.3, 0.5, 1.0])
RARE = 6
SIGMAS_MACHINE = st.sampled_from([0.5, 0.7, 0.9, 0.0, 0.25, 0.3])   # replay-heavy first: shrinks towards it


def fresh_sampler(name: str):
    return MediumRewardSampler(0.0, 1.0) if name == "medium_reward" else make_sampler(name)


def fresh_filter(name: str):
    return RewardBand(0.0, 1.0) if name == "reward_band" else make_replay_filter(name)


def check_batch(idx: ReplayIndex, b, training) -> None:
    """The per-batch properties: σ bound, no duplicate, δ bound, τ normalisation, α bound."""
    n = len(b)
    assert n == idx.batch_size
    assert len(set(b.sample_ids)) == n, "duplicate sample in a batch"
    in_training = {s for t in training for s in t.sample_ids}
    assert not in_training & set(b.sample_ids), "sample in two batches at once"
    assert b.num_replay <= max_replay_slots(n, idx.sigma)
    assert b.replay_fraction <= idx.sigma + 1e-12
    assert list(b.is_replay) == sorted(b.is_replay), "unused samples come first"
    assert all(0 <= s <= idx.delta for s in b.staleness)
    assert b.alpha <= mixing_weight_bound(idx.sigma, idx.tau) + 1e-12
    assert b.alpha == mixing_weight(b.replay_fraction, idx.tau)
    total = sum(b.loss_tokens)
    mass = math.fsum(w * t for w, t in zip(b.loss_weights, b.loss_tokens))
    if total > 0 and mass > 0:
        assert abs(mass / total - 1.0) <= 1e-9


class IndexMachine(RuleBasedStateMachine):
    @initialize(group_size=st.integers(1, 4), batch_size=st.integers(1, 10), sigma=SIGMAS_MACHINE, tau=TAUS,
                delta=st.integers(0, 2), b_max_factor=st.sampled_from([0.5, 1, 1, 2, 3]),
                sampler=st.sampled_from(["random", "medium_reward", "reward_variance", "recency"]),
                replay_filter=st.sampled_from(["accept_all", "reward_band"]),
                std_norm=st.booleans(), seed=st.integers(0, 2**16), batch_fill=st.sampled_from(BATCH_FILLS))
    def setup(self, group_size, batch_size, sigma, tau, delta, b_max_factor, sampler, replay_filter, std_norm, seed,
              batch_fill):
        self.names = (sampler, replay_filter)
        self.idx = ReplayIndex(group_size=group_size, batch_size=batch_size, sigma=sigma, tau=tau, delta=delta,
                               b_max=max(group_size, math.ceil(batch_size * b_max_factor)), sampler=fresh_sampler(sampler),
                               replay_filter=fresh_filter(replay_filter), seed=seed, adv_std_norm=std_norm,
                               batch_fill=batch_fill, **self.hooks())
        self.start()

    def hooks(self) -> dict:
        """Keyword arguments of every index this machine builds besides its parameters."""
        return {}

    def start(self) -> None:
        self.created: set[int] = set()
        self.ended: dict[int, str] = {}
        self.training: list = []          # batches whose step is not done
        self.now = 0.0
        self.batches = 0

    # -- helpers --------------------------------------------------------------------------------

    def record(self, releases) -> None:
        for r in releases:
            assert r.sample_id in self.created, f"released unknown sample {r.sample_id}"
            assert r.sample_id not in self.ended, f"sample {r.sample_id} ended twice ({self.ended.get(r.sample_id)}, {r.reason})"
            assert r.reason in TERMINAL_REASONS
            self.ended[r.sample_id] = r.reason

    def ids_in(self, *states: str) -> list[int]:
        return sorted(s for s in self.idx.live_ids() if self.idx.sample(s).state in states)

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    # -- events ---------------------------------------------------------------------------------

    @rule(groups=st.integers(1, 4), prompt=st.integers(0, 20), worker=st.integers(-1, 3))
    def dispatch(self, groups, prompt, worker):
        for _ in range(groups):
            if self.idx.can_dispatch_group():
                g = self.idx.new_group(prompt, now=self.tick(), worker=None if worker < 0 else worker)
                assert len(g.sample_ids) == self.idx.group_size and not self.created & set(g.sample_ids)
                self.created.update(g.sample_ids)
            else:
                with pytest.raises(ValueError, match="dispatch budget"):
                    self.idx.new_group(prompt)
            assert self.idx.outstanding <= self.idx.b_max

    @rule(data=st.data(), finishes=st.lists(st.tuples(
        REWARDS, st.sampled_from([0, 0, 0, 1, 2, 4]), st.integers(0, 40), st.integers(0, 3),
        st.sampled_from([1.0, 1.0, 0.5, 2.0])), min_size=1, max_size=8))
    def finish(self, data, finishes):
        for reward, lag, tokens, owner, base_weight in finishes:
            ids = self.ids_in("pending")
            if not ids:
                return
            sid = data.draw(st.sampled_from(ids))
            v = self.idx.version
            lo = max(0, v - lag)                  # lag > δ: evicted on arrival
            hi = data.draw(st.integers(lo, v))
            self.record(self.idx.finished(sid, owner=owner, reward=reward, min_version=lo, max_version=hi,
                                          loss_tokens=tokens, now=self.tick(), location=[owner, sid],
                                          base_weight=base_weight))

    @rule(groups=st.integers(1, 3),
          params=st.lists(st.tuples(REWARDS, st.sampled_from([0, 0, 0, 0, 1, 3]), st.integers(0, 30)),
                          min_size=1, max_size=12))
    def produce(self, groups, params):
        """A burst of healthy production: dispatch up to `groups` groups, finish everything in flight."""
        for _ in range(groups):
            if self.idx.can_dispatch_group():
                self.created.update(self.idx.new_group(0, now=self.tick()).sample_ids)
        for i, sid in enumerate(self.ids_in("pending")):
            reward, lag, tokens = params[i % len(params)]
            v = self.idx.version
            self.record(self.idx.finished(sid, owner=i % 4, reward=reward, min_version=max(0, v - lag),
                                          max_version=v, loss_tokens=tokens, now=self.tick()))

    # Destructive events act only on one draw in RARE, so that samples also get to live long.

    @rule(data=st.data(), go=st.integers(0, RARE))
    def fail(self, data, go):
        ids = self.ids_in("pending")
        if ids and go == 0:
            self.record(self.idx.failed(data.draw(st.sampled_from(ids))))

    def ready_expiring(self) -> int:
        """Unused ready samples the next version bump evicts, counted from the records themselves."""
        idx = self.idx
        recs = [idx.sample(sid) for sid in idx.live_ids()]
        return sum(1 for rec in recs if rec.state == "ready" and rec.min_version <= idx.version - idx.delta)

    @rule()
    def compose(self):
        idx = self.idx
        ready_before = idx.batch_ready()
        unused, replay, expiring = idx.count("ready"), idx.sampler.available(), self.ready_expiring()
        b = idx.compose_batch(now=self.tick())
        assert (b is not None) == ready_before
        if b is None:
            return
        self.batches += 1
        check_batch(idx, b, self.training)
        # the batch fill: all ready unused samples up to b, or as few as replay lets σ leave but never
        # fewer than the next bump would evict; a batch with replay leaves no unused sample to expire
        n, cap = len(b), max_replay_slots(len(b), idx.sigma)
        want = n - max(0, min(cap, replay, n - expiring)) if idx.batch_fill == "fixed_share" else min(unused, n)
        assert b.num_unused == want, (idx.batch_fill, unused, replay, expiring, b.num_unused)
        if b.num_replay:
            assert self.ready_expiring() == 0, (idx.batch_fill, expiring, b.num_unused)
        if idx.batch_fill == "fixed_share" and b.num_replay < min(cap, replay):
            event("fixed_share took unused samples about to expire in place of replay")
        event("a batch with replay samples" if b.num_replay else "a batch of unused samples only")
        self.training.append(b)

    @rule()
    def train_step(self):
        """A whole step: compose a batch and finish its step at once."""
        n = len(self.training)
        self.compose()
        if len(self.training) > n:
            self.record(self.idx.step_done(self.training.pop()))

    @precondition(lambda self: self.training)
    @rule(data=st.data())
    def step_done(self, data):
        if self.training:
            b = self.training.pop(data.draw(st.integers(0, len(self.training) - 1)))
            self.record(self.idx.step_done(b))

    @rule(go=st.integers(0, 2))
    def bump(self, go):
        if go:
            return
        self.record(self.idx.bump_version())
        v, delta = self.idx.version, self.idx.delta
        for sid in self.ids_in("finished", "ready", "replay"):
            assert v - self.idx.sample(sid).min_version <= delta

    @rule(data=st.data(), go=st.integers(0, RARE))
    def abort(self, data, go):
        ids = sorted(self.idx.live_ids())
        if ids and go == 0:
            chosen = data.draw(st.lists(st.sampled_from(ids), max_size=3))
            self.record(self.idx.abort(chosen))

    @rule(data=st.data(), go=st.integers(0, RARE))
    def lose(self, data, go):
        ids = self.ids_in("finished", "ready", "replay", "training")
        if ids and go == 0:
            self.record(self.idx.lost(data.draw(st.sampled_from(ids))))

    @rule(rank=st.integers(0, 3), go=st.integers(0, RARE))
    def lose_worker(self, rank, go):
        if go == 0:
            self.record(self.idx.worker_lost(rank))

    @rule(go=st.integers(0, RARE))
    def checkpoint_round_trip(self, go):
        if go:
            return
        state = json.loads(json.dumps(self.idx.state_dict()))
        clone = ReplayIndex.from_state_dict(state, sampler=fresh_sampler(self.names[0]),
                                            replay_filter=fresh_filter(self.names[1]), resume=False)
        assert json.dumps(clone.state_dict()) == json.dumps(state)
        self.idx = clone

    @rule(go=st.integers(0, RARE))
    def restart(self, go):
        """Checkpoint and restart: in-flight samples end as aborted, training ones return (or are
        evicted when a bump made them too stale during their step)."""
        if go:
            return
        before = {sid: self.idx.sample(sid) for sid in self.idx.live_ids()}
        v, delta = self.idx.version, self.idx.delta
        state = json.loads(json.dumps(self.idx.state_dict()))
        self.idx = ReplayIndex(**{**state["params"], **self.hooks()}, sampler=fresh_sampler(self.names[0]),
                               replay_filter=fresh_filter(self.names[1]))
        released = {r.sample_id: r.reason for r in self.idx.load_state_dict(state, resume=True)}
        for sid, rec in before.items():
            if rec.state == "pending":
                assert sid not in self.idx
                self.ended[sid] = "aborted"
            elif rec.state == "training":
                if v - rec.min_version > delta:
                    assert sid not in self.idx
                    self.ended[sid] = "evicted_stale"
                else:
                    assert self.idx.sample(sid).state == ("replay" if rec.times_used else "ready")
            elif rec.state == "finished" and sid in self.idx:   # nothing is in flight: every group is complete
                assert self.idx.sample(sid).state == "ready"
            elif rec.state == "finished":      # a fresh filter declined its completed group
                assert released[sid] == "uninformative"
                self.ended[sid] = "uninformative"
            else:
                assert self.idx.sample(sid).state == rec.state
        assert self.idx.count("finished") == 0
        assert released == {sid: reason for sid, reason in self.ended.items() if sid in before}
        self.training = []
        assert self.idx.outstanding == 0 and self.idx.dispatch_budget == self.idx.b_max

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        if not hasattr(self, "idx"):
            return
        self.idx.check_invariants()
        assert self.idx.outstanding <= self.idx.b_max
        assert len(self.created) == len(self.idx) + len(self.ended)
        assert self.idx.created == len(self.created)
        counts = Counter(self.ended.values())
        assert self.idx.terminal_counts() == {r: counts.get(r, 0) for r in TERMINAL_REASONS}
        for sid in self.ended:
            assert sid not in self.idx


IndexMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_index_state_machine = IndexMachine.TestCase


class ShutdownMachine(IndexMachine):
    """The same interleavings, then a shutdown: every created sample has exactly one terminal state."""

    @precondition(lambda self: hasattr(self, "idx"))
    @invariant()
    def shutdown_ends_everything(self):
        state = json.loads(json.dumps(self.idx.state_dict()))
        copy = ReplayIndex.from_state_dict(state, sampler=fresh_sampler(self.names[0]),
                                           replay_filter=fresh_filter(self.names[1]), resume=False)
        released = copy.shutdown()
        ids = [r.sample_id for r in released]
        assert len(ids) == len(set(ids)) and set(ids) == set(self.created) - set(self.ended)
        assert len(copy) == 0 and sum(copy.terminal_counts().values()) == copy.created == len(self.created)


ShutdownMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
test_shutdown_state_machine = ShutdownMachine.TestCase


@register_fresh_filter("property_informative")
class RecordingInformative(InformativeGroups):
    """informative_groups that remembers its decision for every sample it saw."""
    kept: dict[int, bool] = {}

    def keep(self, group):
        decisions = super().keep(group)
        RecordingInformative.kept.update((s.sample_id, k) for s, k in zip(group, decisions))
        return decisions


@register_sample_weight("property_by_tokens")
class ByTokens(SampleWeight):
    def weights(self, group):
        return [0.5 + (s.loss_tokens % 3) for s in group]


class DynamicSamplingMachine(IndexMachine):
    @initialize(group_size=st.integers(1, 4), batch_size=st.integers(1, 8), sigma=st.sampled_from([0.0, 0.5, 0.25]),
                tau=TAUS, delta=st.integers(0, 2), b_max_factor=st.sampled_from([0.5, 1, 2, 3]),
                cap=st.sampled_from([0, 0, 1, 2]), recompute=st.booleans(), seed=st.integers(0, 2**16))
    def setup(self, group_size, batch_size, sigma, tau, delta, b_max_factor, cap, recompute, seed):
        self.names = ("random", "accept_all")
        self.cap, self.recompute = cap, recompute
        RecordingInformative.kept = {}
        self.idx = ReplayIndex(group_size=group_size, batch_size=batch_size, sigma=sigma, tau=tau, delta=delta,
                               b_max=max(group_size, math.ceil(batch_size * b_max_factor)),
                               sampler=make_sampler("random"), replay_filter=make_replay_filter("accept_all"),
                               seed=seed, **self.hooks())
        self.start()
        self.dropped_since_batch = 0

    def hooks(self) -> dict:
        return {"fresh_filter": RecordingInformative(), "sample_weight": ByTokens(), "max_gen_batches": self.cap,
                "replay_advantage": "recompute" if self.recompute else "keep"}

    def record(self, releases) -> None:
        super().record(releases)
        self.dropped_since_batch += sum(r.reason == "uninformative" for r in releases)

    @rule()
    def compose(self):
        n = len(self.training)
        super().compose()
        if len(self.training) == n:
            return
        b, idx = self.training[-1], self.idx
        assert len(b) == idx.batch_size
        over_cap = idx.gauges()["buffer/groups_over_cap"]
        for sid, rep, adv in zip(b.sample_ids, b.is_replay, b.advantages):
            assert math.isfinite(adv)
            if not rep:
                assert RecordingInformative.kept[sid] or over_cap > 0, f"uninformative sample {sid} in a batch"
                assert adv == idx.sample(sid).advantage
        if self.cap:
            assert self.dropped_since_batch <= self.cap * idx.batch_size
        else:
            assert over_cap == 0
        event("a batch after dropped groups" if self.dropped_since_batch else "a batch, nothing dropped")
        self.dropped_since_batch = 0

    @invariant()
    def dropped_groups_are_counted(self):
        if hasattr(self, "idx"):
            g = self.idx.gauges()
            assert g["buffer/groups_dropped"] + g["buffer/groups_over_cap"] <= g["buffer/groups_completed"]


DynamicSamplingMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                                    suppress_health_check=[HealthCheck.too_slow])
test_dynamic_sampling_state_machine = DynamicSamplingMachine.TestCase


# ------------------------------------------------------------------------------------------------
# Longer healthy workloads: replay is exercised in every example
# ------------------------------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), group_size=st.integers(1, 4), batch_size=st.integers(4, 12),
       sigma=st.sampled_from([0.25, 0.3, 0.5, 0.7]), tau=TAUS, delta=st.integers(0, 3),
       sampler=st.sampled_from(["random", "medium_reward", "reward_variance", "recency"]),
       replay_filter=st.sampled_from(["accept_all", "reward_band"]), batch_fill=st.sampled_from(BATCH_FILLS))
def test_random_workload(seed, group_size, batch_size, sigma, tau, delta, sampler, replay_filter, batch_fill):
    import random
    rng = random.Random(seed)
    idx = ReplayIndex(group_size=group_size, batch_size=batch_size, sigma=sigma, tau=tau, delta=delta,
                      b_max=max(group_size, batch_size // 2 + rng.randrange(batch_size)), sampler=fresh_sampler(sampler),
                      replay_filter=fresh_filter(replay_filter), seed=seed, batch_fill=batch_fill)
    created, ended, training = set(), {}, []
    replayed = 0

    def record(releases):
        for r in releases:
            assert r.sample_id not in ended
            ended[r.sample_id] = r.reason

    for t in range(250):
        x = rng.random()
        if x < 0.3:
            while idx.can_dispatch_group():
                created.update(idx.new_group(t, now=t).sample_ids)
        elif x < 0.6:
            gen = [s for s in idx.live_ids() if idx.sample(s).state == "pending"]
            for sid in rng.sample(gen, min(len(gen), 3)):
                if rng.random() < 0.03:
                    record(idx.failed(sid))
                    continue
                v = idx.version
                lo = max(0, v - rng.choice([0, 0, 0, 1, 2, 5]))
                record(idx.finished(sid, owner=rng.randrange(4), reward=rng.choice([0.0, 0.5, 1.0, 0.25]),
                                    min_version=lo, max_version=rng.randint(lo, v), loss_tokens=rng.randrange(40),
                                    now=t))
        elif x < 0.92:
            b = idx.compose_batch(now=t)
            if b is not None:
                check_batch(idx, b, training)
                replayed += b.num_replay
                training.append(b)
            if training and rng.random() < 0.8:
                record(idx.step_done(training.pop(0)))
        else:
            record(idx.bump_version())
        idx.check_invariants()
        assert len(created) == len(idx) + len(ended) == idx.created
    if max_replay_slots(batch_size, sigma) == 0:
        assert replayed == 0
    event(f"replay samples trained: {'none' if replayed == 0 else 'some'}")


# ------------------------------------------------------------------------------------------------
# Pure functions
# ------------------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 500), st.sampled_from([0.5, 1.0, 1.5, 3.0])),
                min_size=1, max_size=64), TAUS)
def test_loss_weights_token_mean_is_one(items, tau):
    is_replay, tokens, base = zip(*items)
    w = loss_weights(is_replay, tokens, tau, base)
    if sum(tokens) > 0:
        assert abs(math.fsum(wi * n for wi, n in zip(w, tokens)) / sum(tokens) - 1.0) <= 1e-9
    # replay samples weigh τ times an unused sample of the same base weight
    for (r, _, b), wi in zip(items, w):
        ref = next((wj for (rj, _, bj), wj in zip(items, w) if not rj and bj == b), None)
        if r and ref is not None:
            assert wi == pytest.approx(tau * ref)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4096), st.integers(0, 999))
def test_replay_slots_exact(batch_size, sigma_milli):
    sigma = sigma_milli / 1000
    exact = Fraction(sigma_milli, 1000) * batch_size
    assert max_replay_slots(batch_size, sigma) == math.floor(exact)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 99), st.integers(1, 100), st.integers(1, 100))
def test_alpha_bounded_by_sigma(sigma_pct, tau_pct, lam_share):
    sigma, tau = sigma_pct / 100, tau_pct / 100
    lam = sigma * lam_share / 100           # any λ ≤ σ
    assert 0.0 <= mixing_weight(lam, tau) <= mixing_weight_bound(sigma, tau) + 1e-15
