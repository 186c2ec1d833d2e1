"""Accounting: every sample the index creates ends exactly once, with one terminal reason.

A sample that leaves the index ends in exactly one terminal state, each with a counter:
``trained`` (trained on, replay disabled: σ = 0), ``filtered`` (trained on, the replay filter
declined it), ``evicted_stale`` (staleness > δ), ``aborted`` (shutdown, explicit abort, or in flight
at a restore), ``failed`` (generation failed, or its worker was lost while generating), ``lost``
(payload unreadable: its owner was lost or its shard is damaged), ``uninformative`` (never trained
on: the fresh filter declined it when its group completed, e.g. dynamic sampling's all-equal-reward
groups). Nothing disappears silently.

The counters, each kept up to date in O(1) where the event happens and saved in checkpoints:

``created``
    samples created (dispatched groups and samples recovered after a restart);
``ended[reason]``
    samples that ended with ``reason``;
``evicted_unused``
    the ``evicted_stale`` ones never trained on: generation spent for nothing;
``trained``
    distinct samples trained on at least once, counted when their first step is done;
``replayed``
    training uses beyond a sample's first, ``Σ max(0, times_used - 1)``, counted as steps are done.

With σ > 0 a trained sample usually ends as replayed-then-evicted, so ``ended["trained"]`` says
little about training; ``trained`` and ``replayed`` do.

:meth:`Accounting.report` computes the checks against the live counts rather than trusting the
counters, so that it can report a failure; the first broken check is named in ``why``:

1. the live state counts add up to the live records;
2. ``created == live + Σ ended``;
3. ``0 ≤ evicted_unused ≤ ended["evicted_stale"]``;
4. ``trained`` lies between the samples that provably ended after training —
   ``ended["trained"] + ended["filtered"] + (ended["evicted_stale"] - evicted_unused)`` — and
   ``created``; ``replayed ≥ 0``.
"""

from __future__ import annotations

from typing import Any, Mapping

from reflow_hpc.core.sample import EVICTED_STALE, FILTERED, TERMINAL_REASONS, TRAINED


class Accounting:
    """Creation, end and training-use counters of one index (module docstring)."""

    __slots__ = ("created", "ended", "evicted_unused", "trained", "replayed")

    def __init__(self) -> None:
        self.created = 0
        self.ended = dict.fromkeys(TERMINAL_REASONS, 0)
        self.evicted_unused = 0
        self.trained = 0
        self.replayed = 0

    def report(self, live: Mapping[str, int], records: int) -> dict[str, Any]:
        """The counters and the verdict of the checks, given the live count per state and the
        number of live records: ``{"created", "live", "ended", "evicted_unused", "trained",
        "replayed", "ok", "why"}`` (``why`` is empty when ``ok``)."""
        n_live = sum(live.values())
        why = self._broken(n_live, records)
        return {"created": self.created, "live": n_live, "ended": dict(self.ended),
                "evicted_unused": self.evicted_unused, "trained": self.trained, "replayed": self.replayed,
                "ok": not why, "why": why}

    def check(self, live: Mapping[str, int], records: int) -> None:
        """Raise AssertionError naming the first broken check (O(1))."""
        why = self._broken(sum(live.values()), records)
        if why:
            raise AssertionError(f"accounting: {why}")

    def _broken(self, n_live: int, records: int) -> str:
        ended = sum(self.ended.values())
        if n_live != records or self.created != n_live + ended:
            return (f"created {self.created} != live {n_live} ({records} records) + ended {ended} "
                    f"{self.ended}")
        stale = self.ended[EVICTED_STALE]
        if not 0 <= self.evicted_unused <= stale:
            return f"evicted_unused {self.evicted_unused} outside [0, evicted_stale {stale}]"
        after_training = self.ended[TRAINED] + self.ended[FILTERED] + stale - self.evicted_unused
        if not after_training <= self.trained <= self.created:
            return (f"trained {self.trained} outside [{after_training} that ended after training, "
                    f"created {self.created}]")
        if self.replayed < 0:
            return f"replayed {self.replayed} < 0"
        return ""
