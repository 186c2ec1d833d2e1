"""The loop end to end with FSDP2-sharded trainer replicas (resources.trainer_shard_size = 2) on real MPI
ranks: each mode finishes its steps with the usual invariants, and every token a rollout worker generated
is what the checkpoint of its version — gathered from the shards, like the weights that were synced —
produces."""

from __future__ import annotations

import json

import pytest

from loop_common import check_logprobs_by_version, run, shard_samples, terminal

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

SHARDED = ["resources.trainer_replicas=1", "resources.trainer_shard_size=2", "trainer.batch_size=16",
           "algorithm.group_size=4", "rollout.max_concurrency=16", "reflow.sync_every=1",
           "checkpoint.every_steps=1", "checkpoint.keep_last=0", "trainer.check_replicas_every=1"]


def check_run(run_dir, metrics, summary, policy_dir, steps, roles):
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert [m["version"] for m in metrics] == list(range(steps))
    for m in metrics:
        # Sums over all trainer ranks; a batch whose groups all scored alike has a zero gradient.
        assert m["trainer/samples"] == 16 and m["trainer/loss_tokens"] > 0 and m["trainer/grad_norm"] >= 0
        assert m["trainer/nonfinite_grad"] == 0
    assert summary["accounting_ok"] and summary["buffer"]["buffer/created"] == terminal(summary)
    assert summary["buffer"]["buffer/lost"] == summary["buffer"]["buffer/failed"] == 0
    topo = json.loads((run_dir / "topology.json").read_text())
    assert [r["role"] for r in topo["ranks"]] == roles
    # Checkpoints are Hugging Face directories written by the first rank of the replica.
    assert (run_dir / "checkpoints" / f"step_{steps:06d}" / "model" / "config.json").is_file()
    samples = shard_samples(run_dir)
    by_version = {}
    for t in samples:
        by_version.setdefault(int(t.versions[t.versions >= 0].max()), t)
    assert len(by_version) >= 2
    assert check_logprobs_by_version(run_dir, policy_dir, list(by_version.values())[:4]) >= 2
    return samples


@pytest.mark.parametrize("mode", ["one_step_off", "reflow"])
def test_split_modes_with_one_replica_sharded_over_two_ranks(tmp_path, policy_dir, mode):
    steps = 3 if mode == "one_step_off" else 2           # reflow: then a resumed process set takes one more step
    extra = ["reflow.sigma=0", "reflow.delta=1"] if mode == "one_step_off" else \
        ["reflow.sigma=0.5", "reflow.delta=2", "scheduler.elastic=false"]
    sets = [f"reflow.mode={mode}", *SHARDED, *extra]
    evals = ["run.eval_every_steps=2"] if mode == "one_step_off" else ["run.eval_prompts=0"]
    run_dir, metrics, summary, r = run(tmp_path, policy_dir, *sets, f"trainer.steps={steps}", *evals,
                                       name=f"sharded-{mode}")
    check_run(run_dir, metrics, summary, policy_dir, steps, ["trainer", "trainer", "rollout", "rollout"])
    if mode == "one_step_off":
        assert [m["trainer/token_staleness_max"] for m in metrics] == [0] + [1] * (steps - 1)
        # Evaluation snapshots are gathered too (every 2 steps and the last), and scored after the run.
        snaps = sorted(p.parent.name for p in (run_dir / "eval").glob("step_*/snapshot.json"))
        assert snaps == ["step_000002", "step_000003"], snaps
        assert "eval    2 v2   after" in r.stdout and 0.0 <= summary["eval/task/final_reward"] <= 1.0
    else:
        # A new process set resumes: every rank takes its rows of the full weights and optimizer state.
        _, m2, s2, r2 = run(tmp_path, policy_dir, *sets, f"trainer.steps={steps + 1}", "run.eval_prompts=0",
                            name=f"sharded-{mode}")
        assert "resuming from" in r2.stdout and [m["step"] for m in m2] == list(range(1, steps + 2))
        assert s2["buffer"]["buffer/created"] == terminal(s2) and s2["buffer"]["buffer/lost"] == 0


def test_sync_mode_colocates_two_replicas_of_two_shards(tmp_path, policy_dir):
    steps = 3
    run_dir, metrics, summary, _ = run(tmp_path, policy_dir, "reflow.mode=sync", f"trainer.steps={steps}", *SHARDED,
                                       "reflow.sigma=0", "reflow.delta=1", "run.eval_prompts=0")
    check_run(run_dir, metrics, summary, policy_dir, steps, ["trainer+rollout"] * 4)
    assert all(m["trainer/token_staleness_max"] == 0 for m in metrics)


def test_elastic_pool_moves_whole_sharded_replicas(tmp_path, policy_dir):
    """Six ranks: one replica of two shards, then two (ranks 2 and 3 leave rollout and each receives the
    shard of its counterpart), then one again; replicas compare their shards after every step."""
    steps = 6
    run_dir, metrics, summary, _ = run(
        tmp_path, policy_dir, "reflow.mode=reflow", f"trainer.steps={steps}", *SHARDED, "resources.workers=6",
        "resources.rollout_instances=4", "reflow.delta=2", "reflow.b_max=64", "rollout.max_new_tokens=96",
        "scheduler.elastic=false", 'scheduler.placement_schedule=["2:2","4:1"]', "run.eval_prompts=0")
    samples = check_run(run_dir, metrics, summary, policy_dir, steps, ["trainer"] * 2 + ["rollout"] * 4)
    assert [(m["pool/trainers"], m["pool/rollouts"]) for m in metrics] == [(2, 4)] * 2 + [(4, 2)] * 2 + [(2, 4)] * 2
    assert summary["placements"] == [[2, 2], [4, 1]]                   # trainer replicas, not ranks
    assert "role_switch_seconds/to_trainer" in metrics[2] and "role_switch_seconds/to_rollout" in metrics[4]
    handed = [t for t in samples if "handed_from" in t.meta]
    if handed:
        assert check_logprobs_by_version(run_dir, policy_dir, handed[:2]) >= 1
