"""The launch path through a real Slurm cluster (2 emulated nodes on this host)."""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, run_cmd

pytestmark = pytest.mark.slurm
CFG = str(ROOT / "configs" / "cpu_tiny.toml")


def _wait_job(job_id: str, timeout: float = 240) -> str:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
        m = re.search(r"JobState=(\S+)", out)
        state = m.group(1) if m else ""
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return state
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} still {state} after {timeout} s")


def _job_report(job_id: str | None, log_dir: Path, slurm_conf: str) -> str:
    """Everything Slurm and the ranks left about a job, for a failure message: the job record, its
    completion record, each rank's log (tail) and the daemons' lines that name the job."""
    if not job_id:
        return "\n(no job id)"
    parts = [subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout]
    slurm_log = Path(slurm_conf).parent.parent / "log"
    # (globbing a directory that does not exist yields nothing)
    for f in sorted(p for p in log_dir.rglob("*") if p.is_file() and p.suffix != ".pkl"):
        parts.append(f"--- {f.relative_to(log_dir)}\n{f.read_text(errors='replace')[-6000:]}")
    for f in sorted(slurm_log.glob("*")):
        text = f.read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if re.search(rf"(?<![\d.:]){job_id}\b", ln)]   # not in timestamps
        parts.append(f"--- {f.name} (lines naming job {job_id})\n" + "\n".join(lines[-60:]))
    return "\n" + "\n".join(parts)


def _topology(run_dir):
    topo = json.loads((run_dir / "topology.json").read_text())
    assert topo["verified"] is True
    return topo


def test_sbatch_local_script_runs_check_on_two_nodes(slurm_conf, tmp_path):
    name = f"sb{uuid.uuid4().hex[:8]}"
    r = run_cmd(["sbatch", "--parsable", f"--output={tmp_path}/%j.out", "slurm/reflow_local.sbatch", CFG, "--check",
                 "--set", f"run.output_dir={tmp_path}", "--set", f"run.name={name}"], timeout=60)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    state = _wait_job(job_id)
    log = (tmp_path / f"{job_id}.out").read_text()
    assert state == "COMPLETED", log + _job_report(job_id, tmp_path, slurm_conf)
    topo = _topology(tmp_path / name)
    assert topo["world_size"] == 4 and topo["num_nodes"] == 2
    assert sorted(topo["nodes"]) == ["n1", "n2"]
    by_node = {}
    for rk in topo["ranks"]:
        by_node.setdefault(rk["node"], []).append(rk["local_rank"])
    assert all(sorted(v) == [0, 1] for v in by_node.values())
    assert topo["slurm"]["SLURM_JOB_ID"] == job_id


def fresh_clone(dest: Path) -> Path:
    """The repository's tracked files as they are now, in a directory of their own: what a user who
    just cloned it has (no models, no runs, no log directories)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
            (dest / name).chmod(src.stat().st_mode)
    return dest


def test_the_readme_slurm_lines_work_in_a_fresh_clone(slurm_conf, tmp_path):
    """The README's local-cluster command, literally, from a clone with no directories prepared: the
    job completes and leaves its log where sbatch was run."""
    readme = (ROOT / "README.md").read_text()
    line = "sbatch slurm/reflow_local.sbatch configs/cpu_tiny.toml --check"
    assert line in readme
    clone = fresh_clone(tmp_path / "clone")
    r = run_cmd(["sbatch", "--parsable", *line.split()[1:]], cwd=clone, timeout=60)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    state = _wait_job(job_id)
    logs = sorted(clone.glob(f"*-{job_id}.out"))
    assert state == "COMPLETED" and logs, _job_report(job_id, clone, slurm_conf)
    assert "self-check: 4 ranks on 2 node(s)" in logs[0].read_text()
    assert (clone / "runs" / "cpu_tiny" / "topology.json").is_file()


def test_submit_wait_through_submitit(slurm_conf, tmp_path):
    name = f"sub{uuid.uuid4().hex[:8]}"
    r = run_cmd(["python", "-m", "reflow_hpc.submit", "--nodes", "2", "--wait", CFG, "--set",
                 f"slurm.log_dir={tmp_path}/logs", "--",
                 "--check", "--set", f"run.output_dir={tmp_path}", "--set", f"run.name={name}"], timeout=300)
    job_id = m.group(1) if (m := re.search(r"submitted job (\d+)", r.stdout)) else None
    assert r.returncode == 0, r.stdout + r.stderr + _job_report(job_id, tmp_path / "logs", slurm_conf)
    assert "submitted job" in r.stdout and "self-check: 4 ranks on 2 node(s)" in r.stdout
    topo = _topology(tmp_path / name)
    assert topo["world_size"] == 4 and topo["num_nodes"] == 2


def test_submit_dry_run_prints_sbatch(slurm_conf):
    r = run_cmd(["python", "-m", "reflow_hpc.submit", "--nodes", "2", "--dry-run", "--time", "00:20:00", CFG],
                timeout=60)
    assert r.returncode == 0, r.stderr
    script = r.stdout
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --requeue", "#SBATCH --time=20",
                 "#SBATCH --signal=USR2@180"):
        assert line in script, script
    assert "--mpi=pmi2" in script and "--kill-on-bad-exit=1" in script


def test_submit_rejects_uneven_split():
    r = run_cmd(["python", "-m", "reflow_hpc.submit", "--nodes", "3", "--dry-run", CFG], timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("config error: resources.workers = 4: cannot split evenly over --nodes 3")


def test_srun_without_mpi_bootstrap_fails_fast(slurm_conf):
    t0 = time.monotonic()
    r = run_cmd(["srun", "--mpi=none", "-n", "2", "python", "-m", "reflow_hpc.run", CFG, "--check"], timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "MPI world size 1 differs from SLURM_NTASKS=2" in r.stderr
    assert "--mpi=pmi2" in r.stderr
    assert elapsed < 60
