"""Commands the coordinator emits (:mod:`reflow_hpc.core.coordinator`); drivers (the MPI runtime, the
simulator) carry them out.

Every command names the worker it is for. The MPI driver turns each into one control message; the
simulator into an event of its cost model. None of them carries payload arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Any, Iterable, Iterator, NamedTuple


@dataclass(frozen=True)
class Setup:
    """Build what your role needs: the pools, where the weights come from; answer ready."""
    worker: int
    trainers: tuple[int, ...]
    rollouts: tuple[int, ...]
    colocated: bool                 # every worker generates and trains (sync mode)
    version: int                    # policy version of the weights below
    resume_from: str | None         # checkpoint directory, or None for a fresh start
    placements: tuple[int, ...] = ()   # trainer replica counts (n_T) the elastic pool may take (one group set each)


class DispatchedSample(NamedTuple):
    """One sample of a dispatched group (a tuple: thousands are made per step, and a frozen dataclass's
    ``__init__`` costs several times a tuple's)."""
    sample_id: int
    group_id: int
    prompt_id: int


def dispatched_samples(sample_ids: Iterable[int], group_id: int, prompt_id: int) -> Iterator[DispatchedSample]:
    """The samples of one group. The tuples are made by ``tuple.__new__`` without the NamedTuple's
    Python-level constructor: a simulated run at 1,024 GPUs dispatches millions."""
    return map(tuple.__new__, repeat(DispatchedSample), zip(sample_ids, repeat(group_id), repeat(prompt_id)))


@dataclass(frozen=True)
class Dispatch:
    """Generate these samples (whole groups) with the weights the worker holds."""
    worker: int
    samples: tuple[DispatchedSample, ...]


class TrainSample(NamedTuple):
    """One sample of a trainer replica's share of the batch (a tuple, as :class:`DispatchedSample`)."""
    sample_id: int
    owner: int           # rank to fetch the payload from
    advantage: float
    weight: float        # w̃_i, normalised over the whole batch
    is_replay: bool
    staleness: int


def train_samples(*fields: Iterable[Any]) -> list[TrainSample]:
    """TrainSamples from one iterable per field, in field order (made as :func:`dispatched_samples`)."""
    return list(map(tuple.__new__, repeat(TrainSample), zip(*fields)))


@dataclass(frozen=True)
class Train:
    """Fetch the items from their owners and take one optimizer step (one replica's share)."""
    worker: int
    step: int
    version: int
    samples: tuple[TrainSample, ...]
    batch_loss_tokens: int   # Σ n_j over the whole batch: every replica normalises by it
    replica: int
    replicas: int


@dataclass(frozen=True)
class SyncWeights:
    """Publish weights of ``version``: ``src`` broadcasts to ``group``. A worker outside ``group`` is one
    of the source's sharded replica: it gathers the full weights with ``src``. ``src`` None means
    colocated: the worker loads its own trainer weights into its engine."""
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
class FlushTrajectories:
    """Phase 1 of a checkpoint: flush your shards and report the manifest. With ``partials`` (the run
    stops early) also save the samples you are generating, to be continued after the resume."""
    worker: int
    step: int
    tag: str             # directory name, e.g. "step_000010"
    partials: bool = False


@dataclass(frozen=True)
class WriteCheckpoint:
    """Phase 2, to the writer once every other worker flushed: flush your shards too, then write the
    checkpoint with the model, the optimizer, ``state`` (the coordinator's) and every manifest. Also to
    the other workers of a sharded writer's replica: they gather the model and optimizer state with it
    and report."""
    worker: int
    step: int
    tag: str
    state: dict[str, Any]
    manifests: dict[str, dict[str, Any]]      # rank (as text, a JSON key) -> its shard manifest


@dataclass(frozen=True)
class Snapshot:
    """Save the trainer's weights of ``version`` for evaluation after the run (``run.eval_every_steps``);
    ``elapsed_s`` is the training time of the run when the step that made them ended. Sent to every
    worker of the first (sharded) replica: they gather, its first worker saves."""
    worker: int
    step: int
    version: int
    elapsed_s: float


@dataclass(frozen=True)
class Switch:
    """Every worker, at a sync point: the pools change to ``trainers`` / ``rollouts``. A worker that leaves
    rollout holds its in-flight samples for others to fetch and reports them; one that leaves training puts
    its trainer to sleep and wakes its engine (the weights come with the next sync); a new trainer replica
    receives parameters and optimizer state from the replica named in ``transfers`` (source, destination)."""
    worker: int
    trainers: tuple[int, ...]
    rollouts: tuple[int, ...]
    version: int
    transfers: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Resume:
    """Continue these samples, which ``source`` was generating when it left rollout: fetch their partial
    responses (tokens, log-probs, per-token versions) from it and go on under your weights. ``source``
    -1: the checkpoint this run resumed from saved them (its ``partials/``)."""
    worker: int
    samples: tuple[DispatchedSample, ...]
    source: int


@dataclass(frozen=True)
class SetCap:
    """Run at most ``cap`` requests at once (the adaptive generation scheduler's concurrency cap)."""
    worker: int
    cap: int
