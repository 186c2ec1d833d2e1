"""Typed, versioned control messages between the coordinator (rank 0) and the workers.

Control messages are small dataclasses, pickled by mpi4py inside an envelope that carries
``PROTOCOL``; a peer speaking another protocol version is rejected with an error naming its rank
(mixed installs on a cluster are a real failure mode). Payload arrays never travel here: sample
payloads move through ``storage.fetch`` as raw buffers, weights through torch.distributed.

Tags on the control communicator:

- ``TAG_COORDINATOR``: worker → coordinator thread (rank 0).
- ``TAG_SERVICE``: coordinator → a worker's service thread, which hands commands to the main thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROTOCOL = 1

TAG_COORDINATOR = 11
TAG_SERVICE = 12


class ProtocolError(RuntimeError):
    pass


def wrap(msg: Any) -> tuple[int, Any]:
    return (PROTOCOL, msg)


def unwrap(envelope: Any, source: int, rank: int) -> Any:
    if not (isinstance(envelope, tuple) and len(envelope) == 2 and isinstance(envelope[0], int)):
        raise ProtocolError(f"rank {rank}: malformed control message from rank {source}: {type(envelope).__name__}")
    version, msg = envelope
    if version != PROTOCOL:
        raise ProtocolError(f"rank {rank}: rank {source} speaks control protocol {version}, this rank {PROTOCOL} "
                            f"(different reflow_hpc versions installed on the nodes?)")
    return msg


# ---------------------------------------------------------------------------------------------
# Start-up and shutdown
# ---------------------------------------------------------------------------------------------

@dataclass
class Hello:
    """First message of every worker: who and where it is."""
    rank: int
    node: str            # Slurm node name (SLURMD_NODENAME) or host name
    hostname: str
    pid: int
    scratch: str
    devices: list[str]   # devices visible to this process
    sent_at: float       # worker clock (time.time()), for handshake timings


@dataclass
class Welcome:
    """Coordinator's answer: the placement every worker needs before it builds anything."""
    world_size: int
    node_id: int
    local_rank: int
    local_size: int
    nodes: list[str]
    single_host: bool    # every rank on one host (emulated nodes): rendezvous over loopback
    received_at: float   # coordinator clock when the hello arrived


@dataclass
class Stop:
    reason: str = "done"


@dataclass
class Failure:
    """A worker is about to end the job: the coordinator logs it with its rank before aborting."""
    rank: int
    op: str
    error: str


# ---------------------------------------------------------------------------------------------
# Self-check
# ---------------------------------------------------------------------------------------------

@dataclass
class CheckReport:
    rank: int
    device: str
    backend: str
    handshake_rtt_s: float
    dist_init_s: float
    allreduce_ok: bool
    allreduce_value: float
    allreduce_expected: float
    allreduce_s: float
    mpi_allreduce_ok: bool
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Training run (besides the commands of reflow_hpc.core.commands, which travel as they are)
# ---------------------------------------------------------------------------------------------

@dataclass
class Setup:
    """Coordinator → every worker after the handshake: roles, groups and where to resume from."""
    trainers: list[int]
    rollouts: list[int]
    colocated: bool                 # sync mode: every worker generates and trains
    version: int                    # policy version the weights below correspond to
    resume_from: str | None         # checkpoint directory, or None for a fresh start


@dataclass
class FinishedSample:
    """What the coordinator's index needs of a finished sample (no payload)."""
    sample_id: int
    reward: float
    min_version: int
    max_version: int
    loss_tokens: int
    response_len: int
    finish_reason: str
    location: Any = None


@dataclass
class Ready:
    """A worker is set up; ``inventory`` lists the finished samples it restored from its shards."""
    rank: int
    inventory: list[dict]           # {sample_id, group_id, prompt_id, reward, min_version, max_version, loss_tokens}
    lost: list[int]                 # sample ids its shards lost in a crash


@dataclass
class SamplesFinished:
    rank: int
    samples: list[FinishedSample]
    idle_s: float                   # cumulative rollout idle seconds of this worker
    generated_tokens: int           # cumulative


@dataclass
class SamplesFailed:
    rank: int
    sample_ids: list[int]
    error: str


@dataclass
class StepDone:
    rank: int
    step: int
    stats: dict                     # trainer metrics of this replica (loss, grad_norm, lr, tokens, ...)
    idle_s: float                   # time this replica waited for the batch
    fetch_s: float


@dataclass
class SyncDone:
    rank: int
    version: int
    seconds: float
    bytes: int
    resumed: int                    # in-flight samples held and resumed (partial rollouts)


@dataclass
class CheckpointDone:
    rank: int
    tag: str
    manifest: dict                  # the worker's shard manifest summary


@dataclass
class Heartbeat:
    """Either direction: I am alive (the service thread sends it while the main thread works)."""
    rank: int
    idle_s: float = 0.0
    engine: dict = field(default_factory=dict)


@dataclass
class SaveCheckpoint:
    """Coordinator → the first trainer once every other worker flushed: write the checkpoint.
    ``extra`` holds the coordinator's state and every worker's shard manifest."""
    tag: str
    step: int
    extra: dict
