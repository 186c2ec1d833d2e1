"""MPI program for tests/integration/test_trainer_mpi.py: two trainer replicas, each on half of every batch, end
where one process training on the full batches ends; the replicas stay bit-identical.

    mpiexec -n 2 python tests/helpers/train_replicas.py [--dtype float32|float64] [--timeout T]

Rank 1 starts from different weights (the trainer broadcasts the first replica's at construction).
The last step gives every sample to rank 0 and none to rank 1. Rank 0 then runs the single-process
reference. Finally rank 1 skips a step: rank 0 must fail within ``--absent-timeout`` seconds naming
the operation. Rank 0 prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gloo_ranks import start_ranks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--absent-timeout", type=float, default=4.0)
    args = ap.parse_args()

    MPI = start_ranks(args.timeout)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    import torch
    import torch.distributed as dist

    from reflow_hpc.comm.dist import CollectiveError
    from reflow_hpc.train.trainer import Trainer
    from train_common import loss_tokens, make_batch, make_config, max_param_diff, params_digest, tiny_model

    group = dist.new_group([0, 1])
    dtype = getattr(torch, args.dtype)

    cfg = make_config(warmup_steps=1, micro_batch_size=2)
    cfg.run.timeout_s = args.timeout
    start = tiny_model(0).to(dtype)
    batches = [make_batch(start, cfg, seed=10 + s, groups=3, group_size=4, replay=3) for s in range(3)]
    shares = [b[rank::2] for b in batches[:2]] + [batches[2] if rank == 0 else []]

    model = tiny_model(0 if rank == 0 else 99).to(dtype)
    trainer = Trainer(model, cfg, "cpu", group=group)
    metrics = [trainer.train_step(share, loss_tokens(batch)) for share, batch in zip(shares, batches)]
    trainer.check_replicas()
    digests = comm.allgather(params_digest(model))

    # A replica that drifts is caught on every rank, naming a tensor.
    with torch.no_grad():
        if rank == 1:
            model.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3
    try:
        trainer.check_replicas()
        drift = None
    except RuntimeError as e:
        drift = str(e)
    drifts = comm.gather(drift, root=0)

    result = {}
    if rank == 0:
        ref = Trainer(copy.deepcopy(start), cfg, "cpu")
        ref_metrics = [ref.train_step(batch, loss_tokens(batch)) for batch in batches]
        keys = ("loss", "pg_loss", "grad_norm", "clip_fraction", "ratio/mean", "ratio/max", "approx_kl",
                "entropy", "tokens", "loss_tokens", "samples", "replay_samples", "weights/mean", "lr")
        worst = max(abs(m[k] - r[k]) / max(abs(r[k]), 1e-12) for m, r in zip(metrics, ref_metrics) for k in keys)
        # Rank 0 never applied the drift: its parameters are the replicas' result.
        result = {"max_param_diff": max_param_diff(model, ref.model),
                  "moved": max_param_diff(ref.model, start), "digests_equal": len(set(digests)) == 1,
                  "worst_metric_rel_diff": worst, "drift_errors": drifts,
                  "metrics": [{k: m[k] for k in keys} for m in metrics]}

    # A replica that never joins the step: the other fails within run.timeout_s naming the operation.
    comm.Barrier()
    trainer.replicas.timeout_s = args.absent_timeout
    t0 = time.monotonic()
    absent = None
    if rank == 0:
        try:
            trainer.train_step(shares[0], loss_tokens(batches[0]))
        except CollectiveError as e:
            absent = str(e)
    else:
        time.sleep(args.absent_timeout + 3)
    result.update(absent_error=absent, absent_seconds=time.monotonic() - t0)
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    comm.Barrier()
    # The group that timed out cannot be torn down cleanly: leave MPI and skip Python's teardown.
    MPI.Finalize()
    os._exit(0)


if __name__ == "__main__":
    main()
