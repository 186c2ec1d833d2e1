"""A bounded helper process: a fresh interpreter spoken to in JSON lines, each call bounded from outside.

Shared by every helper that must not run inside an MPI rank: the sandbox's fork servers, and any other
bounded helper (the math scorer's equivalence process is one). The rules:

- it is started with a plain ``subprocess.Popen(..., close_fds=True)``: no ``preexec_fn``, ``user``,
  ``group`` or ``extra_groups``, which make CPython ``fork()`` the rank (an MPI rank must not fork);
  every limit is applied by the helper itself or by the program that wraps it;
- it writes one ready line (a JSON object) before the first call, within ``start_timeout_s``;
- each call is one JSON line out and one back within the caller's deadline; past it the process is
  killed, and a new one is started at once (``respawn="eager"``) or by the next call;
- a helper found dead before a call is replaced and the call is made once more; one that dies during a
  call fails that call (``retry_lost_call``: the call is made once more, for helpers whose input is
  trusted);
- after ``recycle_every`` calls (0: never) it is replaced, so that state it accumulates stays bounded;
- a copy of this object inherited across a ``fork`` never touches the parent's process;
- every helper is started from one thread that lives as long as the process (:func:`popen`): the
  kernel's parent-death signal (the servers' ``PR_SET_PDEATHSIG``, bwrap's ``--die-with-parent``) fires
  when the *thread* that forked the child ends, so a helper started from a short-lived executor
  thread would die with it, and the calls after would fail.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import threading
import time
from typing import Any, Sequence


class HelperError(RuntimeError):
    """The helper could not be started (one line)."""


_spawner: tuple[int, threading.Thread, "queue.SimpleQueue"] | None = None
_spawner_lock = threading.Lock()


def _spawn_loop(requests: "queue.SimpleQueue") -> None:
    while True:
        args, kwargs, reply = requests.get()
        try:
            reply.put((True, subprocess.Popen(*args, **kwargs)))
        except BaseException as e:       # handed to the caller, raised there
            reply.put((False, e))


def popen(*args: Any, **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` run on the process's spawner thread (module docstring)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid() or not _spawner[1].is_alive():
            requests: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=_spawn_loop, args=(requests,), name="reflow-helper-spawner", daemon=True)
            thread.start()
            _spawner = (os.getpid(), thread, requests)
        requests = _spawner[2]
    reply: queue.SimpleQueue = queue.SimpleQueue()
    requests.put((args, kwargs, reply))
    ok, value = reply.get()
    if not ok:
        raise value
    return value


class HelperProcess:
    """One helper process, safe from any thread (calls are serialised)."""

    def __init__(self, argv: Sequence[str], *, name: str, first_line: bytes = b"", start_timeout_s: float = 60.0,
                 recycle_every: int = 0, respawn: str = "eager", retry_lost_call: bool = False,
                 env: dict | None = None):
        self.argv, self.name, self.first_line = list(argv), name, first_line
        self.start_timeout_s, self.recycle_every, self.respawn = start_timeout_s, recycle_every, respawn
        self.retry_lost_call, self.env = retry_lost_call, env
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner = 0          # pid that started _proc
        self._buf = b""
        self._calls = 0          # calls answered by the current process
        self.info: dict = {}     # the ready line of the current process
        self.restarts = 0        # processes killed on a deadline or lost during a call
        self.recycled = 0        # processes replaced after recycle_every calls
        self.last_failure = ""   # why the last failed call failed (one line)

    # ---- process handling (lock held) ---------------------------------------------------------
    def _spawn(self) -> None:
        self._proc = popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, close_fds=True, env=self.env)
        self._owner, self._buf, self.info, self._calls = os.getpid(), b"", {}, 0
        if self.first_line:
            try:
                self._proc.stdin.write(self.first_line.rstrip(b"\n") + b"\n")
                self._proc.stdin.flush()
            except OSError:
                pass             # it died at once: found at the ready line

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and self._owner == os.getpid():
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass

    def _read_line(self, deadline: float) -> dict | None:
        """The next JSON line of the process, or None at the deadline; EOFError when it ended."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except ValueError:
            raise EOFError from None          # a helper that says nonsense is treated as gone
        return msg if isinstance(msg, dict) else {"value": msg}

    def _ready(self) -> None:
        for attempt in (0, 1):
            if self._proc is None or self._owner != os.getpid() or self._proc.poll() is not None:
                self._kill()
                self._spawn()
            if self.info:
                return
            try:
                msg = self._read_line(time.monotonic() + self.start_timeout_s)
            except EOFError:
                # killed while it started (it was replaced meanwhile): once more; else it cannot start
                msg = {"error": "it exited at start"}
                if attempt == 0:
                    self._kill()
                    continue
            break
        if msg is None or "error" in msg:
            self._kill()
            why = msg["error"] if msg else f"no ready line within {self.start_timeout_s:g} s"
            raise HelperError(f"{self.name}: the helper process did not start: {why}")
        self.info = msg

    def _replace(self, why: str) -> None:
        self.restarts += 1
        self.last_failure = why
        self._kill()
        if self.respawn == "eager":
            self._spawn()

    # ---- public ---------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def spawn(self) -> None:
        """Start the process without waiting for its ready line (several helpers start side by side)."""
        with self._lock:
            if self._proc is None or self._owner != os.getpid() or self._proc.poll() is not None:
                self._kill()
                self._spawn()

    def start(self) -> dict:
        """Start the process now (otherwise the first call does) and return its ready line."""
        with self._lock:
            self._ready()
            return dict(self.info)

    def call(self, request: Any, timeout_s: float) -> dict | None:
        """Send one request, return the reply; None when there was none within ``timeout_s`` or the helper
        ended during the call (it is replaced; ``last_failure`` says which). HelperError when it cannot
        start."""
        line = json.dumps(request).encode() + b"\n"
        with self._lock:
            for attempt in (0, 1):
                self._ready()
                assert self._proc is not None and self._proc.stdin is not None
                try:
                    self._proc.stdin.write(line)
                    self._proc.stdin.flush()
                except OSError:           # it had died between calls: a fresh one, once
                    self._kill()
                    continue
                try:
                    reply = self._read_line(time.monotonic() + timeout_s)
                except EOFError:
                    if attempt == 0 and self.retry_lost_call:
                        self._kill()      # it may have been dead before the call: one more try
                        continue
                    self._replace(f"{self.name}: the helper process ended during the call")
                    return None
                if reply is None:
                    self._replace(f"{self.name}: no reply within {timeout_s:g} s; the helper process was killed "
                                  f"and restarted")
                    return None
                self._calls += 1
                if self.recycle_every and self._calls >= self.recycle_every:
                    self.recycled += 1
                    self._kill()
                    if self.respawn == "eager":
                        self._spawn()
                return reply
            self.last_failure = f"{self.name}: the helper process could not take the call"
            return None

    def close(self) -> None:
        with self._lock:
            self._kill()
