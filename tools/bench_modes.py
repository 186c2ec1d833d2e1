"""The four pipeline modes side by side on the same config, seed, workers and batches.

    python tools/bench_modes.py [CONFIG] [--steps N] [--warmup-steps K] [--modes sync,reflow,...]
                                [--repeat N] [--cpu-quota Q] [--peer trl] [--set section.key=value ...] [--json]

CONFIG defaults to ``configs/cpu_bench.toml`` (the calibrated workload) and ``--steps`` to its
``trainer.steps``. Each mode is one real run (``python -m reflow_hpc.run``: MPI ranks, engine,
trainer, shards) of ``--steps`` optimizer steps of ``trainer.batch_size`` samples; all start from
the same warm-started policy with the same seed. Per mode it reports the paper's throughput
(tokens processed by the trainer ÷ step time, averaged over the steps after ``--warmup-steps``),
trainer and rollout idle ratios, final training reward, the end-of-run evaluation
(``reflow_hpc.evaluation``: task prompts and held-out texts), and wall time; then the ratios
reflow ÷ sync and reflow ÷ fully_async. ``--peer trl`` adds TRL's GRPOTrainer on the same model,
task and reward (``tools/peer_trl.py``; needs the ``bench`` extra), in a process held to the same
total CPU share as our ranks together. With ``--json`` the last line is one JSON object.

``--repeat N`` runs every mode N times, the order of the modes reversed on every other pass (sync …
reflow, reflow … sync, …), so that a drift of the machine's speed during the bench weighs alike on
every mode; a mode's throughput is then Σ tokens ÷ Σ step seconds over its passes' measured steps.
The runs are ``bench-<mode>`` (first pass) and ``bench-<mode>-<k>`` (pass k), listed in each row's
``runs``; ``throughput_per_pass`` shows how far the passes agree.

Per rank (``reflow_hpc/runtime/rankstats.py``, summary.json's ``ranks``) it reports the busy generation
rate (tokens ÷ seconds the engine had requests in flight), the CPU seconds of the rank's cgroup (of its
process where the cgroup does not account CPU: cgroup v1 with ``cpuacct`` mounted apart) and that as a
share of one core, the time its CPU quota held it back, and its OS and torch thread counts; to tell a
rank that got less CPU from one whose tokens cost more, also the share of a core its generation got while
busy, its tokens per CPU second of generation, its engine's mean running requests per decode and prefilled
tokens per generated token (re-prefills after aborts), and the CPU of its service thread, other threads
and children: a table of
every rank of every run, the medians per mode as columns of the main table (``gen/rank``, ``CPU/rank``,
``threads``; in the JSON rows ``rank_profile`` and ``ranks``, each pass's records), and a line ``FLAG: …``
for a mode whose per-rank busy generation rate, tokens per CPU second, CPU share of generation or thread
count differs by more than 25 % from sync's
(every mode runs at equal caps, the same ``--cpu-quota``, so a rank should generate as fast in any mode;
a CPU share may differ, since a waiting rank uses less), and for a rank with no CPU cgroup although a
quota was asked for or above its cap. The JSON object's ``flags`` lists them.

The baselines are their namesakes (``core/modes.py``): every mode syncs after every step, the
baselines train without replay (σ = 0), and each run reports the smallest and largest staleness of
any token it trained (the trainer refuses a token that breaks the mode's guarantee). Every rank is
held to ``--cpu-quota`` of one core (``resources.cpu_quota``, default 0.45: four ranks on two
cores), so that a waiting rank loses its time as on a dedicated GPU instead of lending its core to
the others.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_common import cap_flags, drift_flags, mode_flags, rank_profile, ranks_table, run, run_arguments  # noqa: E402

from reflow_hpc.config import load  # noqa: E402
from reflow_hpc.sim.report import table as text_table  # noqa: E402

MODES = ("sync", "one_step_off", "fully_async", "reflow")


def mode_sets(mode: str) -> list[str]:
    """The overrides that make a run of ``mode`` a true instance of it (before the user's own)."""
    from reflow_hpc.core.modes import rules
    sets = [f"reflow.mode={mode}", "reflow.sync_every=1"]
    if not rules(mode).replays:
        sets.append("reflow.sigma=0")
    return sets


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


def run_name(mode: str, k: int) -> str:
    """The run directory of pass ``k`` (from 0) of ``mode``."""
    return f"bench-{mode}" if k == 0 else f"bench-{mode}-{k + 1}"


def pass_order(modes: list[str], k: int) -> list[str]:
    """Pass ``k`` runs the modes forwards when k is even, backwards when odd."""
    return list(modes) if k % 2 == 0 else list(reversed(modes))


def run_mode(config: str, mode: str, name: str, steps: int, sets: list[str], out: Path,
             timeout: float) -> tuple[list[dict], dict, float]:
    """One run of ``mode``: its per-step metrics, its summary (ranks with the machine probe) and its wall seconds."""
    _, metrics, summary, wall = run(config, name, [f"trainer.steps={steps}", *mode_sets(mode), *sets], out, timeout)
    return metrics, summary, wall


def mode_row(mode: str, runs: list[tuple[str, list[dict], dict, float]], warmup: int) -> dict:
    """One mode's row over its passes (``runs``: name, metrics, summary, wall seconds of each)."""
    def measured_of(metrics: list[dict]) -> list[dict]:
        return [m for m in metrics if m["step"] > warmup] or metrics

    def throughput(steps: list[dict]) -> float:
        seconds = sum(m["step_seconds"] for m in steps)
        return sum(m["tokens"] for m in steps) / seconds if seconds else math.nan

    measured = [m for _, metrics, _, _ in runs for m in measured_of(metrics)]
    metrics = [m for _, ms, _, _ in runs for m in ms]
    n = len(runs)
    summary = _merge_summaries([s for _, _, s, _ in runs])
    ranks = [list(s.get("ranks") or []) for _, _, s, _ in runs]           # each pass's rank records
    profile = rank_profile([r for recs in ranks for r in recs])
    return {
        "system": "reflow_hpc", "mode": mode, "steps": len(metrics) // n, "passes": n,
        "runs": [name for name, _, _, _ in runs],
        "throughput_tokens_per_s": throughput(measured),
        "throughput_per_pass": [throughput(measured_of(ms)) for _, ms, _, _ in runs],
        "idle_ratio/trainer": _mean(m["idle_ratio/trainer"] for m in measured),
        "idle_ratio/rollout": _mean(m["idle_ratio/rollout"] for m in measured),
        "replay_fraction": _mean(m["replay_fraction"] for m in measured),
        "staleness/mean": _mean(m["staleness/mean"] for m in measured),
        "token_staleness": [min(m["trainer/token_staleness_min"] for m in metrics),
                            max(m["trainer/token_staleness_max"] for m in metrics)],
        "sync_seconds": _mean(m["sync_seconds"] for m in measured),
        # tool calls (multi-turn tasks): the workers' latency over their last 256 calls, averaged over the
        # measured steps, and the last step's cumulative turns per sample and time spent waiting for tools
        "tool_seconds_p50": _mean(m.get("rollout/tool_seconds_p50") for m in measured),
        "tool_seconds_p99": _mean(m.get("rollout/tool_seconds_p99") for m in measured),
        "turns_per_sample": _mean([metrics[-1].get("rollout/turns_per_sample")]),
        "tool_wait_fraction": _mean([metrics[-1].get("rollout/tool_wait_fraction")]),
        "reward_first_steps": summary.get("reward_first_steps"),
        "reward_last_steps": summary.get("reward_last_steps"),
        **{k: v for k, v in summary.items() if k.startswith("eval/")},
        "trained_tokens": sum(m["tokens"] for m in metrics) / n,          # per pass
        "train_seconds": sum(m["step_seconds"] for m in metrics) / n,
        "wall_seconds": sum(wall for _, _, _, wall in runs) / n,
        "time_split": _time_split(measured),
        "rank_profile": profile, "ranks": ranks,
        "rank_busy_gen_tokens_per_s": profile["busy_gen_tokens_per_s"], "rank_cpu_share": profile["cpu_share"],
        "rank_threads": profile["threads"],
    }


def _merge_summaries(summaries: list[dict]) -> dict:
    """The evaluation and reward entries of several passes' summaries: numbers averaged, anything else
    (the eval curve) from the first pass."""
    out = {}
    for k, v in summaries[0].items():
        if not (k.startswith("eval/") or k.startswith("reward_")):
            continue
        numbers = isinstance(v, (int, float)) and not isinstance(v, bool)
        out[k] = _mean(s.get(k) for s in summaries) if numbers else v
    return out


def _time_split(measured: list[dict]) -> dict:
    """Where a step's time goes, averaged: trainer compute, fetch, waiting for data."""
    return {
        "step_s": _mean(m["step_seconds"] for m in measured),
        "trainer_compute_s": _mean(m.get("trainer/seconds") for m in measured),
        "fetch_s": _mean(m.get("fetch_seconds") for m in measured),
        "trainer_wait_s": _mean(m["idle_ratio/trainer"] * m["step_seconds"] for m in measured),
    }


COLUMNS = [("system", "system", "{}"), ("mode", "mode", "{}"), ("tok/s", "throughput_tokens_per_s", "{:.0f}"),
           ("idle T", "idle_ratio/trainer", "{:.1%}"), ("idle R", "idle_ratio/rollout", "{:.1%}"),
           ("replay", "replay_fraction", "{:.2f}"), ("staleness", "token_staleness", "{0[0]}..{0[1]}"),
           ("reward first", "reward_first_steps", "{:.3f}"),
           ("reward last", "reward_last_steps", "{:.3f}"), ("eval start", "eval/task/start_reward", "{:.3f}"),
           ("eval final", "eval/task/final_reward", "{:.3f}"), ("held-out", "eval/held_out/final_reward", "{:.3f}"),
           ("gen/rank tok/s", "rank_busy_gen_tokens_per_s", "{:.0f}"), ("CPU/rank", "rank_cpu_share", "{:.2f}"),
           ("threads", "rank_threads", "{:.0f}"), ("tool p50 s", "tool_seconds_p50", "{:.3f}"),
           ("tool p99 s", "tool_seconds_p99", "{:.3f}"), ("turns", "turns_per_sample", "{:.2f}"),
           ("train s", "train_seconds", "{:.1f}"),
           ("wall s", "wall_seconds", "{:.1f}")]


def table(rows: list[dict]) -> str:
    return text_table(rows, COLUMNS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs" / "cpu_bench.toml"))
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per mode (default: trainer.steps)")
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeat", type=int, default=1,
                    help="passes over the modes, every other one in reverse order (module docstring)")
    ap.add_argument("--cpu-quota", type=float, default=0.45,
                    help="share of one core every rank is held to (resources.cpu_quota; 0 = none)")
    ap.add_argument("--peer", choices=("trl",), default=None)
    run_arguments(ap, timeout=1800)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: must be at least 1")
    args.sets = [f"resources.cpu_quota={args.cpu_quota}", *args.sets]
    cfg = load(args.config, args.sets)
    if args.steps is None:
        args.steps = cfg.trainer.steps
    if cfg.model.warmstart:
        from reflow_hpc.warmstart import ensure_policy
        ensure_policy(cfg)          # a no-op when model.path holds the policy this config warm-starts
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_modes-"))
    modes = args.modes.split(",")
    runs: dict[str, list] = {m: [] for m in modes}
    for k in range(args.repeat):
        for mode in pass_order(modes, k):
            name = run_name(mode, k)
            print(f"bench_modes: running {mode} ({args.steps} steps, pass {k + 1} of {args.repeat}) ...",
                  file=sys.stderr, flush=True)
            runs[mode].append((name, *run_mode(args.config, mode, name, args.steps, args.sets, out, args.timeout)))
    rows = [mode_row(mode, runs[mode], args.warmup_steps) for mode in modes]
    if args.peer == "trl":
        sys.path.insert(0, str(ROOT / "tools"))
        from peer_trl import run_trl_held
        print("bench_modes: running TRL GRPOTrainer ...", file=sys.stderr, flush=True)
        peer = run_trl_held(args.config, args.sets, cpu_share=cfg.resources.workers * args.cpu_quota,
                            steps=args.steps, timeout=args.timeout)
        peer.setdefault("mode", "GRPOTrainer")
        rows.append(peer)
    by = {r["mode"]: r for r in rows if r.get("system") == "reflow_hpc"}
    ratios = {}
    if "reflow" in by:
        for base in ("sync", "fully_async", "one_step_off"):
            if base in by:
                ratios[f"reflow/{base}"] = by["reflow"]["throughput_tokens_per_s"] / by[base]["throughput_tokens_per_s"]
        if "sync" in by:
            # Training reward (unused samples of the last tenth) is confounded by which prompts each
            # mode reached; the evaluation scores every mode on the same task prompts.
            ratios["final_reward_gap_vs_sync"] = (by["reflow"]["reward_last_steps"] or math.nan) - \
                                                 (by["sync"]["reward_last_steps"] or math.nan)
            ratios["final_eval_gap_vs_sync"] = (by["reflow"].get("eval/task/final_reward") or math.nan) - \
                                               (by["sync"].get("eval/task/final_reward") or math.nan)
    print(table(rows))
    rank_runs = [(name, recs) for r in rows if r.get("system") == "reflow_hpc"
                 for name, recs in zip(r["runs"], r["ranks"])]
    profiles = {m: r["rank_profile"] for m, r in by.items() if r["rank_profile"]["ranks"]}
    flags = mode_flags(profiles, "sync") + drift_flags(profiles, "sync")
    for name, recs in rank_runs:
        flags += cap_flags(name, recs, args.cpu_quota)
    if any(recs for _, recs in rank_runs):
        print(ranks_table(rank_runs))
    else:
        print("per-rank records: none (runs made before the runtime kept ranks/rank<NNNNN>.json)")
    for line in flags:
        print(line)
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}" if "gap" not in k else f"{k}: {v:+.3f}")
    targets = {"reflow/sync": 1.6, "reflow/fully_async": 1.25}
    for k, t in targets.items():
        if k in ratios:
            print(f"target {k} ≥ {t}: {'met' if ratios[k] >= t else 'NOT met'} ({ratios[k]:.2f})")
    if "reflow" in by:
        r = by["reflow"]
        print(f"target reflow idle: trainer {r['idle_ratio/trainer']:.1%} (≤ 10%), rollout {r['idle_ratio/rollout']:.1%} (≤ 2%)")
    if args.json:
        print(json.dumps({"config": args.config, "steps": args.steps, "warmup_steps": args.warmup_steps,
                          "cpu_quota": args.cpu_quota, "repeat": args.repeat,
                          "rows": rows, "ratios": ratios, "flags": flags, "out": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
