"""Command line of the simulator.

    python -m reflow_hpc.sim CONFIG [--set section.key=value ...] [--gpus N[,N...]] [--modes M,...]
                                    [--json] [--plot DIR]
    python -m reflow_hpc.sim --calibrate [--json]
    python -m reflow_hpc.sim --crosscheck BENCH_JSON [--json]

The first form simulates each mode (default: all four) of CONFIG at each GPU count (default:
``sim.gpus``, or the ``[resources]`` split when it is 0) and prints one row per run, then the ratios
reflow ÷ each baseline per GPU count. With ``--json`` the last line is one JSON object:
``{"config", "rows", "by_gpus": {N: {"ratios": …}}}`` and, when one GPU count was asked for, a
top-level ``"ratios"`` too. ``--plot DIR`` writes throughput.png, idle.png and one role timeline per
reflow run. The second form runs the calibration gate (:mod:`reflow_hpc.sim.calibrate`); its exit
status is 1 when a gated point is off by more than the tolerance, and its JSON has ``max_abs_error``.
The third compares a ``tools/bench_modes.py --json`` result (a file holding its JSON line) with the
same modes simulated on ``configs/sim_cpu_tiny.toml``; it reports, it does not gate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..config import main_guard, notices
from . import calibrate as cal
from .report import idle_beside_paper, ratios, simulate, table
from .workload import MODE_ORDER


def _plain(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def run_config(args) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODE_ORDER]
    if unknown:
        raise SystemExit(f"sim: unknown mode {unknown[0]!r} (modes: {', '.join(MODE_ORDER)})")
    gpu_list = [int(g) for g in args.gpus.split(",")] if args.gpus else [None]
    rows, by_gpus, timelines = [], {}, []
    noted: set[str] = set()
    for gpus in gpu_list:
        here = []
        for mode in modes:
            res = simulate(args.config, mode, args.sets, gpus, timeline=bool(args.plot) and mode == "reflow")
            row = res.summary
            here.append(row)
            print(f"sim: {mode} on {row['gpus']} GPU(s): {row['throughput_tokens_per_s']:,.0f} tokens/s "
                  f"({row['events']:,} events)", file=sys.stderr, flush=True)
            for line in notices(res.sim.cfg):
                if line not in noted:
                    noted.add(line)
                    print(f"sim: {line}", file=sys.stderr, flush=True)
            if res.sim.timeline is not None:
                timelines.append((row, res.sim.timeline))
        rows += here
        by_gpus[str(here[0]["gpus"])] = {"ratios": ratios(here)}
    print(table(rows))
    for g, d in by_gpus.items():
        if d["ratios"]:
            print(f"{g} GPUs: " + "  ".join(f"{k} {v:.2f}" for k, v in d["ratios"].items()))
    for r in rows:
        if r["mode"] == "reflow":
            print(f"{r['gpus']} GPUs: reflow trainer idle {r['idle_trainer']:.1%}, rollout idle {r['idle_rollout']:.1%}, "
                  f"replay fraction {r['replay_fraction']:.2f}, switches {r['switches']}")
    for r in rows:
        if r.get("prefill_share"):
            sh = r["prefill_share"]
            print(f"{r['gpus']} GPUs: {r['mode']} rollout time in prefill stalls: first {sh['first']:.1%}, "
                  f"re-prefill after preemption or hand-over {sh['reprefill']:.1%}, after weight syncs {sh['sync']:.1%}")
    for line in idle_beside_paper(rows):
        print(line)
    if args.plot:
        from .plots import role_timeline, scaling
        out = Path(args.plot)
        title = Path(args.config).stem if args.config else "defaults"
        paths = scaling(rows, out, title) if len(gpu_list) > 1 else []
        for row, tl in timelines:
            paths.append(role_timeline(tl, row["workers"], out, f"{title}: reflow on {row['gpus']} GPUs",
                                       f"roles_reflow_{row['gpus']}.png"))
        for p in paths:
            print(f"wrote {p}")
    if args.json:
        obj = {"config": args.config, "sets": args.sets, "rows": rows, "by_gpus": by_gpus}
        if len(by_gpus) == 1:
            obj["ratios"] = next(iter(by_gpus.values()))["ratios"]
        print(json.dumps(obj, default=_plain))
    return 0


def run_calibration(args) -> int:
    print(f"calibration gate: every gated point within ±{cal.TOLERANCE:.0%} of its published value", flush=True)
    outcomes = cal.run(progress=lambda o: print(cal.format_outcome(o), flush=True))
    rep = cal.report(outcomes)
    sw = cal.role_switch_check()
    for direction, d in sw.items():
        print(f"role switch {direction:<10} (ReFlow Table 2, not gated): published {d['published']:.2f} s, "
              f"cost model {d['simulated']:.2f} s")
    print(f"max |error| of the gated points: {rep['max_abs_error']:.1%} "
          f"({'passed' if rep['passed'] else 'FAILED'}); of all points: {rep['max_abs_error_all']:.1%}")
    if args.json:
        print(json.dumps({**rep, "role_switch": sw}, default=_plain))
    return 0 if rep["passed"] else 1


def run_crosscheck(args) -> int:
    lines = [ln for ln in Path(args.crosscheck).read_text().splitlines() if ln.strip().startswith("{")]
    if not lines:
        raise SystemExit(f"sim: {args.crosscheck}: no JSON line of tools/bench_modes.py --json")
    rep = cal.crosscheck(json.loads(lines[-1]))
    if rep["fit"]:
        print(f"cost model fitted to the bench's runs ({rep['runs']}): {' '.join(rep['fit'])}")
        for m in rep["primitives"]:
            print(f"  {m['mode']:<13} trainer {m['trainer_ms_per_token']:.3f} ms/token  update {m['update_s']:.3f} s  "
                  f"sync {m['sync_s']:.4f} s  fetch {m['fetch_ms_per_sample']:.2f} ms/sample  "
                  f"engine {m['generation_rate_per_busy_worker']:.0f} tokens/s busy")
    else:
        print(f"the bench's run directories are gone: {rep['config']}'s stored cost model is used, not a fit to "
              f"the bench's machine")
    print(f"cross-check: tools/bench_modes.py measured vs {rep['config']} simulated ({rep['seeds']} seeds)")
    for m in rep["modes"]:
        print(f"  {m['mode']:<13} measured {m['measured']:8.0f} tok/s  simulated {m['simulated']:8.0f} tok/s  "
              f"error {m['error']:+6.1%}")
    for r in rep["ratios"]:
        print(f"  {r['ratio']:<19} measured {r['measured']:5.2f}  simulated {r['simulated']:5.2f}  error {r['error']:+6.1%}")
    own = rep.get("own_primitives")
    if own:
        print("each mode simulated on the primitives of its own runs (the event logic, not one cost model for all):")
        for m in own["modes"]:
            print(f"  {m['mode']:<13} measured {m['measured']:8.0f} tok/s  simulated {m['simulated']:8.0f} tok/s  "
                  f"error {m['error']:+6.1%}")
        for r in own["ratios"]:
            print(f"  {r['ratio']:<19} measured {r['measured']:5.2f}  simulated {r['simulated']:5.2f}  "
                  f"error {r['error']:+6.1%}")
    if args.json:
        print(json.dumps(rep, default=_plain))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reflow_hpc.sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", help="TOML config (a real run's config works too)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--gpus", default="", help="GPU count(s), comma-separated (default: sim.gpus)")
    ap.add_argument("--modes", default=",".join(MODE_ORDER))
    ap.add_argument("--json", action="store_true", help="one JSON object on the last line")
    ap.add_argument("--plot", default="", metavar="DIR", help="write PNG figures into DIR")
    ap.add_argument("--calibrate", action="store_true", help="run the calibration gate")
    ap.add_argument("--crosscheck", default="", metavar="BENCH_JSON",
                    help="compare a tools/bench_modes.py --json result with the simulated modes")
    args = ap.parse_args(argv)
    if args.calibrate:
        return main_guard(lambda: run_calibration(args))
    if args.crosscheck:
        return main_guard(lambda: run_crosscheck(args))
    if not args.config:
        ap.error("a CONFIG is needed (or --calibrate)")
    return main_guard(lambda: run_config(args))


if __name__ == "__main__":
    sys.exit(main())
