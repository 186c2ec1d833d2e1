"""``python -m reflow_hpc.submit`` without a cluster: the dry run renders anywhere, a missing or refusing
Slurm is one line, and submitit's folder (pickles that the compute nodes and ``--wait`` load) is private
and checked before anything is submitted or loaded. sbatch is a stand-in script where one is needed."""

from __future__ import annotations

import os
import pickle
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

QWEN = str(ROOT / "configs" / "qwen3_8b_dapo_128gpu.toml")
TINY = str(ROOT / "configs" / "cpu_tiny.toml")

OK_SBATCH = '#!/bin/bash\necho "$*" >> "$FAKE_SBATCH_LOG"\necho "Submitted batch job 77"\n'
REFUSING_SBATCH = ('#!/bin/bash\necho "$*" >> "$FAKE_SBATCH_LOG"\n'
                   'echo "sbatch: error: invalid partition specified: nope" >&2\n'
                   'echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2\n'
                   'exit 1\n')


def submit(tmp_path: Path, *args: str, sbatch: str | None = None, srun: bool = False) -> subprocess.CompletedProcess:
    """Run submit from tmp_path/cwd with a PATH that holds no Slurm command but the stand-ins asked for (srun
    is never run by submit: it stands for a login node that has every Slurm command)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("sbatch", sbatch), ("srun", "#!/bin/bash\nexit 1\n" if srun else None)):
        if text is not None:
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "REFLOW_", "SUBMITIT_"))}
    env.update(PATH=str(bin_dir), PYTHONPATH=str(ROOT), FAKE_SBATCH_LOG=str(tmp_path / "sbatch.log"))
    return subprocess.run([sys.executable, "-m", "reflow_hpc.submit", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def sbatch_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "sbatch.log"
    return log.read_text().splitlines() if log.exists() else []


def test_dry_run_of_the_128_gpu_config_needs_no_slurm(tmp_path):
    r = submit(tmp_path, "--nodes", "16", "--dry-run", QWEN)
    assert r.returncode == 0, r.stderr
    for line in ("#SBATCH --nodes=16", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --requeue", "#SBATCH --time=1440", "#SBATCH --signal=USR2@180"):
        assert line in r.stdout, r.stdout
    assert "--mpi=pmi2 --kill-on-bad-exit=1" in r.stdout
    assert os.listdir(tmp_path / "cwd") == []       # a dry run writes nothing, not even slurm_logs


def test_submit_without_sbatch_is_one_line(tmp_path):
    r = submit(tmp_path, "--nodes", "2", TINY)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("submit: sbatch not found on PATH"), r.stderr
    assert os.listdir(tmp_path / "cwd") == []


def test_sbatch_refusing_is_one_line_with_what_slurm_said(tmp_path):
    r = submit(tmp_path, "--nodes", "2", "--partition", "nope", TINY, sbatch=REFUSING_SBATCH, srun=True)
    assert r.returncode == 1
    assert r.stderr == ("submit: sbatch refused the job: invalid partition specified: nope; Batch job submission "
                        "failed: Invalid partition name specified\n")
    assert len(sbatch_calls(tmp_path)) == 1
    assert os.listdir(tmp_path / "cwd" / "slurm_logs") == []     # no pickle or script left from the failed try


def test_a_rendered_flag_is_checked_like_its_key(tmp_path):
    r = submit(tmp_path, "--nodes", "2", "--dry-run", "--partition", "gpu\n#SBATCH --uid=0", TINY, srun=True)
    assert r.returncode == 2
    assert r.stderr == ('config error: slurm.partition = "gpu\\n#SBATCH --uid=0": must not contain control '
                        'characters (a newline would add a line to the generated batch script)\n')


def test_a_newline_in_run_name_never_reaches_the_script(tmp_path):
    r = submit(tmp_path, "--nodes", "2", "--dry-run", "--set", 'run.name="x\\n#SBATCH --uid=0"', TINY, srun=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith('config error: run.name = "x\\n#SBATCH --uid=0": ') and r.stderr.count("\n") == 1


def test_submission_makes_the_log_dir_private(tmp_path):
    r = submit(tmp_path, "--nodes", "2", TINY, sbatch=OK_SBATCH, srun=True)
    assert r.returncode == 0, r.stderr
    assert "submitted job 77" in r.stdout
    logs = tmp_path / "cwd" / "slurm_logs"
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    pickles = list(logs.rglob("*.pkl"))
    assert pickles and all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in pickles)


@pytest.mark.parametrize("hostile", ["world-writable", "group-writable", "symlink"])
def test_a_log_dir_others_can_write_is_refused_before_submitting(tmp_path, hostile):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    logs = cwd / "slurm_logs"
    if hostile == "symlink":
        (tmp_path / "theirs").mkdir(mode=0o700)
        logs.symlink_to(tmp_path / "theirs")
    else:
        logs.mkdir()
        logs.chmod(0o777 if hostile == "world-writable" else 0o770)
    r = submit(tmp_path, "--nodes", "2", TINY, sbatch=OK_SBATCH, srun=True)
    assert r.returncode == 1
    assert r.stderr.startswith(f"submit: slurm.log_dir {logs}: ") and r.stderr.count("\n") == 1, r.stderr
    assert sbatch_calls(tmp_path) == []
    assert not list(tmp_path.rglob("*.pkl"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another user")
def test_a_log_dir_of_another_user_is_refused(tmp_path):
    logs = tmp_path / "cwd" / "slurm_logs"
    logs.mkdir(parents=True, mode=0o700)
    os.chown(logs, 65534, 65534)
    r = submit(tmp_path, "--nodes", "2", TINY, sbatch=OK_SBATCH, srun=True)
    assert r.returncode == 1 and "owned by uid 65534" in r.stderr and r.stderr.count("\n") == 1
    assert sbatch_calls(tmp_path) == []


class _Planted:
    """A pickle that someone else put where the job's pickle is looked for: loading it runs their code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_a_task_does_not_load_a_pickle_from_a_log_dir_others_can_write(tmp_path):
    """The command each Slurm task runs (from the rendered script) checks the folder before loading."""
    r = submit(tmp_path, "--nodes", "2", "--dry-run", TINY, srun=True)
    assert r.returncode == 0, r.stderr
    srun = next(ln for ln in r.stdout.splitlines() if ln.startswith("srun "))
    words = shlex.split(srun)
    task = words[words.index(sys.executable):]          # what srun starts in each task
    logs = tmp_path / "cwd" / "slurm_logs"
    (logs / "77").mkdir(parents=True)
    logs.chmod(0o777)                                   # e.g. made by hand, or by an older version, on a shared path
    marker = tmp_path / "their-code-ran"
    (logs / "77" / "77_submitted.pkl").write_bytes(pickle.dumps(_Planted(marker)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "REFLOW_", "SUBMITIT_"))}
    env.update(SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="77", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
               SLURM_NTASKS="1", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="localhost", PYTHONPATH=str(ROOT))
    t = subprocess.run(task, cwd=tmp_path / "cwd", env=env, capture_output=True, text=True, timeout=120)
    assert not marker.exists(), t.stderr
    assert t.returncode == 1
    assert t.stderr.startswith(f"reflow_hpc: not loading the job's pickle: slurm.log_dir {logs}: writable by group "
                               f"or others") and t.stderr.count("\n") == 1, t.stderr


def test_submitit_checkpoint_honours_max_requeues(monkeypatch, capsys):
    from reflow_hpc.submit import RankJob

    job = RankJob("cfg.toml", [], max_requeues=2)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    again = job.checkpoint()
    assert again is not None and again.function.max_requeues == 2
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert job.checkpoint() is None                     # submitit ends the job instead of requeueing it
    assert capsys.readouterr().out == ("not requeueing Slurm job 77: it has restarted 2 time(s), slurm.max_requeues"
                                       " = 2; resubmit it to resume from its newest checkpoint\n")
