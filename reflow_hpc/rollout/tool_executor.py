"""A rollout worker's executor for tool calls and rewards, off the engine loop (DESIGN §6).

``task.tool_concurrency`` daemon threads take jobs in arrival order. The engine loop submits a job
and goes on decoding; finished jobs wait in a queue that the loop drains between engine steps
(:meth:`ToolExecutor.finished`), so a job's result is applied on the loop's thread and the runner's
state is never touched from two threads. Daemon threads, not ``concurrent.futures``: a tool stuck past
its time limit cannot be killed from Python, and it must not keep the process alive at exit.

A job is a callable plus a *ticket* (any object): the runner compares the ticket of a result with the
one its sample waits for, so a late result of a call it stopped waiting for (a timeout, a hand-off,
a cancel) is dropped. The executor stamps when a job started running, which the runner's time limit
counts from (time spent queued behind other calls is not the tool's).

:class:`ToolStats` keeps what the metrics report: tool calls, errors, time-outs, the latency of the
last calls, the time samples spent waiting for a tool against the time they were in flight, and
turns per finished sample.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

# Latencies kept for the p50/p99 the heartbeat reports: the most recent calls.
LATENCY_WINDOW = 256


@dataclass
class Job:
    ticket: Any
    fn: Callable[[], Any]
    submitted_at: float
    started_at: float | None = None       # set by the thread that runs it
    ended_at: float | None = None
    result: Any = None
    error: BaseException | None = None


class ToolExecutor:
    def __init__(self, threads: int, name: str = "tools"):
        if threads < 1:
            raise ValueError(f"task.tool_concurrency = {threads}: must be ≥ 1")
        self.threads = threads
        self.name = name
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self.outstanding = 0                  # submitted and not yet handed back by finished()

    def submit(self, ticket: Any, fn: Callable[[], Any]) -> Job:
        if not self._workers:                 # started on first use: a runner without tools starts none
            self._workers = [threading.Thread(target=self._loop, name=f"{self.name}-{i}", daemon=True)
                             for i in range(self.threads)]
            for t in self._workers:
                t.start()
        job = Job(ticket, fn, time.monotonic())
        self.outstanding += 1
        self._jobs.put(job)
        return job

    def finished(self, wait_s: float = 0.0) -> list[Job]:
        """Jobs that ended since the last call; waits up to ``wait_s`` for the first when none has."""
        out: list[Job] = []
        try:
            out.append(self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self.outstanding -= len(out)
        return out

    def close(self) -> None:
        """Let the threads end once the jobs queued before this are done (a stuck one stays, as a daemon)."""
        for _ in self._workers:
            self._jobs.put(None)
        self._workers = []

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job.started_at = time.monotonic()
            try:
                job.result = job.fn()
            except BaseException as e:       # reported with the job: the runner fails that sample only
                job.error = e
            job.ended_at = time.monotonic()
            self._done.put(job)


@dataclass
class ToolStats:
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    tool_seconds: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    wait_s: float = 0.0           # Σ over samples: time from a tool call's submission to its observation
    sample_s: float = 0.0         # Σ over finished samples: time from start (here) to reward
    samples: int = 0              # finished samples
    turns: int = 0                # their model turns

    def snapshot(self) -> dict[str, Any]:
        """A plain dict for the heartbeat (cumulative counts; latencies of the last calls). Read on another
        thread than the one that adds: ``list(deque)`` copies in one step under the GIL."""
        return {"calls": self.calls, "errors": self.errors, "timeouts": self.timeouts,
                "tool_seconds": [round(x, 6) for x in list(self.tool_seconds)], "wait_s": self.wait_s,
                "sample_s": self.sample_s, "samples": self.samples, "turns": self.turns}


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``xs`` by the nearest rank; nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def step_metrics(stats: dict[int, dict]) -> dict[str, float]:
    """The ``rollout/tool_*`` metrics from each rollout worker's latest :meth:`ToolStats.snapshot`."""
    if not stats:
        return {}
    snaps = list(stats.values())
    lat = [x for s in snaps for x in s["tool_seconds"]]
    total = lambda k: sum(s[k] for s in snaps)
    samples, sample_s = total("samples"), total("sample_s")
    return {"rollout/tool_calls": total("calls"), "rollout/tool_errors": total("errors"),
            "rollout/tool_timeouts": total("timeouts"),
            "rollout/tool_seconds_p50": percentile(lat, 0.5), "rollout/tool_seconds_p99": percentile(lat, 0.99),
            "rollout/tool_wait_fraction": total("wait_s") / sample_s if sample_s > 0 else 0.0,
            "rollout/turns_per_sample": total("turns") / samples if samples else float("nan")}
