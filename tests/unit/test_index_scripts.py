"""Event-script tests of the replay-buffer index (h11 style): each test is a table of events in and
the outputs expected — releases, batches (ids, replay flags, weights, staleness), gauges, accounting.

A row is ``(event, expected)``. :func:`run` feeds the events to one index in order, compares each
output with its expectation and names the row that differs; after every row the index's full
invariant check runs, until a row deliberately corrupts it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from reflow_hpc.core import RecoveredSample, ReplayIndex, make_replay_filter, make_sampler
from reflow_hpc.core.filters import RewardBand

EV, READY, REPLAY = "evicted_stale", "ready", "replay"


# ------------------------------------------------------------------------------------------------
# The script runner
# ------------------------------------------------------------------------------------------------

class Runner:
    """One index under a script, and the batches composed whose steps are not done yet."""

    def __init__(self, idx: ReplayIndex):
        self.idx, self.batches, self.now, self.checked = idx, {}, 0.0, True

    def tick(self) -> float:
        self.now += 1.0
        return self.now


@dataclass
class Event:
    text: str
    act: Callable[[Runner], Any]

    def __repr__(self) -> str:
        return self.text


@dataclass
class Expect:
    """An expectation that is not plain equality."""
    text: str
    ok: Callable[[Any], bool]

    def __repr__(self) -> str:
        return self.text


def matches(got: Any, expected: Any) -> bool:
    if isinstance(expected, Expect):
        return expected.ok(got)
    if isinstance(expected, list) and isinstance(got, list):          # releases
        return len(got) == len(expected) and all(
            (r.sample_id, r.reason, r.rank, r.has_payload)[:len(e)] == tuple(e) for r, e in zip(got, expected))
    return got == expected


def run(script: list[tuple[Event, Any]], **params: Any) -> Runner:
    """Run the rows of ``script`` on a fresh index made with ``params`` (see :func:`index`)."""
    r = Runner(index(**params))
    for n, (event, expected) in enumerate(script, 1):
        got = event.act(r)
        assert matches(got, expected), f"row {n}: {event!r} gave {got!r}, expected {expected!r}"
        if r.checked:
            r.idx.check_invariants()
    return r


def index(*, group_size=1, batch_size=4, sigma=0.5, tau=0.5, delta=1, b_max=16, sampler="random",
          replay_filter="accept_all", seed=0) -> ReplayIndex:
    return ReplayIndex(group_size=group_size, batch_size=batch_size, sigma=sigma, tau=tau, delta=delta,
                       b_max=b_max, sampler=make_sampler(sampler),
                       replay_filter=replay_filter if not isinstance(replay_filter, str)
                       else make_replay_filter(replay_filter), seed=seed)


# -- events --------------------------------------------------------------------------------------

def new(prompt: int = 0, worker: Any = None) -> Event:
    """Dispatch a group; gives its sample ids."""
    return Event(f"new_group({prompt})",
                 lambda r: r.idx.new_group(prompt, now=r.tick(), worker=worker).sample_ids)


def fin(sid: int, reward: float = 0.5, v: int | None = None, hi: int | None = None, tokens: int = 10,
        owner: int = 1, weight: float = 1.0) -> Event:
    """A sample finished with token versions ``v..hi`` (default: the current version); gives releases."""
    def act(r: Runner):
        lo = r.idx.version if v is None else v
        return r.idx.finished(sid, owner=owner, reward=reward, min_version=lo, max_version=lo if hi is None else hi,
                              loss_tokens=tokens, now=r.tick(), base_weight=weight)
    return Event(f"finished({sid}, v={v})", act)


def compose() -> Event:
    def act(r: Runner):
        b = r.idx.compose_batch(now=r.tick())
        if b is not None:
            r.batches[b.step] = b
        return b
    return Event("compose_batch()", act)


def done(step: int | None = None) -> Event:
    """The step of batch ``step`` (default: the oldest not done) is done; gives releases."""
    def act(r: Runner):
        return r.idx.step_done(r.batches.pop(min(r.batches) if step is None else step))
    return Event(f"step_done({'' if step is None else step})", act)


def call(text: str, f: Callable[[ReplayIndex], Any]) -> Event:
    """Any call on the index, by name (failed, lost, abort, bump_version, …)."""
    return Event(text, lambda r: f(r.idx))


def bump() -> Event:
    return call("bump_version()", lambda idx: idx.bump_version())


def failed(sid: int) -> Event:
    return call(f"failed({sid})", lambda idx: idx.failed(sid))


def states(*sids: int) -> Event:
    return call(f"states{sids}", lambda idx: tuple(idx.sample(s).state if s in idx else "ended" for s in sids))


def budget() -> Event:
    return call("dispatch_budget", lambda idx: idx.dispatch_budget)


def gauges() -> Event:
    return call("gauges()", lambda idx: idx.gauges())


def accounting() -> Event:
    return call("accounting()", lambda idx: idx.accounting())


def check_accounting() -> Event:
    def act(idx: ReplayIndex) -> str:
        try:
            idx.check_accounting()
        except AssertionError as e:
            return str(e)
        return "ok"
    return call("check_accounting()", act)


def corrupt(text: str, f: Callable[[ReplayIndex], None]) -> Event:
    """Break the index behind its back (its invariant checks stop running after this row)."""
    def act(r: Runner):
        f(r.idx)
        r.checked = False
    return Event(f"corrupt: {text}", act)


def restart(resume: bool = True, keep: tuple[int, ...] = (), **params: Any) -> Event:
    """Checkpoint through JSON and load it into a fresh index (``params`` override its settings)."""
    def act(r: Runner):
        state = json.loads(json.dumps(r.idx.state_dict()))
        r.idx = index(**{**_params(state), **params})
        r.batches = {}
        return r.idx.load_state_dict(state, resume=resume, keep=keep)
    return Event(f"restart(resume={resume}, keep={keep})", act)


def recover(*samples: RecoveredSample) -> Event:
    return call(f"recover({[s.sample_id for s in samples]})", lambda idx: idx.recover(samples))


def _params(state: dict) -> dict:
    p = state["params"]
    return {k: p[k] for k in ("group_size", "batch_size", "sigma", "tau", "delta", "b_max")}


# -- expectations --------------------------------------------------------------------------------

NOTHING: list = []          # no releases


def ended(*pairs: tuple) -> list:
    """Releases, in order: ``(sample_id, reason)`` or ``(sample_id, reason, rank, has_payload)``."""
    return list(pairs)


def batch(ids: tuple, *, replay: tuple | None = None, weights: tuple | None = None,
          staleness: tuple | None = None, times_used: tuple | None = None, alpha: float | None = None) -> Expect:
    want = {"sample_ids": ids, "is_replay": replay, "loss_weights": weights, "staleness": staleness,
            "times_used": times_used, "alpha": alpha}
    want = {k: v for k, v in want.items() if v is not None}

    def ok(b: Any) -> bool:
        if b is None:
            return False
        for k, v in want.items():
            got = getattr(b, k)
            if k in ("loss_weights", "alpha"):
                if got != pytest.approx(v, rel=1e-12):
                    return False
            elif got != v:
                return False
        # the τ normalisation holds for every batch: Σ w̃ n / Σ n = 1
        total = sum(b.loss_tokens)
        return total == 0 or math.isclose(sum(w * n for w, n in zip(b.loss_weights, b.loss_tokens)) / total, 1.0)
    return Expect(f"batch({want})", ok)


def has(**kw: Any) -> Expect:
    """A dict with at least these items; a name without "/" means ``buffer/<name>`` for gauges."""
    def ok(d: dict) -> bool:
        for k, v in kw.items():
            key = k if k in d else f"buffer/{k}"
            if key not in d or not matches(d[key], v):
                return False
        return True
    return Expect(f"has({kw})", ok)


def contains(text: str) -> Expect:
    return Expect(f"contains({text!r})", lambda s: text in s)


def approx(*values: float) -> Expect:
    return Expect(f"approx{values}", lambda got: got == pytest.approx(values, rel=1e-12))


T, F = True, False


# ------------------------------------------------------------------------------------------------
# σ and τ: batch composition
# ------------------------------------------------------------------------------------------------

def test_sigma_caps_replay_and_tau_weights_normalise_by_tokens():
    # b = 4, σ = 0.5: at least ceil(4·0.5) = 2 unused samples per batch, replay fills the rest.
    # Replay weight τ = 0.5; tokens 20, 20 (unused) and 10, 10 (replay):
    # w = [1, 1, .5, .5], Z = (20 + 20 + 5 + 5) / 60, w̃ = w / Z = [1.2, 1.2, .6, .6].
    run([
        (new(0),            (0,)),
        (fin(0),            NOTHING),
        (new(1),            (1,)),
        (fin(1),            NOTHING),
        (compose(),         None),                   # 2 unused, empty replay pool: 2 slots unfilled
        (new(2),            (2,)),
        (fin(2),            NOTHING),
        (new(3),            (3,)),
        (fin(3),            NOTHING),
        (compose(),         batch((0, 1, 2, 3), replay=(F, F, F, F), weights=(1, 1, 1, 1), alpha=0.0)),
        (done(),            NOTHING),                # accept_all: all four become replay samples
        (gauges(),          has(replay=4, trained_samples=4, replayed_uses=0)),
        (new(4),            (4,)),
        (fin(4, tokens=20), NOTHING),
        (compose(),         None),                   # 1 unused < 2
        (new(5),            (5,)),
        (fin(5, tokens=20), NOTHING),
        (compose(),         batch((4, 5, 3, 1), replay=(F, F, T, T), weights=(1.2, 1.2, 0.6, 0.6),
                                  times_used=(0, 0, 1, 1), alpha=1 / 3)),
        (done(),            NOTHING),
        (accounting(),      has(ok=True, created=6, live=6, trained=6, replayed=2)),
    ], group_size=1, batch_size=4, sigma=0.5, tau=0.5)


def test_more_unused_than_a_batch_takes_the_oldest_and_no_replay():
    run([
        (new(0),            (0,)),
        (fin(0),            NOTHING),
        (compose(),         batch((0,))),
        (done(),            NOTHING),                # 0 is a replay sample
        (bump(),            NOTHING),
        (new(1),            (1,)),
        (new(2),            (2,)),
        (fin(2, v=1),       NOTHING),                # min version 1
        (fin(1, v=0, hi=1), NOTHING),                # min version 0: older, although it finished later
        (compose(),         batch((1,), staleness=(1,), replay=(F,))),
        (compose(),         batch((2,), staleness=(0,), replay=(F,))),
        (compose(),         None),                   # σ = 0.5 of b = 1 is no replay slot
    ], group_size=1, batch_size=1, sigma=0.5, delta=2)


def test_sigma_zero_trains_each_sample_once_and_ends_it_as_trained():
    run([
        (new(0),            (0, 1)),
        (fin(0),            NOTHING),
        (fin(1),            NOTHING),
        (compose(),         batch((0, 1), replay=(F, F))),
        (done(),            ended((0, "trained"), (1, "trained"))),
        (accounting(),      has(ok=True, created=2, live=0, trained=2, replayed=0,
                                ended={"trained": 2, "filtered": 0, "evicted_stale": 0, "aborted": 0,
                                       "failed": 0, "lost": 0, "uninformative": 0})),
    ], group_size=2, batch_size=2, sigma=0.0)


def test_the_replay_filter_ends_what_it_declines():
    run([
        (new(0),            (0, 1, 2)),
        (fin(0, reward=0.0), NOTHING),
        (fin(1, reward=0.5), NOTHING),
        (fin(2, reward=1.0), NOTHING),
        (compose(),         batch((0, 1, 2))),
        (done(),            ended((0, "filtered"), (2, "filtered"))),
        (states(0, 1, 2),   ("ended", REPLAY, "ended")),
        (accounting(),      has(ok=True, trained=3, replayed=0)),
    ], group_size=3, batch_size=3, sigma=0.5, replay_filter=RewardBand(0.0, 1.0))


# ------------------------------------------------------------------------------------------------
# δ: staleness
# ------------------------------------------------------------------------------------------------

def test_delta_evicts_at_the_bump_and_on_arrival():
    run([
        (new(0),            (0, 1)),
        (fin(0),            NOTHING),
        (fin(1),            NOTHING),
        (compose(),         batch((0, 1), staleness=(0, 0))),
        (done(),            NOTHING),                # 0, 1: replay samples of version 0
        (new(1),            (2, 3)),
        (fin(2),            NOTHING),
        (fin(3),            NOTHING),                # 2, 3: unused ready samples of version 0
        (new(2),            (4, 5)),                 # still generating
        (bump(),            NOTHING),                # staleness 1 ≤ δ
        (bump(),            ended((0, EV, 1, T), (1, EV, 1, T), (2, EV, 1, T), (3, EV, 1, T))),
        (gauges(),          has(evicted_stale=4, evicted_unused=2, pending=2, ready=0, replay=0)),
        (fin(4, v=0, hi=2), ended((4, EV))),         # already staler than δ when it arrives
        (fin(5, v=1, hi=2), NOTHING),                # recent enough; completes the group alone
        (states(5,),        (READY,)),
        (gauges(),          has(evicted_unused=3, trained_samples=2)),
        (accounting(),      has(ok=True, created=6, live=1)),
    ], group_size=2, batch_size=2, sigma=0.5, delta=1)


def test_training_samples_outlive_bumps_and_are_checked_when_their_step_ends():
    run([
        (new(0),            (0, 1)),
        (fin(0),            NOTHING),
        (fin(1),            NOTHING),
        (compose(),         batch((0, 1))),
        (bump(),            NOTHING),
        (bump(),            NOTHING),                # in training: left alone during the step
        (done(),            ended((0, EV), (1, EV))),
        (gauges(),          has(evicted_unused=0, trained_samples=2)),   # trained once before going stale
    ], group_size=2, batch_size=2, sigma=0.5, delta=1)


def test_replay_then_eviction_is_how_trained_samples_end_when_sigma_is_positive():
    # The end of a run: every trained sample ended as evicted_stale, none as "trained"; the training
    # counters say what was trained and how often.
    run([
        (new(0),            (0,)),
        (fin(0),            NOTHING),
        (new(1),            (1,)),
        (fin(1),            NOTHING),
        (compose(),         batch((0, 1), replay=(F, F))),
        (done(),            NOTHING),
        (new(2),            (2,)),
        (fin(2),            NOTHING),
        (compose(),         batch((2, 1), replay=(F, T), times_used=(0, 1))),
        (done(),            NOTHING),                # 1 trained twice: one replay use
        (accounting(),      has(ok=True, trained=3, replayed=1)),
        (bump(),            NOTHING),
        (bump(),            ended((0, EV), (1, EV), (2, EV))),
        (gauges(),          has(trained=0, evicted_stale=3, evicted_unused=0, trained_samples=3,
                                replayed_uses=1)),
        (accounting(),      has(ok=True, live=0, trained=3, replayed=1)),
    ], group_size=1, batch_size=2, sigma=0.5, delta=1)


# ------------------------------------------------------------------------------------------------
# Groups
# ------------------------------------------------------------------------------------------------

def test_a_group_completes_with_a_failed_member_and_normalises_over_the_finished():
    a = 1 / (0.5 + 1e-6)                          # (r - mean) / (std + eps) for rewards 1, 0
    run([
        (new(0, worker=2),  (0, 1, 2)),
        (fin(0, reward=1.0), NOTHING),
        (fin(1, reward=0.0), NOTHING),
        (states(0, 1, 2),   ("finished", "finished", "pending")),
        (compose(),         None),
        (failed(2),         ended((2, "failed", 2, F))),   # no payload: the generating worker is named
        (states(0, 1),      (READY, READY)),
        (call("advantages", lambda idx: (idx.sample(0).advantage, idx.sample(1).advantage)),
                            approx(0.5 * a, -0.5 * a)),
        (compose(),         batch((0, 1))),
    ], group_size=3, batch_size=2, sigma=0.0)


def test_losing_a_worker_fails_its_generation_and_loses_its_payloads_after_the_step():
    run([
        (new(0, worker=[5, 6]), (0, 1)),
        (fin(1, owner=6),   NOTHING),
        (new(1, worker=6),  (2, 3)),
        (fin(2, owner=5),   NOTHING),
        (fin(3, owner=5),   NOTHING),
        (compose(),         batch((2, 3))),          # trains on rank 5's payloads
        (call("worker_lost(5)", lambda idx: idx.worker_lost(5)), ended((0, "failed", 5, F))),
        (states(1, 2, 3),   (READY, "training", "training")),
        (done(),            ended((2, "lost"), (3, "lost"))),
        (accounting(),      has(ok=True, trained=2, ended={"trained": 0, "filtered": 0, "evicted_stale": 0,
                                                          "aborted": 0, "failed": 1, "lost": 2,
                                                          "uninformative": 0})),
    ], group_size=2, batch_size=2, sigma=0.5)


# ------------------------------------------------------------------------------------------------
# b_max: the dispatch window
# ------------------------------------------------------------------------------------------------

def test_b_max_window_opens_per_step_and_reopens_when_starving():
    run([
        (budget(),          4),
        (new(0),            (0, 1)),
        (new(1),            (2, 3)),
        (budget(),          0),
        (call("can_dispatch_group()", lambda idx: idx.can_dispatch_group()), False),
        (fin(0),            NOTHING),
        (fin(1),            NOTHING),
        (fin(2),            NOTHING),
        (budget(),          0),                      # finishing does not refill within a step
        (fin(3),            NOTHING),
        (compose(),         batch((0, 1, 2, 3))),
        (budget(),          4),                      # the trainer starts a step: b_max - outstanding
        (new(2),            (4, 5)),
        (budget(),          2),
        (fin(4),            NOTHING),
        (failed(5),         ended((5, "failed"))),
        (budget(),          4),                      # 1 ready < 4, nothing outstanding: a fresh window
        (new(3),            (6, 7)),
        (budget(),          2),                      # spent from the fresh window
        (new(4),            (8, 9)),
        (budget(),          0),
        (gauges(),          has(**{"dispatch/budget": 0, "pending": 4})),
    ], group_size=2, batch_size=4, sigma=0.0, b_max=4)


# ------------------------------------------------------------------------------------------------
# Accounting
# ------------------------------------------------------------------------------------------------

def test_accounting_reports_a_corrupted_count():
    run([
        (new(0),            (0, 1)),
        (fin(0),            NOTHING),
        (fin(1),            NOTHING),
        (call("abort([0])", lambda idx: idx.abort([0])), ended((0, "aborted"))),
        (accounting(),      has(ok=True, why="", created=2, live=1)),
        (corrupt("an end goes uncounted", lambda idx: idx._accounts.ended.__setitem__("aborted", 0)),
                            None),
        (accounting(),      has(ok=False, why="created 2 != live 1 (1 records) + ended 0 "
                                              "{'trained': 0, 'filtered': 0, 'evicted_stale': 0, "
                                              "'aborted': 0, 'failed': 0, 'lost': 0, 'uninformative': 0}")),
        (check_accounting(), contains("accounting: created 2 != live 1")),
    ], group_size=2, batch_size=2)


def test_accounting_reports_a_record_lost_without_an_end():
    run([
        (new(0),            (0, 1)),
        (corrupt("a record vanishes", lambda idx: idx._samples.pop(1)), None),
        (accounting(),      has(ok=False, why=contains("live 2 (1 records)"))),
        (check_accounting(), contains("(1 records)")),
    ], group_size=2, batch_size=2)


def test_accounting_reports_impossible_training_counts():
    run([
        (new(0),            (0,)),
        (fin(0),            NOTHING),
        (compose(),         batch((0,))),
        (done(),            ended((0, "trained"))),
        (corrupt("the use goes uncounted", lambda idx: setattr(idx._accounts, "trained", 0)), None),
        (accounting(),      has(ok=False, why="trained 0 outside [1 that ended after training, created 1]")),
        (corrupt("more evicted unused than evicted", lambda idx: setattr(idx._accounts, "evicted_unused", 1)),
                            None),
        (check_accounting(), "accounting: evicted_unused 1 outside [0, evicted_stale 0]"),
    ], group_size=1, batch_size=1, sigma=0.0)


# ------------------------------------------------------------------------------------------------
# Checkpoints: restart and recover
# ------------------------------------------------------------------------------------------------

def test_restart_aborts_pending_returns_training_and_keeps_the_counters():
    run([
        (new(0),            (0, 1)),
        (fin(0),            NOTHING),
        (fin(1),            NOTHING),
        (compose(),         batch((0, 1))),
        (done(),            NOTHING),                # 0, 1: replay
        (new(1),            (2, 3)),
        (fin(2),            NOTHING),
        (fin(3),            NOTHING),
        (compose(),         batch((2, 3), replay=(F, F))),
        (new(2, worker=4),  (4, 5)),
        (new(3, worker=4),  (6, 7)),
        (restart(keep=(6,)), ended((4, "aborted", 4, F), (5, "aborted", 4, F), (7, "aborted", 4, F))),
        (states(0, 1, 2, 3, 6), (REPLAY, REPLAY, READY, READY, "pending")),   # 6: its partial was saved
        (budget(),          5),                      # b_max 6 beside the one kept
        (accounting(),      has(ok=True, created=8, live=5, trained=2, replayed=0)),
        (compose(),         batch((2, 3), replay=(F, F))),   # the interrupted step's batch again
        (done(),            NOTHING),
        (accounting(),      has(ok=True, trained=4, replayed=0)),
    ], group_size=2, batch_size=2, sigma=0.5, b_max=6)


def test_restart_without_resume_is_an_exact_copy_and_a_smaller_delta_evicts_at_load():
    run([
        (new(0),            (0,)),
        (fin(0),            NOTHING),
        (compose(),         batch((0,))),
        (done(),            NOTHING),
        (new(1),            (1,)),
        (fin(1),            NOTHING),
        (bump(),            NOTHING),
        (bump(),            NOTHING),                # staleness 2 ≤ δ = 3
        (restart(resume=False), NOTHING),
        (states(0, 1),      (REPLAY, READY)),
        (gauges(),          has(version=2, trained_samples=1, replay=1, ready=1)),
        (restart(delta=1),  ended((0, EV), (1, EV))),
        (accounting(),      has(ok=True, live=0, trained=1, evicted_unused=1)),
    ], group_size=1, batch_size=1, sigma=0.5, delta=3)


def test_recover_readmits_samples_found_in_shards():
    def found(sid, gid, reward, lo, hi):
        return RecoveredSample(sid, gid, 7, owner=1, reward=reward, min_version=lo, max_version=hi, loss_tokens=4)

    run([
        (new(0),            (0, 1)),
        (fin(0),            NOTHING),
        (fin(1),            NOTHING),
        (bump(),            NOTHING),
        (bump(),            ended((0, EV), (1, EV))),
        (restart(),         NOTHING),
        (recover(found(5, 3, 1.0, 2, 2), found(4, 3, 0.0, 1, 2),    # one group, within [v-δ, v]
                 found(6, 4, 0.0, 0, 2),                            # too stale
                 found(7, 4, 0.0, 2, 3)),                           # newer than v: lost updates
                            ended((6, EV), (7, EV))),
        (states(4, 5),      (READY, READY)),
        (call("advantage signs", lambda idx: (idx.sample(5).advantage > 0 > idx.sample(4).advantage)), True),
        (accounting(),      has(ok=True, created=6, live=2)),
        (new(0),            (8, 9)),                 # ids continue past the recovered ones
        (call("recover again", lambda idx: pytest.raises(ValueError, idx.recover, []).match("before any new_group")),
                            True),
    ], group_size=2, batch_size=2, sigma=0.5, delta=1)


def test_a_checkpoint_from_before_the_training_counters_loads_with_their_lower_bounds():
    r = run([
        (new(0),            (0,)),
        (fin(0),            NOTHING),
        (new(1),            (1,)),
        (fin(1),            NOTHING),
        (compose(),         batch((0, 1))),
        (done(),            NOTHING),
        (new(2),            (2,)),
        (fin(2),            NOTHING),
        (compose(),         batch((2, 1), replay=(F, T))),
        (done(),            NOTHING),
        (new(3),            (3,)),
        (fin(3),            NOTHING),
        (compose(),         batch((3, 2), replay=(F, T))),
        (done(),            NOTHING),
        (bump(),            NOTHING),
        (bump(),            ended((0, EV), (1, EV), (2, EV), (3, EV))),
        (new(4),            (4,)),
        (fin(4),            NOTHING),
        (new(5),            (5,)),
        (fin(5),            NOTHING),
        (compose(),         batch((4, 5))),
        (done(),            NOTHING),
        (accounting(),      has(ok=True, trained=6, replayed=2)),
    ], group_size=1, batch_size=2, sigma=0.5, delta=1)
    state = json.loads(json.dumps(r.idx.state_dict()))
    del state["trained"], state["replayed"]
    old = ReplayIndex.from_state_dict(state, resume=False)
    # 4 ended after training (evicted_stale, none unused) + 2 live trained ones; no live replay use
    assert old.accounting() == {**r.idx.accounting(), "trained": 6, "replayed": 0}
    old.check_invariants()
