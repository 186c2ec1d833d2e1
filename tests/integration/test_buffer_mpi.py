"""The replay buffer across real MPI ranks (mpiexec -n 4, tests/helpers/buffer_roundtrip.py): producers of
different speeds, the index composing batches under σ and δ on rank 0, payloads fetched from the
owners' memory caches and HDF5 shards and checked bit for bit, every sample accounted for."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from conftest import alive, leftover_processes, run_mpi

MPIEXEC = shutil.which("mpiexec")
STEPS, BATCH_SIZE, SIGMA, DELTA = 40, 8, 0.5, 1

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")]


def run_roundtrip(directory: Path, *args: str, timeout: float = 150.0) -> tuple[int, str]:
    """mpiexec -n 4 buffer_roundtrip.py; its output, and the test fails on a timeout."""
    res = run_mpi("buffer_roundtrip.py", str(directory), "--steps", str(STEPS), *args, timeout=timeout)
    return res.returncode, res.stdout


def test_replay_buffer_roundtrip_over_four_ranks(tmp_path):
    shards = tmp_path / "shards"
    code, out = run_roundtrip(shards)
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert code == 0 and not fails, f"exit code {code}; failed checks:\n" + "\n".join(fails) + f"\n{out[-6000:]}"
    lines = [ln for ln in out.splitlines() if ln.startswith("SUMMARY ")]
    assert len(lines) == 1, f"expected one SUMMARY line:\n{out[-6000:]}"
    s = json.loads(lines[0][len("SUMMARY "):])
    why = json.dumps(s, indent=1, sort_keys=True)

    assert s["ok"] and s["failures"] == 0, why
    assert s["steps"] == STEPS and s["version"] == STEPS, why
    # σ: never more than σ·b replay samples, and replay did happen.
    assert s["max_replay_fraction"] <= SIGMA, why
    assert s["replay_batches"] >= 1 and s["replay_samples_trained"] >= 1, why
    # δ: no trained sample staler than δ; stale ones were evicted, on arrival and later.
    assert s["max_staleness"] <= DELTA and set(map(int, s["staleness"])) <= set(range(DELTA + 1)), why
    assert s["terminal"]["evicted_stale"] >= 1 and s["evicted_stale_on_arrival"] >= 1, why
    # Every created sample ended exactly once, with the reasons the index counts.
    assert s["created"] == s["ended"] == sum(s["terminal"].values()), why
    assert sum(s["ended_where"].values()) == s["created"], why
    # Every trained payload came over MPI and matched bit for bit: partial rollouts (two versions in
    # one sample) and empty responses included; from memory and from the HDF5 shards.
    assert s["verified"] == STEPS * BATCH_SIZE, why
    assert s["trained_multi_version"] >= 1 and s["trained_empty_response"] >= 1, why
    assert s["fetched_from_memory"] >= 1 and s["fetched_from_shard"] >= 1, why
    assert s["fetched_from_memory"] + s["fetched_from_shard"] == STEPS * BATCH_SIZE, why
    # After shutdown each shard directory holds exactly what its producer made, readable offline.
    assert s["shard_rows_verified"] == sum(s["produced"].values()) >= 1, why
    assert sorted(s["produced"]) == ["1", "2", "3"], why
    for rank in (1, 2, 3):
        d = shards / f"rank{rank:02d}"
        assert (d / "manifest.json").is_file() and list(d.glob("seg-*.h5")), f"{d}: {sorted(os.listdir(d))}"

    # No rank outlives the job.
    pids = {int(r): int(p) for r, p in re.findall(r"PID (\d+) (\d+)", out)}
    assert sorted(pids) == [0, 1, 2, 3], out[-3000:]
    deadline = time.monotonic() + 30
    while (left := [p for p in pids.values() if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"ranks left running after the job ended: {left}"
    assert not leftover_processes(str(shards)), leftover_processes(str(shards))


