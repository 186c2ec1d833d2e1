"""The batch scripts' requeue and log handling, run by bash with stand-ins for srun and scontrol (no Slurm).

The submit directory is often shared with other users: a file planted there must not requeue the job,
a symlink planted there must not redirect srun's log, and only a request that rank 0 of this very job
wrote (this job's id and the script's nonce) requeues it, at most slurm.max_requeues times."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

SCRIPTS = ["slurm/reflow_local.sbatch", "slurm/reflow_128gpu.sbatch"]
JOB = "4242"

# What srun's ranks do, by FAKE_SRUN: rank 0 asks for a requeue through the real reflow_hpc.run code, or
# a request is forged in one way or another.
FAKE_SRUN = r"""#!/bin/bash
echo "srun: fake step" >&2
case "${FAKE_SRUN:-}" in
  run) "$FAKE_PYTHON" -c 'import sys; from reflow_hpc.config import load; from reflow_hpc.run import requeue
requeue(load(None, sys.argv[2:], check_files=False), sys.argv[1])' \
         "$SLURM_JOB_ID" "slurm.max_requeues=$FAKE_MAX_REQUEUES" ;;
  plant) for n in ".reflow-requeue-$SLURM_JOB_ID" ".reflow-$SLURM_JOB_ID" requeue; do
           printf '%s\n' "$SLURM_JOB_ID" > "$PWD/$n"; done ;;
  job-id) printf '%s\n' "$SLURM_JOB_ID" > "$REFLOW_REQUEUE_FILE" ;;
  other-job) printf '%s\n' "1:${REFLOW_REQUEUE_TOKEN#*:}" > "$REFLOW_REQUEUE_FILE" ;;
  chown) printf '%s\n' "$REFLOW_REQUEUE_TOKEN" > "$REFLOW_REQUEUE_FILE"; chown 65534 "$REFLOW_REQUEUE_FILE" ;;
  symlink) printf '%s\n' "$REFLOW_REQUEUE_TOKEN" > "$FAKE_ELSEWHERE"; ln -s "$FAKE_ELSEWHERE" "$REFLOW_REQUEUE_FILE" ;;
esac
exit "${FAKE_SRUN_RC:-0}"
"""
FAKE_SCONTROL = '#!/bin/bash\necho "$*" >> "$FAKE_SCONTROL_LOG"\n'


def run_script(script: str, tmp_path: Path, mode: str = "", restarts: int | None = None, max_requeues: int = 3,
               rc: int = 0) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``script`` as Slurm's batch step would, from the submit directory tmp_path/submit."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    submit = tmp_path / "submit"
    submit.mkdir(exist_ok=True)
    log = tmp_path / "scontrol.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "REFLOW_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID=JOB, FAKE_SRUN=mode, FAKE_SRUN_RC=str(rc),
               FAKE_SCONTROL_LOG=str(log), FAKE_PYTHON=sys.executable, FAKE_MAX_REQUEUES=str(max_requeues),
               FAKE_ELSEWHERE=str(tmp_path / "elsewhere"), PYTHONPATH=str(ROOT))
    if restarts is not None:
        env["SLURM_RESTART_COUNT"] = str(restarts)
    r = subprocess.run(["bash", str(ROOT / script), str(ROOT / "configs" / "cpu_tiny.toml")], cwd=submit, env=env,
                       capture_output=True, text=True, timeout=120)
    calls = log.read_text().splitlines() if log.exists() else []
    return r, calls


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_request_of_this_job_requeues_it_and_leaves_nothing_behind(script, tmp_path):
    r, calls = run_script(script, tmp_path, "run")
    assert r.returncode == 0, r.stderr
    assert calls == [f"requeue {JOB}"]
    assert f"requeueing Slurm job {JOB}" in r.stdout
    assert os.listdir(tmp_path / "submit") == []           # the job's private state directory is gone


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_request_planted_in_the_submit_directory_does_not_requeue(script, tmp_path):
    """Another user who can write the submit directory plants requests (the old name, guesses of the new
    one) while the job runs."""
    r, calls = run_script(script, tmp_path, "plant")
    assert r.returncode == 0, r.stderr
    assert calls == []


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("mode", ["job-id", "other-job", "symlink"])
def test_a_request_without_this_jobs_nonce_is_refused_in_one_line(script, mode, tmp_path):
    r, calls = run_script(script, tmp_path, mode)
    assert calls == []
    refusals = [ln for ln in r.stderr.splitlines() if "not requeueing" in ln]
    assert len(refusals) == 1 and f"job {JOB}" in refusals[0] and "(owner or content)" in refusals[0], r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the request file to another user")
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_request_owned_by_someone_else_is_refused(script, tmp_path):
    r, calls = run_script(script, tmp_path, "chown")
    assert calls == []
    assert "not requeueing" in r.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_requeues_stop_at_slurm_max_requeues(script, tmp_path):
    r, calls = run_script(script, tmp_path, "run", restarts=2, max_requeues=3)
    assert calls == [f"requeue {JOB}"], r.stdout + r.stderr
    (tmp_path / "scontrol.log").unlink()
    r, calls = run_script(script, tmp_path, "run", restarts=3, max_requeues=3)
    assert r.returncode == 0, r.stderr
    assert calls == []
    lines = [ln for ln in r.stdout.splitlines() if "requeueing" in ln]
    assert lines == [f"not requeueing Slurm job {JOB}: it has restarted 3 time(s), slurm.max_requeues = 3; "
                     f"resubmit it to resume from its newest checkpoint"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_symlink_planted_at_the_srun_log_is_not_followed(script, tmp_path):
    submit = tmp_path / "submit"
    submit.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (submit / f"srun-{JOB}.err").symlink_to(victim)
    r, _ = run_script(script, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "srun: fake step" in r.stderr                  # srun's stderr still reaches the job's log
    assert victim.read_text() == "precious\n"
    assert (submit / f"srun-{JOB}.err").is_symlink()      # left alone, not removed or written through


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_failed_step_still_gets_its_post_mortem_from_the_private_log(script, tmp_path):
    r, calls = run_script(script, tmp_path, rc=3)
    assert r.returncode == 3
    assert calls == []
    assert "srun: fake step" in r.stderr
    assert os.listdir(tmp_path / "submit") == []
