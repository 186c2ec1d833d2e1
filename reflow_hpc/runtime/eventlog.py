"""The coordinator's event log on disk: one JSON object per line in ``<run dir>/events.jsonl``.

The coordinator (pure) records events as small dicts (the ``log`` of :class:`~reflow_hpc.core.outputs.Outputs`).
The coordinator thread only hands each batch of them to :class:`EventWriter`, whose own thread turns
them into lines and appends them, so the log takes the coordinator thread nothing but the hand-over.
The events of every sample (``dispatch``, ``finish``, ``end``) are formatted directly, about five
times faster than ``json.dumps``; the rare ones go through ``json.dumps``. Both give the same JSON.
The schema is in docs/storage.md.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

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


class EventWriter(threading.Thread):
    """Appends events to a file from its own thread; :meth:`put` is all the caller's thread does."""

    def __init__(self, path: Path, *, append: bool, flush_s: float = 0.5):
        super().__init__(name="event-log", daemon=True)
        self.path = path
        self._file = path.open("a" if append else "w")
        self._queue: deque[list[dict]] = deque()
        self._wake = threading.Event()
        self._closing = False
        self._flush_s = flush_s            # how often the thread writes what was put (the file's lag behind)
        self.events = 0
        self.cpu_seconds = 0.0             # this thread's CPU time encoding and writing
        self.start()

    def put(self, events: list[dict]) -> None:
        self._queue.append(events)         # no wake-up: the writer comes every flush_s

    def flush(self) -> None:
        """Write everything put so far before returning (checkpoints: the log is on disk with them)."""
        done = threading.Event()
        self._queue.append([{"__flush__": done}])
        self._wake.set()
        done.wait()

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self.join()
        self._file.close()

    def run(self) -> None:
        while True:
            self._wake.wait(self._flush_s)
            self._wake.clear()
            t0 = time.thread_time()
            while self._queue:
                batch = self._queue.popleft()
                if batch and "__flush__" in batch[0]:
                    self._file.flush()
                    batch[0]["__flush__"].set()
                    continue
                self._file.write("".join(encode(e) + "\n" for e in batch))
                self.events += len(batch)
            self._file.flush()
            self.cpu_seconds += time.thread_time() - t0
            if self._closing and not self._queue:
                return
