"""Commands the pipeline emits; drivers (MPI runtime, simulator) carry them out.

Every command names the worker it is for. The MPI driver turns each into one control message; the
simulator into an event of its cost model. None of them carries payload arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class DispatchedSample:
    sample_id: int
    group_id: int
    prompt_id: int


@dataclass(frozen=True)
class Dispatch:
    """Generate these samples (whole groups) with the weights the worker holds."""
    worker: int
    samples: tuple[DispatchedSample, ...]


@dataclass(frozen=True, slots=True)
class TrainItem:
    """One sample of a trainer replica's share of the batch."""
    sample_id: int
    owner: int           # rank to fetch the payload from
    location: Any        # where the owner stored it
    advantage: float
    weight: float        # w̃_i, normalised over the whole batch
    is_replay: bool
    staleness: int


@dataclass(frozen=True)
class Train:
    """Fetch the items from their owners and take one optimizer step (one replica's share)."""
    worker: int
    step: int
    version: int
    items: tuple[TrainItem, ...]
    batch_loss_tokens: int   # Σ n_j over the whole batch: every replica normalises by it
    replica: int
    replicas: int


@dataclass(frozen=True)
class Sync:
    """Publish weights of ``version``: ``src`` broadcasts to ``group`` (the worker is one of them).
    ``src`` None means colocated: the worker loads its own trainer weights into its engine."""
    worker: int
    version: int
    src: int | None
    group: tuple[int, ...]


@dataclass(frozen=True)
class Drop:
    """These samples ended: free their payloads from memory (the shard keeps the rows)."""
    worker: int
    sample_ids: tuple[int, ...]


@dataclass(frozen=True)
class Cancel:
    """Stop generating these samples (they ended while in flight)."""
    worker: int
    sample_ids: tuple[int, ...]


@dataclass(frozen=True)
class Checkpoint:
    """Flush shards and report the manifest; the first trainer also saves model and optimizer."""
    worker: int
    step: int
    tag: str             # directory name, e.g. "step_000010"
    save_trainer: bool
