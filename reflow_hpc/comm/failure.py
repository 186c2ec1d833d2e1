"""Ending the whole job when one rank cannot go on, and fault injection for tests.

A rank that fails prints one line naming itself (rank, node, pid) and the operation, tells the
coordinator when it still can, and aborts ``COMM_WORLD`` so the launcher ends every rank: a
half-dead job that keeps its allocation is worse than a crash.

Fault injection: ``REFLOW_FAILPOINTS="handshake@2=hang,fetch@1=raise"`` makes the named rank hang,
raise, or kill itself with SIGKILL when it reaches that point. Tests use it to show that
timeouts name the right rank and that no process is left behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import Any


def describe(rank: int) -> str:
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    return f"rank {rank} ({node}, pid {os.getpid()})"


_abort_lock = threading.Lock()


def fatal(rank: int, op: str, error: BaseException | str, *, comm: Any = None, notify: Any = None,
          exit_code: int = 1, show_traceback: bool = True, grace_s: float = 1.0) -> None:
    """Report and end the job. ``notify(op, text)`` may tell the coordinator first (best effort)."""
    with _abort_lock:
        text = str(error) if not isinstance(error, BaseException) else (str(error) or error.__class__.__name__)
        if show_traceback and isinstance(error, BaseException) and os.environ.get("REFLOW_TRACEBACK", "1") != "0":
            traceback.print_exception(error, file=sys.stderr)
        print(f"reflow_hpc: {describe(rank)}: {op} failed: {text}", file=sys.stderr, flush=True)
        if notify is not None:
            try:
                notify(op, text)
            except Exception:
                pass
        sys.stdout.flush()
        # The launcher forwards output through pipes; aborting at once can lose the line above.
        time.sleep(grace_s)
        if comm is not None and comm.Get_size() > 1:
            comm.Abort(exit_code)
        os._exit(exit_code)


def _parse(spec: str) -> dict[tuple[str, int], str]:
    points = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, _, action = item.partition("=")
        name, _, rank = where.partition("@")
        points[(name, int(rank))] = action or "raise"
    return points


def failpoint(name: str, rank: int) -> None:
    """Trigger the configured fault for (name, rank), if any."""
    spec = os.environ.get("REFLOW_FAILPOINTS")
    if not spec:
        return
    action = _parse(spec).get((name, rank))
    if action is None:
        return
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault at {name}")
