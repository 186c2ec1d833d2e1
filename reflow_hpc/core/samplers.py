"""Replay samplers: which replay samples fill the slots that unused samples leave in a batch.

The index owns the replay pool's lifecycle and tells the sampler about it through two hooks:
``add(sample)`` when a sample enters the ``replay`` state and ``remove(sample_id)`` when it leaves
(picked into a batch, evicted as stale, aborted, lost). The sampler keeps whatever structure makes
``pick`` cheap; it never changes sample state itself. ``available()`` says how many samples ``pick``
could return right now (a sampler may ignore some replay samples, e.g. ``medium_reward``), and the
index asks for no more than that. ``pick(k, rng)`` returns ``k`` distinct ids and must draw its
randomness from ``rng``, the index's seeded generator, so that a run replays deterministically.

Add a sampler::

    from reflow_hpc.core import PoolSampler, register_sampler

    @register_sampler("long_first")
    class LongFirst(PoolSampler):
        def eligible(self, sample):
            return sample.loss_tokens >= 128

and select it with ``[reflow] sampler = "long_first"``. ``from_settings(settings)`` receives the
``[reflow]`` config section (attribute access only) when the sampler needs parameters.

A batch takes its replay samples through :func:`take_replay`, which holds a sampler to its contract
(``k`` distinct ids of replay samples) and tells it that the picked ones left the pool; a sampler
that breaks the contract stops the run with an error naming it, rather than training on a wrong batch.
"""

from __future__ import annotations

import abc
import random
from typing import Any, Mapping, Sequence

from reflow_hpc.core.registry import Registered, Registry
from reflow_hpc.core.sample import REPLAY, RewardBandRule, SampleRecord


class Sampler(Registered):
    """Interface of a replay sampler (see the module docstring for the contract)."""

    @abc.abstractmethod
    def add(self, sample: SampleRecord) -> None:
        """``sample`` entered the replay pool."""

    @abc.abstractmethod
    def remove(self, sample_id: int) -> None:
        """``sample_id`` left the replay pool (it may be one this sampler ignored)."""

    @abc.abstractmethod
    def available(self) -> int:
        """How many distinct samples ``pick`` could return now."""

    @abc.abstractmethod
    def pick(self, k: int, rng: random.Random) -> list[int]:
        """``k`` distinct replay sample ids (``k ≤ available()``); the index then removes them."""

    def state_dict(self) -> Any:
        """JSON-able state that makes a restored sampler pick exactly as this one would."""
        return None

    def load_state_dict(self, state: Any, samples: Sequence[SampleRecord]) -> None:
        """Restore from ``state_dict()`` output; ``samples`` is the replay pool in insertion order.

        ``state`` is None when the checkpoint was written by another sampler: rebuild from ``samples``.
        """
        for sample in samples:
            self.add(sample)


SAMPLERS: Registry[Sampler] = Registry("replay sampler", "reflow.sampler")
register_sampler = SAMPLERS.register        # class decorator: selectable as reflow.sampler
make_sampler = SAMPLERS.make                # (name, [reflow] section or None) -> a fresh sampler
sampler_names = SAMPLERS.names


class PoolSampler(Sampler):
    """Uniform choice among the eligible replay samples: an array plus a position map, so insert,
    removal (swap with the last element) and a random pick of ``k`` cost O(1) each.

    Subclasses narrow the pool by overriding :meth:`eligible`.
    """

    def __init__(self) -> None:
        self._pool: list[int] = []
        self._pos: dict[int, int] = {}

    def eligible(self, sample: SampleRecord) -> bool:
        return True

    def add(self, sample: SampleRecord) -> None:
        if self.eligible(sample):
            self._pos[sample.sample_id] = len(self._pool)
            self._pool.append(sample.sample_id)

    def remove(self, sample_id: int) -> None:
        i = self._pos.pop(sample_id, None)
        if i is None:
            return
        last = self._pool.pop()
        if last != sample_id:
            self._pool[i] = last
            self._pos[last] = i

    def available(self) -> int:
        return len(self._pool)

    def pick(self, k: int, rng: random.Random) -> list[int]:
        pool = self._pool
        return [pool[i] for i in rng.sample(range(len(pool)), k)]

    def state_dict(self) -> Any:
        return {"pool": list(self._pool)}

    def load_state_dict(self, state: Any, samples: Sequence[SampleRecord]) -> None:
        eligible = [s.sample_id for s in samples if self.eligible(s)]
        saved = state["pool"] if isinstance(state, dict) else None
        # The saved order reproduces future picks; it applies only when the pool it describes is the
        # one these settings give (a restart may change e.g. the reward band).
        order = saved if saved is not None and sorted(saved) == sorted(eligible) else eligible
        self._pool = list(order)
        self._pos = {sid: i for i, sid in enumerate(self._pool)}

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._pos


@register_sampler("random")
class RandomSampler(PoolSampler):
    """Uniformly random replay samples (the paper's evaluation setting)."""


@register_sampler("medium_reward")
class MediumRewardSampler(RewardBandRule, PoolSampler):
    """Only replay samples whose reward lies strictly inside (reward_low, reward_high): neither
    solved nor hopeless prompts. Uniform among those."""

    label = "medium_reward sampler"

    def eligible(self, sample: SampleRecord) -> bool:
        return self.inside(sample)


@register_sampler("reward_variance")
class RewardVarianceSampler(PoolSampler):
    """Only replay samples that carry a learning signal: those whose group-normalised advantage is not 0,
    that is whose group's rewards varied (a group whose members all scored alike gives each of them
    advantage 0). With ``algorithm.replay_advantage = "kept"`` such a sample adds no gradient when
    replayed but still takes a slot and its share of the loss normaliser, diluting the batch. Uniform
    among those kept."""

    def eligible(self, sample: SampleRecord) -> bool:
        return sample.advantage != 0.0


@register_sampler("recency")
class RecencySampler(Sampler):
    """The least stale replay samples first: those whose oldest token came from the newest policy version
    (``min_version``), uniformly at random among the samples of the last version it needs. One bucket per
    version (at most δ + 1 are live), each a :class:`PoolSampler`, so a pick costs O(k + versions)."""

    def __init__(self) -> None:
        self._buckets: dict[int, PoolSampler] = {}
        self._version: dict[int, int] = {}

    def add(self, sample: SampleRecord) -> None:
        self._buckets.setdefault(sample.min_version, PoolSampler()).add(sample)
        self._version[sample.sample_id] = sample.min_version

    def remove(self, sample_id: int) -> None:
        v = self._version.pop(sample_id, None)
        if v is None:
            return
        bucket = self._buckets[v]
        bucket.remove(sample_id)
        if not bucket.available():
            del self._buckets[v]

    def available(self) -> int:
        return len(self._version)

    def pick(self, k: int, rng: random.Random) -> list[int]:
        out: list[int] = []
        for v in sorted(self._buckets, reverse=True):
            if len(out) == k:
                break
            bucket = self._buckets[v]
            need = k - len(out)
            out += list(bucket._pool) if bucket.available() <= need else bucket.pick(need, rng)
        return out

    def state_dict(self) -> Any:
        return {"buckets": {str(v): b.state_dict() for v, b in self._buckets.items()}}

    def load_state_dict(self, state: Any, samples: Sequence[SampleRecord]) -> None:
        self._buckets, self._version = {}, {}
        saved = state.get("buckets", {}) if isinstance(state, dict) else {}
        by_version: dict[int, list[SampleRecord]] = {}
        for sample in samples:
            by_version.setdefault(sample.min_version, []).append(sample)
            self._version[sample.sample_id] = sample.min_version
        for v, members in by_version.items():
            bucket = self._buckets[v] = PoolSampler()
            bucket.load_state_dict(saved.get(str(v)), members)


def take_replay(sampler: Sampler, k: int, rng: random.Random,
                samples: Mapping[int, SampleRecord]) -> list[SampleRecord]:
    """``k`` replay samples picked by ``sampler`` with ``rng`` and removed from it; RuntimeError when the
    sampler returns anything but ``k`` distinct ids of live samples in the replay state."""
    picked = sampler.pick(k, rng)
    recs = [rec for rec in map(samples.get, picked) if rec is not None and rec.state == REPLAY]
    if len(picked) != k or len(set(picked)) != k or len(recs) != k:
        raise RuntimeError(f'replay sampler "{sampler.name}" returned {picked[:8]} for {k} slots: '
                           f"expected {k} distinct ids of samples in the replay state")
    for sid in picked:
        sampler.remove(sid)
    return recs
