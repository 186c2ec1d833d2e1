"""The elastic pool on 4 real MPI ranks: role switches both ways mid-run (forced by a schedule),
replicas that stay bit-identical, samples handed over without loss, and a resume after a switch."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from loop_common import check_logprobs_by_version, run, shard_samples, terminal

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

SCHEDULE = '["2:3","5:1","8:2"]'        # 2+2 -> 3 trainers -> 1 trainer -> 2 trainers again


def test_switches_both_ways_keep_replicas_identical_and_lose_nothing(tmp_path, policy_dir):
    steps = 10
    run_dir, metrics, summary, r = run(
        tmp_path, policy_dir, "reflow.mode=reflow", f"trainer.steps={steps}", "trainer.batch_size=16",
        "algorithm.group_size=4", "rollout.max_concurrency=16", "reflow.sync_every=1", "reflow.delta=2",
        # B_max well above what two steps consume, so that generation never pauses on a full buffer
        # and a worker leaving rollout always has samples in flight to hand over.
        "reflow.b_max=256", "rollout.max_new_tokens=96", "scheduler.elastic=false",
        f"scheduler.placement_schedule={SCHEDULE}",
        # Replicas compare parameters and optimizer state after every step: a joined replica that is not
        # an exact copy ends the run.
        "trainer.check_replicas_every=1",
        "checkpoint.every_steps=1", "checkpoint.keep_last=0", "run.eval_prompts=0")
    pools = [(m["pool/trainers"], m["pool/rollouts"]) for m in metrics]
    assert pools == [(2, 2)] * 2 + [(3, 1)] * 3 + [(1, 3)] * 3 + [(2, 2)] * 2
    assert [m["role/2"] for m in metrics] == ["rollout"] * 2 + ["trainer"] * 3 + ["rollout"] * 5
    assert summary["placements"] == [[2, 3], [5, 1], [8, 2]]
    switched = [m for m in metrics if "role_switch_seconds/to_trainer" in m or "role_switch_seconds/to_rollout" in m]
    assert [m["step"] for m in switched] == [3, 6, 9]
    assert all(m.get("role_switch_seconds/to_trainer", 0) >= 0 for m in switched)
    assert "role_switch_seconds/to_rollout" in switched[1]
    topo = json.loads((run_dir / "topology.json").read_text())
    assert topo["role_timeline"] == [{"step": 2, "trainer_replicas": 3}, {"step": 5, "trainer_replicas": 1},
                                     {"step": 8, "trainer_replicas": 2}]
    assert [r_["role"] for r_ in topo["ranks"]] == ["trainer", "trainer", "rollout", "rollout"]
    # Nothing lost, nothing twice.
    assert summary["buffer"]["buffer/created"] == terminal(summary)
    assert summary["buffer"]["buffer/lost"] == summary["buffer"]["buffer/failed"] == 0
    samples = shard_samples(run_dir)
    counts = Counter(t.sample_id for t in samples)
    assert not [sid for sid, n in counts.items() if n > 1], "a sample was finished twice"
    # Samples that the worker leaving rollout handed over finished elsewhere, with their partial tokens:
    # each token of each version is what that version's weights produce.
    assert summary["handed_over"] > 0
    handed = [t for t in samples if "handed_from" in t.meta]
    assert handed and all(t.owner != t.meta["handed_from"] for t in handed)
    assert check_logprobs_by_version(run_dir, policy_dir, handed[:4]) >= 2
    lo = [m["trainer/token_staleness_min"] for m in metrics]
    hi = [m["trainer/token_staleness_max"] for m in metrics]
    assert min(lo) >= 0 and max(hi) <= 2


def test_a_run_resumes_after_a_switch_with_the_pools_it_had(tmp_path, policy_dir):
    sets = ["reflow.mode=reflow", "trainer.batch_size=16", "algorithm.group_size=4", "reflow.sync_every=1",
            "scheduler.elastic=false", 'scheduler.placement_schedule=["2:3"]', "trainer.check_replicas_every=1",
            "run.eval_prompts=0", "storage.flush_rows=1"]
    run_dir, m1, s1, _ = run(tmp_path, policy_dir, *sets, "trainer.steps=4", name="resume-switch")
    assert (m1[-1]["pool/trainers"], s1["placements"]) == (3, [[2, 3]])
    _, m2, s2, r2 = run(tmp_path, policy_dir, *sets, "trainer.steps=7", name="resume-switch")
    assert "resuming from" in r2.stdout
    assert [m["step"] for m in m2] == list(range(1, 8))
    assert all(m["pool/trainers"] == 3 for m in m2[4:])          # the resumed run kept the split
    assert s2["buffer"]["buffer/created"] == terminal(s2) and s2["buffer"]["buffer/lost"] == 0
