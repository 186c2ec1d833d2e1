"""MPI program for tests/integration/test_ppo_mpi.py: ppo trainer replicas on 3 ranks through role switches both
ways, as the elastic pool makes them (groups per split, state sent point to point to a joining replica).

    mpiexec -n 3 python tests/helpers/train_ppo_replicas.py [--timeout T]

Every rank starts from other weights. Ranks 0 and 1 train (rank 2 "generates", its trainer offloaded); rank 2
joins (state from rank 0); rank 1 leaves; rank 1 joins again (state from rank 0). After every phase the
replicas in force compare digests (before the transfer too: a joining replica differs) of every tensor of
their state — policy and critic parameters and AdamW state, bit for bit — and their schedule points. Rank 0 prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gloo_ranks import start_ranks  # noqa: E402


def digests(trainer) -> dict:
    out = {}
    for name, t in trainer.state_tensors():
        kind = "critic" if name.startswith("critic/") else "policy"
        h = out.setdefault(kind, hashlib.sha256())
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    meta = {"step": trainer.step, "critic": trainer.critic.meta(), "lr": trainer.lr}
    return {**{k: h.hexdigest() for k, h in out.items()}, "meta": json.dumps(meta, sort_keys=True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    MPI = start_ranks(args.timeout)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    import torch.distributed as dist

    from reflow_hpc.train.trainer import Trainer
    from train_common import loss_tokens, make_batch, make_config, tiny_model

    groups = {(0, 1): dist.new_group([0, 1]), (0, 1, 2): dist.new_group([0, 1, 2]), (0, 2): dist.new_group([0, 2])}
    cfg = make_config(steps=12, warmup_steps=1)
    cfg.run.timeout_s = args.timeout
    cfg.algorithm.name, cfg.algorithm.gae_lambda = "ppo", 0.95
    cfg.critic.warmup_steps, cfg.critic.lr = 1, 3e-3
    start = tiny_model(0)
    batches = [make_batch(start, cfg, seed=40 + s, groups=3, group_size=4, replay=3) for s in range(7)]
    for b in batches:
        for it in b:
            it.advantage = 0.0

    trainers = (0, 1)
    trainer = Trainer(tiny_model(10 + rank), cfg, "cpu", group=groups[trainers] if rank in trainers else None)
    if rank not in trainers:
        trainer.offload()
    critic0 = digests(trainer)["critic"]
    phases = [((0, 1), None, 2), ((0, 1, 2), (0, 2), 2), ((0, 2), None, 1), ((0, 1, 2), (0, 1), 2)]
    report, next_batch, metrics = [], 0, []
    for now, transfer, steps in phases:
        was = trainers
        trainers = now
        if rank in now and rank not in was:
            trainer.onload()
        trainer.set_group(groups[now] if rank in now else None)
        before = comm.gather(digests(trainer) if rank in now else None, root=0)   # the joining one differs
        if transfer is not None:
            src, dst = transfer
            if rank == src:
                trainer.send_state(dst)
            elif rank == dst:
                trainer.recv_state(src)
        if rank in was and rank not in now:
            trainer.offload()
        for _ in range(steps):
            batch = batches[next_batch]
            next_batch += 1
            if rank in now:
                share = batch[now.index(rank)::len(now)]
                metrics.append(trainer.train_step(share, loss_tokens(batch)))
        if rank in now:
            trainer.check_replicas()
        mine = digests(trainer) if rank in now else None
        seen = comm.gather(mine, root=0)
        if rank == 0:
            held = [seen[r] for r in now]
            report.append({"trainers": list(now), "identical": all(h == held[0] for h in held),
                           "critic_identical_before": len({before[r]["critic"] for r in now}) == 1,
                           "critic_moved": held[0]["critic"] != critic0, "step": json.loads(held[0]["meta"])["step"]})
    if rank == 0:
        keys = ("critic/value_loss", "critic/explained_var", "critic/policy_frozen", "critic/step", "loss")
        print("RESULT " + json.dumps({"phases": report, "metrics": [{k: m[k] for k in keys} for m in metrics]}),
              flush=True)
    comm.Barrier()


if __name__ == "__main__":
    main()
