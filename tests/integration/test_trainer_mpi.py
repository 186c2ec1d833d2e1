"""Trainer replicas on real MPI ranks (gloo): half a batch each equals the full batch on one process."""

from __future__ import annotations

import json

import pytest

from conftest import HELPERS, run_cmd

pytestmark = pytest.mark.mpi


def test_two_replicas_equal_one_process_on_the_full_batch():
    # float64: the check is about the arithmetic of the split (normalisation by the batch-wide token
    # count, summed gradients, empty shares), not float32 rounding, which Adam magnifies on elements
    # whose gradient is near its ε (about 1e-5 after three steps at lr 1e-3).
    r = run_cmd(["mpiexec", "-n", "2", "python", str(HELPERS / "train_replicas.py"), "--dtype", "float64",
                 "--timeout", "60", "--absent-timeout", "4"], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    res = json.loads(line.removeprefix("RESULT "))
    assert res["moved"] > 1e-3                       # training did change the weights
    assert res["max_param_diff"] <= 1e-6, res["max_param_diff"]
    assert res["worst_metric_rel_diff"] <= 1e-9
    assert res["digests_equal"] is True              # the replicas are bit-identical
    errors = res["drift_errors"]
    assert len(errors) == 2 and all(e and "replicas diverged" in e and "down_proj" in e for e in errors)
    assert errors[0].startswith("rank 0:") and errors[1].startswith("rank 1:")
    assert [m["samples"] for m in res["metrics"]] == [12, 12, 12]
    # Rank 1 skips a step: rank 0 fails within the timeout, naming itself, the operation and the step.
    err = res["absent_error"]
    assert err and err.startswith("rank 0: trainer all-reduce of gradients, bucket 1/") and "(step 4)" in err, err
    assert "not complete after 4 s" in err and res["absent_seconds"] < 4 + 10
