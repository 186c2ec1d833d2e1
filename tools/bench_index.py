"""Replay-buffer index throughput at several resident sizes, side by side in one run.

    python tools/bench_index.py                      # 10k and 1M resident samples
    python tools/bench_index.py --sizes 10000 --json # one JSON object on the last line

For each size N the index is first filled with N replay samples (dispatched, finished, trained
once). Then a steady-state loop runs at ~N resident samples; every iteration
dispatches ``batch/2`` samples (insert), finishes them (complete), composes a batch of ``batch``
samples — half unused, half replay picked by the sampler — (compose) and ends the step (step_done):
the unused half enters the replay pool and the replayed half, trained for the second time, is
filtered out, so the resident count stays at N. Each kind of event is timed on its own; after one
warm-up round per size, ``--rounds`` rounds run, alternating between the sizes, and the best round
counts (least disturbed by other processes). Finally two version bumps evict everything (evict).
Events are counted per sample; compose also reports batches/s.

No operation of the index may scan the resident samples, so a rate at 1M should stay close to the
rate at 10k: the table ends with that ratio per event kind.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from reflow_hpc.core import ReplayFilter, ReplayIndex, make_sampler, register_replay_filter

OPS = ("insert", "complete", "compose", "step_done", "evict")


@register_replay_filter("bench_replay_once")
class ReplayOnce(ReplayFilter):
    """Reinsert a sample after its first step only: keeps the resident count constant."""

    def accept(self, sample):
        return sample.times_used < 2


def build(n_resident: int, group_size: int, batch: int, seed: int) -> tuple[ReplayIndex, float]:
    idx = ReplayIndex(group_size=group_size, batch_size=batch, sigma=0.5, tau=0.5, delta=1,
                      b_max=max(n_resident, batch) + group_size, sampler=make_sampler("random"),
                      replay_filter=ReplayOnce(), seed=seed)
    t0 = time.perf_counter()
    groups = -(-n_resident // group_size)
    for g in range(groups):
        for sid in idx.new_group(g).sample_ids:
            idx.finished(sid, owner=sid % 16, reward=(sid % 5) / 4, min_version=0, max_version=0,
                         loss_tokens=64 + sid % 100, location=[sid % 16, sid])
    while idx.count("ready") >= batch:
        idx.step_done(idx.compose_batch())
    return idx, time.perf_counter() - t0


def steady_round(idx: ReplayIndex, iterations: int, prompt0: int) -> dict[str, float]:
    group_size, batch = idx.group_size, idx.batch_size
    per_iter = batch // 2 // group_size            # groups dispatched per iteration
    spent = dict.fromkeys(("insert", "complete", "compose", "step_done"), 0.0)
    counts = dict.fromkeys(spent, 0)
    batches = 0
    clock = time.perf_counter
    for it in range(iterations):
        t0 = clock()
        groups = [idx.new_group(prompt0 + it * per_iter + k) for k in range(per_iter)]
        t1 = clock()
        for g in groups:
            for sid in g.sample_ids:
                idx.finished(sid, owner=sid % 16, reward=(sid % 5) / 4, min_version=0, max_version=0,
                             loss_tokens=64 + sid % 100, location=[sid % 16, sid])
        t2 = clock()
        b = idx.compose_batch()
        t3 = clock()
        if b is None:
            raise RuntimeError("bench: batch not ready in steady state")
        idx.step_done(b)
        t4 = clock()
        n = per_iter * group_size
        spent["insert"] += t1 - t0
        spent["complete"] += t2 - t1
        spent["compose"] += t3 - t2
        spent["step_done"] += t4 - t3
        counts["insert"] += n
        counts["complete"] += n
        counts["compose"] += len(b)
        counts["step_done"] += len(b)
        batches += 1
    rates = {op: counts[op] / spent[op] for op in spent}
    rates["compose_batches"] = batches / spent["compose"]
    return rates


def evict_all(idx: ReplayIndex) -> float:
    clock = time.perf_counter
    t0 = clock()
    n = len(idx.bump_version()) + len(idx.bump_version())
    dt = clock() - t0
    if n == 0 or len(idx) != 0:
        raise RuntimeError(f"bench: eviction left {len(idx)} samples")
    return n / dt


def run(sizes: list[int], rounds: int, iterations: int, group_size: int, batch: int, seed: int) -> dict:
    out: dict = {"sizes": {}, "group_size": group_size, "batch_size": batch, "rounds": rounds,
                 "iterations": iterations}
    built = {n: build(n, group_size, batch, seed) for n in sizes}
    best: dict[int, dict[str, float]] = {n: {} for n in sizes}
    for n, (idx, _) in built.items():
        steady_round(idx, iterations, prompt0=10**7)          # warm-up, discarded
    # Rounds alternate between the sizes so that load from other processes hits them alike.
    for r in range(1, rounds + 1):
        for n, (idx, _) in built.items():
            rates = steady_round(idx, iterations, prompt0=(r + 1) * 10**7)
            best[n] = {k: max(v, best[n].get(k, 0.0)) for k, v in rates.items()}
    for n, (idx, fill_s) in built.items():
        idx.check_accounting()
        row = {op: {"events_per_s": best[n][op]} for op in ("insert", "complete", "compose", "step_done")}
        row["compose"]["batches_per_s"] = best[n]["compose_batches"]
        row["resident"] = len(idx)
        row["evict"] = {"events_per_s": evict_all(idx)}
        row["fill_s"] = fill_s
        out["sizes"][str(n)] = row
    rows = list(out["sizes"].values())
    out["min_events_per_s"] = min(row[op]["events_per_s"] for row in rows for op in OPS)
    if len(rows) > 1:
        out["ratio_largest_vs_smallest"] = {op: rows[-1][op]["events_per_s"] / rows[0][op]["events_per_s"]
                                            for op in OPS}
    return out


def table(result: dict) -> str:
    sizes = list(result["sizes"])
    lines = [f"replay index events/s (per sample; best of {result['rounds']} rounds of {result['iterations']} "
             f"iterations; group {result['group_size']}, batch {result['batch_size']})", ""]
    head = f"{'event':<12}" + "".join(f"{int(s):>16,}" for s in sizes)
    ratio = result.get("ratio_largest_vs_smallest")
    if ratio:
        head += f"{'ratio':>10}"
    lines += [head, "-" * len(head)]
    for op in OPS:
        line = f"{op:<12}" + "".join(f"{result['sizes'][s][op]['events_per_s']:>16,.0f}" for s in sizes)
        if ratio:
            line += f"{ratio[op]:>10.2f}"
        lines.append(line)
    lines.append(f"{'batches/s':<12}" + "".join(f"{result['sizes'][s]['compose']['batches_per_s']:>16,.0f}"
                                                 for s in sizes))
    lines.append(f"{'resident':<12}" + "".join(f"{result['sizes'][s]['resident']:>16,}" for s in sizes))
    lines.append(f"{'fill (s)':<12}" + "".join(f"{result['sizes'][s]['fill_s']:>16.1f}" for s in sizes))
    lines += ["", f"slowest event kind: {result['min_events_per_s']:,.0f} events/s (target ≥ 100,000)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000], help="resident samples")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=100, help="steady-state iterations per round")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = ap.parse_args(argv)
    if args.batch_size // 2 < args.group_size or args.batch_size % (2 * args.group_size):
        ap.error("--batch-size must be a multiple of 2 × --group-size")
    result = run(args.sizes, args.rounds, args.iterations, args.group_size, args.batch_size, args.seed)
    print(table(result))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
