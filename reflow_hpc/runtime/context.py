"""Start-up and shutdown of one rank: MPI, the launch checks, the threads and the handshake.

Order on every rank: MPI init (thread multiple) → fail fast when srun gave every task its own
one-rank world or the rank count differs from ``resources.workers`` → service thread (and, on
rank 0, the coordinator thread) → hello / welcome handshake under ``run.timeout_s`` → topology.
After the handshake every rank is known to be alive, so the collective that duplicates the data
communicator cannot hang on a rank that never started.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable

from ..comm.channel import ControlChannel
from ..comm.failure import failpoint, fatal
from ..comm.mpi import RankTimeout, barrier, init
from ..config import Config, ConfigError
from ..core.liveness import Unresponsive
from .eventlog import EventLogError
from .pump import MessagePump, Side
from .messages import TAG_COORDINATOR, Failure, Hello, Stop, Welcome
from .service import ServiceThread
from .telemetry import nvml_gpus
from .topology import Topology, check_world_size, node_name, scratch_dir, visible_devices

# The coordinator bounds the handshake by run.timeout_s and names a missing rank; a worker waits
# this many times as long for its welcome, so that the coordinator's message, not the worker's,
# ends the job.
WELCOME_WAIT_FACTOR = 2


def pick_device(cfg: Config, local_rank: int) -> str:
    want = cfg.resources.device
    if want == "cpu":
        return "cpu"
    import torch
    if torch.cuda.is_available():
        return f"cuda:{local_rank % torch.cuda.device_count()}"
    if want == "cuda":
        raise RuntimeError("resources.device = \"cuda\" but torch sees no CUDA device on this node")
    return "cpu"


class Runtime:
    """Everything a worker's main thread uses to talk to the rest of the job."""

    def __init__(self, cfg: Config, side_factory: Callable[[], Side] | None):
        self.cfg = cfg
        self.MPI = init(timeout_s=cfg.run.timeout_s)
        self.world = self.MPI.COMM_WORLD
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        check_world_size(self.size, self.rank)
        if self.size != cfg.resources.workers:
            raise ConfigError("resources.workers", cfg.resources.workers,
                              f"the launcher started {self.size} ranks; make the task count and "
                              f"resources.workers agree (and the pool split with them)")
        self.control = ControlChannel(self.world, poll_min_s=cfg.run.poll_min_s, poll_max_s=cfg.run.poll_max_s)
        self.service = ServiceThread(self.control, on_fatal=self.fail)
        self.pump: MessagePump | None = None
        if self.rank == 0:
            assert side_factory is not None
            self.pump = MessagePump(self.control, side_factory(), timeout_s=cfg.run.timeout_s,
                                    heartbeat_s=cfg.run.heartbeat_s, on_fatal=self._coordinator_failed)
        self.data_comm: Any = None
        self.topology: Topology | None = None
        self.handshake_rtt_s = 0.0
        self.single_host = False
        self._stopped = False

    # -- start-up ------------------------------------------------------------------------------

    def start(self) -> "Runtime":
        self.service.start()
        if self.pump is not None:
            self.pump.start()
        failpoint("handshake", self.rank)
        scratch = scratch_dir(self.cfg.storage.dir, self.cfg.run.name, self.rank)
        t0 = time.time()
        self.control.send(0, Hello(self.rank, node_name(), socket.gethostname(), os.getpid(), str(scratch),
                                   visible_devices(), t0, nvml_gpus()), TAG_COORDINATOR)
        welcome = self.service.next_command(WELCOME_WAIT_FACTOR * self.cfg.run.timeout_s,
                                            "handshake (waiting for welcome)")
        if not isinstance(welcome, Welcome):
            raise RuntimeError(f"rank {self.rank}: handshake: expected Welcome, got {type(welcome).__name__}")
        self.handshake_rtt_s = time.time() - t0
        self.single_host = welcome.single_host
        device = pick_device(self.cfg, welcome.local_rank)
        if device.startswith("cuda"):
            import torch
            torch.cuda.set_device(torch.device(device))
        self.topology = Topology(self.rank, self.size, node_name(), welcome.node_id, welcome.local_rank,
                                 welcome.local_size, welcome.nodes, socket.gethostname(), os.getpid(),
                                 device, str(scratch))
        self.data_comm = self.world.Dup()
        return self

    # -- talking to the coordinator ------------------------------------------------------------

    def send(self, msg: Any) -> None:
        self.control.send(0, msg, TAG_COORDINATOR)

    def next_command(self, op: str, timeout: float | None = None) -> Any:
        return self.service.next_command(self.cfg.run.timeout_s if timeout is None else timeout, op)

    # -- failure and shutdown ------------------------------------------------------------------

    def fail(self, op: str, error: BaseException | str) -> None:
        """End the job from any thread of this rank, telling the coordinator first."""
        def notify(op_: str, text: str) -> None:
            if self.rank != 0:
                self.control.send(0, Failure(self.rank, op_, text), TAG_COORDINATOR)
                self.control.drain_sends(self.cfg.run.abort_grace_s)
        fatal(self.rank, op, error, comm=self.world, notify=notify,
              show_traceback=not isinstance(error, (RankTimeout, ConfigError)), grace_s=self.cfg.run.abort_grace_s)

    def _coordinator_failed(self, op: str, error: BaseException) -> None:
        quiet = isinstance(error, (RankTimeout, Unresponsive, EventLogError))    # their one line says it all
        fatal(0, op, error, comm=self.world, show_traceback=not quiet, grace_s=self.cfg.run.abort_grace_s)

    def wait_stop(self, op: str = "waiting for the coordinator's stop") -> None:
        while True:
            msg = self.next_command(op)
            if isinstance(msg, Stop):
                return

    def shutdown(self) -> None:
        """Ordered end: threads joined, sends drained, every rank past a final barrier."""
        if self._stopped:
            return
        self._stopped = True
        timeout = self.cfg.run.timeout_s
        self.service.stop()
        self.service.join(timeout)
        if self.pump is not None:
            self.pump.join(timeout)
            if self.pump.is_alive():
                raise RankTimeout(0, "shutdown (coordinator thread did not end)", timeout)
        self.control.drain_sends(timeout)
        barrier(self.world, timeout=timeout, op="shutdown barrier")
        # Late heartbeats and abandoned replies must not be left unreceived: MPI_Finalize refuses a
        # communicator with unmatched messages. Every send started before the barrier, so after a
        # second barrier nothing more can arrive.
        for _ in range(2):
            self._discard_pending()
            barrier(self.world, timeout=timeout, op="shutdown barrier (drain)")
        if self.data_comm is not None:
            self.data_comm.Free()
            self.data_comm = None

    def _discard_pending(self) -> None:
        MPI = self.MPI
        for comm in (self.world, self.data_comm):
            if comm is None:
                continue
            while True:
                status = MPI.Status()
                handle = comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
                if handle is None:
                    break
                handle.Recv([bytearray(max(1, status.Get_count(MPI.BYTE))), MPI.BYTE])   # raw: any payload
