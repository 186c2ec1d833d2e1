"""Liveness: every event names the worker it came from; a worker silent too long ends the run.

Before every worker reported ready (models load, process groups join) the bound is
``setup_timeout_s`` and counts from the start of the run; afterwards it is ``timeout_s`` since each
worker's last message or heartbeat. Time arrives with the events (:class:`~reflow_hpc.core.events.Tick`).
"""

from __future__ import annotations

from typing import Sequence


class Unresponsive(TimeoutError):
    """A worker sent nothing for too long; the message names it and what the coordinator waited for."""

    def __init__(self, worker: int, op: str, seconds: float):
        self.worker, self.op, self.seconds = worker, op, seconds
        super().__init__(f"rank 0: {op}: no answer from rank {worker} after {seconds:.1f} s")


class Liveness:
    def __init__(self, workers: Sequence[int], *, timeout_s: float, setup_timeout_s: float):
        self.workers = list(workers)
        self.timeout_s, self.setup_timeout_s = timeout_s, setup_timeout_s
        self.last_seen: dict[int, float] = {}
        self.started_at = 0.0
        self.ready: set[int] = set()

    def start(self, now: float) -> None:
        self.started_at = now
        self.last_seen = {w: now for w in self.workers}

    def heard(self, worker: int, now: float) -> None:
        self.last_seen[worker] = now

    def report_ready(self, worker: int) -> bool:
        """``worker`` is ready; True once every worker is."""
        self.ready.add(worker)
        return len(self.ready) >= len(self.workers)

    def check(self, now: float, *, setup: bool, running: bool) -> None:
        """Raise :class:`Unresponsive` naming a worker silent too long (during ``setup`` or once ``running``)."""
        if setup:
            self.check_setup(now)
        elif running:
            self.check_running(now)

    def check_setup(self, now: float) -> None:
        missing = [w for w in self.workers if w not in self.ready]
        if missing and now - self.started_at > self.setup_timeout_s:
            raise Unresponsive(missing[0], f"setup (no ready from rank(s) {', '.join(map(str, missing))})",
                               self.setup_timeout_s)

    def check_running(self, now: float) -> None:
        silent = [w for w, t in self.last_seen.items() if now - t > self.timeout_s]
        if silent:
            raise Unresponsive(silent[0], f"watching rank {silent[0]} (no message or heartbeat)", self.timeout_s)
