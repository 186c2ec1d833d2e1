"""The b_max dispatch window: how many samples may go to rollout workers before the next step.

b_max — dispatch budget.
    Outstanding (pending) samples never exceed ``b_max``, and one step dispatches at most
    ``b_max`` samples: a dispatch window opens with budget ``b_max - outstanding`` when a batch is
    composed (the trainer starts a step) and each dispatched sample spends one. Groups are
    dispatched whole — a group of n needs n budget; a remainder smaller than n is not carried over —
    so ``b_max`` must be at least n. One exception keeps a run live: when the next batch cannot be
    composed from the pool and nothing is outstanding (failures, evictions or filters drained it),
    a fresh window of ``b_max`` opens; otherwise nothing could ever become ready again.
"""

from __future__ import annotations

from typing import Callable, Mapping

from reflow_hpc.core.sample import PENDING


class DispatchWindow:
    """The budget left in the current window (module docstring).

    ``count`` is the pool's live count per state (read for the outstanding samples) and
    ``batch_ready`` says whether the pool holds the next batch; both are read, never changed.
    """

    __slots__ = ("b_max", "left", "_count", "_batch_ready")

    def __init__(self, b_max: int, count: Mapping[str, int], batch_ready: Callable[[], bool]):
        self.b_max = b_max
        self.left = b_max               # what the current window still allows
        self._count, self._batch_ready = count, batch_ready

    def budget(self) -> int:
        """Samples that may be dispatched now."""
        left = self.left
        if left < self.b_max and self._count[PENDING] == 0 and not self._batch_ready():
            return self.b_max            # starving with nothing in flight: a fresh window
        return left

    def spend(self, budget: int, n: int) -> None:
        """``n`` samples were dispatched out of ``budget`` (what :meth:`budget` said)."""
        self.left = budget - n

    def open(self) -> None:
        """The trainer starts a step: a new window, beside what is still outstanding."""
        self.left = self.b_max - self._count[PENDING]

    def restore(self, saved: int) -> None:
        """A checkpoint's budget, within what this ``b_max`` (perhaps a new one) allows."""
        self.left = max(0, min(saved, self.b_max - self._count[PENDING]))

    def check(self) -> None:
        """AssertionError when the outstanding samples or the budget left break the window's bounds."""
        outstanding = self._count[PENDING]
        if outstanding > self.b_max:
            raise AssertionError(f"outstanding {outstanding} > b_max {self.b_max}")
        if not 0 <= self.left <= self.b_max - outstanding:
            raise AssertionError(f"dispatch budget {self.left} outside [0, b_max - outstanding = "
                                 f"{self.b_max - outstanding}]")
