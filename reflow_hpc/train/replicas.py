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
  default group, in buckets of ``trainer.sync_bucket_mb``. No full gather, no restart. The schedule
  point (step, the LR scheduler's state, the learning rates) travels as JSON (:func:`encode_meta`),
  never as a pickle: what arrives over the network is only ever parsed, not executed.

Every collective and every transfer waits at most ``run.timeout_s`` and fails naming the rank, the
operation (the step, the bucket, the peer).
"""

from __future__ import annotations

import json
import math
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

# The schedule point is well under a kilobyte; a size header past this is not a schedule point.
MAX_META_BYTES = 1 << 20


def _check_json(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} = {value}: not a finite number, not sent")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} ({type(k).__name__}) is not a string; not sent")
            _check_json(v, f"{where}[{k!r}]")
        return
    # A tuple would come back a list, a tensor or an object not at all: refuse rather than change it.
    raise ValueError(f"{where}: a {type(value).__name__} is not sent (None, bool, int, float, str, list and "
                     f"dicts with string keys are)")


def encode_meta(meta: dict) -> bytes:
    """``meta`` as UTF-8 JSON, refused (naming the value) unless it holds only None, bools, ints, finite
    floats, strings, lists and dicts with string keys, so that :func:`decode_meta` gives back an equal
    dict: floats go through ``repr``, which is exact."""
    if not isinstance(meta, dict):
        raise ValueError(f"meta: a {type(meta).__name__}, not a dict")
    _check_json(meta, "meta")
    return json.dumps(meta, allow_nan=False, separators=(",", ":")).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number this encoding sends")


def decode_meta(raw: bytes) -> dict:
    """What :func:`encode_meta` made, back; ValueError for anything else."""
    meta = json.loads(raw.decode(), parse_constant=_no_constant)
    if not isinstance(meta, dict):
        raise ValueError(f"a {type(meta).__name__}, not a dict")
    return meta


def _p2p(op: Any, tensor: torch.Tensor, peer: int, what: str, rank: int, timeout_s: float) -> None:
    bounded(rank, f"{what} ({'to' if op is dist.isend else 'from'} rank {peer})", timeout_s, lambda: op(tensor, peer))


def send_state(named: Named, meta: dict, dst: int, *, device: torch.device, rank: int, timeout_s: float,
               bucket_mb: float) -> int:
    """Send ``meta`` (the schedule point, as JSON: :func:`encode_meta`) and the ``named`` tensors (parameters and
    AdamW state, local shards) to rank ``dst``; returns the bytes of the tensors."""
    try:
        raw = encode_meta(meta)
    except ValueError as e:
        raise ValueError(f"rank {rank}: send_state to rank {dst}: schedule point: {e}") from None
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
    size = int(head[0])
    if not 0 < size <= MAX_META_BYTES:
        raise RuntimeError(f"rank {rank}: recv_state from rank {src}: schedule point of {size} bytes "
                           f"(at most {MAX_META_BYTES})")
    raw = torch.empty(size, dtype=torch.uint8, device=device)
    _p2p(dist.irecv, raw, src, "recv_state: schedule", rank, timeout_s)
    try:
        meta = decode_meta(raw.cpu().numpy().tobytes())
    except ValueError as e:               # bad UTF-8 and bad JSON are ValueErrors too
        raise RuntimeError(f"rank {rank}: recv_state from rank {src}: schedule point is not JSON: {e}") from None
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
