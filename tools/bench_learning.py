"""Time to reward: the four modes from the same warm start, for the same training-time budget, over seeds.

    python tools/bench_learning.py [CONFIG] [--modes sync,one_step_off,fully_async,reflow] [--seeds 0,1,2]
                                   [--algorithms grpo,dapo,...] [--budget-s 120] [--eval-every-steps 20]
                                   [--cpu-quota 0.45]
                                   [--peer trl] [--out DIR] [--plot FILE.png] [--set section.key=value ...] [--json]

ReFlow's claim is *the same final reward, reached sooner*. Each (mode, seed) is one real run
(``python -m reflow_hpc.run``: MPI ranks, engine, trainer, shards) of CONFIG (default: the main job,
``configs/cpu_tiny.toml``) from its warm-started policy, stopped after ``--budget-s`` seconds of
training (``trainer.time_budget_s``). The modes are their namesakes (``tools/bench_modes.py``:
every mode syncs after every step, the baselines train without replay) and every rank is held to
``--cpu-quota`` of one core, so a waiting rank loses its time as on a GPU. The runs snapshot their
weights every ``--eval-every-steps`` steps and score each snapshot after training, on the same task
prompts never drawn in training (``eval/task/reward``: the mean reward of ``run.eval_samples``
samples per prompt), stamped with the training time at which it was taken.

Per mode: the eval reward against training time, mean ± standard error over seeds (a PNG plot),
and a table with the final eval reward, the time to reach 90 % of sync's final gain, and that
time divided by sync's. The JSON object (``--json``, last line) adds ``reflow_over_sync_time``
(reflow's time to reach sync's final eval reward ÷ sync's), ``final_gap`` (reflow − sync final
eval reward, mean over seeds) and ``final_gap_se``. The goal it measures: reflow reaches sync's
final reward in ≤ 0.6× sync's time, and ends within one standard error (or 0.02) of it.

``--algorithms a,b,…`` runs every objective (``algorithm.name``) in each mode of ``--modes`` from the
same warm start, seeds and budget; the arms are then named by objective (``mode:objective`` with more
than one mode). An arm may carry its own settings, ``cispo[cispo_clip_low=1;cispo_clip_high=2]``
(``section.key=value``; a bare key is in ``[algorithm]``), so variants of one objective compare side by
side with the others. The JSON object's ``algorithms`` maps each to ``final``, ``final_se`` (eval reward at the
end, mean ± s.e. over seeds), ``gain``, ``gain_se`` (final minus the start policy's sampled eval reward,
per seed), ``well_formed_gain`` (the same among samples already in the verifier's answer form, which
separates learning the task from learning its format), ``vs_grpo`` and ``vs_grpo_se`` (final minus
grpo's, paired by seed) and the means of the run's ``rollout_is/*`` metrics.

``--peer trl`` adds TRL's GRPOTrainer (``tools/peer_trl.py``) for the same budget, held to the same
total CPU share; it reports only its start and final score (TRL has no snapshot scoring here).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_modes import MODES, mode_sets  # noqa: E402

from reflow_hpc.config import load  # noqa: E402
from reflow_hpc.metrics import read_jsonl  # noqa: E402

GAIN_FRACTION = 0.9          # "time to reach 90 % of sync's final gain"
GRID_POINTS = 200            # common time grid the seeds' curves are averaged on


# ----------------------------------------------------------------------------------------------
# Curves (pure: the unit tests drive these)
# ----------------------------------------------------------------------------------------------

def interpolate(points: list[tuple[float, float]], t: float) -> float:
    """A seed's curve at time ``t``: linear between its snapshots, its last value after the last one."""
    if t <= points[0][0]:
        return points[0][1]
    for (t0, y0), (t1, y1) in zip(points, points[1:]):
        if t <= t1:
            return y0 if t1 == t0 else y0 + (y1 - y0) * (t - t0) / (t1 - t0)
    return points[-1][1]


def mean_curve(runs: list[list[tuple[float, float]]], horizon: float) -> list[tuple[float, float, float]]:
    """(t, mean, standard error) over the seeds on a common grid from 0 to ``horizon``."""
    out = []
    for i in range(GRID_POINTS + 1):
        t = horizon * i / GRID_POINTS
        ys = [interpolate(r, t) for r in runs]
        out.append((t, _mean(ys), _se(ys)))
    return out


def time_to_reach(curve: list[tuple[float, float, float]], level: float) -> float:
    """First time the mean curve reaches ``level`` (linear between grid points); nan if it never does."""
    for (t0, y0, _), (t1, y1, _) in zip(curve, curve[1:]):
        if y0 >= level:
            return t0
        if y1 >= level:
            return t0 + (t1 - t0) * (level - y0) / (y1 - y0)
    return curve[-1][0] if curve and curve[-1][1] >= level else math.nan


def summarise(curves: dict[str, list[list[tuple[float, float]]]], horizon: float) -> dict:
    """Per mode: final reward (mean, se over seeds), time to 90 % of sync's gain and its ratio to sync's;
    overall: reflow_over_sync_time, final_gap, final_gap_se."""
    rows: dict[str, dict] = {}
    # A run's last evaluation comes a little after the budget (the step in flight ends first): the grid
    # reaches every run's last point, so that a mean curve ends at the mean of the final rewards.
    horizon = max([horizon] + [r[-1][0] for runs in curves.values() for r in runs if r])
    means = {mode: mean_curve(runs, horizon) for mode, runs in curves.items()}
    for mode, runs in curves.items():
        finals = [r[-1][1] for r in runs]
        rows[mode] = {"final_reward": _mean(finals), "final_reward_se": _se(finals), "seeds": len(runs),
                      "start_reward": _mean([r[0][1] for r in runs])}
    out: dict = {"modes": rows}
    if "sync" in means:
        start, sync_final = rows["sync"]["start_reward"], rows["sync"]["final_reward"]
        level = start + GAIN_FRACTION * (sync_final - start)
        sync_t = time_to_reach(means["sync"], level)
        for mode, curve in means.items():
            t = time_to_reach(curve, level)
            rows[mode]["time_to_90pct_of_sync_gain_s"] = t
            rows[mode]["time_over_sync"] = t / sync_t if sync_t and not math.isnan(sync_t) else math.nan
        if "reflow" in means:
            sync_own = time_to_reach(means["sync"], sync_final)
            out["reflow_over_sync_time"] = time_to_reach(means["reflow"], sync_final) / sync_own \
                if sync_own and not math.isnan(sync_own) else math.nan
            gaps = None
            if len(curves["reflow"]) == len(curves["sync"]):         # paired by seed
                gaps = [a[-1][1] - b[-1][1] for a, b in zip(curves["reflow"], curves["sync"])]
            out["final_gap"] = rows["reflow"]["final_reward"] - sync_final
            out["final_gap_se"] = _se(gaps) if gaps else math.hypot(rows["reflow"]["final_reward_se"],
                                                                     rows["sync"]["final_reward_se"])
            out["gain_level"] = level
    return out


def summarise_algorithms(runs: list[dict], labels: list[str]) -> dict:
    """Per objective (arm label): final eval reward, gain over the start policy, the same gain among
    well-formed samples and the difference to grpo's arm, each mean ± s.e. over seeds (paired by seed)."""
    by: dict[str, dict[int, dict]] = {}
    for r in runs:
        by.setdefault(r["mode"], {})[r["seed"]] = r
    out: dict[str, dict] = {}
    ref = next((lab for lab in labels if lab.split(":")[-1] == "grpo"), None)
    for label in labels:
        seeds = by.get(label, {})
        finals = [r["curve"][-1][1] for r in seeds.values()]
        gains = [r["curve"][-1][1] - r["curve"][0][1] for r in seeds.values()]
        wf = [r["well_formed_curve"][-1][1] - r["well_formed_curve"][0][1] for r in seeds.values()
              if r.get("well_formed_curve")]
        row = {"final": _mean(finals), "final_se": _se(finals), "gain": _mean(gains), "gain_se": _se(gains),
               "well_formed_gain": _mean(wf), "well_formed_gain_se": _se(wf), "seeds": len(finals)}
        if ref is not None:
            diffs = [r["curve"][-1][1] - by[ref][sd]["curve"][-1][1] for sd, r in seeds.items() if sd in by[ref]]
            row["vs_grpo"], row["vs_grpo_se"] = _mean(diffs), _se(diffs)
        is_keys = sorted({k for r in seeds.values() for k in r.get("rollout_is", {})})
        for k in is_keys:
            row[k] = _mean([r["rollout_is"][k] for r in seeds.values() if k in r.get("rollout_is", {})])
        out[label] = row
    return out


def algorithms_table(rows: dict[str, dict]) -> str:
    head = ["objective", "seeds", "final", "± s.e.", "gain", "± s.e.", "well-formed gain", "vs grpo", "± s.e.",
            "IS mean"]
    lines = [head]
    for label, r in rows.items():
        lines.append([label, str(r["seeds"]), f"{r['final']:.3f}", _fmt(r["final_se"], ".3f"), f"{r['gain']:+.3f}",
                      _fmt(r["gain_se"], ".3f"), _fmt(r["well_formed_gain"], "+.3f"), _fmt(r.get("vs_grpo"), "+.3f"),
                      _fmt(r.get("vs_grpo_se"), ".3f"), _fmt(r.get("rollout_is/mean"), ".4f")])
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    text = ["  ".join(c.rjust(w) for c, w in zip(x, widths)) for x in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _se(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    if len(xs) < 2:
        return math.nan
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------

def arm_sets(arm: str) -> list[str]:
    """``--set`` values of an arm ``name`` or ``name[key=value;section.key=value]``."""
    name, _, rest = arm.partition("[")
    extra = [kv.strip() for kv in rest.rstrip("]").split(";") if kv.strip()]
    return [f"algorithm.name={name.strip()}"] + [kv if "." in kv.split("=")[0] else f"algorithm.{kv}" for kv in extra]


def run_one(config: str, mode: str, seed: int, args: argparse.Namespace, out: Path,
            algorithm: str | None = None, label: str | None = None) -> dict:
    label = label or mode
    name = "learn-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") + f"-s{seed}"
    chosen = arm_sets(algorithm) if algorithm else []
    sets = [*mode_sets(mode), *chosen, f"run.seed={seed}", f"trainer.time_budget_s={args.budget_s}",
            "trainer.steps=1000000", f"run.eval_every_steps={args.eval_every_steps}",
            f"resources.cpu_quota={args.cpu_quota}", f"run.output_dir={out}", f"run.name={name}",
            f"storage.dir={out / 'scratch' / name}", "checkpoint.resume=false", "checkpoint.every_steps=0",
            *args.sets]
    cmd = [sys.executable, "-m", "reflow_hpc.run", config]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.budget_s * 4 + 900)
    if r.returncode != 0:
        raise SystemExit(f"bench_learning: {name} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    run_dir = out / name
    evals = read_jsonl(run_dir / "metrics.jsonl", "eval")
    steps = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    is_keys = sorted({k for m in steps for k in m if k.startswith("trainer/rollout_is/")})
    return {"mode": label, "seed": seed, "steps": summary["steps"], "train_seconds": summary["train_seconds"],
            "wall_seconds": time.monotonic() - t0,
            "curve": [(e["eval/elapsed_s"], e["eval/task/reward"]) for e in evals],
            "well_formed_curve": [(e["eval/elapsed_s"], e.get("eval/task/well_formed_reward", math.nan),
                                   e.get("eval/task/well_formed", math.nan)) for e in evals],
            "rollout_is": {k.removeprefix("trainer/"): _mean([m[k] for m in steps if k in m]) for k in is_keys},
            "greedy": [(e["eval/elapsed_s"], e["eval/task/greedy"]) for e in evals],
            "throughput_tokens_per_s": sum(m["tokens"] for m in steps) / max(1e-9, sum(m["step_seconds"] for m in steps)),
            "idle_ratio/trainer": _mean([m["idle_ratio/trainer"] for m in steps]),
            "idle_ratio/rollout": _mean([m["idle_ratio/rollout"] for m in steps])}


def run_peer(config: str, seed: int, args: argparse.Namespace, workers: int) -> dict:
    """TRL for the same budget, held to the same total CPU share as our ranks together."""
    from peer_trl import run_trl_held
    res = run_trl_held(config, [f"run.seed={seed}", *args.sets], cpu_share=workers * args.cpu_quota,
                       steps=1_000_000, max_seconds=args.budget_s, timeout=args.budget_s * 4 + 900)
    return {"mode": "trl", "seed": seed, "steps": res.get("steps"), "train_seconds": res["wall_seconds"],
            "curve": [(0.0, res["eval/task/start_reward"]), (res["wall_seconds"], res["eval/task/final_reward"])],
            "throughput_tokens_per_s": res.get("throughput_tokens_per_s")}


def plot(curves: dict[str, list], horizon: float, path: Path, level: float | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, runs in curves.items():
        if mode == "trl":
            xs = [r[-1][0] for r in runs]
            ys = [r[-1][1] for r in runs]
            ax.scatter(xs, ys, marker="x", label="TRL GRPOTrainer (final)")
            continue
        c = mean_curve(runs, horizon)
        t = [p[0] for p in c]
        m = [p[1] for p in c]
        se = [0.0 if math.isnan(p[2]) else p[2] for p in c]
        ax.plot(t, m, label=f"{mode} ({len(runs)} seeds)")
        ax.fill_between(t, [a - b for a, b in zip(m, se)], [a + b for a, b in zip(m, se)], alpha=0.2)
    if level is not None and not math.isnan(level):
        ax.axhline(level, color="grey", lw=0.8, ls="--", label=f"{GAIN_FRACTION:.0%} of sync's final gain")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("eval reward, task prompts never trained on")
    ax.set_title("Eval reward against training time (mean ± s.e. over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(result: dict) -> str:
    head = ["mode", "seeds", "final reward", "± s.e.", "t to 90% of sync gain (s)", "÷ sync"]
    rows = [head]
    for mode, r in result["modes"].items():
        rows.append([mode, str(r["seeds"]), f"{r['final_reward']:.3f}", _fmt(r["final_reward_se"], ".3f"),
                     _fmt(r.get("time_to_90pct_of_sync_gain_s"), ".0f"), _fmt(r.get("time_over_sync"), ".2f")])
    widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(x, widths)) for x in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs" / "cpu_tiny.toml"))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--algorithms", default=None, help="objectives (algorithm.name) to compare, comma-separated")
    ap.add_argument("--budget-s", type=float, default=120.0, help="training time of every run (seconds)")
    ap.add_argument("--eval-every-steps", type=int, default=25)
    ap.add_argument("--cpu-quota", type=float, default=0.45)
    ap.add_argument("--peer", choices=("trl",), default=None)
    ap.add_argument("--out", default=None, help="directory for the runs (default: a temporary one)")
    ap.add_argument("--plot", default=None, help="PNG path (default: OUT/bench_learning.png)")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cfg = load(args.config, args.sets)
    if cfg.model.warmstart:
        from reflow_hpc.warmstart import ensure_policy
        ensure_policy(cfg)                     # one warm start shared by every run
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_learning-"))
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = args.modes.split(",")
    algorithms = re.findall(r"[^,\[]+(?:\[[^\]]*\])?", args.algorithms) if args.algorithms else [None]
    # (label, mode, objective) of every arm: by mode alone, or by objective (and mode, with several)
    arms = [(mode if alg is None else alg if len(modes) == 1 else f"{mode}:{alg}", mode, alg)
            for alg in algorithms for mode in modes]
    runs: list[dict] = []
    for seed in seeds:                         # seeds outermost: a drifting machine hits every arm alike
        for label, mode, alg in arms:
            print(f"bench_learning: {label}, seed {seed}, {args.budget_s:g} s ...", file=sys.stderr, flush=True)
            runs.append(run_one(args.config, mode, seed, args, out, alg, label))
        if args.peer == "trl":
            print(f"bench_learning: TRL, seed {seed} ...", file=sys.stderr, flush=True)
            runs.append(run_peer(args.config, seed, args, cfg.resources.workers))
    curves: dict[str, list] = {}
    for r in runs:
        curves.setdefault(r["mode"], []).append(r["curve"])
    result = summarise({m: c for m, c in curves.items() if m != "trl"}, args.budget_s)
    if args.algorithms:
        result["algorithms"] = summarise_algorithms(runs, [label for label, _, _ in arms])
    if "trl" in curves:
        finals = [c[-1][1] for c in curves["trl"]]
        result["modes"]["trl"] = {"final_reward": _mean(finals), "final_reward_se": _se(finals),
                                  "seeds": len(finals), "start_reward": _mean([c[0][1] for c in curves["trl"]])}
    png = Path(args.plot) if args.plot else out / "bench_learning.png"
    plot(curves, args.budget_s, png, result.get("gain_level"))
    print(table(result))
    if "algorithms" in result:
        print(algorithms_table(result["algorithms"]))
    if "reflow_over_sync_time" in result:
        print(f"reflow reaches sync's final eval reward in {result['reflow_over_sync_time']:.2f}x sync's time "
              f"(goal ≤ 0.6); final gap reflow - sync {result['final_gap']:+.3f} ± {result['final_gap_se']:.3f} "
              f"(goal: within one s.e. or 0.02)")
    print(f"plot: {png}")
    if args.json:
        print(json.dumps({"config": args.config, "budget_s": args.budget_s, "seeds": seeds, "cpu_quota": args.cpu_quota,
                          "plot": str(png), "out": str(out), **result,
                          "runs": [{k: v for k, v in r.items()} for r in runs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
