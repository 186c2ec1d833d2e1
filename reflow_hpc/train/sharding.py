"""A trainer replica sharded over ``s_T`` workers with FSDP2 (``torch.distributed.fsdp.fully_shard``).

The FSDP2 pieces of :class:`~reflow_hpc.train.parallel.Sharded`, the layout
:func:`~reflow_hpc.train.parallel.parallelize` picks when the shard group holds more than one rank;
the same code runs on gloo (CPU) and NCCL (GPU).

- **Layout.** Every decoder layer, then the root module, is ``fully_shard``-ed over a 1-D device
  mesh made from the shard group (:func:`shard_model`). Each parameter becomes a DTensor sharded
  on dim 0 the way ``torch.chunk`` splits it: member ``i`` holds rows
  ``[i·c, min((i+1)·c, rows))`` with ``c = ceil(rows / s_T)`` (:func:`shard_rows`; the last
  members may hold fewer rows, or none). Tied parameters (``lm_head`` = ``embed_tokens``) live in
  the root's group and stay one parameter.
- **Gradients are summed.** The loss of every micro-batch is already divided by the loss tokens of
  the whole batch, so FSDP's reduce-scatter must add the members' gradients, not average them:
  every FSDP module gets a gradient divide factor of 1 and sum-only reductions (``PREMUL_SUM``,
  which gloo lacks, is never used).
- **Full tensors, bucket by bucket.** :class:`ShardGather` rebuilds full tensors from the members'
  shards: the tensors are grouped into buckets (:mod:`reflow_hpc.train.buckets`, planned from the
  full shapes, so every member plans the same), each member packs its rows of a bucket padded to
  ``c`` rows per tensor, one all-gather moves the bucket, and the full tensors are cut out of the
  result. Every member must run the same gathers in the same order; one that only takes part
  (``keep=False``) skips the unpacking. Every all-gather waits at most ``timeout_s`` and fails
  naming the rank, what is gathered and the bucket.
- **Loading a full tensor** into a sharded parameter or optimizer state copies this member's rows
  (:func:`copy_full_into`): no collective.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from ..comm.collective import bounded
from .buckets import MB, TensorSpec, plan_buckets


def is_sharded(t: Any) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: the local shard of a DTensor (a view of its storage), else ``t``."""
    return t.to_local() if is_sharded(t) else t


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """(first row, row count) of member ``index`` when ``rows`` rows are split as ``torch.chunk`` does."""
    per = -(-rows // shards) if rows else 0
    start = min(index * per, rows)
    return start, min(per, rows - start)


def shard_mesh(group: Any, device: torch.device) -> Any:
    """A 1-D device mesh over the ranks of ``group`` (a process group made by ``dist.new_group``)."""
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(group, device.type)


def decoder_layers(model: Any) -> Sequence[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(f"sharded trainer: {type(model).__name__} has no decoder layers at model.model.layers "
                         f"to shard (resources.trainer_shard_size > 1 needs a decoder-only transformers model)")
    return layers


def shard_model(model: Any, mesh: Any) -> None:
    """``fully_shard`` every decoder layer, then the root; gradients summed over the shard group."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    for p in model.parameters():
        if p.dim() == 0:
            raise ValueError("sharded trainer: a 0-dimensional parameter cannot be sharded on dim 0")
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` into ``target``: all of it into a plain tensor, this member's rows into a DTensor."""
    if not is_sharded(target):
        target.copy_(full)
        return
    mesh = target.device_mesh
    if mesh.ndim != 1 or len(target.placements) != 1 or not target.placements[0].is_shard(0):
        raise ValueError(f"sharded tensor with placements {target.placements}: only Shard(0) on a 1-D mesh is "
                         "supported")
    start, n = shard_rows(int(full.shape[0]), mesh.size(), mesh.get_local_rank())
    dest = target.to_local()
    if n:
        dest.copy_(full.narrow(0, start, n))


class ShardGather:
    """Bucketed all-gathers of full tensors over a shard group (see the module docstring).

    ``specs`` are the full (name, shape, dtype) of the tensors, in the order they are passed to
    :meth:`gather`; ``index`` is this rank's position in ``group`` of ``shards`` members.
    """

    def __init__(self, specs: Sequence[TensorSpec], *, group: Any, shards: int, index: int, bucket_mb: float,
                 device: torch.device, rank: int, timeout_s: float | None):
        for s in specs:
            if not s.shape:
                raise ValueError(f"sharded trainer: {s.name} is 0-dimensional and cannot be gathered by rows")
        self.specs = list(specs)
        self.group, self.shards, self.index = group, shards, index
        self.device, self.rank, self.timeout_s = device, rank, timeout_s
        self.buckets = plan_buckets(self.specs, max(1, int(bucket_mb * MB)))

    def _padded(self, spec: TensorSpec) -> tuple[int, int]:
        """(rows a member packs, elements per row) of ``spec``."""
        rows = spec.shape[0]
        inner = spec.numel // rows if rows else 0
        return -(-rows // self.shards), inner

    def gather(self, named_locals: Sequence[tuple[str, torch.Tensor]], *, what: str, keep: bool = True,
               to_cpu: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of every spec, bucket by bucket; ``named_locals`` are this member's shards
        in the specs' order. With ``keep=False`` the gathers run and nothing is yielded."""
        shards = dict(named_locals)
        if len(shards) != len(self.specs):
            raise ValueError(f"rank {self.rank}: {what}: {len(shards)} tensors to gather, the plan has "
                             f"{len(self.specs)}")
        gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        n_buckets = len(self.buckets)
        for bucket in self.buckets:
            layout, n = [], 0
            for spec in bucket.specs:
                per, inner = self._padded(spec)
                layout.append((spec, per, inner, n))
                n += per * inner
            flat = torch.zeros(n, dtype=bucket.dtype, device=self.device)
            with torch.no_grad():
                for spec, per, inner, off in layout:
                    mine = shards[spec.name]
                    rows = shard_rows(spec.shape[0], self.shards, self.index)[1]
                    if tuple(mine.shape[:1]) != (rows,) and mine.numel():
                        raise ValueError(f"rank {self.rank}: {what}: the shard of {spec.name} has "
                                         f"{tuple(mine.shape)}, expected {rows} rows")
                    if rows:
                        flat[off:off + rows * inner].copy_(mine.reshape(-1))
            out = torch.empty(n * self.shards, dtype=bucket.dtype, device=self.device)
            bounded(self.rank, f"{what}: all-gather of {bucket.describe(n_buckets)} over the shard group",
                    self.timeout_s, lambda: gather_single(out, flat, group=self.group, async_op=True))
            if not keep:
                continue
            for spec, per, inner, off in layout:
                full = torch.empty(spec.shape, dtype=spec.dtype, device="cpu" if to_cpu else self.device)
                for member in range(self.shards):
                    start, rows = shard_rows(spec.shape[0], self.shards, member)
                    if rows:
                        base = member * n + off
                        full[start:start + rows].copy_(out[base:base + rows * inner].view(rows, *spec.shape[1:]))
                yield spec.name, full
