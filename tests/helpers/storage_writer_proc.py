"""A worker that streams samples into its store until it is killed (for tests/integration/test_storage.py).

    python tests/helpers/storage_writer_proc.py DIR [--seed S] [--flush-rows N] [--segment-mib M]

Sample i is make_sample(seed, 0, i), put one at a time. After every flush it prints
``FLUSHED <n>``: samples 0..n-1 are then in the shard on disk.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from storage_samples import make_sample  # noqa: E402

from reflow_hpc.config import StorageConfig  # noqa: E402
from reflow_hpc.storage import SampleStore  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--flush-rows", type=int, default=16)
    ap.add_argument("--segment-mib", type=float, default=0.05)
    ap.add_argument("--max-samples", type=int, default=200_000)
    ap.add_argument("--sleep", type=float, default=0.0005, help="seconds between puts")
    args = ap.parse_args()
    cfg = StorageConfig(flush_rows=args.flush_rows, segment_mib=args.segment_mib, flush_s=3600.0)
    store = SampleStore(args.dir, 0, cfg)
    flushed = 0
    print("READY", flush=True)
    for i in range(args.max_samples):
        store.put([make_sample(args.seed, 0, i, max_len=100)])
        if store.writer.flushed_total != flushed:
            flushed = store.writer.flushed_total
            print(f"FLUSHED {flushed}", flush=True)
        time.sleep(args.sleep)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
