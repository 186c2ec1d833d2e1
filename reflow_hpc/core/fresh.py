"""Fresh-sample hooks: what happens to a group's finished samples when the group completes.

Replay samplers and replay filters (:mod:`~reflow_hpc.core.samplers`, :mod:`~reflow_hpc.core.filters`)
act on samples already trained on. The two hooks here act on fresh ones, once, when their group
completes (every member finished or ended) and after the group's advantages are set:

fresh filter (``reflow.fresh_filter``)
    ``keep(group)`` sees the group's finished members (completion order) and returns one bool per
    member: kept members become ``ready``; declined ones end as ``uninformative`` without ever being
    trained on. Advantages were computed over every finished member, so a filter that keeps part of
    a group keeps the group's baseline. Built in: ``accept_all`` and ``informative_groups`` —
    dynamic sampling (Yu et al. 2025, DAPO; verl's ``filter_groups``): a group whose rewards are all
    equal has zero advantage everywhere and no gradient, so it is dropped and the batch fills from
    other groups (it waits for more ready samples).
sample weight (``reflow.sample_weight``)
    ``weights(group)`` returns ω_i for each kept member: the base weight of the loss
    ``w_i = ω_i`` (unused) or ``τ·ω_i`` (replay), normalised per batch (:mod:`~reflow_hpc.core.mixing`).
    Built in: ``uniform`` (every ω_i stays what the sample finished with: 1).

Both read the records (reward, advantage, loss_tokens, versions, prompt and group ids) and change
nothing; the index writes what they return.

The generation cap (``algorithm.max_gen_batches``).
    Dropped groups were generated: they spend the ``b_max`` budget like any group, and a step that
    keeps dropping would wait for ever on a prompt set that is all solved or all hopeless. So the
    gate counts the finished samples of the groups completed since the last batch was composed;
    once a declined group would take that count past ``max_gen_batches · batch_size``, it goes
    through whole instead (counted as ``passed``) until the next batch — the step trains on what it
    has rather than stopping the run (verl raises an error there). 0 = no cap. Hence the samples
    dropped between two batches never exceed the cap.

Add a fresh filter (and select it with ``[reflow] fresh_filter = "short_only"``)::

    from reflow_hpc.core import FreshFilter, register_fresh_filter

    @register_fresh_filter("short_only")
    class ShortOnly(FreshFilter):
        def keep(self, group):
            return [s.loss_tokens <= 512 for s in group]

and a sample weight (``[reflow] sample_weight = "by_length"``)::

    from reflow_hpc.core import SampleWeight, register_sample_weight

    @register_sample_weight("by_length")
    class ByLength(SampleWeight):
        def weights(self, group):
            return [1.0 / max(1, s.loss_tokens) for s in group]

``from_settings(settings)`` receives the ``[reflow]`` config section when a hook needs parameters.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Sequence

from reflow_hpc.core.registry import Registered, Registry
from reflow_hpc.core.sample import SampleRecord

_NONE: list[SampleRecord] = []


class FreshFilter(Registered):
    """Interface of a fresh filter (see the module docstring)."""

    @abc.abstractmethod
    def keep(self, group: Sequence[SampleRecord]) -> Sequence[bool]:
        """One bool per member of ``group`` (its finished samples): True keeps it for training."""


class SampleWeight(Registered):
    """Interface of a sample-weight hook (see the module docstring)."""

    @abc.abstractmethod
    def weights(self, group: Sequence[SampleRecord]) -> Sequence[float]:
        """ω_i (finite, ≥ 0) for each member of ``group`` (its kept samples)."""


FRESH_FILTERS: Registry[FreshFilter] = Registry("fresh filter", "reflow.fresh_filter")
register_fresh_filter = FRESH_FILTERS.register      # class decorator: selectable as reflow.fresh_filter
make_fresh_filter = FRESH_FILTERS.make
fresh_filter_names = FRESH_FILTERS.names

SAMPLE_WEIGHTS: Registry[SampleWeight] = Registry("sample weight", "reflow.sample_weight")
register_sample_weight = SAMPLE_WEIGHTS.register    # class decorator: selectable as reflow.sample_weight
make_sample_weight = SAMPLE_WEIGHTS.make
sample_weight_names = SAMPLE_WEIGHTS.names


@register_fresh_filter("accept_all")
class AcceptAllFresh(FreshFilter):
    """Keep every finished sample (no filtering)."""

    def keep(self, group: Sequence[SampleRecord]) -> Sequence[bool]:
        return [True] * len(group)


@register_fresh_filter("informative_groups")
class InformativeGroups(FreshFilter):
    """Dynamic sampling (DAPO): keep a group only when its rewards are not all equal."""

    def keep(self, group: Sequence[SampleRecord]) -> Sequence[bool]:
        rewards = [s.reward for s in group]
        informative = bool(rewards) and max(rewards) > min(rewards)
        return [informative] * len(group)


@register_sample_weight("uniform")
class UniformWeight(SampleWeight):
    """ω_i = the weight the sample finished with (1: no driver sets another)."""

    def weights(self, group: Sequence[SampleRecord]) -> Sequence[float]:
        return [s.base_weight for s in group]


class GroupGate:
    """The fresh filter, the generation cap and the sample weights, applied to each completed group
    (module docstring); counts groups completed, dropped and passed over the cap."""

    __slots__ = ("fresh_filter", "sample_weight", "cap", "active", "seen", "completed", "dropped", "passed")

    def __init__(self, fresh_filter: FreshFilter | None = None, sample_weight: SampleWeight | None = None,
                 cap: int = 0):
        if not (isinstance(cap, int) and cap >= 0):
            raise ValueError(f"replay index: max generated samples per step {cap!r}: must be an integer ≥ 0")
        self.fresh_filter = fresh_filter if fresh_filter is not None else AcceptAllFresh()
        self.sample_weight = sample_weight if sample_weight is not None else UniformWeight()
        self.cap = cap                  # samples; 0 = no cap
        # the built-in defaults change nothing: skip their calls (the simulator completes a group per event)
        self.active = type(self.fresh_filter) is not AcceptAllFresh or type(self.sample_weight) is not UniformWeight
        self.seen = 0                   # finished samples of the groups completed since the last batch
        self.completed = self.dropped = self.passed = 0    # groups

    def admit(self, members: list[SampleRecord]) -> list[SampleRecord]:
        """The members to drop (as ``uninformative``); sets the kept members' base weights."""
        self.completed += 1
        if not self.active:
            return _NONE
        self.seen += len(members)
        keep = list(self.fresh_filter.keep(members))
        if len(keep) != len(members):
            raise RuntimeError(f'fresh filter "{self.fresh_filter.name}" returned {len(keep)} decisions for a '
                               f"group of {len(members)}")
        declined = [rec for rec, k in zip(members, keep) if not k]
        if declined and self.cap and self.seen > self.cap:
            self.passed += 1            # over the cap: this step trains on what it has
            declined = []
        elif declined:
            self.dropped += 1
        kept = [rec for rec, k in zip(members, keep) if k] if declined else members
        if kept and type(self.sample_weight) is not UniformWeight:
            self._weigh(kept)
        return declined

    def _weigh(self, kept: list[SampleRecord]) -> None:
        weights = list(self.sample_weight.weights(kept))
        if len(weights) != len(kept) or not all(isinstance(w, (int, float)) and math.isfinite(w) and w >= 0
                                                for w in weights):
            raise RuntimeError(f'sample weight "{self.sample_weight.name}" returned {weights[:8]} for a group of '
                               f"{len(kept)}: expected one finite weight ≥ 0 per sample")
        for rec, w in zip(kept, weights):
            rec.base_weight = float(w)

    def batch_composed(self) -> None:
        """A batch was composed: the generation of the next step starts counting."""
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"fresh_filter": self.fresh_filter.name, "sample_weight": self.sample_weight.name,
                "seen": self.seen, "completed": self.completed, "dropped": self.dropped, "passed": self.passed}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Counters of ``state_dict()``; None (a checkpoint from before the gate) leaves them at 0."""
        if state:
            self.seen, self.completed = int(state["seen"]), int(state["completed"])
            self.dropped, self.passed = int(state["dropped"]), int(state["passed"])
