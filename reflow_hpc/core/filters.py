"""Replay filters: after a step, which trained samples go back into the pool as replay samples.

The index asks ``accept(sample)`` for every sample of a finished step when replay is enabled
(σ > 0) and the sample is still within the staleness bound δ; accepted samples enter the ``replay``
state, the others end as ``filtered``. A filter reads the sample's metadata (reward, advantage,
times_used, loss_tokens, versions) and changes nothing.

Add a filter::

    from reflow_hpc.core import ReplayFilter, register_replay_filter

    @register_replay_filter("at_most_twice")
    class AtMostTwice(ReplayFilter):
        def accept(self, sample):
            return sample.times_used < 2

and select it with ``[reflow] replay_filter = "at_most_twice"``.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from reflow_hpc.core.registry import Registry
from reflow_hpc.core.sample import SampleRecord

REPLAY_FILTERS: Registry = Registry("replay filter", "reflow.replay_filter")


def register_replay_filter(name: str):
    """Class decorator: make a :class:`ReplayFilter` selectable as ``reflow.replay_filter = name``."""
    return REPLAY_FILTERS.register(name)


def make_replay_filter(name: str, settings: Any = None) -> "ReplayFilter":
    """A fresh filter of the registered class ``name``, configured from ``settings`` when given."""
    cls = REPLAY_FILTERS.get(name)
    return cls.from_settings(settings) if settings is not None else cls()


def replay_filter_names() -> list[str]:
    return REPLAY_FILTERS.names()


class ReplayFilter(abc.ABC):
    name: ClassVar[str] = ""

    @classmethod
    def from_settings(cls, settings: Any) -> "ReplayFilter":
        """Build from the ``[reflow]`` config section; the default takes no parameters."""
        return cls()

    @abc.abstractmethod
    def accept(self, sample: SampleRecord) -> bool:
        """True: reinsert ``sample`` (just trained on) as a replay sample."""


@register_replay_filter("accept_all")
class AcceptAll(ReplayFilter):
    """Reinsert every trained sample (the paper's evaluation setting)."""

    def accept(self, sample: SampleRecord) -> bool:
        return True


@register_replay_filter("reward_band")
class RewardBand(ReplayFilter):
    """Reinsert only samples whose reward lies strictly inside (reward_low, reward_high)."""

    def __init__(self, reward_low: float = 0.0, reward_high: float = 1.0) -> None:
        if not reward_low < reward_high:
            raise ValueError(f"reward_band filter: reward_low ({reward_low}) must be < reward_high ({reward_high})")
        self.reward_low, self.reward_high = reward_low, reward_high

    @classmethod
    def from_settings(cls, settings: Any) -> "RewardBand":
        return cls(settings.reward_low, settings.reward_high)

    def accept(self, sample: SampleRecord) -> bool:
        return self.reward_low < sample.reward < self.reward_high
