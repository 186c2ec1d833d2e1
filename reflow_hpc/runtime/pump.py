"""The message pump: the thread on rank 0 that carries messages between the workers and a side
(Horovod's pattern); the coordinator runs on it.

The thread first runs the handshake — one :class:`Hello` from every rank within ``run.timeout_s``,
answered by a :class:`Welcome` with each rank's node id and local rank — and then pumps messages:
every message from a worker goes to ``side.on_message(source, msg, now)`` (the training side routes
it by type to the pure :class:`~reflow_hpc.core.coordinator.Coordinator`, ``runtime/training.py``;
the self-check side collects reports), ``side.on_tick(now)`` runs on every loop, and the
``(dest, message)`` pairs they return are sent. Every ``run.heartbeat_s`` every worker gets a
:class:`Heartbeat`; when ``side.done()`` turns true every worker gets :class:`Stop`
(``side.stop_reason()``).

A :class:`Failure` from any worker is logged with its rank and ends the job.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Iterable, Protocol

from ..comm.channel import ControlChannel
from ..comm.failure import fatal
from ..comm.mpi import RankTimeout, wait_until
from ..core.liveness import Unresponsive
from .eventlog import EventLogError
from .messages import TAG_COORDINATOR, TAG_SERVICE, Failure, Heartbeat, Hello, Stop, Welcome
from .topology import place

Outgoing = Iterable[tuple[int, Any]]


class Side(Protocol):
    """What the pump drives: the training run (runtime/training.py) or the self-check (runtime/selfcheck.py)."""

    def on_start(self, hellos: list[Hello], handshake_s: float, now: float) -> Outgoing: ...

    def on_message(self, source: int, msg: Any, now: float) -> Outgoing: ...

    def on_tick(self, now: float) -> Outgoing: ...

    def done(self) -> bool: ...

    def stop_reason(self) -> str:
        """What the :class:`Stop` every worker gets once ``done()`` says (messages.DONE: ended as planned)."""
        ...


class HandshakeTimeout(RankTimeout):
    def __init__(self, missing: list[int], world: int, seconds: float):
        self.missing = missing
        TimeoutError.__init__(self, f"rank 0: handshake: no hello from rank{'s' if len(missing) > 1 else ''} "
                                    f"{', '.join(map(str, missing))} after {seconds:.1f} s "
                                    f"({world - len(missing)} of {world} ranks answered)")
        self.rank, self.op, self.seconds, self.peer = 0, "handshake", seconds, missing[0]


class MessagePump(threading.Thread):
    def __init__(self, channel: ControlChannel, side: Side, *, timeout_s: float, heartbeat_s: float,
                 on_fatal: Callable[[str, BaseException], None] | None = None):
        super().__init__(name="coordinator", daemon=True)     # the coordinator runs on it
        self.channel = channel
        self.side = side
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.hellos: list[Hello] = []
        self.handshake_s = 0.0
        self._on_fatal = on_fatal
        self.error: BaseException | None = None

    # -- plumbing ------------------------------------------------------------------------------

    def _send_all(self, out: Outgoing) -> None:
        for dest, msg in out:
            self.channel.send(dest, msg, TAG_SERVICE)

    def _handshake(self) -> None:
        world = self.channel.size
        got: dict[int, Hello] = {}
        received_at: dict[int, float] = {}
        start = time.monotonic()
        backoff = self.channel.backoff()

        def everyone() -> bool:
            m = self.channel.poll(TAG_COORDINATOR)
            if m is None:
                return False
            backoff.progress()
            source, msg = m
            if isinstance(msg, Failure):
                raise RuntimeError(f"rank {msg.rank} failed during {msg.op}: {msg.error}")
            if not isinstance(msg, Hello):
                raise RuntimeError(f"rank 0: handshake: unexpected {type(msg).__name__} from rank {source}")
            got[source] = msg
            received_at[source] = time.time()
            return len(got) == world

        try:
            wait_until(everyone, timeout=self.timeout_s, rank=0, op="handshake", backoff=backoff)
        except RankTimeout:
            raise HandshakeTimeout(sorted(set(range(world)) - set(got)), world, self.timeout_s) from None
        self.handshake_s = time.monotonic() - start
        self.hellos = [got[r] for r in range(world)]
        placement = place([h.node for h in self.hellos])
        single_host = len({h.hostname for h in self.hellos}) == 1
        for r in range(world):
            self.channel.send(r, Welcome(world, placement.node_of_rank[r], placement.local_rank[r],
                                         placement.local_size[r], placement.nodes, single_host, received_at[r]),
                              TAG_SERVICE)

    def run(self) -> None:
        try:
            self._handshake()
            self._send_all(self.side.on_start(self.hellos, self.handshake_s, time.time()))
            backoff = self.channel.backoff()
            next_heartbeat = 0.0
            while not self.side.done():
                m = self.channel.poll(TAG_COORDINATOR)
                if m is not None:
                    backoff.progress()
                    source, msg = m
                    if isinstance(msg, Failure):
                        print(f"reflow_hpc: coordinator: rank {msg.rank} failed in {msg.op}: {msg.error}",
                              file=sys.stderr, flush=True)
                        raise RuntimeError(f"rank {msg.rank} failed in {msg.op}")
                    self._send_all(self.side.on_message(source, msg, time.time()))
                out = list(self.side.on_tick(time.time()))
                if time.monotonic() >= next_heartbeat:
                    out += [(r, Heartbeat(0)) for r in range(self.channel.size)]
                    next_heartbeat = time.monotonic() + self.heartbeat_s
                self._send_all(out)
                if m is None and not out:
                    backoff.idle()
            for r in range(self.channel.size):
                self.channel.send(r, Stop(self.side.stop_reason()), TAG_SERVICE)
        except BaseException as e:
            self.error = e
            quiet = isinstance(e, (RankTimeout, Unresponsive, EventLogError))
            if self._on_fatal is not None:
                self._on_fatal("coordinator", e)
            else:
                fatal(0, "coordinator", e, comm=self.channel.comm, show_traceback=not quiet)
