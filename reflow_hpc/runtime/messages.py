"""Control messages between the coordinator (rank 0) and the workers, besides the coordinator's
commands (:mod:`reflow_hpc.core.commands`), which travel as they are.

They are small dataclasses carried by the typed channel (:mod:`reflow_hpc.comm.channel`, which
checks the protocol version). Payload arrays never travel here: sample payloads move through
``storage.fetch`` as raw buffers, weights through torch.distributed.

Tags on the control communicator:

- ``TAG_COORDINATOR``: worker → coordinator thread (rank 0).
- ``TAG_SERVICE``: coordinator → a worker's service thread, which hands commands to the main thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.events import FinishedSample

TAG_COORDINATOR = 11
TAG_SERVICE = 12


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
    gpus: list[str] = field(default_factory=list)   # GPUs NVML sees on this node (empty without NVML)


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
    """The run is over: ``DONE``, or why it was cut short (a signal), in which case the ranks skip the
    end-of-run evaluation and leave it to the resumed run (a stop signal leaves little time before the kill)."""
    reason: str = "done"


DONE = Stop().reason


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


# ---------------------------------------------------------------------------------------------
# Training run: worker -> coordinator (each message is one coordinator event; runtime/training.py)
# ---------------------------------------------------------------------------------------------

@dataclass
class Ready:
    """A worker is set up; ``inventory`` lists the finished samples it restored from its shards."""
    rank: int
    inventory: list[dict]           # {sample_id, group_id, prompt_id, reward, min_version, max_version, loss_tokens,
    #                                  location}
    lost: list[int]                 # sample ids its shards lost in a crash
    groups: int = 0                 # process groups it created (a set for every placement of the pool)
    groups_s: float = 0.0           # and the seconds that took


@dataclass
class EngineReport:
    """A rollout worker's engine load (the generation scheduler's input)."""
    kv_tokens_used: int
    kv_tokens_budget: int
    preemptions: int                # cumulative
    running: int
    queued: int
    waiting: int = 0                # samples waiting for a tool call or a reward (outside the engine)


@dataclass
class SamplesFinished:
    rank: int
    samples: list[FinishedSample]
    idle_s: float                   # cumulative rollout idle seconds of this worker
    generated_tokens: int           # cumulative tokens its engine generated
    load: EngineReport | None = None


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
class WeightsLoaded:
    rank: int
    version: int
    seconds: float
    bytes: int
    resumed: int                    # in-flight samples continued under the new weights (partial rollouts)


@dataclass
class TrajectoriesFlushed:
    """Phase 1 of a checkpoint: the worker flushed its trajectory shard."""
    rank: int
    tag: str
    manifest: dict                  # the worker's trajectory shard manifest, summed up
    partials: list[int] = field(default_factory=list)   # in-flight samples it saved (a run stopping early)


@dataclass
class CheckpointWritten:
    """Phase 2 of a checkpoint: the writer wrote it."""
    rank: int
    tag: str
    path: str


@dataclass
class Switched:
    """A worker carried out a role switch; ``handed_off``: the samples it was generating, held for the
    remaining rollout workers to fetch."""
    rank: int
    handed_off: list[int]
    seconds: float


@dataclass
class Heartbeat:
    """Either direction: I am alive (the service thread sends it while the main thread works). A rollout
    worker's carries its cumulative idle time, generated tokens and engine load; a worker on a GPU with
    NVML its GPU's latest reading (:mod:`reflow_hpc.runtime.telemetry`); a worker that ran tool calls or
    rewards its executor's counts (:meth:`reflow_hpc.rollout.tool_executor.ToolStats.snapshot`)."""
    rank: int
    idle_s: float = 0.0
    generated_tokens: int = 0
    load: EngineReport | None = None
    gpu: dict | None = None
    tools: dict | None = None
