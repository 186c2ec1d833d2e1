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

from reflow_hpc.core.registry import Registered, Registry
from reflow_hpc.core.sample import RewardBandRule, SampleRecord


class ReplayFilter(Registered):
    """Interface of a replay filter (see the module docstring)."""

    @abc.abstractmethod
    def accept(self, sample: SampleRecord) -> bool:
        """True: reinsert ``sample`` (just trained on) as a replay sample."""


REPLAY_FILTERS: Registry[ReplayFilter] = Registry("replay filter", "reflow.replay_filter")
register_replay_filter = REPLAY_FILTERS.register       # class decorator: selectable as reflow.replay_filter
make_replay_filter = REPLAY_FILTERS.make               # (name, [reflow] section or None) -> a fresh filter
replay_filter_names = REPLAY_FILTERS.names


@register_replay_filter("accept_all")
class AcceptAll(ReplayFilter):
    """Reinsert every trained sample (the paper's evaluation setting)."""

    def accept(self, sample: SampleRecord) -> bool:
        return True


@register_replay_filter("reward_band")
class RewardBand(RewardBandRule, ReplayFilter):
    """Reinsert only samples whose reward lies strictly inside (reward_low, reward_high)."""

    label = "reward_band filter"

    def accept(self, sample: SampleRecord) -> bool:
        return self.inside(sample)
