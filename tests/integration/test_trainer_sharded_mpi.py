"""FSDP2-sharded trainer replicas on real MPI ranks (gloo): the same update as one unsharded replica,
counterparts that stay identical and hand their shards over, weight sync and checkpoints of full
tensors gathered from the shards (tests/helpers/train_sharded.py)."""

from __future__ import annotations

import json

import pytest

from conftest import HELPERS, run_cmd

pytestmark = pytest.mark.mpi


def run(tmp_path, ranks: int, dtype: str) -> dict:
    r = run_cmd(["mpiexec", "-n", str(ranks), "python", str(HELPERS / "train_sharded.py"), "--dtype", dtype,
                 "--out", str(tmp_path), "--timeout", "60"], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


# float64 isolates the arithmetic of the split (sums of shards, norms over shards); in float32 Adam
# magnifies rounding on elements whose gradient is near its ε, as for unsharded replicas.
@pytest.mark.parametrize("dtype, param_tol, metric_tol", [("float64", 1e-12, 1e-12), ("float32", 1e-4, 1e-5)])
def test_one_replica_sharded_over_two_ranks_equals_one_unsharded_replica_and_checkpoints(tmp_path, dtype, param_tol,
                                                                                          metric_tol):
    res = run(tmp_path, 2, dtype)
    assert (res["shards"], res["replicas"]) == (2, 1)
    assert res["groups"] == [[0, 1]]                         # the shard group; nothing else holds two ranks
    assert res["moved"] > 1e-3                               # training did change the weights
    assert res["max_param_diff"] <= param_tol, res["max_param_diff"]
    assert res["worst_metric_rel_diff"] <= metric_tol, res["worst_metric_rel_diff"]
    assert [m["samples"] for m in res["metrics"]] == [12, 12, 12]      # the last step all on rank 0
    assert res["tied"] is True                               # lm_head is still embed_tokens under fully_shard
    # The checkpoint: rank 0 wrote a Hugging Face directory of the gathered weights, rank 1 only gathered.
    assert res["ranks"][1]["state_on_mate"] == [True, True]
    assert res["hf_equal"] is True and res["hf_tied"] is True and res["hf_architectures"] == ["Qwen3ForCausalLM"]
    for r in res["ranks"]:
        assert r["loaded_equal"] and r["resume_identical"] and r["resume_metrics_equal"], r
        assert r["resume_step"] == [4, 4]
    # The optimizer state is saved full, as an unsharded replica saves it: one resumes from it too.
    assert res["unsharded_resume_max_diff"] <= param_tol


def test_two_replicas_of_two_shards_equal_one_replica_hand_shards_over_and_sync_weights(tmp_path):
    res = run(tmp_path, 4, "float64")
    assert (res["shards"], res["replicas"]) == (2, 2)
    # Shard groups; the sync group of the split with one replica; the counterparts of the split with two.
    assert res["groups"] == [[0, 1], [2, 3], [0, 2, 3], [0, 2], [1, 3]]
    assert res["moved"] > 1e-3
    assert res["max_param_diff"] <= 1e-12, res["max_param_diff"]
    assert res["worst_metric_rel_diff"] <= 1e-12
    ranks = res["ranks"]
    assert all(r["check_replicas_ok"] for r in ranks)
    # A drift in shard 1 of replica 1: its counterpart names the tensor; the rest of both shard groups fail too.
    errors = [r["drift_error"] for r in ranks]
    assert all(e and e.startswith(f"rank {i}: trainer replicas diverged") for i, e in enumerate(errors)), errors
    assert "down_proj" in errors[1] and "down_proj" in errors[3] and "another shard" in errors[0]
    # send_state / recv_state between counterparts: replica 1 becomes a bit-identical copy, shard by shard.
    assert all(r["counterparts_identical"] for r in ranks)
    assert ranks[0]["sent_bytes"] == ranks[2]["received_bytes"] > 0
    # Weight sync from replica 0 (rank 1 gathering with rank 0): plain models get the full weights.
    assert res["sync_buckets"] > 1
    assert ranks[2]["synced_equal"] and ranks[3]["synced_equal"] and ranks[3]["synced_tied"]
