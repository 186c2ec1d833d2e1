"""MPI program for tests/integration/test_ppo_mpi.py: a ppo trainer replica FSDP2-sharded over 2 ranks (policy and
critic alike) against one unsharded replica on the same batches.

    mpiexec -n 2 python tests/helpers/train_ppo_sharded.py [--timeout T]

Rank 1 starts from other weights (the shard group starts from its first member's, the critic too). The first
step is the critic's warm-up; the last gives every sample to rank 0 (rank 1 runs empty rounds of the critic's
and the policy's micro-batches). Both gather the full state (:meth:`Trainer.state_dict`, a collective); rank 0
compares it with the unsharded replica's and prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gloo_ranks import start_ranks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    MPI = start_ranks(args.timeout)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()

    from reflow_hpc.comm.dims import ParallelDims
    from reflow_hpc.comm.groups import ProcessGroups
    from reflow_hpc.train.trainer import Trainer
    from train_common import loss_tokens, make_batch, make_config, tiny_model

    groups = ProcessGroups.create(ParallelDims(world=2, shard=2, replicas=(1,)), rank, args.timeout)
    cfg = make_config(warmup_steps=1, micro_batch_size=2, sync_bucket_mb=0.02)
    cfg.run.timeout_s = args.timeout
    cfg.algorithm.name, cfg.algorithm.gae_lambda, cfg.critic.warmup_steps = "ppo", 0.95, 1
    start = tiny_model(0).double()
    batches = [make_batch(start, cfg, seed=50 + s, groups=3, group_size=4, replay=3) for s in range(3)]
    shares = [b[rank::2] for b in batches[:-1]] + [batches[-1] if rank == 0 else []]
    trainer = Trainer(tiny_model(0 if rank == 0 else 99).double(), cfg, "cpu", group=groups.replica(1),
                      shard_group=groups.shard)
    metrics = [trainer.train_step(share, loss_tokens(batch)) for share, batch in zip(shares, batches)]
    model = trainer.full_model()
    state = trainer.state_dict(include_model=False)
    if rank == 0:
        ref = Trainer(copy.deepcopy(start), cfg, "cpu")
        ref_metrics = [ref.train_step(b, loss_tokens(b)) for b in batches]
        ref_state = ref.state_dict(include_model=False)
        policy = max(float((p.detach() - q.detach()).abs().max())
                     for p, q in zip(model.parameters(), ref.model.parameters()))
        critic = max(float((state["critic"]["model"][n] - v).abs().max())
                     for n, v in ref_state["critic"]["model"].items())
        adam = max(float((state["critic"]["optimizer"]["state"][i][k] - v[k]).abs().max())
                   for i, v in ref_state["critic"]["optimizer"]["state"].items() for k in ("exp_avg", "exp_avg_sq"))
        keys = ("loss", "grad_norm", "critic/value_loss", "critic/grad_norm", "critic/explained_var")
        worst = max(abs(m[k] - r[k]) / max(abs(r[k]), 1e-12) for m, r in zip(metrics, ref_metrics) for k in keys)
        moved = max(float((p.detach() - q.detach()).abs().max())
                    for p, q in zip(ref.critic.model.parameters(), Trainer(copy.deepcopy(start), cfg, "cpu")
                                    .critic.model.parameters()))
        print("RESULT " + json.dumps({"policy_diff": policy, "critic_diff": critic, "critic_adam_diff": adam,
                                      "worst_metric_rel_diff": worst, "critic_moved": moved,
                                      "shards": trainer.critic.parallel.shards,
                                      "frozen": [m["critic/policy_frozen"] for m in metrics],
                                      "critic_step": state["critic"]["step"]}), flush=True)
    comm.Barrier()
    MPI.Finalize()
    os._exit(0)


if __name__ == "__main__":
    main()
