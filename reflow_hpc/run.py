"""Entry point of one rank: ``python -m reflow_hpc.run CONFIG [--set section.key=value ...] [--check]``.

Under ``srun`` or ``mpiexec`` every process is one rank. Started by hand without a launcher, it
relaunches itself as ``mpiexec -n <resources.workers> python -m reflow_hpc.run …`` so a laptop user
types one command. ``--check`` is the start-up self-check (handshake, all-reduce, topology.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .config import Config, ConfigError, load, main_guard, notices
from .private import UnsafePathError, apply_umask, write_atomic


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m reflow_hpc.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="TOML config file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config key (repeatable)")
    ap.add_argument("--check", action="store_true",
                    help="start-up self-check: handshake, all-reduce, write topology.json, exit")
    return ap


def find_mpiexec(cfg: Config) -> str:
    name = cfg.run.mpiexec
    if os.sep not in name:
        # Prefer the launcher installed beside this interpreter (the mpich wheel in a venv):
        # it belongs to the MPI that mpi4py was built against.
        sibling = Path(sys.executable).parent / name
        if sibling.is_file() and os.access(sibling, os.X_OK):
            return str(sibling)
    found = shutil.which(name)
    if found is None:
        raise ConfigError("run.mpiexec", name, "launcher not found on PATH (pip install 'reflow-hpc[mpich]', "
                                               "or load your site MPI, or run under srun)")
    return found


# Set by relaunch() for the ranks it starts under mpiexec.
RELAUNCHED = "REFLOW_RELAUNCHED"


def relaunched() -> bool:
    """This process is one of the ranks that relaunch() started."""
    return os.environ.get(RELAUNCHED) == "1"


def relaunch(cfg: Config, argv: list[str]) -> int:
    """Run this same command as `resources.workers` MPI ranks and return the launcher's exit code."""
    if relaunched():
        print("reflow_hpc: relaunched under mpiexec but no MPI launcher environment was found; "
              "check that run.mpiexec belongs to the MPI that mpi4py uses", file=sys.stderr)
        return 1
    rank_cmd = [sys.executable, "-m", "reflow_hpc.run", *argv]
    group = ""
    if cfg.resources.cpu_quota > 0:
        from .runtime import cpuquota
        why = cpuquota.available()
        if why is None:
            group = f"reflow-{os.getpid()}"
            rank_cmd = [sys.executable, "-m", "reflow_hpc.runtime.cpuquota", str(cfg.resources.cpu_quota), group,
                        "--", *rank_cmd]
            print(f"reflow_hpc: every rank is held to {cfg.resources.cpu_quota:g} of a CPU core "
                  f"(cgroup {cpuquota.CONTROLLER}/{group}-rank*)", file=sys.stderr, flush=True)
        else:
            print(f"reflow_hpc: resources.cpu_quota = {cfg.resources.cpu_quota:g} not applied: {why}; "
                  f"running without it", file=sys.stderr, flush=True)
    launcher = find_mpiexec(cfg)
    # Hydra (MPICH) kills every rank the moment one dies, too fast to tell which one died first; this
    # process watches the ranks itself instead (_watch_ranks), names the dead one and stops the rest.
    hydra = "HYDRA" in subprocess.run([launcher, "--version"], capture_output=True, text=True).stdout
    watch = hydra and "--check" not in argv
    cmd = [launcher, *(["-disable-auto-cleanup"] if watch else []), "-n", str(cfg.resources.workers), *rank_cmd]
    env = dict(os.environ, **{RELAUNCHED: "1"})
    # The launcher's output passes through here line by line, so that a rank killed without a word
    # (which only the launcher reports, by pid) can be explained in one line at the end.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tail: list[str] = []
    first_dead: list[dict] = []
    pumps = [threading.Thread(target=_pump, args=(stream, out, tail), daemon=True)
             for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
    if watch:
        pumps.append(threading.Thread(target=_watch_ranks, args=(cfg, proc, first_dead), daemon=True))
    for t in pumps:
        t.start()

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        code = proc.wait()
    finally:
        if group:
            from .runtime import cpuquota
            cpuquota.remove(group, cfg.resources.workers)
    for t in pumps:
        t.join(timeout=10)
    if code not in (0, 2):
        from .postmortem import diagnose
        line = diagnose(cfg, tail, code, first_dead[0] if first_dead else None)
        if line:
            print(line, file=sys.stderr, flush=True)
    return code


# Lines of the launcher's output kept for the post-mortem (hydra's report of a dead rank is ~10 lines).
POSTMORTEM_LINES = 200


# How often the launcher looks for ranks that died; a killed rank's peers are stopped by the launcher
# within milliseconds to seconds, so the first one gone is the one that died.
RANK_WATCH_S = 0.05


def _watch_ranks(cfg: Config, proc: subprocess.Popen, first_dead: list[dict]) -> None:
    """While the job trains (topology.json written, summary.json not yet), a rank whose process is gone
    died: note it and kill the others, as hydra would have, so the job ends at once."""
    import json
    import time
    started = time.time()
    fresh = lambda p: p.is_file() and p.stat().st_mtime >= started     # noqa: E731 - written by this job
    topology, summary = cfg.run_dir / "topology.json", cfg.run_dir / "summary.json"
    ranks: list[dict] = []
    while proc.poll() is None:
        time.sleep(RANK_WATCH_S)
        if not ranks:
            if fresh(topology):
                try:
                    ranks = json.loads(topology.read_text())["ranks"]
                except (ValueError, KeyError, OSError):
                    ranks = []
            continue
        if fresh(summary):
            return                          # training ended: ranks leave one by one from here on
        state = {r["rank"]: _state(int(r["pid"])) for r in ranks}
        gone = [r for r in ranks if state[r["rank"]] in (None, "Z", "X")]
        if gone:
            # Several can be dead by the first look (a peer's death ends others within milliseconds). The
            # launcher reaps each rank as it dies, so one already reaped died before those still zombies.
            gone.sort(key=lambda r: state[r["rank"]] is not None)
            first_dead.append(gone[0])
            for r in ranks:
                if r not in gone:
                    try:
                        os.kill(int(r["pid"]), signal.SIGKILL)
                    except OSError:
                        pass
            return


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie, dead and not reaped yet), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _pump(stream, out, tail: list[str]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        out.write(line)
        out.flush()
        tail.append(line.rstrip("\n"))
        del tail[:-POSTMORTEM_LINES]


def check_sandbox(cfg: Config) -> None:
    """A run whose model may call the ``python`` tool, or whose task judges code (``code_*``), needs a
    sandbox tier this machine offers (one-line config error naming what to install or set:
    ``sandbox.require_tier``)."""
    if "python" in [n.strip() for n in cfg.task.tools.split(",")] or cfg.task.name.startswith("code_"):
        from .sandbox import require_tier
        require_tier(cfg)


def check_resume(cfg: Config) -> None:
    """A run that resumes must keep the keys its checkpoint is laid out by (one-line config error)."""
    if not cfg.checkpoint.resume:
        return
    from .config import ConfigError, to_dict
    from .train.checkpoint import latest_checkpoint, resume_changes

    latest = latest_checkpoint(cfg.checkpoint_dir)
    if latest is None:
        return
    fixed, _ = resume_changes(latest, to_dict(cfg))
    if fixed:
        key, saved, now = fixed[0]
        raise ConfigError(key, now, f"the checkpoint this run resumes ({latest}) was written with {saved!r}; "
                                    f"keep it, or start a new run (another run.name, or checkpoint.resume = false)")


def run_rank(cfg: Config, args: argparse.Namespace) -> int:
    """The life of one rank."""
    from .runtime.context import Runtime
    from .runtime.topology import LaunchError

    try:
        if args.check:
            from .runtime.selfcheck import CheckSide, gpus_by_node, run_check
            rt = Runtime(cfg, lambda: CheckSide(cfg, cfg.resources.workers))
        else:
            from .runtime.training import TrainingSide
            rt = Runtime(cfg, lambda: TrainingSide(cfg))
    except LaunchError as e:
        print(f"reflow_hpc: {e}", file=sys.stderr, flush=True)
        return 1
    except ConfigError as e:
        # Every rank sees the same error; one line is enough.
        from .comm.mpi import launcher_rank
        if launcher_rank() in ("0", "?"):
            print(str(e), file=sys.stderr, flush=True)
        return 2

    op = "start-up"
    try:
        import torch

        from .comm.dist import destroy

        torch.set_num_threads(cfg.resources.cpu_threads)
        rt.start()
        if args.check:
            op = "self-check"
            report = run_check(rt)
            rt.wait_stop()
            rt.shutdown()
            destroy()
            if rt.rank == 0:
                topo = rt.topology
                path = cfg.run_dir / "topology.json"
                ok = "verified" if report.allreduce_ok and report.mpi_allreduce_ok else "FAILED"
                print(f"self-check: {rt.size} ranks on {len(topo.nodes)} node(s), {report.backend} all-reduce "
                      f"{ok}, handshake {rt.pump.handshake_s * 1e3:.1f} ms; wrote {path}", flush=True)
                for node, gpus in gpus_by_node(rt.pump.hellos).items():
                    seen = "; ".join(gpus) if gpus else "none (no NVML: CPU node, or nvidia-ml-py not installed)"
                    print(f"self-check: node {node}: GPUs seen by NVML: {seen}", flush=True)
            return 0 if report.allreduce_ok and report.mpi_allreduce_ok else 1
        op = "training"
        return train(rt)
    except BaseException as e:  # noqa: BLE001 - one rank failing ends the job with a named error
        rt.fail(op, e)
        return 1


def finish_rank(code: int, teardown_s: float) -> int:
    """Finalize MPI, then leave through the normal interpreter exit.

    MPICH ends its PMI session (the launcher's record that this rank finished cleanly) only in a C
    exit handler. A rank that skips it (``os._exit``) closes its PMI connection unannounced, and
    hydra takes that for a crash: it SIGKILLs every rank still running (typically one still in
    MPI_Finalize) and a finished job fails. The interpreter's teardown is bounded instead: past
    ``teardown_s`` SIGALRM ends the rank, so a hung destructor still ends the job.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    from .comm.failure import failpoint
    from .comm.mpi import init
    MPI = init()
    rank = MPI.COMM_WORLD.Get_rank()
    MPI.Finalize()
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, math.ceil(teardown_s)))
    failpoint("exit", rank)
    return code


def train(rt) -> int:
    """One rank of a training run; rank 0 also reports, evaluates and, after USR2, requeues."""
    from .comm.dist import destroy
    from .runtime.training import STOP_SIGNALS
    from .runtime.worker import Worker

    side = rt.pump.side if rt.pump is not None else None
    stop_signal: list[int] = []

    def on_stop(signum: int, frame: object) -> None:
        stop_signal.append(signum)
        side.request_stop(signum, frame)

    # Slurm signals every task; only the coordinator acts, the others wait for its Stop.
    for sig in STOP_SIGNALS:
        signal.signal(sig, on_stop if side is not None else signal.SIG_IGN)
    worker = Worker(rt)
    worker.run()
    from .runtime.rankstats import gather_records, write_record
    write_record(rt.cfg.run_dir, worker)        # its account for the benchmarks, before the evaluation
    rt.shutdown()
    destroy()
    # After a stop signal the kill is near (Slurm's KillWait, the USR2 lead): the resumed run scores the
    # snapshots instead, at its end, as it scores any it finds unscored.
    from .runtime.messages import DONE
    evaluating = bool(rt.cfg.run.eval_prompts) and worker.stop_reason == DONE
    scores = evaluate(rt) if evaluating else None
    if side is None:
        return 0
    if rt.cfg.run.eval_prompts and not evaluating:
        print(f"reflow_hpc: {worker.stop_reason}: the held-out evaluation is left to the resumed run, which scores "
              f"this run's snapshots at its end", flush=True)
    summary = dict(side.summary)
    summary.update(scores or {})
    summary["ranks"] = gather_records(rt.cfg.run_dir, rt.size, since=worker.account.started)
    write_atomic(rt.cfg.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(report(summary, rt.cfg), flush=True)
    if stop_signal and stop_signal[0] == signal.SIGUSR2 and "SLURM_JOB_ID" in os.environ \
            and summary.get("steps", 0) < rt.cfg.trainer.steps:
        requeue(rt.cfg, os.environ["SLURM_JOB_ID"])
    return 0


def requeue_refusal(max_requeues: int, job: str) -> str | None:
    """Why Slurm job ``job`` may not requeue itself again (one line), or None: slurm.max_requeues caps
    the restarts Slurm counts in SLURM_RESTART_COUNT, so a job that is stopped again and again ends."""
    try:
        restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        restarts = 0
    if restarts >= max_requeues:
        return (f"not requeueing Slurm job {job}: it has restarted {restarts} time(s), slurm.max_requeues = "
                f"{max_requeues}; resubmit it to resume from its newest checkpoint")
    return None


def requeue(cfg: Config, job: str) -> bool:
    """After USR2, ask for Slurm job ``job`` to be requeued; it resumes from the checkpoint just written.

    Under our batch scripts (slurm/*.sbatch) rank 0 only leaves a request, in the job's private state
    directory, holding the nonce the script made (REFLOW_REQUEUE_TOKEN): the script requeues once srun
    has returned, and only for that request. Elsewhere (submitit) it calls ``scontrol requeue`` itself."""
    refusal = requeue_refusal(cfg.slurm.max_requeues, job)
    if refusal:
        print(refusal, flush=True)
        return False
    print(f"requeueing Slurm job {job}: it resumes from the checkpoint just written", flush=True)
    request = os.environ.get("REFLOW_REQUEUE_FILE")
    if not request:
        subprocess.run(["scontrol", "requeue", job], check=False)
        return True
    from .private import UnsafePathError, open_new
    try:
        # Never through a file or link already there: the request is this process's alone.
        with open_new(request) as f:
            f.write(os.environ.get("REFLOW_REQUEUE_TOKEN", job) + "\n")
    except (OSError, UnsafePathError) as e:
        print(f"not requeueing Slurm job {job}: cannot write the requeue request {request}: {e}", flush=True)
        return False
    return True


def evaluate(rt) -> dict | None:
    """Every rank scores its share of the run's policies (:mod:`reflow_hpc.evaluation`); rank 0 records
    them and returns the summary entries."""
    import torch

    from .comm.mpi import wait_until
    from .evaluation import evaluate_run

    cfg = rt.cfg
    torch.set_num_threads(cfg.resources.cpu_threads)

    def wait(done, timeout_s: float) -> None:
        wait_until(done, timeout=timeout_s, rank=rt.rank, op="waiting for the other ranks' evaluation results",
                   backoff=rt.control.backoff())

    return evaluate_run(cfg, rt.rank, rt.size, wait=wait)


def report(summary: dict, cfg: Config) -> str:
    from .evaluation import report_lines

    lines = [f"run {cfg.run.name}: {summary.get('steps')} steps in {summary.get('wall_seconds', 0):.0f} s "
             f"({summary.get('mode')} mode); run directory {cfg.run_dir}"]
    lines += report_lines(summary)
    lines.append(f"training reward of unused samples: first steps {summary.get('reward_first_steps', float('nan')):.3f}"
                 f" -> last steps {summary.get('reward_last_steps', float('nan')):.3f}")
    b = summary.get("buffer", {})
    from .core.sample import TERMINAL_REASONS
    ends = ", ".join(f"{k.split('/', 1)[1]} {v}" for k, v in b.items()
                     if k.startswith("buffer/") and k.split("/", 1)[1] in TERMINAL_REASONS)
    # With σ > 0 a trained sample usually ends replayed-then-evicted, so the reasons alone hide training.
    trained = (f"trained on: {b['buffer/trained_samples']} samples, plus {b['buffer/replayed_uses']} replays; "
               if "buffer/trained_samples" in b else "")
    lines.append(f"samples: {b.get('buffer/created', 0)} created; {trained}ended: {ends} "
                 f"({b.get('buffer/evicted_unused', 0)} of the evicted never trained)")
    r = cfg.reflow
    if r.mode == "reflow" and r.sigma > 0 and b.get("buffer/trained_samples") and not b.get("buffer/replayed_uses"):
        why = (f"medium_reward keeps only rewards strictly between reflow.reward_low = {r.reward_low:g} and "
               f"reflow.reward_high = {r.reward_high:g}, which a 0/1 reward never is" if r.sampler == "medium_reward"
               else "see replay_fraction in metrics.jsonl")
        lines.append(f"note: reflow.sigma = {r.sigma:g} but no sample was replayed: the replay sampler "
                     f"{r.sampler!r} returned none ({why})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """One rank (under a launcher) or the launcher itself. A rank returns with MPI finalized and its
    teardown bounded (:func:`finish_rank`), also inside submitit's task wrapper, whose own exit then
    runs under that bound."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)

    def go() -> int:
        cfg = load(args.config, args.overrides)
        try:        # first, on the front end and on every rank: whatever is written next is private
            apply_umask(cfg.run.umask)
        except ValueError:
            raise ConfigError("run.umask", cfg.run.umask, "not an octal umask between 000 and 777") from None
        if not args.check:
            check_resume(cfg)
        check_sandbox(cfg)
        from .comm.mpi import launcher_rank, under_launcher
        launched = under_launcher()
        if not launched or (launcher_rank() == "0" and not relaunched()):   # once: the front end, or rank 0 of srun
            for line in notices(cfg):
                print(f"reflow_hpc: {line}", file=sys.stderr, flush=True)
        if not launched:
            if not args.check and (cfg.model.warmstart or cfg.model.init_config):
                from .warmstart import ensure_policy
                ensure_policy(cfg)
            return relaunch(cfg, argv)
        code = run_rank(cfg, args)
        return finish_rank(code, cfg.run.timeout_s)

    def guarded() -> int:
        try:
            return go()
        except UnsafePathError as e:        # a planted or shared path outside a rank: one line, no traceback
            print(f"reflow_hpc: {e}", file=sys.stderr, flush=True)
            return 1

    return main_guard(guarded)


if __name__ == "__main__":
    sys.exit(main())
