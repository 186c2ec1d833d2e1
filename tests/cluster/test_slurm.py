"""The launch path through a real Slurm cluster (2 emulated nodes on this host)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, run_cmd

pytestmark = pytest.mark.slurm
CFG = str(ROOT / "configs" / "cpu_tiny.toml")


def _queued() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    return set(out.split())


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs(slurm_conf):
    """A test that fails part-way leaves no job behind to hold the nodes for the tests after it."""
    before = _queued()
    yield
    left = sorted(_queued() - before)
    if left:
        subprocess.run(["scancel", *left], capture_output=True)


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
    if "MPICH" in topo["mpi"]["library"]:       # the [mpich] wheel, built with both UCX and OFI
        # under Slurm's pmi2 plugin it starts on OFI (comm.mpi.netmod_override), and says so once
        assert topo["mpi"]["netmod"] == "MPIR_CVAR_CH4_NETMOD=ofi", topo["mpi"]
        assert log.count("network module 'ofi' instead of UCX") == 1, log


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


def _job_field(job_id: str, key: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    m = re.search(rf"\b{key}=(\S+)", out)
    return m.group(1) if m else ""


def _wait_running(job_id: str, run_dir: Path, logs: Path, slurm_conf: str, steps: int = 3) -> None:
    """Wait until the job's run has taken ``steps`` steps; else fail with the job's report (logs in ``logs``)."""
    try:
        _wait_steps(run_dir, steps)
    except AssertionError:
        raise AssertionError(_job_report(job_id, logs, slurm_conf)) from None


def _wait_steps(run_dir: Path, steps: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = run_dir / "metrics.jsonl"
        if m.exists() and sum(1 for ln in m.read_text().splitlines() if '"kind"' not in ln) >= steps:
            return
        time.sleep(0.5)
    raise AssertionError(f"{run_dir} did not reach {steps} steps in {timeout} s")


def _finished_losing_nothing(run_dir: Path, steps: int) -> dict:
    """The run did all its steps and every sample it created ended exactly once, none lost."""
    summary = json.loads((run_dir / "summary.json").read_text())
    b = summary["buffer"]
    ended = sum(b[f"buffer/{k}"] for k in ("trained", "filtered", "evicted_stale", "aborted", "failed", "lost"))
    assert summary["steps"] == steps and b["buffer/created"] == ended and b["buffer/lost"] == 0, b
    return summary


def _steps_alive(job_id: str) -> bool:
    """Does a slurmstepd of the job (its batch script or a step) still run on the local nodes?"""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return any(line.startswith(f"slurmstepd: [{job_id}.") for line in out.splitlines())


def _wait_requeued_and_done(job_id: str, timeout: float = 420) -> str:
    """Wait until the job restarted at least once and then ended. A requeued job that Slurm holds back
    (BeginTime, for the old instance to end) is released 2 s after none of its old processes is left:
    sooner, the new instance is refused ("job credential revoked") or its ranks meet the old step's
    PMI server."""
    deadline = time.monotonic() + timeout
    state = ""
    gone_since = None
    while time.monotonic() < deadline:
        state, restarts = _job_field(job_id, "JobState"), _job_field(job_id, "Restarts")
        held = state == "PENDING" and _job_field(job_id, "Reason") == "BeginTime"
        if held and not _steps_alive(job_id):
            gone_since = gone_since or time.monotonic()
            # Slurm revokes the old instance's credential with 1 s resolution: a launch within the
            # same second as the kill is refused too.
            if time.monotonic() - gone_since >= 2.0:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") and restarts not in ("", "0"):
            return state
        if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return state
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} still {state} after {timeout} s")


def test_usr2_on_slurm_checkpoints_requeues_resumes_and_loses_nothing(slurm_conf, tmp_path, policy_dir):
    """Preemption end to end on the local cluster (2 emulated nodes): USR2 mid-run, the run checkpoints
    with its samples in flight, requeues itself, restarts, resumes them and finishes; one accounting
    identity over the whole job."""
    name = f"pre{uuid.uuid4().hex[:6]}"
    steps = 12
    # Generation slower than training (4 sequences per engine, a window of 256): the rollout workers still
    # hold samples when the stop comes, however fast this machine trains. With 32 sequences the window
    # of a step could finish before the step did, leaving nothing in flight to resume.
    r = run_cmd(["sbatch", "--parsable", f"--output={tmp_path}/%j.out", "--open-mode=append",
                 "slurm/reflow_local.sbatch", CFG, "--set", f"run.output_dir={tmp_path}", "--set", f"run.name={name}",
                 "--set", f"model.path={policy_dir}", "--set", "model.warmstart=false", "--set", f"trainer.steps={steps}",
                 "--set", "trainer.batch_size=16", "--set", "algorithm.group_size=4", "--set", "reflow.b_max=256",
                 "--set", "rollout.max_concurrency=4",
                 "--set", "run.eval_prompts=0", "--set", "trainer.micro_batch_size=8", "--set", "run.timeout_s=90",
                 "--set", "scheduler.elastic=false", "--set", f"storage.dir={tmp_path / 'scratch'}"], timeout=60)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    run_dir = tmp_path / name
    _wait_running(job_id, run_dir, tmp_path, slurm_conf)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    state = _wait_requeued_and_done(job_id)
    log = (tmp_path / f"{job_id}.out").read_text()
    assert state == "COMPLETED", log + _job_report(job_id, tmp_path, slurm_conf)
    assert "stop requested" in log and f"requeueing Slurm job {job_id}" in log and "resuming from" in log
    summary = _finished_losing_nothing(run_dir, steps)
    assert summary["resumed_partials"] > 0, log[-3000:]   # the samples in flight at the stop went on after the restart
    steps_logged = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
                    if '"kind"' not in x]
    assert steps_logged == list(range(1, steps + 1))


def test_kill_9_of_a_rank_under_slurm_is_named_in_one_line(slurm_conf, tmp_path, policy_dir):
    """srun ends the job when a rank is killed (--kill-on-bad-exit); the batch script's post-mortem names the
    rank and what the job was doing, well before run.timeout_s."""
    import os
    import signal

    name = f"k9{uuid.uuid4().hex[:6]}"
    r = run_cmd(["sbatch", "--parsable", f"--output={tmp_path}/%j.out", "slurm/reflow_local.sbatch", CFG,
                 "--set", f"run.output_dir={tmp_path}", "--set", f"run.name={name}", "--set", f"model.path={policy_dir}",
                 "--set", "model.warmstart=false", "--set", "trainer.steps=200", "--set", "trainer.batch_size=16",
                 "--set", "trainer.micro_batch_size=8", "--set", "algorithm.group_size=4", "--set", "run.eval_prompts=0",
                 "--set", "run.timeout_s=120",
                 "--set", "checkpoint.every_steps=2", "--set", f"storage.dir={tmp_path / 'scratch'}"], timeout=60)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    run_dir = tmp_path / name
    _wait_running(job_id, run_dir, tmp_path, slurm_conf)
    pid = json.loads((run_dir / "topology.json").read_text())["ranks"][2]["pid"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    state = _wait_job(job_id, timeout=120)
    assert time.monotonic() - t0 < 60
    log = (tmp_path / f"{job_id}.out").read_text()
    assert state == "FAILED", log + _job_report(job_id, tmp_path, slurm_conf)
    assert "reflow_hpc: rank 2 (node n2" in log and "during training (after step" in log, log[-3000:]


def test_usr2_through_submitit_requeues_and_resumes(slurm_conf, tmp_path, policy_dir):
    """The same preemption through ``python -m reflow_hpc.submit``: submitit's job, requeued by rank 0,
    restarts the pickled task, which resumes from the checkpoint and finishes."""
    name = f"subpre{uuid.uuid4().hex[:6]}"
    steps = 10
    sets = [f"run.output_dir={tmp_path}", f"run.name={name}", f"model.path={policy_dir}", "model.warmstart=false",
            f"trainer.steps={steps}", "trainer.batch_size=16", "algorithm.group_size=4", "reflow.b_max=128",
            "run.eval_prompts=0", "trainer.micro_batch_size=8", "run.timeout_s=90", "scheduler.elastic=false",
            f"storage.dir={tmp_path / 'scratch'}", f"slurm.log_dir={tmp_path}/logs"]
    args = ["python", "-m", "reflow_hpc.submit", "--nodes", "2", CFG]
    for s_ in sets:
        args += ["--set", s_]
    r = run_cmd(args, timeout=120)
    m = re.search(r"submitted job (\d+)", r.stdout)
    assert r.returncode == 0 and m, r.stdout + r.stderr
    job_id = m.group(1)
    run_dir = tmp_path / name
    _wait_running(job_id, run_dir, tmp_path / "logs", slurm_conf)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    state = _wait_requeued_and_done(job_id)
    assert state == "COMPLETED", _job_report(job_id, tmp_path / "logs", slurm_conf)
    _finished_losing_nothing(run_dir, steps)


def test_submit_wait_through_submitit(slurm_conf, tmp_path):
    name = f"sub{uuid.uuid4().hex[:8]}"
    try:
        r = run_cmd(["python", "-m", "reflow_hpc.submit", "--nodes", "2", "--wait", CFG, "--set",
                     f"slurm.log_dir={tmp_path}/logs", "--",
                     "--check", "--set", f"run.output_dir={tmp_path}", "--set", f"run.name={name}"], timeout=300)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        job_id = m.group(1) if (m := re.search(r"submitted job (\d+)", out)) else None
        nodes = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %T %E"], capture_output=True, text=True).stdout
        raise AssertionError(f"submit --wait still running after 300 s\n{out}\n--- nodes\n{nodes}"
                             + _job_report(job_id, tmp_path / "logs", slurm_conf)) from None
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


def test_usr2_past_max_requeues_checkpoints_and_ends_without_requeueing(slurm_conf, tmp_path, policy_dir):
    """slurm.max_requeues = 0: after USR2 the run checkpoints and ends; rank 0 says in one line why the job
    is not requeued, and the batch script does not requeue it."""
    name = f"cap{uuid.uuid4().hex[:6]}"
    sets = [f"run.output_dir={tmp_path}", f"run.name={name}", f"model.path={policy_dir}", "model.warmstart=false",
            "trainer.steps=200", "trainer.batch_size=16", "trainer.micro_batch_size=8", "algorithm.group_size=4",
            "run.eval_prompts=0", "run.timeout_s=90", "scheduler.elastic=false", "slurm.max_requeues=0",
            f"storage.dir={tmp_path / 'scratch'}"]
    r = run_cmd(["sbatch", "--parsable", f"--output={tmp_path}/%j.out", "slurm/reflow_local.sbatch", CFG,
                 *[x for s_ in sets for x in ("--set", s_)]], timeout=60)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    run_dir = tmp_path / name
    _wait_running(job_id, run_dir, tmp_path, slurm_conf)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    state = _wait_job(job_id)
    log = (tmp_path / f"{job_id}.out").read_text()
    assert state == "COMPLETED" and _job_field(job_id, "Restarts") == "0", log + _job_report(job_id, tmp_path,
                                                                                            slurm_conf)
    assert "stop requested" in log
    lines = [ln for ln in log.splitlines() if "requeueing" in ln]
    assert lines == [f"not requeueing Slurm job {job_id}: it has restarted 0 time(s), slurm.max_requeues = 0; "
                     f"resubmit it to resume from its newest checkpoint"], log
    assert (run_dir / "checkpoints").is_dir()
    assert not list(ROOT.glob(f".reflow-{job_id}.*"))          # the job's private state directory is gone


def test_submit_to_a_partition_slurm_does_not_have_is_one_line(slurm_conf, tmp_path):
    r = run_cmd(["python", "-m", "reflow_hpc.submit", "--nodes", "2", "--partition", "nosuch", CFG,
                 "--set", f"slurm.log_dir={tmp_path}/logs"], timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith("submit: sbatch refused the job: ") and r.stderr.count("\n") == 1, r.stderr
    assert "nosuch" in r.stderr or "partition" in r.stderr.lower()
    assert os.listdir(tmp_path / "logs") == []
