"""What the replay-buffer index knows about one sample: its lifecycle state and its metadata.

The payload (tokens, log-probs, per-token versions) stays on the worker that produced it; the index
holds only this record. The lifecycle through the states is drawn in :mod:`reflow_hpc.core.pool`; the
terminal reasons are counted in :mod:`reflow_hpc.core.accounting`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, Self

# Live states, in lifecycle order.
PENDING = "pending"        # dispatched to a rollout worker (queued there or generating), not finished
FINISHED = "finished"      # payload exists on its owner; the group is not complete yet
READY = "ready"            # trainable and never trained on: an unused sample
TRAINING = "training"      # selected into a batch that is being trained on
REPLAY = "replay"          # trained on and reinserted by the replay filter: trainable again
LIVE_STATES = (PENDING, FINISHED, READY, TRAINING, REPLAY)

# Terminal reasons: every sample that leaves the index leaves with exactly one of them.
TRAINED = "trained"                # trained on; not reinserted because replay is disabled (σ = 0)
FILTERED = "filtered"              # trained on; the replay filter declined reinsertion
EVICTED_STALE = "evicted_stale"    # staleness > δ
ABORTED = "aborted"                # cancelled at shutdown, by an abort event, or in flight at a restore
FAILED = "failed"                  # generation failed or the generating worker was lost
LOST = "lost"                      # the payload cannot be read back (owner lost, shard damaged)
UNINFORMATIVE = "uninformative"    # never trained on: the fresh filter declined it when its group completed
TERMINAL_REASONS = (TRAINED, FILTERED, EVICTED_STALE, ABORTED, FAILED, LOST, UNINFORMATIVE)   # added at the end

GENERATING = frozenset((PENDING,))                 # no payload yet; held by `worker`
POOLED = frozenset((FINISHED, READY, REPLAY))       # subject to staleness eviction at a version bump


@dataclass(slots=True, eq=False)
class SampleRecord:
    """Index metadata of one sample. Samplers and replay filters read it; only the index writes it."""

    sample_id: int
    group_id: int
    prompt_id: int
    state: str = PENDING
    worker: int = -1            # rank generating it while pending (-1: not known)
    owner: int = -1             # rank whose memory/shard holds the payload once finished
    reward: float = 0.0
    min_version: int = -1       # oldest policy version among its generated tokens
    max_version: int = -1       # newest one (partial rollouts span several versions)
    loss_tokens: int = 0        # n_j: tokens that carry loss
    base_weight: float = 1.0    # ω_j before the replay factor τ and the normalisation
    advantage: float = 0.0      # group-normalised, set when the group completes; kept on replay
    times_used: int = 0         # optimizer steps that trained on it
    location: Any = None        # where the owner stored the payload: [shard segment, row] (JSON-able)
    created_at: float = 0.0     # `now` of the dispatch
    finished_at: float = 0.0    # `now` of the finished event
    finish_seq: int = -1        # completion order (ties between equal min versions)
    owner_lost: bool = False    # owner died while the sample was in a batch: end it as lost after the step

    def staleness(self, version: int) -> int:
        """Current version minus the oldest version among the sample's tokens."""
        return version - self.min_version

    @property
    def is_replay(self) -> bool:
        return self.times_used > 0

    def to_row(self) -> list[Any]:
        return [getattr(self, name) for name in ROW_FIELDS]

    @classmethod
    def from_row(cls, row: list[Any]) -> "SampleRecord":
        if len(row) == len(ROW_FIELDS) and row[3] == "running":
            row = [*row[:3], PENDING, *row[4:]]    # checkpoints from before `running` was folded into `pending`
        if len(row) != len(ROW_FIELDS):
            raise ValueError(f"sample row has {len(row)} fields, expected {len(ROW_FIELDS)} ({', '.join(ROW_FIELDS)})")
        return cls(*row)


ROW_FIELDS = tuple(SampleRecord.__dataclass_fields__)


class RewardBandRule:
    """A sample is kept when its reward lies strictly inside (reward_low, reward_high), the ``[reflow]``
    keys of the same names: the rule of the ``reward_band`` filter and of the ``medium_reward`` sampler,
    which list it before their base class."""

    label: ClassVar[str] = "reward band"     # who applies the rule, in errors

    def __init__(self, reward_low: float = 0.0, reward_high: float = 1.0) -> None:
        super().__init__()
        if not reward_low < reward_high:
            raise ValueError(f"{self.label}: reward_low ({reward_low}) must be < reward_high ({reward_high})")
        self.reward_low, self.reward_high = reward_low, reward_high

    @classmethod
    def from_settings(cls, settings: Any) -> Self:
        return cls(settings.reward_low, settings.reward_high)

    def inside(self, sample: SampleRecord) -> bool:
        return self.reward_low < sample.reward < self.reward_high


def check_finished(sample_id: int, reward: Any, min_version: Any, max_version: Any, loss_tokens: Any,
                   base_weight: Any, *, max_allowed_version: int | None) -> None:
    """What a finished sample must carry; ValueError naming the first bad field.

    ``max_allowed_version`` is the published version no token can be newer than (None: unchecked).
    """
    sid = sample_id
    if not (isinstance(reward, numbers.Real) and math.isfinite(reward)):
        raise ValueError(f"sample {sid}: reward {reward!r} is not a finite number")
    if not 0 <= min_version <= max_version:
        raise ValueError(f"sample {sid}: token versions {min_version}..{max_version} must satisfy 0 ≤ min ≤ max")
    if max_allowed_version is not None and max_version > max_allowed_version:
        raise ValueError(f"sample {sid}: max token version {max_version} is newer than the published "
                         f"version {max_allowed_version}")
    if not (isinstance(loss_tokens, numbers.Integral) and int(loss_tokens) >= 0):
        raise ValueError(f"sample {sid}: loss_tokens {loss_tokens!r} must be an integer ≥ 0")
    if not (isinstance(base_weight, numbers.Real) and math.isfinite(base_weight) and float(base_weight) >= 0.0):
        raise ValueError(f"sample {sid}: base_weight {base_weight!r} must be a finite number ≥ 0")
