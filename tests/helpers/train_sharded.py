"""MPI program for tests/integration/test_trainer_sharded_mpi.py: FSDP2-sharded trainer replicas (gloo) against one
unsharded replica on the same batches.

    mpiexec -n 2 python tests/helpers/train_sharded.py --out DIR [--dtype float32|float64]
    mpiexec -n 4 python tests/helpers/train_sharded.py --out DIR [--dtype float32|float64]

Two ranks: one replica sharded over both (s_T = 2). The last step gives every sample to rank 0 and
none to rank 1 (rank 1 runs empty micro-batches so that FSDP's collectives match). Then a checkpoint:
rank 0 writes a Hugging Face directory from the gathered model and the full optimizer state; a new
sharded replica and an unsharded one load it and take the same next step as the replica that wrote it.

Four ranks: two replicas of two shards (ranks 0-1 and 2-3; counterparts {0, 2} and {1, 3}); then
``check_replicas``, a drift that it must catch, ``send_state``/``recv_state`` between counterparts into
a replica whose parameters were spoiled, and a weight sync from replica 0 (rank 1 joins the gathers)
to ranks 2 and 3, which receive into plain models.

The process groups come from ``ParallelDims`` / ``ProcessGroups`` as a worker makes them: the shard
groups, the counterparts and (four ranks) the weight-sync group of the split with one trainer replica.

Rank 0 runs the unsharded reference and prints one line ``RESULT {json}``.
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

KEYS = ("loss", "pg_loss", "grad_norm", "clip_fraction", "ratio/mean", "ratio/max", "approx_kl", "entropy",
        "tokens", "loss_tokens", "samples", "replay_samples", "weights/mean", "lr")


def full_params(trainer) -> dict:
    """Every parameter of a trainer in full (a collective for a sharded one)."""
    return {n: t.clone() for n, t in trainer.named_weights()}


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def worst_rel(metrics, ref_metrics) -> float:
    return max(abs(m[k] - r[k]) / max(abs(r[k]), 1e-12) for m, r in zip(metrics, ref_metrics) for k in KEYS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    MPI = start_ranks(args.timeout)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    import torch

    from reflow_hpc.comm.dims import ParallelDims
    from reflow_hpc.comm.groups import ProcessGroups
    from reflow_hpc.train.trainer import Trainer
    from train_common import loss_tokens, make_batch, make_config, tiny_model

    dtype = getattr(torch, args.dtype)
    # Every rank trains (s_T = 2); with four ranks the split of one replica is prepared too, for its
    # weight-sync group (rank 0 to ranks 2 and 3).
    dims = ParallelDims(world=size, shard=2, replicas=(1, 2) if size == 4 else (1,))
    groups = ProcessGroups.create(dims, rank, args.timeout)
    shard_group, group = groups.shard, groups.replica(size // 2)

    cfg = make_config(warmup_steps=1, micro_batch_size=3, sync_bucket_mb=0.02)
    cfg.trainer.micro_batch_tokens = 36         # passes of 1–3 samples by length: the members' pass counts differ
    cfg.run.timeout_s = args.timeout
    start = tiny_model(0).to(dtype)
    steps = 3
    batches = [make_batch(start, cfg, seed=10 + s, groups=3, group_size=4, replay=3) for s in range(steps)]
    # Each rank's share, as the coordinator splits a batch over n_T·s_T trainer ranks; the last step all
    # on rank 0.
    shares = [b[rank::size] for b in batches[:-1]] + [batches[-1] if rank == 0 else []]

    # Rank 1 starts from other weights: the shard group starts from its first member's.
    trainer = Trainer(tiny_model(0 if rank == 0 else 99).to(dtype), cfg, "cpu", group=group, shard_group=shard_group)
    result: dict = {"world": size, "shards": trainer.parallel.shards, "replicas": trainer.replicas.size,
                    "groups": [list(g.ranks) for g in dims.plan()]}
    t0 = time.perf_counter()
    metrics = [trainer.train_step(share, loss_tokens(batch)) for share, batch in zip(shares, batches)]
    result["sharded_seconds"] = time.perf_counter() - t0
    sharded = full_params(trainer)

    if rank == 0:
        ref = Trainer(copy.deepcopy(start), cfg, "cpu")
        t0 = time.perf_counter()
        ref_metrics = [ref.train_step(batch, loss_tokens(batch)) for batch in batches]
        result["unsharded_seconds"] = time.perf_counter() - t0
        reference = full_params(ref)
        result.update(max_param_diff=max_diff(sharded, reference), moved=max_diff(reference, full_params(
            Trainer(copy.deepcopy(start), cfg, "cpu"))), worst_metric_rel_diff=worst_rel(metrics, ref_metrics),
            metrics=[{k: m[k] for k in KEYS} for m in metrics],
            grad_norms=[[m["grad_norm"], r["grad_norm"]] for m, r in zip(metrics, ref_metrics)])
        result["tied"] = bool(trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight)

    if size == 2:
        result.update(checkpoint_round_trip(args, comm, trainer, cfg, start, batches, shard_group, dtype))
    else:
        result.update(replicas_and_sync(args, comm, trainer, groups.sync(1)))

    gathered = comm.gather(result, root=0)
    if rank == 0:
        merged = dict(gathered[0])
        merged["ranks"] = gathered
        print("RESULT " + json.dumps(merged), flush=True)
    comm.Barrier()
    MPI.Finalize()
    os._exit(0)


def checkpoint_round_trip(args, comm, trainer, cfg, start, batches, shard_group, dtype) -> dict:
    import torch

    from reflow_hpc.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from reflow_hpc.train.trainer import Trainer
    from train_common import loss_tokens, make_batch

    rank = comm.Get_rank()
    out: dict = {}
    root = Path(args.out) / "checkpoints"
    model, state = trainer.checkpoint_state()
    if rank == 0:
        save_checkpoint(root, trainer.step, model=model, trainer_state=state)
        out["state_on_mate"] = None
    else:
        out["state_on_mate"] = [model is None, state is None]
    comm.Barrier()
    path = latest_checkpoint(root)
    nxt = make_batch(start, cfg, seed=99, groups=2, group_size=4, replay=2)
    share = nxt[comm.Get_rank()::2]
    before = {n: t.clone() for n, t in trainer.named_weights()}

    resumed = Trainer(tiny_model_like(start), cfg, "cpu", shard_group=shard_group)
    load_checkpoint(path, trainer=resumed, restore_rng=False)
    out["loaded_equal"] = all(torch.equal(before[n], t) for n, t in resumed.named_weights())
    m_orig = trainer.train_step(share, loss_tokens(nxt))
    m_res = resumed.train_step(share, loss_tokens(nxt))
    after_orig = {n: t.clone() for n, t in trainer.named_weights()}
    after_res = {n: t.clone() for n, t in resumed.named_weights()}
    out["resume_identical"] = all(torch.equal(after_orig[n], after_res[n]) for n in after_orig)
    out["resume_metrics_equal"] = all(m_orig[k] == m_res[k] for k in KEYS)
    out["resume_step"] = [trainer.step, resumed.step]
    if rank == 0:
        # The directory is a Hugging Face model: transformers loads it, with the weights gathered at save.
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(path / "model", dtype=dtype)
        params = dict(hf.named_parameters())
        out["hf_equal"] = all(torch.equal(params[n].detach(), before[n]) for n in before)
        out["hf_tied"] = bool(hf.lm_head.weight is hf.model.embed_tokens.weight)
        out["hf_architectures"] = hf.config.architectures
        # An unsharded replica resumes from the same checkpoint and takes the same step.
        plain = Trainer(tiny_model_like(start), cfg, "cpu")
        load_checkpoint(path, trainer=plain, restore_rng=False)
        plain.train_step(nxt, loss_tokens(nxt))
        out["unsharded_resume_max_diff"] = max(float((t - after_orig[n]).abs().max())
                                               for n, t in plain.named_weights())
    return out


def tiny_model_like(start):
    from train_common import tiny_model
    return tiny_model(7).to(next(start.parameters()).dtype)


def replicas_and_sync(args, comm, trainer, sync_group) -> dict:
    import torch

    from reflow_hpc.train.weight_sync import WeightSync
    from train_common import tiny_model

    rank = comm.Get_rank()
    out: dict = {}
    trainer.check_replicas()
    out["check_replicas_ok"] = True
    # A drift in one shard of one replica is caught by that shard's counterparts.
    with torch.no_grad():
        if rank == 3:
            p = dict(trainer.model.named_parameters())["model.layers.1.mlp.down_proj.weight"]
            p.to_local()[0, 0] += 1e-3
    try:
        trainer.check_replicas()
        out["drift_error"] = None
    except RuntimeError as e:
        out["drift_error"] = str(e)
    # Replica 1 (ranks 2, 3) is spoiled, then receives every shard from its counterpart in replica 0.
    with torch.no_grad():
        if rank >= 2:
            for _, t in trainer.state_tensors():
                t.add_(0.5)
    comm.Barrier()
    if rank < 2:
        out["sent_bytes"] = trainer.send_state(rank + 2)
    else:
        out["received_bytes"] = trainer.recv_state(rank - 2)
    digest = [torch.cat([t.reshape(-1).double() for _, t in trainer.state_tensors()]).numpy().tobytes()]
    pairs = comm.allgather(digest[0])
    out["counterparts_identical"] = pairs[rank % 2] == pairs[rank % 2 + 2]
    trainer.check_replicas()

    # Weight sync from replica 0: rank 0 sends, rank 1 joins the gathers, ranks 2 and 3 receive.
    dtype = next(trainer.model.parameters()).dtype
    plain = tiny_model(5).to(dtype)
    specs_model = trainer.model if rank == 0 else plain
    sync = WeightSync.for_model(specs_model, src=0, bucket_mb=0.02, group=sync_group, timeout_s=args.timeout) \
        if rank != 1 else None
    comm.Barrier()
    if rank == 0:
        stats = sync.send(trainer.named_weights())
        out["sync_buckets"] = stats.buckets
    elif rank == 1:
        trainer.join_weight_gather()
    else:
        with torch.no_grad():
            params = dict(plain.named_parameters())
            for name, value in sync.receive():
                params[name].copy_(value)
    truth = {n: t.clone() for n, t in trainer.named_weights()}          # replica 1's own gather
    if rank >= 2:
        out["synced_equal"] = all(torch.equal(p.detach(), truth[n]) for n, p in plain.named_parameters())
        out["synced_tied"] = bool(plain.lm_head.weight is plain.model.embed_tokens.weight)
    return out


if __name__ == "__main__":
    main()
