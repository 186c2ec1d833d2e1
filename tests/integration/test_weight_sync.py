"""Weight sync: the bucket plan, and a real bucketed broadcast over gloo from a trainer to two engines."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import HELPERS, run_cmd
from reflow_hpc.train.buckets import MB, TensorSpec, fingerprint, pack, plan_buckets, specs_of, unpack


def _specs():
    return [TensorSpec("emb", (100, 64), torch.float32), TensorSpec("a", (64,), torch.float32),
            TensorSpec("h", (8, 8), torch.bfloat16), TensorSpec("b", (64, 16), torch.float32),
            TensorSpec("c", (10,), torch.float32), TensorSpec("g", (4,), torch.bfloat16),
            TensorSpec("big", (300, 64), torch.float32)]


@pytest.mark.parametrize("bucket_bytes", [1, 300, 4096, 30_000, 1 << 30])
def test_bucket_plan_respects_the_bound_the_dtypes_and_covers_every_tensor_once(bucket_bytes):
    specs = _specs()
    buckets = plan_buckets(specs, bucket_bytes)
    names = [s.name for b in buckets for s in b.specs]
    assert sorted(names) == sorted(s.name for s in specs)
    for b in buckets:
        assert all(s.dtype == b.dtype for s in b.specs)
        assert b.nbytes <= bucket_bytes or len(b.specs) == 1        # only a single oversized tensor exceeds it
        assert b.numel == sum(s.numel for s in b.specs)
        assert list(b.offsets) == [sum(s.numel for s in b.specs[:i]) for i in range(len(b.specs))]
    for dtype in (torch.float32, torch.bfloat16):                   # order kept within a dtype
        assert [n for n in names if dict((s.name, s.dtype) for s in specs)[n] == dtype] == \
               [s.name for s in specs if s.dtype == dtype]
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert plan_buckets(specs, bucket_bytes) == buckets             # both sides compute the same plan
    if bucket_bytes == 1 << 30:
        assert len(buckets) == 2                                     # one per dtype


def test_pack_unpack_round_trip_and_fingerprint():
    gen = torch.Generator().manual_seed(0)
    tensors = {s.name: torch.randn(s.shape, generator=gen).to(s.dtype) for s in _specs()}
    specs = specs_of(tensors.items())
    for bucket in plan_buckets(specs, 5000):
        flat = pack(bucket, [tensors[s.name] for s in bucket.specs], "cpu")
        for s, view in zip(bucket.specs, unpack(bucket, flat)):
            assert torch.equal(view, tensors[s.name])
    single = plan_buckets([specs[0]], 10)[0]
    assert pack(single, [tensors["emb"]], "cpu").data_ptr() == tensors["emb"].data_ptr()   # no copy
    assert fingerprint(specs) == fingerprint(list(specs))
    assert fingerprint(specs) != fingerprint(specs[:-1])
    assert fingerprint(specs) != fingerprint([TensorSpec("emb", (64, 100), torch.float32), *specs[1:]])
    assert fingerprint(specs) != fingerprint([TensorSpec("emb", (100, 64), torch.bfloat16), *specs[1:]])
    assert MB == 1 << 20


@pytest.mark.mpi
def test_bucketed_sync_to_two_engines_then_a_mismatch_and_an_absent_receiver():
    timeout = 5.0
    r = run_cmd(["mpiexec", "-n", "3", "python", str(HELPERS / "train_weight_sync.py"),
                 "--bucket-mb", "0.02", "--timeout", str(timeout)], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = {d["rank"]: d for d in json.loads(line.removeprefix("RESULT "))}
    assert sorted(ranks) == [0, 1, 2], r.stdout[-3000:] + r.stderr[-3000:]

    # 1. Bit-identical after each sync; the second sync carried the trained weights.
    first, second = ranks[0]["digests"]
    assert len(set(first)) == 1 and len(set(second)) == 1 and first[0] != second[0]
    for rank in (1, 2):
        d = ranks[rank]
        assert d["engine_version_1"] == 1 and d["engine_version_2"] == 2
        # Receivers hold one bucket (or one oversized tensor) at a time, never a second full model.
        assert d["largest_received_storage"] <= max(0.02 * MB, d["largest_tensor"]) < d["model_bytes"]
    for d in ranks.values():
        for v in (1, 2):
            st = d[f"stats_{v}"]
            assert st["bytes"] == d["model_bytes"] and st["buckets"] >= 5 and st["seconds"] > 0

    # 2. A receiver with another architecture: every rank fails at once, naming rank 2.
    for rank, d in ranks.items():
        err = d["mismatch_error"]
        assert err and err.startswith(f"rank {rank}: weight sync: the model of rank(s) 2 differs"), err
    assert "this rank holds" in ranks[2]["mismatch_error"]

    # 3. A receiver that never joins: the others fail within the timeout naming rank, sync and bucket.
    for rank in (0, 1):
        err, seconds = ranks[rank]["absent_error"], ranks[rank]["absent_seconds"]
        assert err and err.startswith(f"rank {rank}: weight sync 3: bucket "), err
        assert "broadcast from rank 0" in err
        assert seconds < timeout + 10, seconds
    assert ranks[2]["absent_error"] is None
