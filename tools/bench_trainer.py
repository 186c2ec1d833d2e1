"""A trainer replica's step on a run's own samples, with and without a token cap on its passes.

    python tools/bench_trainer.py [CONFIG] [--run DIR] [--shares 16,11] [--caps 0,1600,800]
                                  [--steps N] [--repeat R] [--threads T] [--json]

The samples are a finished run's (``DIR/shards``, the shards a run collects at its end); without
``--run`` the benchmark first runs CONFIG as it is (default ``configs/cpu_drift.toml``, whose response
lengths are long-tailed and grow over the run). One trainer replica of CONFIG's policy then trains
``--steps`` batches drawn from those samples, of each ``--shares`` size (a replica's share of a batch
``b``: b / n_T), once per ``trainer.micro_batch_tokens`` in ``--caps`` (0: passes of
``trainer.micro_batch_size`` samples), the same batches for every cap; the caps take turns within
each of ``--repeat`` rounds, so a slow spell of the machine hits all of them. Per share and cap it
prints the passes per step, the padded tokens (samples × the longest, per pass) against the tokens
the samples hold, the largest pass (what bounds activation memory), the forward/backward seconds
per step (median over the rounds of each round's mean) and its ratio to no cap, measured side by
side. ``--json`` prints one object on the last line with every row.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, mean, median, prepare, run, run_arguments, table  # noqa: E402


def run_samples(run_dir: Path) -> list:
    """Every sample a run's collected shards hold that has tokens to train on."""
    from reflow_hpc.storage.reader import ShardReader
    shards = run_dir / "shards"
    dirs = sorted(p for p in shards.iterdir() if p.is_dir()) if shards.is_dir() else []
    if not dirs:
        raise SystemExit(f"bench_trainer: {shards}: no shard directories (a finished run with storage.collect = true)")
    out = []
    for d in dirs:
        with ShardReader(d) as reader:
            out += [t for t in reader.get(reader.ids()) if t.num_loss_tokens > 0]
    if not out:
        raise SystemExit(f"bench_trainer: {shards}: no sample with generated tokens")
    return out


def batches(samples: list, share: int, steps: int, seed: int) -> list[list]:
    """``steps`` batches of ``share`` samples each, drawn without replacement within a batch; advantages
    standard normal, the same weight for every sample (what a step costs does not depend on them)."""
    import numpy as np
    from reflow_hpc.train.trainer import WeightedSample
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        idx = rng.choice(len(samples), size=min(share, len(samples)), replace=False)
        out.append([WeightedSample(samples[i], float(rng.normal()), 1.0) for i in idx])
    return out


def passes(batch: list, max_samples: int, max_tokens: int) -> tuple[int, int, int, int]:
    """(passes, padded tokens, tokens held, the largest pass's padded tokens) of one batch."""
    from reflow_hpc.train.trainer import micro_batches
    lengths = sorted(len(it.trajectory.tokens) for it in batch)
    runs = micro_batches(lengths, max_samples, max_tokens)
    padded = [len(lengths[r]) * lengths[r][-1] for r in runs]
    return len(runs), sum(padded), sum(lengths), max(padded)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs" / "cpu_drift.toml"))
    ap.add_argument("--run", default=None, help="a finished run's directory (default: run CONFIG first)")
    ap.add_argument("--shares", default=None, help="samples per replica and step (default: b/2 and b/3)")
    ap.add_argument("--caps", default=None, help="trainer.micro_batch_tokens values (default: 0, and the "
                                                 "largest pass of no cap ÷ 2 and ÷ 4)")
    ap.add_argument("--steps", type=int, default=8, help="batches per share and cap in each round")
    ap.add_argument("--repeat", type=int, default=3, help="rounds, the caps taking turns in each")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the CPU benches' one rank per core)")
    run_arguments(ap, timeout=1800)
    args = ap.parse_args(argv)
    cfg = prepare(args.config, args.sets)
    if args.run:
        run_dir = Path(args.run)
    else:
        out = Path(args.out or tempfile.mkdtemp(prefix="bench_trainer-"))
        print(f"bench_trainer: running {Path(args.config).name} for its samples ...", file=sys.stderr, flush=True)
        run_dir, _, _, _ = run(args.config, "samples", ["run.eval_prompts=0", "checkpoint.every_steps=0",
                                                        "storage.collect=true", *args.sets], out, args.timeout)
    samples = run_samples(run_dir)
    b, mbs = cfg.trainer.batch_size, cfg.trainer.micro_batch_size
    shares = [int(x) for x in args.shares.split(",")] if args.shares else sorted({-(-b // 2), -(-b // 3)}, reverse=True)

    import torch
    from reflow_hpc.policy import load_policy
    from reflow_hpc.train.trainer import Trainer
    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.run.seed)
    plan = {share: batches(samples, share, args.steps, cfg.run.seed + share) for share in shares}
    if args.caps:
        caps = [int(x) for x in args.caps.split(",")]
    else:
        widest = max(passes(batch, mbs, 0)[3] for bs in plan.values() for batch in bs)
        caps = [0, widest // 2, widest // 4]
    lengths = sorted(len(t.tokens) for t in samples)
    print(f"bench_trainer: {len(samples)} samples of {run_dir}, tokens per sample median {median(lengths):.0f}, "
          f"max {lengths[-1]}; micro_batch_size {mbs}; caps {caps}; {args.steps} steps × {args.repeat} rounds",
          file=sys.stderr, flush=True)

    model, _ = load_policy(cfg.model.path, cfg.model.dtype, "cpu")
    seconds: dict[tuple[int, int], list[float]] = {}
    for rnd in range(args.repeat):
        for k in range(len(caps)):
            cap = caps[(k + rnd) % len(caps)]              # the caps take turns
            cfg.trainer.micro_batch_tokens = cap
            trainer = Trainer(model, cfg, "cpu")
            for share in shares:
                ts = []
                for batch in plan[share]:
                    n = sum(it.trajectory.num_loss_tokens for it in batch)
                    ts.append(trainer.train_step(batch, n, len(batch))["forward_backward_seconds"])
                seconds.setdefault((share, cap), []).append(mean(ts))
    rows = []
    for share in shares:
        base = median(seconds[(share, 0)]) if (share, 0) in seconds else float("nan")
        for cap in caps:
            shape = [passes(batch, mbs, cap) for batch in plan[share]]
            s = median(seconds[(share, cap)])
            rows.append({"share": share, "cap": cap, "passes": mean([x[0] for x in shape]),
                         "padded_tokens": mean([x[1] for x in shape]), "tokens": mean([x[2] for x in shape]),
                         "padding": mean([1 - x[2] / x[1] for x in shape]), "largest_pass": max(x[3] for x in shape),
                         "fwd_bwd_s": s, "over_no_cap": s / base})
    print(table(rows, [("share", "share", "{}"), ("cap", "cap", "{}"), ("passes", "passes", "{:.1f}"),
                       ("padded tok", "padded_tokens", "{:.0f}"), ("tokens", "tokens", "{:.0f}"),
                       ("padding", "padding", "{:.1%}"), ("largest pass", "largest_pass", "{}"),
                       ("fwd+bwd s", "fwd_bwd_s", "{:.3f}"), ("÷ no cap", "over_no_cap", "{:.2f}")]))
    if args.json:
        print(json.dumps({"run": str(run_dir), "samples": len(samples), "micro_batch_size": mbs, "steps": args.steps,
                          "repeat": args.repeat, "threads": args.threads, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
