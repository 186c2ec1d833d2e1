"""The coordinator's sans-IO logic (DESIGN §4): pure state machines driven by the MPI runtime and by
the simulator. Nothing here performs I/O or reads a clock. Start with :mod:`reflow_hpc.core.coordinator`
(every decision of a run), then :mod:`reflow_hpc.core.index` (the replay-buffer rules) and
:mod:`reflow_hpc.core.modes` (what each mode guarantees)."""

from reflow_hpc.core.advantages import group_advantages
from reflow_hpc.core.filters import (AcceptAll, ReplayFilter, RewardBand, make_replay_filter,
                                     register_replay_filter, replay_filter_names)
from reflow_hpc.core.fresh import (FreshFilter, SampleWeight, fresh_filter_names, make_fresh_filter,
                                   make_sample_weight, register_fresh_filter, register_sample_weight,
                                   sample_weight_names)
from reflow_hpc.core.index import (GAUGE_NAMES, Batch, Group, RecoveredSample, Release, ReplayIndex,
                                   build_index)
from reflow_hpc.core.mixing import (loss_weights, max_replay_slots, min_unused, mixing_weight,
                                    mixing_weight_bound)
from reflow_hpc.core.sample import LIVE_STATES, TERMINAL_REASONS, SampleRecord
from reflow_hpc.core.samplers import (MediumRewardSampler, PoolSampler, RandomSampler, Sampler, make_sampler,
                                      register_sampler, sampler_names)

__all__ = [
    "AcceptAll", "Batch", "FreshFilter", "GAUGE_NAMES", "Group", "LIVE_STATES", "MediumRewardSampler", "PoolSampler",
    "RandomSampler", "RecoveredSample", "Release", "ReplayFilter", "ReplayIndex", "RewardBand", "SampleWeight",
    "Sampler", "SampleRecord", "TERMINAL_REASONS", "build_index", "group_advantages", "loss_weights", "make_replay_filter",
    "make_sampler", "max_replay_slots", "min_unused", "mixing_weight", "mixing_weight_bound",
    "register_replay_filter", "register_sampler", "replay_filter_names", "sampler_names",
    "fresh_filter_names", "make_fresh_filter", "make_sample_weight", "register_fresh_filter",
    "register_sample_weight", "sample_weight_names",
]
