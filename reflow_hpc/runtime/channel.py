"""The control channel: pickled control messages over a dedicated communicator.

Sends are non-blocking (``isend``; completed requests are reaped on later sends) so a slow peer
never stalls the sender. Receives are matched probes on one tag, so two threads of a rank can
receive concurrently as long as they listen on different tags.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .messages import unwrap, wrap
from .mpi import Backoff, RankTimeout, init


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
        backoff = self.backoff()
        deadline = time.monotonic() + timeout
        while True:
            got = self.poll(tag)
            if got is not None:
                return got
            if time.monotonic() > deadline:
                raise RankTimeout(self.rank, op, timeout, peer)
            backoff.idle()

    def drain_sends(self, timeout: float) -> bool:
        """Wait (bounded) until every message sent so far has left; True when all did."""
        deadline = time.monotonic() + timeout
        backoff = self.backoff()
        while True:
            with self._lock:
                self._inflight = [r for r in self._inflight if not r.Test()]
                if not self._inflight:
                    return True
            if time.monotonic() > deadline:
                return False
            backoff.idle()
