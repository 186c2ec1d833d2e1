"""resources.cpu_quota: every rank held to a fixed CPU share by a cgroup, as a dedicated device would be."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from reflow_hpc.runtime import cpuquota

BUSY = "import time, os\nt = time.monotonic()\nwhile time.monotonic() - t < 1.5:\n    pass\nprint(sum(os.times()[:2]))\n"


def test_a_rank_held_to_a_quarter_core_uses_about_a_quarter_core():
    why = cpuquota.available()
    if why is not None:
        pytest.skip(f"no CPU quota on this machine: {why}")
    group = f"reflow-test-{os.getpid()}"
    cmd = [sys.executable, "-m", "reflow_hpc.runtime.cpuquota", "0.25", group, "--", sys.executable, "-c", BUSY]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=dict(os.environ, PMI_RANK="3"))
        assert r.returncode == 0, r.stderr
        cpu_s = float(r.stdout.split()[-1])                 # CPU time of a 1.5 s busy loop
        stat = (cpuquota.group_dir(group, 3) / "cpu.stat").read_text()
        throttled = int(dict(line.split() for line in stat.splitlines())["nr_throttled"])
    finally:
        cpuquota.remove(group, 4)
    assert cpu_s < 1.5 * 0.25 * 1.6, f"{cpu_s:.2f} s of CPU in 1.5 s under a quota of 0.25"
    assert throttled > 0
    assert not cpuquota.group_dir(group, 3).exists()         # removed after the rank exited


def test_without_access_the_rank_runs_without_the_quota(tmp_path):
    """A controller that cannot be written: the wrapper says so in one line and still runs the command."""
    r = subprocess.run([sys.executable, "-c",
                        "import sys; from reflow_hpc.runtime import cpuquota as q; from pathlib import Path; "
                        f"q.CONTROLLER = Path({str(tmp_path / 'none')!r}); "
                        "sys.exit(q.main(['0.5', 'g', '--', sys.executable, '-c', 'print(42)']))"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "42"
    assert "CPU quota not applied" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "no cgroup-v1 cpu controller" in cpuquota.available(tmp_path / "none")
