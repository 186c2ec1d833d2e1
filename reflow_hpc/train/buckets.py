"""Flat buckets of same-dtype tensors: the unit that the gradient all-reduce and the weight sync move.

- A bucket holds tensors of one dtype whose sizes add up to at most ``bucket_bytes``; a tensor
  larger than that travels alone in its own bucket (it is never split, so the source can send it
  from its own storage without a copy).
- The plan is a pure function of the ordered tensor specs (name, shape, dtype) and the bucket size:
  tensors are taken in order, each dtype fills its own open bucket, and a bucket is closed when the
  next tensor would overflow it. Two processes holding the same architecture therefore compute the
  same plan without exchanging any metadata.
- :func:`fingerprint` digests the specs so that both sides can check once that they agree.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

MB = 1 << 20


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class Bucket:
    index: int
    dtype: torch.dtype
    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]        # element offset of each tensor in the flat bucket
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def describe(self, total: int) -> str:
        first = self.specs[0].name
        more = f" +{len(self.specs) - 1} more" if len(self.specs) > 1 else ""
        return (f"bucket {self.index + 1}/{total} ({str(self.dtype).removeprefix('torch.')}, "
                f"{self.nbytes / MB:.2f} MB: {first}{more})")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def specs_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in named]


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Group ``specs`` into buckets of at most ``bucket_bytes`` per dtype (see the module docstring)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, not {bucket_bytes}")
    closed: list[tuple[torch.dtype, list[TensorSpec]]] = []
    open_: dict[torch.dtype, tuple[list[TensorSpec], list[int]]] = {}   # dtype -> (members, [bytes])
    for spec in specs:
        members, filled = open_.get(spec.dtype, (None, None))
        if members and filled[0] + spec.nbytes > bucket_bytes:
            closed.append((spec.dtype, members))
            members = None
        if not members:
            members, filled = open_[spec.dtype] = ([], [0])
        members.append(spec)
        filled[0] += spec.nbytes
    closed.extend((dtype, members) for dtype, (members, _) in open_.items() if members)
    buckets = []
    for index, (dtype, members) in enumerate(closed):
        offsets, n = [], 0
        for s in members:
            offsets.append(n)
            n += s.numel
        buckets.append(Bucket(index, dtype, tuple(members), tuple(offsets), n))
    return buckets


def pack(bucket: Bucket, tensors: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The bucket's tensors as one flat tensor on ``device`` (a single tensor there is not copied)."""
    if len(tensors) == 1 and tensors[0].device == torch.device(device) and tensors[0].is_contiguous():
        return tensors[0].detach().reshape(-1)
    flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
    for t, spec, off in zip(tensors, bucket.specs, bucket.offsets, strict=True):
        flat[off:off + spec.numel].copy_(t.detach().reshape(-1), non_blocking=True)
    return flat


def unpack(bucket: Bucket, flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat``, one per tensor of the bucket, in the bucket's order and shapes."""
    return [flat[off:off + s.numel].view(s.shape) for s, off in zip(bucket.specs, bucket.offsets)]


def fingerprint(specs: Sequence[TensorSpec]) -> bytes:
    """sha256 of the ordered names, shapes and dtypes."""
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}:{','.join(map(str, s.shape))}:{s.dtype}\n".encode())
    return h.digest()
