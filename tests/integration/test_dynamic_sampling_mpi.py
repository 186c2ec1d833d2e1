"""Dynamic sampling on 4 real MPI ranks (algorithm.dynamic_sampling, core/fresh.py).

Groups of two samples on the arithmetic task with the warm-started policy: most groups are both right
(or both wrong), so most are dropped as uninformative. The run must train on informative groups only —
an all-equal group trains only when the step's generation passed the cap, and is counted then — every
batch full, with no more than ``max_gen_batches · b`` samples dropped between two batches, and
its accounting must close (every created sample ended once or is live, the new reason included). The
event log is the witness: ``dispatch`` names each group's samples, ``finish`` their rewards,
``compose`` each batch and ``end`` every sample's terminal reason. ``one_step_off`` is the batch-level
mode whose short batches are refilled on the newest weights (core/modes.py ``refills``); its trainer
ranks check every token's staleness against that rule.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from loop_common import run, terminal

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

B, CAP = 16, 3


@pytest.mark.parametrize("mode", ["reflow", "one_step_off"])
def test_only_informative_groups_are_trained_and_batches_stay_full(tmp_path, policy_dir, mode):
    sets = [f"reflow.mode={mode}", f"trainer.batch_size={B}", "algorithm.group_size=2", "trainer.steps=6",
            "algorithm.dynamic_sampling=on", f"algorithm.max_gen_batches={CAP}", "run.eval_prompts=0",
            "scheduler.elastic=false", "run.event_log=true", "trainer.micro_batch_size=8"]
    if mode != "reflow":
        sets += ["reflow.sigma=0", "reflow.delta=1"]
    run_dir, metrics, summary, _ = run(tmp_path, policy_dir, *sets)
    assert summary["steps"] == 6 and summary["accounting_ok"], summary.get("accounting")
    buffer = summary["buffer"]
    assert buffer["buffer/created"] == terminal(summary) + sum(
        buffer[f"buffer/{s}"] for s in ("ready", "replay", "training", "pending", "finished"))

    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    group_of, rewards, reason = {}, {}, {}
    members = defaultdict(list)
    for e in events:
        if e["e"] == "dispatch":
            for sid in e["ids"]:
                group_of[sid] = e["group"]
                members[e["group"]].append(sid)
        elif e["e"] == "finish":
            rewards[e["id"]] = e["reward"]
        elif e["e"] == "end":
            reason[e["id"]] = e["reason"]
    composes = [e for e in events if e["e"] == "compose"]
    assert len(composes) >= 6
    dropped_groups = {group_of[s] for s, r in reason.items() if r == "uninformative"}
    assert dropped_groups, "no group was dropped: the test needs all-equal groups"
    passed = set()                  # all-equal groups trained: only those let through over the cap
    for c in composes:
        assert len(c["ids"]) == B, f"batch of step {c['step']} is not full"
        for sid, rep in zip(c["ids"], c["replay"]):
            g = [rewards[m] for m in members[group_of[sid]] if m in rewards]
            if not rep and max(g) == min(g):
                passed.add(group_of[sid])
    assert len(passed) <= buffer["buffer/groups_over_cap"], (passed, buffer["buffer/groups_over_cap"])
    for sid, r in reason.items():
        if r == "uninformative":
            g = [rewards[m] for m in members[group_of[sid]] if m in rewards]
            assert max(g) == min(g)

    # the cap: samples dropped between two batches (the event log in order)
    dropped, worst = 0, 0
    for e in events:
        if e["e"] == "end" and e["reason"] == "uninformative":
            dropped += 1
        elif e["e"] == "compose":
            worst, dropped = max(worst, dropped), 0
    assert worst <= CAP * B
    assert buffer["buffer/uninformative"] == sum(r == "uninformative" for r in reason.values())
    assert buffer["buffer/groups_dropped"] == len(dropped_groups)
    assert buffer["buffer/groups_over_cap"] == sum(m["dynamic_sampling/over_cap"] for m in metrics)
    assert all(0.0 <= m["dynamic_sampling/dropped_fraction"] <= 1.0 for m in metrics)
    assert any(m["dynamic_sampling/dropped_fraction"] > 0 for m in metrics)
    assert all(m["reward/task_mean"] == m["reward/mean"] for m in metrics)     # no shaping: the same
