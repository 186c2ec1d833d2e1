"""The service thread every worker runs beside its main thread (DESIGN §3).

It receives the coordinator's commands and hands them to the main thread through an inbox queue,
and it keeps the data plane answering (fetch requests for samples this worker owns) while the main
thread is busy generating or training. Anything it polls is a callable returning True when it did
work; the thread backs off while nothing happens.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from ..comm.channel import ControlChannel
from ..comm.failure import fatal
from .messages import TAG_SERVICE, Heartbeat, Stop


class ServiceThread(threading.Thread):
    def __init__(self, channel: ControlChannel, *, pollers: list[Callable[[], bool]] | None = None,
                 on_fatal: Callable[[str, BaseException], None] | None = None):
        super().__init__(name=f"service-{channel.rank}", daemon=True)
        self.channel = channel
        self.inbox: queue.Queue = queue.Queue()
        self.pollers = list(pollers or [])
        self._stop_flag = threading.Event()
        self._on_fatal = on_fatal
        self.last_heard = time.monotonic()       # last message from the coordinator
        self.heartbeat: Callable[[], None] | None = None
        self.heartbeat_s = 0.0
        self.cpu_s: float | None = None          # this thread's CPU seconds, set when it ends (rankstats)

    def add_poller(self, poll: Callable[[], bool]) -> None:
        self.pollers.append(poll)

    def stop(self) -> None:
        self._stop_flag.set()

    def run(self) -> None:
        backoff = self.channel.backoff()
        next_beat = time.monotonic()
        try:
            while not self._stop_flag.is_set():
                busy = False
                got = self.channel.poll(TAG_SERVICE)
                if got is not None:
                    busy = True
                    self.last_heard = time.monotonic()
                    if not isinstance(got[1], Heartbeat):
                        self.inbox.put(got[1])
                    if isinstance(got[1], Stop):
                        return
                if self.heartbeat is not None and time.monotonic() >= next_beat:
                    self.heartbeat()
                    next_beat = time.monotonic() + self.heartbeat_s
                for poll in self.pollers:
                    busy = poll() or busy
                if busy:
                    backoff.progress()
                else:
                    backoff.idle()
        except BaseException as e:  # a dead service thread would hang every peer: end the job instead
            if self._on_fatal is not None:
                self._on_fatal("service thread", e)
            else:
                fatal(self.channel.rank, "service thread", e, comm=self.channel.comm)
        finally:
            self.cpu_s = time.thread_time()

    def next_command(self, timeout: float, op: str) -> Any:
        """The next command for the main thread; RankTimeout naming the coordinator after ``timeout``."""
        from ..comm.mpi import RankTimeout
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise RankTimeout(self.channel.rank, op, timeout, peer="0 (coordinator)") from None

    def poll_command(self, wait_s: float = 0.0) -> Any | None:
        """The next command, waiting at most ``wait_s``; None when there is none."""
        try:
            return self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard
