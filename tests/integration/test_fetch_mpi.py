"""Fetch over real MPI ranks (mpiexec -n 4): bit-for-bit round trips and timeouts naming the rank."""

from __future__ import annotations

import re
import shutil
import time

import pytest
from conftest import alive, run_mpi

MPIEXEC = shutil.which("mpiexec")

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")]


def test_every_rank_fetches_every_other_rank_bit_for_bit(tmp_path):
    res = run_mpi("fetch_roundtrip.py", str(tmp_path), "--samples", "60")
    assert res.returncode == 0, res.stdout
    ok = re.findall(r"OK rank (\d): (\d+) samples verified", res.stdout)
    assert sorted(r for r, _ in ok) == ["0", "1", "2", "3"], res.stdout
    # 4 × 60 from the all-ranks fetch + 10 rounds × 3 owners × 7 from the concurrent thread
    assert all(int(n) == 4 * 60 + 10 * 3 * 7 for _, n in ok), res.stdout
    assert "FAIL" not in res.stdout


def test_unresponsive_owner_fails_in_time_naming_the_rank(tmp_path):
    res = run_mpi("fetch_unresponsive.py", str(tmp_path), "--timeout", "3.0")
    out = res.stdout
    assert "FAIL" not in out, out
    m1 = re.search(r"TIMEOUT1 after ([\d.]+) s ranks=\[2, 3\] partial=5 partial_ok=True: "
                   r"fetch from ranks 2, 3 timed out after 3\.0 s \(5, 5 samples\)", out)
    m2 = re.search(r"TIMEOUT2 after ([\d.]+) s ranks=\[2\]: fetch from rank 2 timed out after 3\.0 s \(5 samples\)",
                   out)
    assert m1 and m2, out
    # It waited for the timeout, not for the hung rank (which would take minutes).
    assert all(3.0 <= float(m.group(1)) < 60 for m in (m1, m2)), out
    assert res.returncode != 0          # the job ended through MPI_Abort
    # Ranks' lines may interleave in the merged output, so no line anchors here.
    pids = {int(r): int(p) for r, p in re.findall(r"PID (\d) (\d+)", out)}
    assert sorted(pids) == [0, 1, 2, 3], out
    pids = list(pids.values())
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "ranks left running after the job ended"


