"""Elastic vs static placement, and adaptive vs fixed generation caps, on a workload that drifts.

    python tools/bench_elastic.py [CONFIG] [--steps N] [--warmup-steps K] [--cpu-quota Q] [--repeat N]
                                  [--set section.key=value ...] [--json]

CONFIG defaults to ``configs/cpu_drift.toml``: the tiny Qwen3 on arithmetic whose responses grow
during the run (``task.drift_prompts``), so the balance between generation and training moves:
early on the trainer is the bottleneck, later generation is. Every run is mode reflow from the same
warm start with the same seed and steps, every rank held to ``--cpu-quota`` of one core
(``resources.cpu_quota``, so a waiting rank loses its time as on a GPU). The runs:

- ``elastic``: the placement planner moves workers between the pools (scheduler.elastic);
- ``static n_T=k``: every fixed split of the ranks;
- ``elastic, fixed caps``: elastic, without adaptive generation scheduling (scheduler.adaptive = false).

Per run also the machine probe around it (tokens per CPU second of a fixed generation,
``machine_probe.json``): this machine's speed drifts between runs minutes apart, and a repeat whose
elastic arm ran more than 25 % slower or faster than its best static arm is flagged.

Per run: tokens/s (the paper's throughput: trainer tokens ÷ step time, over the steps after
``--warmup-steps``), generation tokens/s (``rollout/generated_tokens_per_s``), trainer and rollout
idle, the planner's median error per step in the usable fresh coverage and the step time it
predicted (``placement/coverage_*``, ``placement/step_predicted_s``), and the placements it went
through. Then elastic ÷ best static, elastic ÷ worst static, and adaptive ÷ fixed caps in generation
tokens/s. ``--repeat N`` runs the whole set N times, interleaved, and reports the median of each
ratio over the repeats. ``--json`` prints one object on the last line with those medians
(``elastic_over_best_static``, ``elastic_over_worst_static``, ``elastic_idle_trainer``,
``elastic_idle_rollout``, ``elastic_coverage_error``, ``elastic_step_error``,
``adaptive_over_fixed_generation``) and every repeat's. The goals it measures: elastic ≥ 1.0× the
best static split and ≥ 1.15× the worst; trainer idle ≤ 10 %, rollout idle ≤ 2 %.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import RANK_TOLERANCE, ROOT, machine_speed, mean, median, prepare, run, run_arguments, table  # noqa: E402

from reflow_hpc.sim.report import median_error  # noqa: E402



def measure(name: str, metrics: list[dict], summary: dict, warmup: int, wall: float) -> dict:
    measured = [m for m in metrics if m["step"] > warmup] or metrics
    seconds = sum(m["step_seconds"] for m in measured)
    return {"run": name, "steps": len(metrics),
            "throughput_tokens_per_s": sum(m["tokens"] for m in measured) / seconds if seconds else float("nan"),
            "generation_tokens_per_s": mean(m.get("rollout/generated_tokens_per_s") for m in measured),
            "idle_ratio/trainer": mean(m["idle_ratio/trainer"] for m in measured),
            "idle_ratio/rollout": mean(m["idle_ratio/rollout"] for m in measured),
            "replay_fraction": mean(m["replay_fraction"] for m in measured),
            "placements": " ".join(f"{s}:{n}" for s, n in summary.get("placements", [])) or "-",
            "coverage_error": median_error(measured, "placement/coverage_predicted", "placement/coverage_observed"),
            "step_error": median_error(measured, "placement/step_predicted_s", "step_seconds"),
            "train_seconds": sum(m["step_seconds"] for m in metrics), "wall_seconds": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs" / "cpu_drift.toml"))
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: trainer.steps)")
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--cpu-quota", type=float, default=0.45)
    run_arguments(ap, timeout=3600)
    ap.add_argument("--repeat", type=int, default=1, help="run every arm N times, interleaved; ratios are medians")
    args = ap.parse_args(argv)
    cfg = prepare(args.config, args.sets)
    steps = args.steps or cfg.trainer.steps
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_elastic-"))
    common = ["reflow.mode=reflow", f"trainer.steps={steps}", f"resources.cpu_quota={args.cpu_quota}",
              "run.eval_prompts=0", "checkpoint.every_steps=0", *args.sets]
    w = cfg.resources.workers
    plans = [("elastic", ["scheduler.elastic=true"])]
    plans += [(f"static n_T={k}", ["scheduler.elastic=false", f"resources.trainer_replicas={k}",
                                   f"resources.rollout_instances={w - k}"]) for k in range(1, w)]
    plans += [("elastic, fixed caps", ["scheduler.elastic=true", "scheduler.adaptive=false"])]
    rows = []
    for rep in range(args.repeat):                    # repeats interleaved: a slow spell of the machine hits every run
        for name, sets in plans:
            tag = f" (repeat {rep + 1})" if args.repeat > 1 else ""
            print(f"bench_elastic: {name}{tag} ({steps} steps) ...", file=sys.stderr, flush=True)
            run_name = name.replace(" ", "_").replace("=", "").replace(",", "") + (f"_r{rep}" if rep else "")
            run_dir, metrics, summary, wall = run(args.config, run_name, common + sets, out, args.timeout)
            rows.append({"repeat": rep + 1, **measure(name, metrics, summary, args.warmup_steps, wall),
                         "machine_probe": machine_speed(run_dir) or float("nan")})
    reps = [ratios([r for r in rows if r["repeat"] == k + 1]) for k in range(args.repeat)]
    res = {k: median([x[k] for x in reps]) for k in reps[0] if isinstance(reps[0][k], float)}
    res.update(repeats=reps, cpu_quota=args.cpu_quota, steps=steps, rows=rows)
    print(table(rows, [("rep", "repeat", "{}"), ("run", "run", "{}"), ("tok/s", "throughput_tokens_per_s", "{:.0f}"),
                       ("gen tok/s", "generation_tokens_per_s", "{:.0f}"), ("idle T", "idle_ratio/trainer", "{:.1%}"),
                       ("idle R", "idle_ratio/rollout", "{:.1%}"), ("replay", "replay_fraction", "{:.2f}"),
                       ("cov err", "coverage_error", "{:.1%}"), ("step err", "step_error", "{:.1%}"),
                       ("placements (after step:n_T)", "placements", "{}"), ("train s", "train_seconds", "{:.0f}"),
                       ("probe", "machine_probe", "{:.0f}")]))
    for x in reps:
        print(f"repeat: elastic / best static ({x['best_static']}) {x['elastic_over_best_static']:.2f}, "
              f"/ worst ({x['worst_static']}) {x['elastic_over_worst_static']:.2f}; elastic idle trainer "
              f"{x['elastic_idle_trainer']:.1%}, rollout {x['elastic_idle_rollout']:.1%}; machine probe, elastic / "
              f"best static: {x['probe_elastic_over_best']:.2f}")
        if abs(x["probe_elastic_over_best"] - 1) > RANK_TOLERANCE:
            print(f"  flag: the machine ran the elastic arm at {x['probe_elastic_over_best']:.2f}× the best static "
                  f"arm's speed (probe, tokens per CPU second): this repeat's ratio measures the machine as much "
                  f"as the placement")
    med = f"median of {args.repeat} " if args.repeat > 1 else ""
    print(f"{med}elastic / best static: {res['elastic_over_best_static']:.2f} (goal ≥ 1.0); elastic / worst static: "
          f"{res['elastic_over_worst_static']:.2f} (goal ≥ 1.15)")
    print(f"{med}elastic idle: trainer {res['elastic_idle_trainer']:.1%} (goal ≤ 10%), rollout "
          f"{res['elastic_idle_rollout']:.1%} (goal ≤ 2%); adaptive / fixed caps, generation tokens/s: "
          f"{res['adaptive_over_fixed_generation']:.2f}; the planner's coverage / step-time error (median "
          f"|predicted / observed − 1| per step): {res['elastic_coverage_error']:.1%} / {res['elastic_step_error']:.1%}")
    if args.json:
        print(json.dumps(res))
    return 0


def ratios(rows: list[dict]) -> dict:
    """One repeat's ratios: elastic against the best and the worst static split, adaptive against fixed caps."""
    by = {r["run"]: r for r in rows}
    static = [r for r in rows if r["run"].startswith("static")]
    best = max(static, key=lambda r: r["throughput_tokens_per_s"])
    worst = min(static, key=lambda r: r["throughput_tokens_per_s"])
    e = by["elastic"]
    return {"elastic_over_best_static": e["throughput_tokens_per_s"] / best["throughput_tokens_per_s"],
            "elastic_over_worst_static": e["throughput_tokens_per_s"] / worst["throughput_tokens_per_s"],
            "best_static": best["run"], "worst_static": worst["run"],
            "elastic_idle_trainer": e["idle_ratio/trainer"], "elastic_idle_rollout": e["idle_ratio/rollout"],
            "elastic_coverage_error": e["coverage_error"], "elastic_step_error": e["step_error"],
            "adaptive_over_fixed_generation": e["generation_tokens_per_s"]
            / by["elastic, fixed caps"]["generation_tokens_per_s"],
            "probe_elastic_over_best": e["machine_probe"] / best["machine_probe"]}


if __name__ == "__main__":
    sys.exit(main())
