"""How the simulator's cost grows with GPUs and steps.

    python tools/bench_sim.py [--config CONFIG] [--mode reflow] [--gpus 64,256,1024] [--steps 10,20,40]
                              [--batch N] [--split] [--interpreted] [--repeat N] [--json]

Each cell is one simulated run of ``--mode`` on CONFIG (default: the paper's workload,
``configs/sim_qwen3_8b_dapo.toml``) at that many GPUs and steps, in this process, one at a time.
Reported: CPU seconds of the run (``time.process_time``, so other load on a shared machine does not
count), simulated samples, events, microseconds per sample, and simulated seconds per CPU second.
``--split`` also measures the CPU time spent inside the coordinator (``reflow_hpc.core``: its one
entrance, ``handle``, wrapped with a timer that adds a little overhead of its own). The last lines fit
``cpu = a + b·samples`` over the cells and give the 1,024-GPU × 500-step estimate at the batch size
used. Each row says whether the event loop ran compiled (``tools/compile_sim.py``) or interpreted;
``--interpreted`` (with a compiled build) also runs every cell on an interpreted copy of the package,
in a subprocess one cell after the other, and prints the ratio of the two CPU times. ``--repeat N``
runs every cell N times (alternating with its interpreted run) and keeps the least CPU time of
each: a shared VM's speed drifts by tens of percent within an hour. With ``--json`` the last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reflow_hpc.core import coordinator as core_coordinator  # noqa: E402
from reflow_hpc.sim import compiled  # noqa: E402
from reflow_hpc.sim.report import simulate  # noqa: E402

# Runs this script on another copy of the package: that copy is imported first, so it is the one measured.
OTHER_TREE = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); import reflow_hpc; "
              "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")

class CoreTimer:
    """Accumulates CPU time spent in the coordinator (its one entrance, ``Coordinator.handle``)."""

    def __init__(self):
        self.seconds = 0.0
        self._saved = None

    def __enter__(self):
        cls = core_coordinator.Coordinator
        self._saved = f = cls.handle
        timer = self

        def timed(*a, **k):
            t0 = time.process_time()
            try:
                return f(*a, **k)
            finally:
                timer.seconds += time.process_time() - t0
        cls.handle = timed
        return self

    def __exit__(self, *exc):
        core_coordinator.Coordinator.handle = self._saved


def cell(config: str, mode: str, gpus: int, steps: int, batch: int | None, split: bool) -> dict:
    sets = [f"trainer.steps={steps}", "sim.warmup_steps=0"] + ([f"trainer.batch_size={batch}"] if batch else [])
    timer = CoreTimer() if split else None
    t0 = time.process_time()
    if timer:
        with timer:
            res = simulate(config, mode, sets, gpus)
    else:
        res = simulate(config, mode, sets, gpus)
    cpu = time.process_time() - t0
    s = res.summary
    samples = res.sim.coordinator.summary()["buffer"]["buffer/created"]
    row = {"engine": "compiled" if compiled() else "interpreted",
           "gpus": gpus, "steps": steps, "batch": res.sim.cfg.trainer.batch_size, "workers": s["workers"],
           "cpu_s": cpu, "samples": samples, "events": s["events"], "us_per_sample": cpu / samples * 1e6,
           "simulated_s": s["simulated_s"], "speedup": s["simulated_s"] / cpu}
    if timer:
        row["core_s"] = timer.seconds
        row["core_share"] = timer.seconds / cpu
    return row


def interpreted_cell(tree: Path, args: argparse.Namespace, gpus: int, steps: int) -> dict:
    """The same cell on ``tree``, an interpreted copy of the package, in a subprocess."""
    cmd = [sys.executable, "-c", OTHER_TREE, str(tree), __file__, "--config", args.config, "--mode", args.mode,
           "--gpus", str(gpus), "--steps", str(steps), "--json"] + (["--batch", str(args.batch)] if args.batch else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_sim: the interpreted run of {gpus} GPUs × {steps} steps failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])["rows"][0]
    if row["engine"] != "interpreted":
        raise SystemExit(f"bench_sim: the copy in {tree} imported a compiled event loop")
    return row


def line(r: dict) -> str:
    core = f"  core {r['core_share']:.0%}" if "core_share" in r else ""
    return (f"{r['gpus']:>5} GPUs {r['steps']:>4} steps ×{r['batch']:>5}: {r['cpu_s']:7.2f} s CPU, "
            f"{r['samples']:>8,} samples, {r['events']:>8,} events, {r['us_per_sample']:5.1f} µs/sample, "
            f"{r['speedup']:>7,.0f}× real time  {r['engine']}{core}")


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares cpu = a + b·samples."""
    xs = [r["samples"] for r in rows]
    ys = [r["cpu_s"] for r in rows]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else my / mx
    return my - b * mx, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "sim_qwen3_8b_dapo.toml"))
    ap.add_argument("--mode", default="reflow")
    ap.add_argument("--gpus", default="64,256,1024")
    ap.add_argument("--steps", default="10,20,40")
    ap.add_argument("--batch", type=int, default=None, help="trainer.batch_size (default: the config's)")
    ap.add_argument("--split", action="store_true", help="also measure the CPU time inside the coordinator")
    ap.add_argument("--interpreted", action="store_true",
                    help="also run each cell on an interpreted copy of the package (needs a compiled build)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each cell; the least CPU time is kept")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: must be at least 1")
    if args.interpreted and not compiled():
        ap.error("--interpreted compares with a compiled build: run python tools/compile_sim.py first")
    rows, others = [], []
    with tempfile.TemporaryDirectory(prefix="reflow-bench-sim-") as tmp:
        tree = Path(tmp)
        if args.interpreted:
            shutil.copytree(ROOT / "reflow_hpc", tree / "reflow_hpc",
                            ignore=shutil.ignore_patterns("*.so", "*.pyd", "_compiled.json", "__pycache__"))
        for gpus in [int(g) for g in args.gpus.split(",")]:
            for steps in [int(s) for s in args.steps.split(",")]:
                runs, other_runs = [], []
                for _ in range(args.repeat):
                    runs.append(cell(args.config, args.mode, gpus, steps, args.batch, args.split))
                    if args.interpreted:
                        other_runs.append(interpreted_cell(tree, args, gpus, steps))
                best = f"  (least of {args.repeat})" if args.repeat > 1 else ""
                rows.append(min(runs, key=lambda r: r["cpu_s"]))
                print(line(rows[-1]) + best, flush=True)
                if other_runs:
                    others.append(min(other_runs, key=lambda r: r["cpu_s"]))
                    print(line(others[-1]) + best
                          + f"  (compiled: {others[-1]['cpu_s'] / rows[-1]['cpu_s']:.2f}× faster)", flush=True)
    a, b = fit(rows)
    per_step = sum(r["samples"] / r["steps"] for r in rows) / len(rows)
    estimate = a + b * per_step * 500
    print(f"fit: cpu ≈ {a:.2f} s + {b * 1e6:.1f} µs × samples; 500 steps of {rows[-1]['batch']} samples "
          f"(≈ {per_step * 500:,.0f} created): ≈ {estimate:.0f} s")
    out = {"config": args.config, "mode": args.mode, "rows": rows, "fit": {"a_s": a, "b_s_per_sample": b},
           "estimate_500_steps_s": estimate}
    if others:
        ratio = sum(o["cpu_s"] for o in others) / sum(r["cpu_s"] for r in rows)
        print(f"compiled vs interpreted, same cells: {ratio:.2f}× less CPU")
        out.update(interpreted_rows=others, compiled_speedup=ratio)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
