"""The event log's file stops accepting writes in the middle of a run on 4 real MPI ranks: the job ends at
once with one line naming the file and the cause (not a worker's timeout blaming a silent coordinator),
leaves no process behind, and the same command resumes from the newest checkpoint with nothing lost.

How the writes fail, for real and as root: after a checkpoint, the test lowers the file-size limit
(RLIMIT_FSIZE, prlimit(2)) of rank 0's process, which runs the coordinator and its event-log writer, to
ten bytes past the size events.jsonl has then. The kernel cuts the next write short at the limit (an
unfinished line, as a disk that fills leaves) and refuses the rest with EFBIG, "File too large" — root
is not exempt from the limit, and CPython ignores SIGXFSZ, so the write returns the error rather than
killing the process. Nothing is swapped under the writer (its open
file stays the same regular file, whatever flags it was opened with), and the other files rank 0
appends to while the job ends are smaller than the event log (metrics.jsonl) or written only at the next
checkpoint, several steps later.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
import uuid

import pytest

from conftest import ROOT, leftover_processes
from loop_common import run, run_argv, terminal

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_event_log_write_failure_ends_the_job_with_one_line_and_a_rerun_loses_nothing(tmp_path, policy_dir):
    name = f"evlog{uuid.uuid4().hex[:6]}"
    timeout_s = 90
    sets = ["reflow.mode=reflow", "trainer.batch_size=32", "algorithm.group_size=4", "storage.flush_rows=1",
            "trainer.steps=12", "checkpoint.every_steps=3", "scheduler.elastic=false", "run.eval_prompts=0"]
    args = run_argv(tmp_path, policy_dir, name, *sets, timeout_s=timeout_s)
    run_dir = tmp_path / name
    log = run_dir / "events.jsonl"
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:           # the first checkpoint is written
            if (run_dir / "checkpoints" / "step_000003" / "meta.json").is_file():
                break
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        else:
            pytest.fail("no checkpoint after 400 s")
        rank0 = json.loads((run_dir / "topology.json").read_text())["ranks"][0]["pid"]
        # The size limit is the process's, so the event log must be the first file to reach it: wait until
        # the metrics file is at least two of its records below the log (32 samples a step write about
        # twice the metrics' bytes to the log; with 16 the two grew alike and a step record could hit first).
        metrics_file = run_dir / "metrics.jsonl"
        while True:
            record = max((len(ln) + 1 for ln in metrics_file.read_text().splitlines()), default=0)
            if log.stat().st_size - metrics_file.stat().st_size > 2 * record:
                break
            assert time.monotonic() < deadline, "the event log never outgrew the metrics file"
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        # A few bytes past the log's end: the next write is cut short mid-line, as on a disk that fills.
        limit = log.stat().st_size + 10
        resource.prlimit(rank0, resource.RLIMIT_FSIZE, (limit, limit))
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=3 * timeout_s)
    except BaseException:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    took = time.monotonic() - t0
    assert took < timeout_s / 2, f"the job took {took:.0f} s to end: it waited for a timeout\n{err[-3000:]}"
    assert proc.returncode not in (0, 2)
    lines = [ln for ln in err.splitlines() if ln.startswith("reflow_hpc: rank")]
    assert lines and lines[0].startswith("reflow_hpc: rank 0 (") and f"event log {log}" in lines[0] \
        and "File too large" in lines[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "no answer from rank 0" not in err, err[-3000:]
    assert leftover_processes(name) == []

    # Shards and checkpoint are intact: the same command resumes and every sample ends exactly once.
    _, metrics, s2, r2 = run(tmp_path, policy_dir, *sets, name=name)
    assert "resuming from" in r2.stdout
    assert s2["steps"] == 12 and [m["step"] for m in metrics][-1] == 12
    assert s2["accounting_ok"] and s2["buffer"]["buffer/created"] == terminal(s2)
    assert s2["buffer"]["buffer/lost"] == 0
    # The line the failed write left unfinished is gone: every line of the log is one event.
    assert all(json.loads(x)["e"] for x in log.read_text().splitlines())
