"""Spill speed of the shard writer against raw file writes of the same bytes, side by side in one run.

    python tools/bench_storage.py                    # ~50 MB of samples, best of 5 rounds
    python tools/bench_storage.py --fsync --json     # fsync per batch on both sides; JSON last line

The *shard* side is what a worker does: ``SampleStore.put`` one sample at a time (memory cache off),
the writer batching ``--flush-rows`` samples per write + flush, an XXH3-64 hash per batch, rotating segments
at ``--segment-mib`` (the config default unless given), then ``close`` (manifest). The *raw* side
writes the same payload bytes (tokens, logprobs, versions of every sample) with plain buffered
``write`` calls to one file and flushes after every ``--flush-rows`` samples — the same flush
policy; with ``--fsync`` both sides also fsync after every batch. Both write to the same directory;
rounds alternate raw/shard and the best round of each side counts (the least disturbed by other
processes; the ratio of the medians is printed too). MB/s counts payload bytes only (12 bytes per
token), so the shard's metadata, offsets and checksums are overhead it has to pay for.
Target: ratio ≥ 0.7.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from reflow_hpc.config import StorageConfig
from reflow_hpc.storage import SampleStore
from reflow_hpc.trajectory import Trajectory


def make_samples(n: int, mean_len: int, seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(mean_len // 4, mean_len * 7 // 4 + 1))
        prompt = min(length, int(rng.integers(16, 256)))
        versions = np.full(length, -1, np.int32)
        versions[prompt:] = 3
        logprobs = np.zeros(length, np.float32)
        logprobs[prompt:] = -rng.exponential(1.0, length - prompt)
        out.append(Trajectory(sample_id=i, group_id=i // 8, prompt_id=i // 8,
                              tokens=rng.integers(0, 151_000, length, dtype=np.int32),
                              logprobs=logprobs, versions=versions, prompt_len=prompt,
                              reward=float(i % 2), finish_reason="stop", meta={"answer": str(i)}))
    return out


def raw_round(trajs: list[Trajectory], path: Path, flush_rows: int, fsync: bool) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for k, t in enumerate(trajs, 1):
            f.write(t.tokens)
            f.write(t.logprobs)
            f.write(t.versions)
            if k % flush_rows == 0 or k == len(trajs):
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
    return time.perf_counter() - t0


def shard_round(trajs: list[Trajectory], directory: Path, cfg: StorageConfig) -> float:
    t0 = time.perf_counter()
    store = SampleStore(directory, 0, cfg)
    for t in trajs:
        store.put([t])
    store.close()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--mean-len", type=int, default=2048, help="mean tokens per sample (prompt + response)")
    ap.add_argument("--flush-rows", type=int, default=StorageConfig.flush_rows)
    ap.add_argument("--segment-mib", type=float, default=StorageConfig.segment_mib,
                    help="segment size bound (smaller values add rotations: ~10 ms each)")
    ap.add_argument("--fsync", action="store_true", help="fsync every batch on both sides")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="", help="scratch directory (default: a temporary one under $TMPDIR)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = ap.parse_args(argv)

    trajs = make_samples(args.samples, args.mean_len, args.seed)
    payload = sum(t.tokens.nbytes + t.logprobs.nbytes + t.versions.nbytes for t in trajs)
    cfg = StorageConfig(flush_rows=args.flush_rows, flush_s=3600.0, fsync=args.fsync,
                        segment_mib=args.segment_mib, memory_mib=0.0)
    scratch = Path(tempfile.mkdtemp(prefix="bench_storage-", dir=args.dir or None))
    raw_s, shard_s, segments = [], [], 0
    try:
        for r in range(args.rounds):
            raw_s.append(raw_round(trajs, scratch / "raw.bin", args.flush_rows, args.fsync))
            (scratch / "raw.bin").unlink()
            shard_dir = scratch / f"shard{r}"
            shard_s.append(shard_round(trajs, shard_dir, cfg))
            segments = len(list(shard_dir.glob("seg-*.h5")))
            shutil.rmtree(shard_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    mb = payload / 1e6
    raw_mbs, shard_mbs = mb / min(raw_s), mb / min(shard_s)
    median_ratio = statistics.median(raw_s) / statistics.median(shard_s)
    result = {"samples": args.samples, "payload_mb": round(mb, 1), "flush_rows": args.flush_rows,
              "segment_mib": args.segment_mib, "segments": segments, "fsync": args.fsync, "rounds": args.rounds,
              "raw_mb_s": round(raw_mbs, 1), "shard_mb_s": round(shard_mbs, 1),
              "shard_samples_s": round(args.samples / min(shard_s), 1),
              "ratio": round(shard_mbs / raw_mbs, 3), "ratio_of_medians": round(median_ratio, 3),
              "raw_rounds_s": [round(x, 4) for x in raw_s], "shard_rounds_s": [round(x, 4) for x in shard_s]}
    policy = "write + flush + fsync per batch" if args.fsync else "write + flush per batch, no fsync"
    print(f"shard spill vs raw write: {args.samples} samples, {mb:.1f} MB payload, batches of "
          f"{args.flush_rows}, {policy}, best of {args.rounds} rounds, dir {args.dir or tempfile.gettempdir()}")
    print(f"{'side':<8}{'MB/s':>10}{'samples/s':>12}  rounds (s)")
    print(f"{'raw':<8}{raw_mbs:>10.1f}{args.samples / min(raw_s):>12.1f}  " + " ".join(f"{x:.3f}" for x in raw_s))
    print(f"{'shard':<8}{shard_mbs:>10.1f}{args.samples / min(shard_s):>12.1f}  "
          + " ".join(f"{x:.3f}" for x in shard_s) + f"  ({segments} segments)")
    print(f"ratio shard/raw: {shard_mbs / raw_mbs:.3f} (target ≥ 0.7; ratio of medians {median_ratio:.3f})")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
