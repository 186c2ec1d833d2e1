"""Weight sync: the trainer's weights to every rollout worker, as a bucketed broadcast (DESIGN §7).

Rules it implements:

- **Who.** One source rank (the trainer replica that publishes, usually the first trainer) and a
  torch.distributed process group that holds it and every rollout worker that loads the weights
  (NCCL on CUDA, gloo on CPU; ``group=None`` is the default group). Every member calls
  :meth:`WeightSync.send` (the source) or :meth:`WeightSync.receive` (the others) once per sync.
- **No metadata per sync.** Both sides hold the same architecture, so each builds the bucket plan
  from the names, shapes and dtypes of its own model (:mod:`reflow_hpc.train.buckets`, buckets of at
  most ``trainer.sync_bucket_mb`` MB per dtype) and only tensor data travels.
- **Verified once.** At the first sync the source broadcasts a digest of its specs (tensor count,
  element count, sha256 of names/shapes/dtypes); every rank compares it with its own and an
  all-gather of the verdicts lets every rank fail at once with the same error naming the ranks
  whose model differs, instead of receiving garbage or hanging.
- **One bucket in memory.** A receiver gets ``(name, tensor)`` pairs, views into the bucket just
  received, ready for the engine's ``load_weights(pairs, version)``, which copies each one into
  its model. Each bucket gets a fresh buffer, so a consumer that keeps tensors still sees correct
  data, while one that copies and drops them never holds more than about one bucket beyond its
  model. A consumer must exhaust the iterator: the source waits for every member at every bucket.
- **Streamed on the source.** :meth:`WeightSync.send` takes ``(name, tensor)`` pairs from its
  iterator only as the buckets need them, so a sharded trainer that gathers its full tensors on
  demand (:meth:`reflow_hpc.train.trainer.Trainer.named_weights`, the other members of its shard
  group gathering alongside) never holds its whole model at once.
- **Bounded waits.** Every collective waits at most ``timeout_s`` (pass ``run.timeout_s``; None
  falls back to the group's own timeout, 30 min for a gloo group made without one, see
  :mod:`reflow_hpc.comm.collective`); a failure or a member that never joins ends in
  :class:`~reflow_hpc.comm.dist.CollectiveError` naming the rank, the sync and the bucket
  (dtype, size, first tensor).
- **Measured.** Each sync records :class:`SyncStats` (seconds, bytes, buckets) for the
  ``sync_seconds`` metric; the source returns it, a receiver finds it in :attr:`WeightSync.last`
  once the iterator is exhausted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..comm.collective import bounded
from ..comm.dist import CollectiveError
from .buckets import MB, Bucket, TensorSpec, fingerprint, pack, plan_buckets, specs_of, unpack


@dataclass(frozen=True)
class SyncStats:
    seconds: float
    bytes: int
    buckets: int


class WeightSyncMismatch(CollectiveError):
    """The models of the source and of some receivers differ in names, shapes or dtypes."""


class WeightSync:
    """One member's side of the weight sync over ``group`` (see the module docstring).

    ``specs`` are the (name, shape, dtype) of the tensors that travel, in the model's order:
    :meth:`for_model` takes them from ``model.named_parameters()``, which is what
    :meth:`reflow_hpc.train.trainer.Trainer.named_weights` sends. ``src`` is the global rank of the
    source; ``device`` is where the buckets live (the process group's device: CUDA for NCCL, CPU for
    gloo); ``timeout_s`` bounds every collective (``run.timeout_s``).
    """

    def __init__(self, specs: Sequence[TensorSpec], *, src: int, bucket_mb: float,
                 device: str | torch.device = "cpu", group: Any = None, timeout_s: float | None = None):
        if not specs:
            raise ValueError("weight sync: the model has no tensors to send")
        self.specs = list(specs)
        self.src = int(src)
        self.group = group
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.rank = dist.get_rank()
        self.is_source = self.rank == self.src
        self.buckets = plan_buckets(self.specs, max(1, int(bucket_mb * MB)))
        self.bytes = sum(b.nbytes for b in self.buckets)
        self.syncs = 0                       # completed syncs
        self.last: SyncStats | None = None
        self._verified = False

    @classmethod
    def for_model(cls, model: Any, **kw: Any) -> "WeightSync":
        return cls(specs_of(model.named_parameters()), **kw)

    # ------------------------------------------------------------------ source

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """Broadcast the named tensors (the source's side of one sync)."""
        if not self.is_source:
            raise RuntimeError(f"rank {self.rank}: weight sync send() on a receiver (the source is rank {self.src})")
        t0 = time.perf_counter()
        self._verify()
        # Taken from the iterator only as the buckets need them: a source that produces its tensors on
        # demand (a sharded trainer gathers them) holds about one bucket beyond its model.
        source = iter(named_tensors)
        known = {s.name: s for s in self.specs}
        pending: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for bucket in self.buckets:
                for s in bucket.specs:
                    while s.name not in pending:
                        name, t = next(source, (None, None))
                        if name is None:
                            raise ValueError(f"rank {self.rank}: weight sync: tensor {s.name} is missing from what "
                                             f"was sent")
                        self._check(known, name, t)
                        pending[name] = t
                flat = pack(bucket, [pending.pop(s.name) for s in bucket.specs], self.device)
                self._broadcast(flat, bucket)
        for name, t in source:
            self._check(known, name, t)
        return self._finish(t0)

    def _check(self, known: dict[str, TensorSpec], name: str, t: torch.Tensor) -> None:
        s = known.get(name)
        if s is None:
            raise ValueError(f"rank {self.rank}: weight sync: tensor {name} is not in the plan")
        if tuple(t.shape) != s.shape or t.dtype != s.dtype:
            raise ValueError(f"rank {self.rank}: weight sync: {s.name} is {tuple(t.shape)} {t.dtype}, the plan "
                             f"expects {s.shape} {s.dtype}")

    # ------------------------------------------------------------------ receivers

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs of one sync, bucket by bucket (a receiver's side)."""
        if self.is_source:
            raise RuntimeError(f"rank {self.rank}: weight sync receive() on the source rank")
        t0 = time.perf_counter()
        self._verify()
        for bucket in self.buckets:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.device)
            self._broadcast(flat, bucket)
            yield from zip((s.name for s in bucket.specs), unpack(bucket, flat))
            del flat
        self._finish(t0)

    # ------------------------------------------------------------------ internals

    def _op(self, what: str) -> str:
        return f"weight sync {self.syncs + 1}: {what}"

    def _broadcast(self, flat: torch.Tensor, bucket: Bucket) -> None:
        bounded(self.rank, self._op(f"{bucket.describe(len(self.buckets))} broadcast from rank {self.src}"),
                self.timeout_s, lambda: dist.broadcast(flat, src=self.src, group=self.group, async_op=True))

    def _finish(self, t0: float) -> SyncStats:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.syncs += 1
        self.last = SyncStats(seconds=time.perf_counter() - t0, bytes=self.bytes, buckets=len(self.buckets))
        return self.last

    def _header(self) -> torch.Tensor:
        digest = np.frombuffer(fingerprint(self.specs), dtype="<i8")
        numel = sum(s.numel for s in self.specs)
        return torch.tensor([len(self.specs), numel, *digest.tolist()], dtype=torch.int64, device=self.device)

    def _verify(self) -> None:
        """At the first sync: every member checks that its specs match the source's."""
        if self._verified:
            return
        mine = self._header()
        theirs = mine.clone()
        bounded(self.rank, self._op(f"model digest broadcast from rank {self.src}"), self.timeout_s,
                lambda: dist.broadcast(theirs, src=self.src, group=self.group, async_op=True))
        ok = torch.tensor([1 if torch.equal(mine, theirs) else 0], dtype=torch.int64, device=self.device)
        size = dist.get_world_size(self.group)
        verdicts = [torch.zeros_like(ok) for _ in range(size)]
        bounded(self.rank, self._op("model digest verdicts all-gather"), self.timeout_s,
                lambda: dist.all_gather(verdicts, ok, group=self.group, async_op=True))
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(size))
        bad = [r for r, v in zip(ranks, verdicts) if int(v.item()) == 0]
        if bad:
            own = ""
            if not ok.item():
                own = (f"; this rank holds {int(mine[0])} tensors / {int(mine[1])} elements, the source "
                       f"{int(theirs[0])} / {int(theirs[1])}")
            raise WeightSyncMismatch(
                f"rank {self.rank}: weight sync: the model of rank(s) {', '.join(map(str, bad))} differs from the "
                f"source rank {self.src}'s in parameter names, shapes or dtypes (same architecture and "
                f"model.dtype needed){own}")
        self._verified = True
