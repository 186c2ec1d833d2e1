"""This rank's torch.distributed process groups, created once from a :class:`~reflow_hpc.comm.dims.ParallelDims`
and asked for by name.

:meth:`ProcessGroups.create` makes every group of the dims' plan, in the plan's order, on every rank
(torch.distributed requires every rank to take part in every ``new_group``, members or not), each
with the job's timeout, and keeps the handles of the groups this rank belongs to. The names:

- :attr:`ProcessGroups.shard` — this rank's replica's parameter-shard group (fixed for the run);
- :meth:`ProcessGroups.replica` ``(n_t)`` — its counterparts when the pool has ``n_t`` trainer replicas;
- :meth:`ProcessGroups.sync` ``(n_t)`` — that split's weight-sync broadcast group;
- :meth:`ProcessGroups.tp_instance` ``(n_t)`` — its rollout instance's tensor-parallel group then;
- :attr:`ProcessGroups.tp_block` — the tensor-parallel group of its engine block, whichever split is in
  force (the same group as ``tp_instance`` in every split where the block generates).

Each is None when this rank is not in such a group, or when the group would hold this rank alone
(nothing travels; the trainer and the weight sync treat None as a group of one).
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable

from .dims import GroupSpec, ParallelDims


class ProcessGroups:
    def __init__(self, dims: ParallelDims, rank: int, handles: dict[GroupSpec, Any], created: int, seconds: float):
        self.dims, self.rank = dims, rank
        self._handles = handles          # the groups this rank is in
        self.created = created           # groups made on every rank
        self.seconds = seconds           # and the time that took

    @classmethod
    def create(cls, dims: ParallelDims, rank: int, timeout_s: float,
               new_group: Callable[[list[int]], Any] | None = None) -> "ProcessGroups":
        """Every group of ``dims.plan()``; ``new_group`` stands in for ``torch.distributed.new_group``."""
        if new_group is None:
            import torch.distributed as dist
            deadline = datetime.timedelta(seconds=timeout_s)
            new_group = lambda ranks: dist.new_group(ranks, timeout=deadline)   # noqa: E731
        t0 = time.monotonic()
        plan = dims.plan()
        handles = {}
        for spec in plan:
            group = new_group(list(spec.ranks))
            if rank in spec.ranks:
                handles[spec] = group
        return cls(dims, rank, handles, len(plan), time.monotonic() - t0)

    def _get(self, kind: str, split: int | None, ranks: tuple[int, ...] | None) -> Any:
        return None if ranks is None else self._handles.get(GroupSpec(kind, split, ranks))

    @property
    def shard(self) -> Any:
        """This rank's replica's parameter-shard group (s_T > 1)."""
        return self._get("shard", None, self.dims.shard_group_of(self.rank))

    def replica(self, n_t: int) -> Any:
        """This rank's counterparts (with s_T = 1: every trainer) when the pool has ``n_t`` trainer replicas;
        None when this rank does not train then, or is the only replica."""
        return self._get("replica", n_t, self.dims.split(n_t).counterparts_of(self.rank))

    def sync(self, n_t: int) -> Any:
        """The weight-sync group of split ``n_t`` (the first trainer and every rollout leader), if this rank
        is in it."""
        sp = self.dims.split(n_t)
        return self._get("sync", n_t, sp.sync if self.rank in sp.sync else None)

    def tp_instance(self, n_t: int) -> Any:
        """The tensor-parallel group of this rank's rollout instance in split ``n_t`` (s_R > 1)."""
        return self._get("tp_instance", None, self.dims.split(n_t).instance_of(self.rank))

    @property
    def tp_block(self) -> Any:
        """The tensor-parallel group of this rank's engine block (s_R > 1), made when the block is a rollout
        instance in some split; None for a block that only ever trains (it loads no weights through one)."""
        return self._get("tp_instance", None, self.dims.engine_block(self.rank))
