"""Data parallelism across the ``n_T`` trainer replicas (DESIGN §7, §8).

- **One update.** Every micro-batch loss is already divided by the loss tokens of the whole batch,
  so the gradients are *summed* across the replica group (bucketed all-reduce, buckets of
  ``trainer.allreduce_bucket_mb``): the result is the gradient of one replica on the full batch.
  Sharded, the replica group is this rank's *counterparts* (the same shard index in every replica)
  and each rank sums its local gradient shards with theirs; the buckets are planned from the local
  shards, which every counterpart shapes alike (empty shards stay out). A parameter without a
  gradient sends zeros.
- **Bit-identical replicas.** Replicas start from the parameters of the group's first rank
  (:meth:`Replicas.start`) and apply identical updates to identical sums, so they stay identical;
  :meth:`Replicas.check` verifies it cheaply (per-tensor sums and sums of squares, compared by an
  all-reduce of their maxima and minima). A shard that differs is seen by its counterparts only:
  the shard group shares the verdict, so every trainer rank fails alike.
- **A replica joins.** When the elastic pool turns workers into a new replica, an existing replica
  sends each of them its parameters, AdamW state and schedule point (sharded: each rank its local
  shards, to its counterpart): :func:`send_state` / :func:`recv_state`, point to point over the
  default group, in buckets of ``trainer.sync_bucket_mb``. No full gather, no restart.

Every collective and every transfer waits at most ``run.timeout_s`` and fails naming the rank, the
operation (the step, the bucket, the peer).
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..comm.collective import bounded
from .buckets import MB, pack, plan_buckets, specs_of, unpack
from .parallel import Collective
from .sharding import local

Named = Sequence[tuple[str, torch.Tensor]]


def local_specs(named: Named) -> list:
    """Specs of this rank's parts (local shards) of ``named``, empty ones left out."""
    return [s for s in specs_of((n, local(t)) for n, t in named) if s.numel > 0]


class Replicas:
    """This rank's side of the replica group (module docstring); ``group`` None: a single replica."""

    def __init__(self, group: Any, params: Named, *, device: torch.device, rank: int, timeout_s: float,
                 bucket_mb: float):
        self.device, self.rank = device, rank
        self.group = Collective(group, rank=rank, timeout_s=timeout_s)
        self._grad_buckets = plan_buckets(local_specs(params), int(bucket_mb * MB))

    def set_group(self, group: Any) -> None:
        """The replica group changed (a role switch); None: one replica."""
        self.group = Collective(group, rank=self.rank, timeout_s=self.group.timeout_s)

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def timeout_s(self) -> float:
        return self.group.timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        self.group.timeout_s = seconds

    def all_reduce(self, t: torch.Tensor, op: Any, what: str, step: int) -> torch.Tensor:
        return self.group.all_reduce(t, op, what, step)

    def start(self, params: Named) -> None:
        """Every replica takes the first replica's parameters (sharded: each shard its counterpart's)."""
        self.group.broadcast(((n, local(p.data)) for n, p in params if local(p.data).numel()),
                             "trainer replica start")

    def sum_gradients(self, params: Named, step: int) -> None:
        """Sum the gradients (local shards) across replicas bucket by bucket."""
        if self.size == 1:
            return
        by_name = dict(params)
        n = len(self._grad_buckets)
        for bucket in self._grad_buckets:
            grads = []
            for spec in bucket.specs:
                p = by_name[spec.name]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(local(p.grad))
            flat = pack(bucket, grads, self.device)
            self.all_reduce(flat, dist.ReduceOp.SUM, f"gradients, {bucket.describe(n)}", step)
            if flat.data_ptr() != grads[0].data_ptr():    # packed into a new buffer: copy the sums back
                for g, v in zip(grads, unpack(bucket, flat)):
                    g.copy_(v)

    def check(self, state_tensors: Callable[[], Named], shard: Collective, step: int) -> None:
        """Raise unless every replica holds the same ``state_tensors()`` (parameters and optimizer state; local
        shards). ``shard``: the replica's shard group, which shares the verdict; ``step``: updates done."""
        if self.size == 1:
            return
        named = state_tensors()
        with torch.no_grad():
            checks = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()])
                                  for _, t in named]).reshape(-1)
        both = torch.cat([checks, -checks])
        self.all_reduce(both, dist.ReduceOp.MAX, "replica checksums", step + 1)
        hi, lo = both[:len(checks)], -both[len(checks):]
        differ = (hi != lo).reshape(-1, 2).any(dim=1).nonzero().flatten().tolist()
        seen = shard.all_reduce(torch.tensor([len(differ)], dtype=torch.int64, device=self.device),
                                dist.ReduceOp.MAX, "replica check verdict", step + 1)
        if differ:
            names = [named[i][0] for i in differ]
            raise RuntimeError(f"rank {self.rank}: trainer replicas diverged after step {step}: "
                               f"{len(names)} tensors differ, first {names[0]}")
        if int(seen.item()):
            raise RuntimeError(f"rank {self.rank}: trainer replicas diverged after step {step}: "
                               f"{int(seen.item())} tensors differ in another shard of this replica")


# ---------------------------------------------------------------------- a replica joins

def _p2p(op: Any, tensor: torch.Tensor, peer: int, what: str, rank: int, timeout_s: float) -> None:
    bounded(rank, f"{what} ({'to' if op is dist.isend else 'from'} rank {peer})", timeout_s, lambda: op(tensor, peer))


def send_state(named: Named, meta: dict, dst: int, *, device: torch.device, rank: int, timeout_s: float,
               bucket_mb: float) -> int:
    """Send ``meta`` (the schedule point, pickled) and the ``named`` tensors (parameters and AdamW state, local
    shards) to rank ``dst``; returns the bytes of the tensors."""
    raw = pickle.dumps(meta)
    head = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    _p2p(dist.isend, head, dst, "send_state: size", rank, timeout_s)
    _p2p(dist.isend, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device), dst, "send_state: schedule",
         rank, timeout_s)
    tensors = dict(named)
    sent = 0
    buckets = plan_buckets(local_specs(named), int(bucket_mb * MB))
    for b in buckets:
        flat = pack(b, [tensors[sp.name] for sp in b.specs], device)
        _p2p(dist.isend, flat, dst, f"send_state: {b.describe(len(buckets))}", rank, timeout_s)
        sent += b.nbytes
    return sent


def recv_state(named: Named, src: int, *, device: torch.device, rank: int, timeout_s: float,
               bucket_mb: float) -> tuple[dict, int]:
    """Receive what :func:`send_state` on rank ``src`` sends into the ``named`` tensors, which must be shaped
    as the sender's; returns (its ``meta``, bytes)."""
    head = torch.zeros(1, dtype=torch.int64, device=device)
    _p2p(dist.irecv, head, src, "recv_state: size", rank, timeout_s)
    raw = torch.empty(int(head[0]), dtype=torch.uint8, device=device)
    _p2p(dist.irecv, raw, src, "recv_state: schedule", rank, timeout_s)
    meta = pickle.loads(raw.cpu().numpy().tobytes())
    tensors = dict(named)
    got = 0
    buckets = plan_buckets(local_specs(named), int(bucket_mb * MB))
    with torch.no_grad():
        for b in buckets:
            flat = torch.empty(b.numel, dtype=b.dtype, device=device)
            _p2p(dist.irecv, flat, src, f"recv_state: {b.describe(len(buckets))}", rank, timeout_s)
            for sp, value in zip(b.specs, unpack(b, flat)):
                tensors[sp.name].copy_(value)
            got += b.nbytes
    return meta, got
