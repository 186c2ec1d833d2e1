"""The coordinator thread on rank 0: message plumbing around a pure logic object (Horovod's pattern).

The thread first runs the handshake — one :class:`Hello` from every rank within ``run.timeout_s``,
answered by a :class:`Welcome` with each rank's node id and local rank — and then pumps messages:
every message from a worker goes to ``logic.on_message(source, msg, now)``, ``logic.on_tick(now)``
runs on every loop, and whatever ``(dest, message)`` pairs they return are sent. The logic never
sees MPI and never reads a clock; when ``logic.done()`` turns true every worker gets :class:`Stop`.

A :class:`Failure` from any worker is logged with its rank and ends the job.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Iterable, Protocol

from .channel import ControlChannel
from .failure import fatal
from .messages import TAG_COORDINATOR, TAG_SERVICE, Failure, Hello, Stop, Welcome
from .mpi import RankTimeout
from .topology import place

Outgoing = Iterable[tuple[int, Any]]


class CoordinatorLogic(Protocol):
    def on_start(self, hellos: list[Hello], handshake_s: float, now: float) -> Outgoing: ...

    def on_message(self, source: int, msg: Any, now: float) -> Outgoing: ...

    def on_tick(self, now: float) -> Outgoing: ...

    def done(self) -> bool: ...


class HandshakeTimeout(RankTimeout):
    def __init__(self, missing: list[int], world: int, seconds: float):
        self.missing = missing
        TimeoutError.__init__(self, f"rank 0: handshake: no hello from rank{'s' if len(missing) > 1 else ''} "
                                    f"{', '.join(map(str, missing))} after {seconds:.1f} s "
                                    f"({world - len(missing)} of {world} ranks answered)")
        self.rank, self.op, self.seconds, self.peer = 0, "handshake", seconds, missing[0]


class CoordinatorThread(threading.Thread):
    def __init__(self, channel: ControlChannel, logic: CoordinatorLogic, *, timeout_s: float,
                 on_fatal: Callable[[str, BaseException], None] | None = None):
        super().__init__(name="coordinator", daemon=True)
        self.channel = channel
        self.logic = logic
        self.timeout_s = timeout_s
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
        start = time.monotonic()
        deadline = start + self.timeout_s
        backoff = self.channel.backoff()
        received_at: dict[int, float] = {}
        while len(got) < world:
            m = self.channel.poll(TAG_COORDINATOR)
            if m is None:
                if time.monotonic() > deadline:
                    raise HandshakeTimeout(sorted(set(range(world)) - set(got)), world, self.timeout_s)
                backoff.idle()
                continue
            backoff.progress()
            source, msg = m
            if isinstance(msg, Failure):
                raise RuntimeError(f"rank {msg.rank} failed during {msg.op}: {msg.error}")
            if not isinstance(msg, Hello):
                raise RuntimeError(f"rank 0: handshake: unexpected {type(msg).__name__} from rank {source}")
            got[source] = msg
            received_at[source] = time.time()
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
            self._send_all(self.logic.on_start(self.hellos, self.handshake_s, time.time()))
            backoff = self.channel.backoff()
            while not self.logic.done():
                m = self.channel.poll(TAG_COORDINATOR)
                if m is not None:
                    backoff.progress()
                    source, msg = m
                    if isinstance(msg, Failure):
                        print(f"reflow_hpc: coordinator: rank {msg.rank} failed in {msg.op}: {msg.error}",
                              file=sys.stderr, flush=True)
                        raise RuntimeError(f"rank {msg.rank} failed in {msg.op}")
                    self._send_all(self.logic.on_message(source, msg, time.time()))
                out = list(self.logic.on_tick(time.time()))
                self._send_all(out)
                if m is None and not out:
                    backoff.idle()
            for r in range(self.channel.size):
                self.channel.send(r, Stop(), TAG_SERVICE)
        except BaseException as e:
            self.error = e
            if self._on_fatal is not None:
                self._on_fatal("coordinator", e)
            else:
                fatal(0, "coordinator", e, comm=self.channel.comm,
                      show_traceback=not isinstance(e, RankTimeout))
