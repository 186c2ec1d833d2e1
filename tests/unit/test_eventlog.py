"""The event log's lines are the JSON of the coordinator's events, fast path or not."""

from __future__ import annotations

import json

from hypothesis import given, strategies as st

from reflow_hpc.runtime.eventlog import encode

IDS = st.lists(st.integers(0, 10**9), max_size=20)
TIME = st.floats(0, 2e9, allow_nan=False)


@given(t=TIME, v=st.integers(0, 10**6), sid=st.integers(0, 10**9), w=st.integers(-1, 4096),
       reward=st.floats(allow_nan=True, allow_infinity=True), lo=st.integers(0, 99), tokens=st.integers(0, 10**6),
       reason=st.sampled_from(["stop", "length", "turns", 'we"ird\\']),
       loc=st.one_of(st.none(), st.lists(st.integers(0, 10**6), min_size=2, max_size=2)))
def test_finish_lines_are_the_json_of_the_event(t, v, sid, w, reward, lo, tokens, reason, loc):
    e = {"t": t, "e": "finish", "v": v, "id": sid, "w": w, "reward": reward, "span": [lo, lo + 1],
         "tokens": tokens, "reason": reason, "loc": loc}
    line = encode(e)
    if reward == reward and abs(reward) != float("inf"):
        assert json.loads(line) == e


@given(t=TIME, v=st.integers(0, 10**6), sid=st.integers(0, 10**9), w=st.integers(-1, 4096),
       reason=st.sampled_from(["trained", "filtered", "evicted_stale", "aborted", "failed", "lost"]), ids=IDS)
def test_end_and_dispatch_lines_are_the_json_of_the_event(t, v, sid, w, reason, ids):
    end = {"t": t, "e": "end", "v": v, "id": sid, "reason": reason, "w": w}
    dispatch = {"t": t, "e": "dispatch", "v": v, "w": w, "group": sid, "prompt": v, "ids": ids}
    assert json.loads(encode(end)) == end and json.loads(encode(dispatch)) == dispatch


def test_other_events_go_through_json():
    e = {"t": 1.5, "e": "compose", "v": 3, "step": 2, "ids": [1, 2], "replay": [0, 1], "weights": [1.2, 0.6],
         "stale": [0, 1]}
    assert json.loads(encode(e)) == e
