"""What the run-based benchmarks share: one real run of ``python -m reflow_hpc.run`` and a text table."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reflow_hpc.metrics import read_jsonl  # noqa: E402
from reflow_hpc.sim.report import table  # noqa: E402,F401  (rows, [(header, key, format)]) -> right-aligned text


def run(config: str, name: str, sets: list[str], out: Path, timeout: float) -> tuple[Path, list[dict], dict, float]:
    """One run in ``out/name`` (no resume, shards under ``out/scratch``); (run dir, step metrics, summary, wall s).
    A failed run ends the benchmark with its output."""
    args = [sys.executable, "-m", "reflow_hpc.run", config, "--set", f"run.output_dir={out}", "--set", f"run.name={name}",
            "--set", f"storage.dir={out / 'scratch' / name}", "--set", "checkpoint.resume=false"]
    for s in sets:
        args += ["--set", s]
    t0 = time.monotonic()
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"{Path(sys.argv[0]).name}: run {name} failed (exit {r.returncode}):\n"
                         f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    run_dir = out / name
    return run_dir, read_jsonl(run_dir / "metrics.jsonl"), json.loads((run_dir / "summary.json").read_text()), wall


def prepare(config: str, sets: list[str]):
    """The config with the benchmark's overrides, its policy warm-started first if it asks for that
    (one warm start shared by every run of the benchmark)."""
    from reflow_hpc.config import load
    cfg = load(config, sets)
    if cfg.model.warmstart:
        from reflow_hpc.warmstart import ensure_policy
        ensure_policy(cfg)
    return cfg


def mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


def median(xs) -> float:
    xs = sorted(x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x)))
    if not xs:
        return math.nan
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
