"""Why a job ended when a rank died without a word (``kill -9``, the OOM killer, a node lost).

A rank that fails in Python prints its own one-line error naming itself and the operation. A rank
that is killed cannot; the launcher notices the dead process and stops the others (hydra's
"BAD TERMINATION ... PID n", srun's "task n: Killed"), which names a process, not what the job was
doing. The process that started the launcher then calls :func:`diagnose` with the launcher's last
lines: it maps the dead process to its rank through ``topology.json`` and reads ``metrics.jsonl``
and the checkpoint directory, to print one line such as::

    reflow_hpc: rank 2 (node n1, pid 26815) was killed by signal 9 during training (after step 16 of 200);
    the launcher stopped the other ranks; the newest checkpoint is step_000010: run the same command
    again to resume from it
"""

from __future__ import annotations

import json
import re

from .config import Config

_HYDRA_PID = re.compile(r"PID (\d+) RUNNING AT (\S+)")
_HYDRA_CODE = re.compile(r"EXIT CODE: (\d+)")
_SRUN_TASK = re.compile(r"task (\d+): (Killed|Segmentation fault|Aborted|Terminated|Exited with exit code \d+)")


def _ranks(cfg: Config) -> list[dict]:
    try:
        return json.loads((cfg.run_dir / "topology.json").read_text())["ranks"]
    except (OSError, ValueError, KeyError):
        return []


def _last_step(cfg: Config) -> int | None:
    try:
        lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    steps = [json.loads(x).get("step") for x in lines if x.strip() and '"kind"' not in x]
    return steps[-1] if steps else None


def diagnose(cfg: Config, launcher_lines: list[str], exit_code: int, first_dead: dict | None = None) -> str | None:
    """The one-line account of a job whose launcher reported a dead rank, or None when it did not.
    ``first_dead``: the topology entry of the rank seen gone first (the launcher watched its host);
    it names the rank better than hydra, whose report may name another process of the job."""
    text = "\n".join(launcher_lines)
    ranks = _ranks(cfg)
    who = how = None
    code = int(c.group(1)) if (c := _HYDRA_CODE.search(text)) else exit_code
    if first_dead is not None and (_HYDRA_PID.search(text) or _SRUN_TASK.search(text) or code in (9, 15, 6, 11)):
        who = f"rank {first_dead['rank']} (node {first_dead['node']}, pid {first_dead['pid']})"
        how = f"was killed by signal {code}" if code in (9, 15, 6, 11) else f"exited with code {code}"
    elif m := _HYDRA_PID.search(text):
        pid, node = int(m.group(1)), m.group(2)
        rank = next((r for r in ranks if r.get("pid") == pid), None)
        who = f"rank {rank['rank']} (node {rank['node']}, pid {pid})" if rank else f"a rank (pid {pid} on {node})"
        how = f"was killed by signal {code}" if code in (9, 15, 6, 11) else f"exited with code {code}"
    elif m := _SRUN_TASK.search(text):
        rank = next((r for r in ranks if r.get("rank") == int(m.group(1))), None)
        who = f"rank {m.group(1)}" + (f" (node {rank['node']}, pid {rank['pid']})" if rank else "")
        how = "was killed" if m.group(2) == "Killed" else m.group(2).lower()
    if who is None:
        return None
    step = _last_step(cfg)
    doing = (f"during training (after step {step} of {cfg.trainer.steps})" if step is not None
             else "before the first training step")
    from .train.checkpoint import latest_checkpoint
    latest = latest_checkpoint(cfg.checkpoint_dir)
    resume = (f"the newest checkpoint is {latest.name}: run the same command again to resume from it"
              if latest is not None else "no checkpoint was written yet")
    return f"reflow_hpc: {who} {how} {doing}; the launcher stopped the other ranks; {resume}"


def main(argv: list[str] | None = None) -> int:
    """``python -m reflow_hpc.postmortem CONFIG [--set ...] --launcher-log FILE --exit-code N``: the batch
    scripts call it when srun fails, with srun's stderr; it prints the one-line account, if any."""
    import argparse
    import sys

    from .config import load, main_guard

    ap = argparse.ArgumentParser(prog="python -m reflow_hpc.postmortem", description=main.__doc__.split(":")[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--launcher-log", required=True)
    ap.add_argument("--exit-code", type=int, required=True)
    args, _ = ap.parse_known_args(argv)          # the run's own flags (--check) pass through

    def go() -> int:
        cfg = load(args.config, args.overrides, check_files=False)
        try:
            lines = open(args.launcher_log, errors="replace").read().splitlines()
        except OSError:
            lines = []
        line = diagnose(cfg, lines, args.exit_code)
        if line:
            print(line, file=sys.stderr, flush=True)
        return 0

    return main_guard(go)


if __name__ == "__main__":
    raise SystemExit(main())
