"""What happens to the coordinator: the one input of :meth:`~reflow_hpc.core.coordinator.Coordinator.handle`.

One event per message a worker sends (they mirror ``runtime/messages.py``), plus three of the
driver's own: the run starts, time passes, a stop is asked for. Every event carries ``now``, the
driver's clock (wall time on MPI, simulated time in the simulator): the coordinator reads no clock.
An event from a worker names it (``worker``), which is also how the coordinator knows it is alive.

Events are named tuples: the simulator makes millions of them at a thousand GPUs.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from .index import RecoveredSample
from .scheduling import EngineLoad


class Start(NamedTuple):
    """Every worker is connected: tell each its role (they answer :class:`Ready`)."""
    now: float


class Tick(NamedTuple):
    """Time passes (after every message and periodically): liveness, the training-time budget."""
    now: float


class Stop(NamedTuple):
    """Stop early (preemption, time limit): finish the step in flight, sync, checkpoint, end."""
    now: float
    reason: str = "stop requested"


class Heartbeat(NamedTuple):
    """A worker is alive; its cumulative rollout idle time and generated tokens, and its engine's load
    when it generates (None otherwise)."""
    worker: int
    now: float
    idle_s: float = 0.0
    generated_tokens: int = 0
    load: EngineLoad | None = None


class Ready(NamedTuple):
    """``worker`` built what its role needs. At a resume: the finished samples its trajectory shards
    hold (``inventory``) and the ids it could not read back (``lost``)."""
    worker: int
    now: float
    inventory: Sequence[RecoveredSample] = ()
    lost: Sequence[int] = ()


class FinishedSample(NamedTuple):
    """One sample whose generation ended (an item of :class:`SamplesFinished`). The coordinator reads
    it by position, so a plain tuple of these fields in this order will do (the simulator's: a named
    tuple costs several times a plain one to make, once per simulated sample)."""
    sample_id: int
    reward: float
    min_version: int
    max_version: int
    loss_tokens: int
    finish_reason: str
    location: Any = None          # where its payload lies in the owner's trajectory shard
    total_tokens: int = 0         # prompt + response (the KV footprint the scheduler predicts); 0: loss_tokens


class SamplesFinished(NamedTuple):
    """Samples ``worker`` finished (it holds their payloads), with its rollout progress and load."""
    worker: int
    now: float
    samples: Sequence[FinishedSample | tuple[int, float, int, int, int, str, Any, int]]
    idle_s: float = 0.0
    generated_tokens: int = 0
    load: EngineLoad | None = None


class SamplesFailed(NamedTuple):
    """Generation of these samples failed on ``worker`` (``error``: why, one line)."""
    worker: int
    now: float
    sample_ids: Sequence[int]
    error: str = ""


class StepDone(NamedTuple):
    """A trainer rank took its share of the step: its metrics, the time it waited for the batch and
    the time it spent fetching payloads."""
    worker: int
    now: float
    step: int
    stats: dict[str, float]
    idle_s: float = 0.0
    fetch_s: float = 0.0


class WeightsLoaded(NamedTuple):
    """``worker`` took part in the weight sync of ``version`` (sent, gathered or loaded it); ``resumed``:
    in-flight samples it held and continued under the new weights."""
    worker: int
    now: float
    version: int
    seconds: float = 0.0
    resumed: int = 0


class Switched(NamedTuple):
    """``worker`` carried out a role switch; ``handed_off``: samples it was generating and now holds for
    the remaining rollout workers to fetch."""
    worker: int
    now: float
    handed_off: Sequence[int] = ()
    seconds: float = 0.0


class TrajectoriesFlushed(NamedTuple):
    """Phase 1 of a checkpoint: ``worker`` flushed its trajectory shard (``manifest``) and, when the run
    stops early, saved the samples it was generating (``partials``)."""
    worker: int
    now: float
    tag: str
    manifest: dict[str, Any]
    partials: Sequence[int] = ()


class CheckpointWritten(NamedTuple):
    """Phase 2 of a checkpoint: the writer wrote it at ``path`` (or another rank of its replica took
    its part: ``path`` empty)."""
    worker: int
    now: float
    tag: str
    path: str = ""


WORKER_EVENTS = (Heartbeat, Ready, SamplesFinished, SamplesFailed, StepDone, WeightsLoaded, Switched,
                 TrajectoriesFlushed, CheckpointWritten)
Event = (Start | Tick | Stop | Heartbeat | Ready | SamplesFinished | SamplesFailed | StepDone | WeightsLoaded
         | Switched | TrajectoriesFlushed | CheckpointWritten)
