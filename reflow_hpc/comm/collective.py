"""One bounded collective: launched asynchronously, waited for with a deadline, failures named.

A process group made by ``torch.distributed.new_group`` without a ``timeout`` waits 30 minutes
(gloo) or 10 minutes (NCCL), not ``run.timeout_s``. The trainer and the weight sync therefore do
not rely on the group's timeout: every collective is started with ``async_op=True`` and its
``Work.wait(timeout)`` gets the deadline explicitly; a failure or a deadline that passes becomes a
:class:`~reflow_hpc.comm.dist.CollectiveError` naming the rank and the operation.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

from .dist import guarded


def bounded(rank: int, op: str, timeout_s: float | None, launch: Callable[[], Any]) -> None:
    """Run ``launch()`` (a collective called with ``async_op=True``) and wait at most ``timeout_s``
    seconds for it (None: the process group's own timeout)."""
    with guarded(rank, op):
        work = launch()
        if timeout_s is None:
            work.wait()
            return
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            first = (str(e).strip().splitlines() or [e.__class__.__name__])[0]
            raise RuntimeError(f"not complete after {timeout_s:g} s ({first})") from e
