"""Submit a run from a login node through submitit.

    python -m reflow_hpc.submit --nodes 16 configs/qwen3_8b_dapo_128gpu.toml
    python -m reflow_hpc.submit --nodes 2 --wait configs/cpu_tiny.toml -- --check
    python -m reflow_hpc.submit --nodes 2 --set reflow.sigma=0.25 configs/cpu_tiny.toml

One Slurm task per GPU (per CPU slot on CPU configs), started by ``srun --mpi=<slurm.mpi>`` so every
task is one MPI rank of ``reflow_hpc.run``. Requeue is on: Slurm sends USR2 ``slurm.signal_before_s``
seconds before the time limit, rank 0 checkpoints and requeues the job. ``--dry-run`` prints the
sbatch script instead of submitting (anywhere: no Slurm needed); ``--wait`` follows rank 0's output
until the job ends and exits with its status.

submitit keeps the job as pickles in ``slurm.log_dir``, which the compute nodes and ``--wait`` load: a
pickle runs code, so that directory is created 0700 and, when it exists, must be the user's own, not
writable by group or others and not a symlink; every task checks it again before loading anything.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .config import Config, ConfigError, load, main_guard, validate
from .private import UnsafePathError, apply_umask, private_dir


class SubmitError(Exception):
    """Slurm is missing or refused the job; str is one line."""


class RankJob:
    """What every Slurm task runs: one rank of ``python -m reflow_hpc.run CONFIG ARGS``."""

    def __init__(self, config: str, run_args: list[str], max_requeues: int):
        self.config = config
        self.run_args = run_args
        self.max_requeues = max_requeues

    def __call__(self) -> int:
        from .run import main
        code = main([self.config, *self.run_args])
        if code != 0:
            raise RuntimeError(f"rank {os.environ.get('SLURM_PROCID', '?')} exited with code {code}")
        return code

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        # Called by submitit on USR2 in task 0 before it requeues the job; the run itself saves its
        # state on the same signal, and resumes from its newest checkpoint when it starts again.
        import submitit

        from .run import requeue_refusal
        refusal = requeue_refusal(self.max_requeues, os.environ.get("SLURM_JOB_ID", "?"))
        if refusal:
            print(refusal, flush=True)
            return None                 # submitit then ends the job instead of requeueing it
        return submitit.helpers.DelayedSubmission(RankJob(self.config, self.run_args, self.max_requeues))


def _minutes(text: str) -> int:
    """Slurm time syntax (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) → minutes, rounded up."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise ConfigError("slurm.time", text, "expected MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is None and b is None:
        return a                                   # MM
    if days is not None and b is None:
        return days * 1440 + a * 60                # D-HH
    if days is None and c is None:
        return a + (1 if b else 0)                 # MM:SS (Slurm reads two fields without a day as this)
    if c is None:
        return days * 1440 + a * 60 + b            # D-HH:MM
    return (days or 0) * 1440 + a * 60 + b + (1 if c else 0)


def tasks_per_node(cfg: Config, nodes: int, gpus_per_node: int) -> tuple[int, bool]:
    """(tasks per node, uses GPUs): one task per GPU, or per CPU slot on CPU configs."""
    workers = cfg.resources.workers
    gpu = cfg.resources.device != "cpu" and gpus_per_node > 0
    if gpu:
        if nodes * gpus_per_node != workers:
            raise ConfigError("resources.workers", workers,
                              f"--nodes {nodes} × --gpus-per-node {gpus_per_node} = {nodes * gpus_per_node} tasks "
                              f"(one per GPU) must equal workers")
        return gpus_per_node, True
    if workers % nodes:
        raise ConfigError("resources.workers", workers, f"cannot split evenly over --nodes {nodes}")
    return workers // nodes, False


def apply_flags(cfg: Config, args: argparse.Namespace, *, check_files: bool) -> None:
    """The flags that override [slurm] keys, checked by the same rules: they are rendered into the script."""
    for flag, key in (("partition", "partition"), ("account", "account"), ("time", "time"), ("mpi", "mpi")):
        if getattr(args, flag) is not None:
            setattr(cfg.slurm, key, getattr(args, flag))
    validate(cfg, check_files=check_files)


@functools.cache
def _executor_class() -> type:
    import submitit

    class Executor(submitit.SlurmExecutor):
        """submitit's Slurm executor, less its demand for ``srun`` on the submitting machine (a login node
        needs only ``sbatch``, checked before submitting; a dry run needs neither), and with each task
        checking slurm.log_dir before it loads the job's pickle (:func:`task_main`)."""

        @classmethod
        def affinity(cls) -> int:
            return 2

        @property
        def _submitit_command_str(self) -> str:
            code = "import sys; from reflow_hpc.submit import task_main; sys.exit(task_main())"
            return " ".join([self.python, "-u -c", shlex.quote(code), shlex.quote(str(self.folder))])

    return Executor


def make_executor(cfg: Config, args: argparse.Namespace) -> Any:
    """The executor for this submission; creates nothing on disk (a dry run renders from it)."""
    gpus = args.gpus_per_node if args.gpus_per_node is not None else cfg.slurm.gpus_per_node
    per_node, gpu = tasks_per_node(cfg, args.nodes, gpus)
    folder = Path(cfg.slurm.log_dir).absolute() / "%j"
    ex = _executor_class()(folder)
    params: dict[str, Any] = dict(
        job_name=f"reflow-{cfg.run.name}",
        nodes=args.nodes,
        ntasks_per_node=per_node,
        cpus_per_task=cfg.slurm.cpus_per_task,
        time=_minutes(cfg.slurm.time),
        signal_delay_s=cfg.slurm.signal_before_s,
        srun_args=[f"--mpi={cfg.slurm.mpi}", "--kill-on-bad-exit=1"],
        additional_parameters={"requeue": True},
        setup=[f"export OMP_NUM_THREADS={cfg.resources.cpu_threads}"],
    )
    if gpu:
        params["gpus_per_node"] = gpus
    if cfg.slurm.partition:
        params["partition"] = cfg.slurm.partition
    if cfg.slurm.account:
        params["account"] = cfg.slurm.account
    ex.update_parameters(**params)
    return ex


def sbatch_text(ex: Any) -> str:
    # submitit renders the script here; there is no public accessor
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


def check_log_dir(log_dir: str | os.PathLike, job_id: str | None = None) -> None:
    """slurm.log_dir (created 0700 when missing) and, given a job id, the job's folder in it must be the
    user's own, not writable by group or others and not symlinks: the job's pickles are loaded from there."""
    root = private_dir(Path(log_dir).absolute(), what="slurm.log_dir")
    if job_id is not None and (root / job_id).exists():
        private_dir(root / job_id, what="slurm.log_dir job folder")


def task_main() -> int:
    """Each Slurm task's entry point in a submitted job: submitit's own, once slurm.log_dir is checked."""
    folder = sys.argv[1]
    from submitit.core.utils import JobPaths
    try:
        check_log_dir(JobPaths.get_first_id_independent_folder(folder), os.environ.get("SLURM_JOB_ID"))
    except UnsafePathError as e:
        print(f"reflow_hpc: not loading the job's pickle: {e}", file=sys.stderr, flush=True)
        return 1
    from submitit.core.submission import submitit_main
    submitit_main()
    return 0


def _sbatch_said(stderr: str) -> str:
    """sbatch's error lines as one line, without its "sbatch: error: " prefixes."""
    lines = [re.sub(r"^sbatch:\s*(error:\s*)?", "", ln.strip()) for ln in stderr.splitlines() if ln.strip()]
    return "; ".join(lines) or "no message"


def require_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch not found on PATH: submit from a machine with Slurm's client commands (a login "
                          "node), or load your site's Slurm module; --dry-run prints the script without Slurm")


def submit_job(ex: Any, job: RankJob, log_dir: Path) -> Any:
    """``ex.submit(job)``, with Slurm's refusal as a one-line SubmitError and no files left from it."""
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    before = set(os.listdir(log_dir))
    submitted = False
    try:
        # submitit prints sbatch's stderr itself before raising; our one line says the same.
        with contextlib.redirect_stderr(io.StringIO()):
            result = ex.submit(job)
        submitted = True
        return result
    except FailedJobError as e:
        raise SubmitError(f"sbatch refused the job: {_sbatch_said(str(e))}") from None
    except (FailedSubmissionError, OSError) as e:
        raise SubmitError(f"submission failed: {_sbatch_said(str(e))}") from None
    finally:
        if not submitted:
            for name in set(os.listdir(log_dir)) - before:        # the pickle and script of the failed try
                if (log_dir / name).is_file():
                    (log_dir / name).unlink()


def _job_state(job_id: str) -> tuple[str, str]:
    """(state, exit code) from scontrol, which works without accounting; ("", "") once forgotten."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    state = re.search(r"JobState=(\S+)", out.stdout)
    code = re.search(r"ExitCode=(\S+)", out.stdout)
    return (state.group(1) if state else "", code.group(1) if code else "")


_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
          "PREEMPTED"}


def follow(job: Any, log_dir: Path, poll_s: float = 1.0) -> int:
    """Print rank 0's output as it grows until the job ends; return the job's exit status."""
    stdout = Path(str(job.paths.stdout).replace("%t", "0"))
    pos = 0
    state, code = "", ""
    while True:
        if stdout.exists():
            with stdout.open("rb") as f:
                f.seek(pos)
                chunk = f.read()
                pos += len(chunk)
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
        state, code = _job_state(str(job.job_id))
        if state in _ENDED or (state == "" and job.paths.result_pickle.exists()):
            break
        time.sleep(poll_s)
    time.sleep(poll_s)
    if stdout.exists():
        with stdout.open("rb") as f:
            f.seek(pos)
            sys.stdout.write(f.read().decode(errors="replace"))
    ok = state == "COMPLETED" or (state == "" and _all_results_ok(job, log_dir))
    if not ok:
        print(f"submit: job {job.job_id} ended {state or 'UNKNOWN'} (exit {code or '?'}); rank logs in "
              f"{job.paths.folder}", file=sys.stderr)
        for task in sorted(Path(job.paths.folder).glob(f"{job.job_id}_*_log.err")):
            for ln in failure_lines(task.read_text(errors="replace")):
                print(f"  {task.name}: {ln}", file=sys.stderr)
    return 0 if ok else 1


def failure_lines(err_log: str, keep: int = 3) -> list[str]:
    """What a rank's stderr says about why it ended: our one-line errors, or else its last lines
    (a traceback's tail, a signal) other than submitit's own progress lines."""
    lines = [ln for ln in err_log.splitlines() if ln.strip()]
    ours = [ln for ln in lines if ln.startswith("reflow_hpc:")]
    return (ours or [ln for ln in lines if not ln.startswith("submitit INFO")])[-keep:]


def _all_results_ok(job: Any, log_dir: Path) -> bool:
    check_log_dir(log_dir, str(job.job_id))     # the results are pickles: checked again before loading them
    try:
        job.results()
        return True
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, run_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m reflow_hpc.submit", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="TOML config file")
    ap.add_argument("--nodes", type=int, required=True, help="nodes to allocate")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="GPUs (= tasks) per node (default slurm.gpus_per_node)")
    ap.add_argument("--partition", default=None)
    ap.add_argument("--account", default=None)
    ap.add_argument("--time", default=None, help="wall-time limit, Slurm syntax (default slurm.time)")
    ap.add_argument("--mpi", default=None, help="srun --mpi plugin (default slurm.mpi)")
    ap.add_argument("--wait", action="store_true", help="follow rank 0's output until the job ends")
    ap.add_argument("--dry-run", action="store_true", help="print the sbatch script and exit")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config key for the submission and every rank (repeatable)")
    args = ap.parse_args(argv)
    if args.nodes < 1:
        ap.error("--nodes must be ≥ 1")

    def go() -> int:
        # Overrides given before `--` count for submission and ranks; those after it for the ranks too.
        forwarded = [x for o in args.overrides for x in ("--set", o)] + run_args
        overrides = [forwarded[i + 1] for i, a in enumerate(forwarded[:-1]) if a == "--set"]
        # A dry run shows the script for a config whose model and data live on the cluster, not here: every
        # rule is checked except that those files exist (a real submission checks them too).
        files = not args.dry_run
        cfg = load(args.config, overrides, check_files=files)
        apply_flags(cfg, args, check_files=files)
        ex = make_executor(cfg, args)
        if args.dry_run:
            print(sbatch_text(ex), end="")
            return 0
        require_sbatch()
        apply_umask(cfg.run.umask)          # submitit's pickles, scripts and job folders: the user's only
        log_dir = Path(cfg.slurm.log_dir).absolute()
        check_log_dir(log_dir)
        job = submit_job(ex, RankJob(str(Path(args.config).absolute()), forwarded, cfg.slurm.max_requeues), log_dir)
        print(f"submitted job {job.job_id}: {args.nodes} node(s), "
              f"{cfg.resources.workers} ranks; rank 0 log: {str(job.paths.stdout).replace('%t', '0')}")
        print(f"logs of every rank: {job.paths.folder}")
        if args.wait:
            return follow(job, log_dir)
        return 0

    def guarded() -> int:
        try:
            return go()
        except (SubmitError, UnsafePathError) as e:
            print(f"submit: {e}", file=sys.stderr)
            return 1

    return main_guard(guarded)


if __name__ == "__main__":
    sys.exit(main())
