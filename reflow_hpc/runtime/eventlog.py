"""The coordinator's event log on disk: one JSON object per line in ``<run dir>/events.jsonl``.

The coordinator (pure) records events as small dicts (the ``log`` of :class:`~reflow_hpc.core.outputs.Outputs`).
The coordinator thread only hands each batch of them to :class:`EventWriter`, whose own thread turns
them into lines and appends them, so the log takes the coordinator thread nothing but the hand-over.
The events of every sample (``dispatch``, ``finish``, ``end``) are formatted directly, about five
times faster than ``json.dumps``; the rare ones go through ``json.dumps``. Both give the same JSON.
The schema is in docs/storage.md.

The log must never hang or silently break a run. A write that fails (disk full, file too large, a
file system gone) stops the writer; the next :meth:`EventWriter.put`, :meth:`~EventWriter.flush` or
:meth:`~EventWriter.close` on the coordinator thread raises :class:`EventLogError`, one line naming
the file and the cause, and the coordinator's failure path ends the job (a rerun resumes from the
newest checkpoint). ``flush`` and ``close`` wait at most ``timeout_s`` (half of ``run.timeout_s``, see
runtime/training.py) for a writer stuck in a write; the queue holds at most :data:`MAX_PENDING_EVENTS`
events before ``put`` waits for the writer (back-pressure, bounded by the same deadline).
"""

from __future__ import annotations

import json
import math
import os
import stat
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from ..private import open_append, open_new

# Most events that may wait in memory for the writer before put() blocks. A finish event's dict is
# ~0.5 KB (measured), so the bound is ~64 MB of rank 0's memory. The writer takes everything queued
# every flush_s, so only a file system that stalls for many seconds ever reaches it.
MAX_PENDING_EVENTS = 1 << 17

_dumps = json.JSONEncoder(separators=(",", ":")).encode


def _ints(xs: Any) -> str:
    return "[" + ",".join(map(str, xs)) + "]"


def _finish(e: dict) -> str | None:
    reward, loc = e["reward"], e["loc"]
    if not (isinstance(reward, float) and math.isfinite(reward)) or not (loc is None or isinstance(loc, list)):
        return None
    return (f'{{"t":{e["t"]!r},"e":"finish","v":{e["v"]},"id":{e["id"]},"w":{e["w"]},"reward":{reward!r},'
            f'"span":{_ints(e["span"])},"tokens":{e["tokens"]},"reason":{_dumps(e["reason"])},'
            f'"loc":{"null" if loc is None else _ints(loc)}}}')


def _end(e: dict) -> str:
    return f'{{"t":{e["t"]!r},"e":"end","v":{e["v"]},"id":{e["id"]},"reason":"{e["reason"]}","w":{e["w"]}}}'


def _dispatch(e: dict) -> str:
    return (f'{{"t":{e["t"]!r},"e":"dispatch","v":{e["v"]},"w":{e["w"]},"group":{e["group"]},'
            f'"prompt":{e["prompt"]},"ids":{_ints(e["ids"])}}}')


_FAST: dict[str, Callable[[dict], str | None]] = {"finish": _finish, "end": _end, "dispatch": _dispatch}


def encode(event: dict) -> str:
    """One event as one line of JSON (without the newline)."""
    fast = _FAST.get(event["e"])
    line = fast(event) if fast is not None else None
    return line if line is not None else _dumps(event)


def _drop_partial_line(path: Path) -> int:
    """Cut a last line that a failed write left unfinished (a run that ended on a full disk), so that the
    lines a resumed run appends stay one JSON object each; returns the bytes cut."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return 0                      # a FIFO or someone else's file: not ours to cut
        end = pos = st.st_size
        while pos > 0:
            start = max(0, pos - (1 << 16))
            chunk = os.pread(fd, pos - start, start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                if start + i + 1 < end:
                    os.ftruncate(fd, start + i + 1)
                return end - (start + i + 1)
            pos = start
        os.ftruncate(fd, 0)
        return end
    finally:
        os.close(fd)


class EventLogError(RuntimeError):
    """The event log cannot go on: one line naming the file, the operation and the cause."""


class EventWriter(threading.Thread):
    """Appends events to a file from its own thread; :meth:`put` is all the caller's thread does."""

    def __init__(self, path: Path, *, append: bool, flush_s: float = 0.5, timeout_s: float = 120.0,
                 max_pending: int = MAX_PENDING_EVENTS):
        super().__init__(name="event-log", daemon=True)
        self.path = path
        self.cut = _drop_partial_line(path) if append else 0
        if append:
            self._file = open_append(path)
        else:               # a fresh log: an old one goes (unlink never follows a symlink), then O_EXCL
            path.unlink(missing_ok=True)
            self._file = open_new(path)
        self._queue: deque[list[dict]] = deque()
        self._wake = threading.Event()
        self._progress = threading.Event()  # set by the writer after each round and when it stops
        self._closing = False
        self._flush_s = flush_s            # how often the thread writes what was put (the file's lag behind)
        self.timeout_s = timeout_s         # the longest flush() and close() wait, and put() under back-pressure
        self.max_pending = max_pending
        self._error: str | None = None     # why the writer stopped; raised on the caller's thread
        self._put = 0                      # events put (caller's thread only)
        self.events = 0                    # events written (writer thread only)
        self._flushed = 0                  # events written and flushed to the file (writer thread only)
        self.cpu_seconds = 0.0             # this thread's CPU time encoding and writing
        self.start()

    def put(self, events: list[dict]) -> None:
        if self._error is not None:
            raise EventLogError(self._error)
        self._queue.append(events)         # no wake-up: the writer comes every flush_s
        self._put += len(events)
        if self._put - self.events > self.max_pending:
            # Back-pressure: wait until the writer has taken half of the bound, not just one event
            # below it, so that the puts after this one go through again.
            self._wait(lambda: self._put - self.events <= self.max_pending // 2, "put (queue full)")

    def flush(self) -> None:
        """Write everything put so far before returning (checkpoints: the log is on disk with them)."""
        target = self._put
        self._wait(lambda: self._flushed >= target, "flush")

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self.join(self.timeout_s)
        if self.is_alive():
            raise EventLogError(f"event log {self.path}: close: the writer has not finished after "
                                f"{self.timeout_s:.1f} s")
        if self._error is not None:
            try:
                self._file.close()         # what is still buffered cannot be written either
            except OSError:
                pass
            raise EventLogError(self._error)
        self._file.close()

    def _wait(self, done: Callable[[], bool], op: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._progress.clear()         # cleared before the test: a round that ends after it sets it again
            if self._error is not None:
                raise EventLogError(self._error)
            if done():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise EventLogError(f"event log {self.path}: {op}: {self._put - self._flushed} events not written "
                                    f"after {self.timeout_s:.1f} s (is its file system answering?)")
            self._wake.set()
            self._progress.wait(left)

    def run(self) -> None:
        try:
            self._write_rounds()
        except BaseException as e:         # whatever stops the writer must reach the caller
            self._error = f"event log {self.path}: write failed: {str(e) or type(e).__name__}"
            self._queue.clear()            # nothing more will be written: free the memory
        finally:
            self._progress.set()

    def _write_rounds(self) -> None:
        while True:
            self._wake.wait(self._flush_s)
            self._wake.clear()
            t0 = time.thread_time()
            while self._queue:
                batch = self._queue.popleft()
                self._file.write("".join(encode(e) + "\n" for e in batch))
                self.events += len(batch)
            self._file.flush()
            self._flushed = self.events
            self.cpu_seconds += time.thread_time() - t0
            self._progress.set()
            if self._closing and not self._queue:
                return
