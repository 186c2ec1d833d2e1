"""Elastic vs static placement, and adaptive vs fixed generation caps, on a workload that drifts.

    python tools/bench_elastic.py [CONFIG] [--steps N] [--warmup-steps K] [--cpu-quota Q]
                                  [--set section.key=value ...] [--json]

CONFIG defaults to ``configs/cpu_drift.toml``: the tiny Qwen3 on arithmetic whose responses grow
during the run (``task.drift_prompts``), so the balance between generation and training moves:
early on the trainer is the bottleneck, later generation is. Every run is mode reflow from the same
warm start with the same seed and steps, every rank held to ``--cpu-quota`` of one core
(``resources.cpu_quota``, so a waiting rank loses its time as on a GPU). The runs:

- ``elastic``: the placement planner moves workers between the pools (scheduler.elastic);
- ``static n_T=k``: every fixed split of the ranks;
- ``elastic, fixed caps``: elastic, without adaptive generation scheduling (scheduler.adaptive = false).

Per run: tokens/s (the paper's throughput: trainer tokens ÷ step time, over the steps after
``--warmup-steps``), generation tokens/s (``rollout/generated_tokens_per_s``), trainer and rollout
idle, and the placements it went through. Then elastic ÷ best static, elastic ÷ worst static, and
adaptive ÷ fixed caps in generation tokens/s. ``--json`` prints one object on the last line with
``elastic_over_best_static``, ``elastic_over_worst_static``, ``elastic_idle_trainer``,
``elastic_idle_rollout`` and ``adaptive_over_fixed_generation``. The goals it measures: elastic ≥
0.95× the best static split and ≥ 1.15× the worst; trainer idle ≤ 10 %, rollout idle ≤ 2 %.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, mean, prepare, run, table  # noqa: E402



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
            "train_seconds": sum(m["step_seconds"] for m in metrics), "wall_seconds": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs" / "cpu_drift.toml"))
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: trainer.steps)")
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--cpu-quota", type=float, default=0.45)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", action="store_true")
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
    for name, sets in plans:
        print(f"bench_elastic: {name} ({steps} steps) ...", file=sys.stderr, flush=True)
        _, metrics, summary, wall = run(args.config, name.replace(" ", "_").replace("=", "").replace(",", ""),
                                        common + sets, out, args.timeout)
        rows.append(measure(name, metrics, summary, args.warmup_steps, wall))
    by = {r["run"]: r for r in rows}
    static = [r for r in rows if r["run"].startswith("static")]
    best = max(static, key=lambda r: r["throughput_tokens_per_s"])
    worst = min(static, key=lambda r: r["throughput_tokens_per_s"])
    e = by["elastic"]
    res = {"elastic_over_best_static": e["throughput_tokens_per_s"] / best["throughput_tokens_per_s"],
           "elastic_over_worst_static": e["throughput_tokens_per_s"] / worst["throughput_tokens_per_s"],
           "best_static": best["run"], "worst_static": worst["run"],
           "elastic_idle_trainer": e["idle_ratio/trainer"], "elastic_idle_rollout": e["idle_ratio/rollout"],
           "adaptive_over_fixed_generation": e["generation_tokens_per_s"]
           / by["elastic, fixed caps"]["generation_tokens_per_s"],
           "cpu_quota": args.cpu_quota, "steps": steps, "rows": rows}
    print(table(rows, [("run", "run", "{}"), ("tok/s", "throughput_tokens_per_s", "{:.0f}"),
                       ("gen tok/s", "generation_tokens_per_s", "{:.0f}"), ("idle T", "idle_ratio/trainer", "{:.1%}"),
                       ("idle R", "idle_ratio/rollout", "{:.1%}"), ("replay", "replay_fraction", "{:.2f}"),
                       ("placements (after step:n_T)", "placements", "{}"), ("train s", "train_seconds", "{:.0f}")]))
    print(f"elastic / best static ({best['run']}): {res['elastic_over_best_static']:.2f} (goal ≥ 0.95); "
          f"elastic / worst static ({worst['run']}): {res['elastic_over_worst_static']:.2f} (goal ≥ 1.15)")
    print(f"elastic idle: trainer {e['idle_ratio/trainer']:.1%} (goal ≤ 10%), rollout {e['idle_ratio/rollout']:.1%} "
          f"(goal ≤ 2%); adaptive / fixed caps, generation tokens/s: {res['adaptive_over_fixed_generation']:.2f}")
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
