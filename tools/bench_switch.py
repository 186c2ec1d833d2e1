"""Role-switch cost of the elastic pool: seconds per switch, each direction, on real MPI ranks.

    python tools/bench_switch.py [CONFIG] [--switches N] [--cpu-quota Q] [--set section.key=value ...] [--json]

One run of CONFIG (default ``configs/cpu_tiny.toml``: the tiny Qwen3, 4 ranks) in mode reflow whose
``scheduler.placement_schedule`` moves one worker from rollout to training and back, every other
step, ``--switches`` times each way. Per direction it reports the median and the largest
``role_switch_seconds`` (the slowest moving worker: hand-over of its samples and sleep of its engine,
or wake and state transfer, group change included) and the coordinator's time for the whole
switch (every worker's report). With ``--json`` the last line is one object with ``to_rollout_s``
and ``to_trainer_s`` (medians). The goal it measures: both under 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, mean, median, prepare, run, run_arguments, table  # noqa: E402



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs" / "cpu_tiny.toml"))
    ap.add_argument("--switches", type=int, default=8, help="switches each way")
    ap.add_argument("--cpu-quota", type=float, default=0.45)
    run_arguments(ap, timeout=1800)
    args = ap.parse_args(argv)
    cfg = prepare(args.config, args.sets)
    base = cfg.resources.trainer_replicas
    schedule = [f"{4 * k + 2}:{base + 1}" for k in range(args.switches)] + \
               [f"{4 * k + 4}:{base}" for k in range(args.switches)]
    steps = 4 * args.switches + 2
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_switch-"))
    sets = ["reflow.mode=reflow", "reflow.sync_every=1", "scheduler.elastic=false", f"trainer.steps={steps}",
            "scheduler.placement_schedule=[" + ",".join(f'"{x}"' for x in schedule) + "]",
            f"resources.cpu_quota={args.cpu_quota}", "run.eval_prompts=0", "checkpoint.every_steps=0", *args.sets]
    print(f"bench_switch: {steps} steps, {args.switches} switches each way ...", file=sys.stderr, flush=True)
    _, metrics, summary, _ = run(args.config, "switch", sets, out, args.timeout)
    rows = []
    for direction in ("to_trainer", "to_rollout"):
        xs = [m[f"role_switch_seconds/{direction}"] for m in metrics if f"role_switch_seconds/{direction}" in m]
        rows.append({"direction": direction, "switches": len(xs), "median_s": median(xs), "max_s": max(xs, default=0),
                     "mean_s": mean(xs)})
    whole = [m for m in metrics if "role_switch/handed_off" in m]
    print(table(rows, [("direction", "direction", "{}"), ("switches", "switches", "{}"),
                       ("median s", "median_s", "{:.3f}"), ("mean s", "mean_s", "{:.3f}"), ("max s", "max_s", "{:.3f}")]))
    print(f"samples handed over at the switches: {summary['handed_over']}; process groups prepared at start-up: "
          f"{summary['process_groups']} in {summary['process_groups_seconds']:.2f} s")
    res = {"to_trainer_s": rows[0]["median_s"], "to_rollout_s": rows[1]["median_s"],
           "to_trainer_max_s": rows[0]["max_s"], "to_rollout_max_s": rows[1]["max_s"], "switches": len(whole),
           "handed_over": summary["handed_over"], "process_groups": summary["process_groups"],
           "process_groups_seconds": summary["process_groups_seconds"], "cpu_quota": args.cpu_quota}
    for k in ("to_trainer_s", "to_rollout_s"):
        print(f"goal {k} < 0.5 s: {'met' if res[k] < 0.5 else 'NOT met'} ({res[k]:.3f} s)")
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
