"""The event log's sums (reflow_hpc.analyze.stats.EventStats) on hand-written logs: why each sample that
went stale was never trained."""

from __future__ import annotations

from reflow_hpc.analyze.stats import EVICTED_UNUSED_CAUSES, EventStats


def feed(events: list[dict]) -> EventStats:
    stats = EventStats()
    for line, e in enumerate(events):
        stats.feed(line, {"t": float(line), **e})
    return stats


def dispatch(group: int, ids: list[int]) -> dict:
    return {"e": "dispatch", "v": 0, "w": 1, "group": group, "prompt": group, "ids": ids}


def finish(sid: int, v: int) -> dict:
    return {"e": "finish", "v": v, "id": sid, "w": 1, "reward": 1.0, "span": [0, v], "tokens": 5, "reason": "stop"}


def end(sid: int, v: int, reason: str = "evicted_stale") -> dict:
    return {"e": "end", "v": v, "id": sid, "reason": reason, "w": 1}


def compose(v: int, ids: list[int]) -> dict:
    return {"e": "compose", "v": v, "step": v, "ids": ids, "replay": [0] * len(ids), "stale": [0] * len(ids)}


def test_each_sample_evicted_unused_gets_the_cause_the_log_shows():
    stats = feed([
        dispatch(0, [0, 1]), dispatch(1, [2, 3]), dispatch(2, [4, 5]), dispatch(3, [6, 7]),
        finish(0, 0), finish(1, 0),          # group 0 ready before the batch, which takes 1 and leaves 0
        finish(2, 0),                        # group 1 waits for 3 until 2 goes stale
        compose(0, [1]),
        finish(4, 0), finish(5, 0),          # group 2 completes after the last batch before the bump
        end(0, 1), end(1, 1), end(2, 1), end(4, 1), end(5, 1),
        end(7, 2, "aborted"),                # ended while generating: group 3 completes without it
        finish(6, 2), end(6, 2),             # stale when it finished
    ])
    assert stats.evicted_unused == 5        # 1 was trained once before it went stale
    assert stats.evicted_unused_by_cause == {"passed_over": 1, "group_incomplete": 1,
                                             "ready_after_last_batch": 2, "stale_on_arrival": 1}
    assert set(stats.evicted_unused_by_cause) <= set(EVICTED_UNUSED_CAUSES)


def test_a_log_without_groups_counts_its_evicted_unused_as_unknown():
    stats = feed([{"e": "dispatch", "v": 0, "w": 1, "ids": [0, 1]}, finish(0, 0), finish(1, 0), end(0, 1)])
    assert stats.evicted_unused == 1 and stats.evicted_unused_by_cause == {"unknown": 1}
