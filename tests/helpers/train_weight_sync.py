"""MPI program for tests/integration/test_weight_sync.py: rank 0 (a trainer) syncs its weights to ranks 1 and 2
(torch rollout engines) in small buckets, then two failures.

    mpiexec -n 3 python tests/helpers/train_weight_sync.py [--bucket-mb MB] [--timeout T]

1. Two syncs, a training step in between: the engines' weights must equal the trainer's bit for bit.
2. Rank 2 holds a model of another shape: every rank fails at the first sync naming rank 2.
3. Rank 2 never joins the third sync: ranks 0 and 1 fail within the sync's timeout ``T`` (the
   process group has the 30-minute default) naming their rank, the sync and the bucket; rank 2
   goes on after ``T + 4`` s.

Rank 0 gathers every rank's findings over MPI and prints one line ``RESULT [json, ...]``; every rank
finalises MPI and ends with ``os._exit`` (a process group that timed out cannot be torn down cleanly).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gloo_ranks import start_ranks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bucket-mb", type=float, default=0.02)
    ap.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args()

    MPI = start_ranks(60)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    import torch.distributed as dist

    from reflow_hpc.rollout.torch_engine import TorchEngine
    from reflow_hpc.comm.dist import CollectiveError
    from reflow_hpc.train.trainer import Trainer
    from reflow_hpc.train.weight_sync import WeightSync, WeightSyncMismatch
    from train_common import loss_tokens, make_batch, make_config, params_digest, tiny_model

    group = dist.new_group([0, 1, 2])      # no timeout of its own: the sync's timeout_s must bound every wait
    out: dict = {"rank": rank}

    # 1. Two good syncs.
    cfg = make_config()
    if rank == 0:
        trainer = Trainer(tiny_model(1), cfg, "cpu")
        model = trainer.model
        sync = WeightSync.for_model(model, src=0, bucket_mb=args.bucket_mb, group=group, timeout_s=args.timeout)
    else:
        model = tiny_model(2)
        engine = TorchEngine(model, max_concurrency=2, kv_budget_tokens=256, max_model_len=64)
        sync = WeightSync.for_model(model, src=0, bucket_mb=args.bucket_mb, group=group, timeout_s=args.timeout)
    digests = []
    for version in (1, 2):
        if rank == 0 and version == 2:
            items = make_batch(model, cfg, seed=3)
            trainer.train_step(items, loss_tokens(items))
        # Each sync starts together on every rank: its timeout bounds the transfer, not how long the
        # others took to build their models or to train (seconds on a loaded machine).
        comm.Barrier()
        if rank == 0:
            stats = sync.send(trainer.named_weights())
        else:
            storages = []

            def watched(pairs):
                for name, tensor in pairs:
                    storages.append(tensor.untyped_storage().nbytes())
                    yield name, tensor

            engine.load_weights(watched(sync.receive()), version)
            stats = sync.last
            out[f"engine_version_{version}"] = engine.version
            out["largest_received_storage"] = max(storages)
        digests.append(comm.allgather(params_digest(model)))
        out[f"stats_{version}"] = {"seconds": stats.seconds, "bytes": stats.bytes, "buckets": stats.buckets}
    out["digests"] = digests
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out["largest_tensor"] = max(p.numel() * p.element_size() for p in model.parameters())

    # 2. Rank 2 holds another architecture.
    other = tiny_model(2, layers=3) if rank == 2 else model
    check = WeightSync.for_model(other, src=0, bucket_mb=args.bucket_mb, group=group, timeout_s=args.timeout)
    comm.Barrier()
    try:
        if rank == 0:
            check.send(trainer.named_weights())
        else:
            list(check.receive())
        out["mismatch_error"] = None
    except WeightSyncMismatch as e:
        out["mismatch_error"] = str(e)

    # 3. Rank 2 never joins the third sync.
    comm.Barrier()
    t0 = time.monotonic()
    try:
        if rank == 0:
            sync.send(trainer.named_weights())
        elif rank == 1:
            engine.load_weights(sync.receive(), 3)
        else:
            time.sleep(args.timeout + 4)
        out["absent_error"] = None
    except CollectiveError as e:
        out["absent_error"] = str(e)
    out["absent_seconds"] = time.monotonic() - t0
    results = comm.gather(out, root=0)     # MPI still works after the gloo group timed out
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    # Leave MPI properly (a rank that exits without MPI_Finalize makes mpiexec kill the others), but
    # skip Python's teardown, which would try to destroy the gloo group that timed out.
    MPI.Finalize()
    os._exit(0)


if __name__ == "__main__":
    main()
