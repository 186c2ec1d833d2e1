"""The typed control channel: pickled control messages over a dedicated communicator.

Every message travels inside an envelope that carries ``PROTOCOL``; a peer speaking another
protocol version is rejected with an error naming its rank (mixed installs on a cluster are a real
failure mode). The message types themselves belong to the layer that speaks them
(``runtime/messages.py``, ``core/commands.py``); payload arrays never travel here.

Sends are non-blocking (``isend``; completed requests are reaped on later sends) so a slow peer
never stalls the sender. Receives are matched probes on one tag, so two threads of a rank can
receive concurrently as long as they listen on different tags.
"""

from __future__ import annotations

import threading
from typing import Any

from .mpi import Backoff, init, wait_until

PROTOCOL = 1


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


class ControlChannel:
    def __init__(self, comm: Any, *, poll_min_s: float, poll_max_s: float):
        self.MPI = init()
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.poll_min_s, self.poll_max_s = poll_min_s, poll_max_s
        self._lock = threading.Lock()
        self._inflight: list[Any] = []

    def backoff(self) -> Backoff:
        return Backoff(self.poll_min_s, self.poll_max_s)

    def send(self, dest: int, msg: Any, tag: int) -> None:
        req = self.comm.isend(wrap(msg), dest=dest, tag=tag)
        with self._lock:
            self._inflight = [r for r in self._inflight if not r.Test()]
            self._inflight.append(req)

    def poll(self, tag: int) -> tuple[int, Any] | None:
        """One waiting message on ``tag`` as (source, message), or None without blocking."""
        status = self.MPI.Status()
        handle = self.comm.improbe(self.MPI.ANY_SOURCE, tag, status)
        if handle is None:
            return None
        source = status.Get_source()
        return source, unwrap(handle.recv(), source, self.rank)

    def recv(self, tag: int, *, timeout: float, op: str, peer: int | None = None) -> tuple[int, Any]:
        return wait_until(lambda: self.poll(tag), timeout=timeout, rank=self.rank, op=op, peer=peer,
                          backoff=self.backoff())

    def drain_sends(self, timeout: float) -> bool:
        """Wait (bounded) until every message sent so far has left; True when all did."""
        def drained() -> bool:
            with self._lock:
                self._inflight = [r for r in self._inflight if not r.Test()]
                return not self._inflight
        return wait_until(drained, timeout=timeout, rank=self.rank, op="draining sends", backoff=self.backoff(),
                          raise_on_timeout=False)
