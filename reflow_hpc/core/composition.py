"""Batch composition: which trainable samples one step trains on, and with what loss weights.

σ (sigma) — replay cap.
    A batch of ``b`` samples needs at least ``ceil(b(1-σ))`` unused ready samples; until then
    :meth:`Composer.compose` returns None and changes nothing. Otherwise it takes
    unused samples, oldest first (lowest min version, then completion order), and fills the
    ``r = b - u`` remaining slots with replay samples chosen by the sampler; if the sampler cannot
    supply ``r``, the batch is not ready either. How many unused samples it takes is the batch fill
    (``reflow.batch_fill``):

    ``unused_first``: ``u = min(ready unused, b)``. The replay fraction ``λ = r/b`` follows
        production: replay only fills the slots fresh samples leave empty.
    ``fixed_share``: ``r = max(0, min(floor(bσ), replay available, b - e))`` and ``u = b - r``, where ``e``
        counts the unused ready samples the next version bump would evict as staler than δ; the
        unused samples beyond ``u`` wait for the next step. λ is σ whenever the sampler can supply
        it and no fresh sample is about to expire, so each step consumes the fewest fresh samples σ
        allows and a step whose trainers would otherwise wait for fresh samples can start at once;
        a fresh sample is never left to go stale while replay takes its slot.

    Either way λ never exceeds σ, and σ = 0 disables replay.
τ (tau) — replay loss weight.
    Each sample carries a base weight ``ω_i`` (1 unless its task says otherwise). Its loss weight is
    ``w_i = ω_i`` (unused) or ``τ·ω_i`` (replay), normalised by ``Z = Σ w_j n_j / Σ n_j``
    (``n_j`` = loss tokens of sample j) so that the token-weighted mean weight is 1
    (:mod:`reflow_hpc.core.mixing`); under the ``seq_mean_token_mean`` aggregation, where every
    sample has the same share of the loss, ``Z = Σ w_j / b`` (``per_sample_weights``) so that the
    mean weight is 1. Each batch reports ``α = τλ/(1-λ+τλ) ≤ τσ/(1-σ+τσ)``.

Advantages.
    An unused sample trains with the advantage its group gave it; a replayed one too, or, with
    ``algorithm.replay_advantage = "recompute"``, with one computed against its prompt's newest
    group (:mod:`reflow_hpc.core.replay_advantage`).

A batch lists its unused samples first, then its replay samples; the sampler draws its randomness
only from the composer's seeded ``random.Random``, so the same events give the same batches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reflow_hpc.core.mixing import loss_weights, max_replay_slots, mixing_weight
from reflow_hpc.core.sample import READY, SampleRecord
from reflow_hpc.core.samplers import Sampler, take_replay

BATCH_FILLS = ("unused_first", "fixed_share")

if TYPE_CHECKING:
    from reflow_hpc.core.pool import Pool


@dataclass(frozen=True)
class Batch:
    """One step's training batch: unused samples first, then replay samples. Per-sample tuples
    are aligned with ``sample_ids``."""
    step: int                       # 0 for the first batch of the run
    version: int                    # policy version when the batch was composed
    sample_ids: tuple[int, ...]
    owners: tuple[int, ...]         # rank to fetch each payload from
    is_replay: tuple[bool, ...]
    advantages: tuple[float, ...]
    loss_weights: tuple[float, ...]  # normalised w̃_i
    loss_tokens: tuple[int, ...]
    staleness: tuple[int, ...]
    rewards: tuple[float, ...]
    times_used: tuple[int, ...]     # before this step
    queue_s: tuple[float, ...]      # time from finished to this batch
    production_s: tuple[float, ...]  # time from dispatch to finished
    replay_fraction: float          # λ = replay samples / b
    alpha: float                    # τλ / (1 - λ + τλ)

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_replay(self) -> int:
        return sum(self.is_replay)

    @property
    def num_unused(self) -> int:
        return len(self.sample_ids) - self.num_replay


class Composer:
    """The σ and τ rules for batches of ``batch_size`` samples taken out of ``pool``, and the count
    of batches composed. ``sampler`` picks the replay samples with the composer's ``rng``; ``fill`` is
    one of :data:`BATCH_FILLS` (module docstring)."""

    def __init__(self, *, batch_size: int, sigma: float, tau: float, pool: Pool, sampler: Sampler, seed: int = 0,
                 per_sample_weights: bool = False, fill: str = "unused_first"):
        self.batch_size, self.sigma, self.tau = batch_size, sigma, tau
        self.fixed_share = fill == "fixed_share"      # at σ = 0 it takes b unused, as unused_first
        self.per_sample_weights = per_sample_weights
        self.max_replay = max_replay_slots(batch_size, sigma)       # floor(b·σ)
        self.min_unused = batch_size - self.max_replay              # ceil(b·(1-σ))
        self.pool, self.sampler = pool, sampler
        self._count = pool.count        # read on every readiness query: one lookup fewer
        self.rng = random.Random(seed)
        self.step = 0                   # batches composed so far: the step number of the next batch

    def ready(self) -> bool:
        """Would the pool's unused samples, with the sampler's replay samples, make a batch? (σ rule; O(1))"""
        unused, b = self._count[READY], self.batch_size
        if unused >= b:
            return True                 # u = b unused samples, no replay slot
        return unused >= self.min_unused and self.sampler.available() >= b - unused

    def compose(self, now: float) -> Batch | None:
        """Take the next batch out of the pool (module docstring), or None — changing nothing."""
        if not self.ready():
            return None
        pool = self.pool
        if self.fixed_share:
            # ready() holds u ≤ ready unused: either b of them, or replay covering b - unused ≤ floor(bσ);
            # the e ≤ ready unused about to expire are taken first (take_ready is oldest first)
            r = max(0, min(self.max_replay, self.sampler.available(), self.batch_size - ready_expiring(pool)))
            u = self.batch_size - r
        else:
            u = min(pool.count[READY], self.batch_size)
            r = self.batch_size - u
        recs = pool.take_ready(u)
        if r:
            recs += take_replay(self.sampler, r, self.rng, pool.samples)
        pool.start_training(recs)
        batch = self.batch(recs, r, pool.version, now)
        self.step += 1
        pool.gate.batch_composed()
        return batch

    def batch(self, recs: list[SampleRecord], replay: int, version: int, now: float) -> Batch:
        """The batch of ``recs`` (unused first, ``replay`` replay samples last) at ``version``."""
        # (list comprehensions: a batch is thousands of samples in the simulator, and tuple(generator) is slower)
        is_replay = tuple([rec.times_used > 0 for rec in recs])
        tokens = tuple([rec.loss_tokens for rec in recs])
        lam = replay / self.batch_size
        latest = self.pool.latest
        advantages = [rec.advantage for rec in recs] if latest is None or not replay else \
            [latest.advantage(rec) if rec.times_used > 0 else rec.advantage for rec in recs]
        return Batch(
            step=self.step, version=version,
            sample_ids=tuple([rec.sample_id for rec in recs]),
            owners=tuple([rec.owner for rec in recs]),
            is_replay=is_replay,
            advantages=tuple(advantages),
            loss_weights=tuple(loss_weights(is_replay, tokens, self.tau, [rec.base_weight for rec in recs],
                                            per_sample=self.per_sample_weights)),
            loss_tokens=tokens,
            staleness=tuple([version - rec.min_version for rec in recs]),
            rewards=tuple([rec.reward for rec in recs]),
            times_used=tuple([rec.times_used for rec in recs]),
            queue_s=tuple([now - rec.finished_at for rec in recs]),
            production_s=tuple([rec.finished_at - rec.created_at for rec in recs]),
            replay_fraction=lam,
            alpha=mixing_weight(lam, self.tau),
        )


def ready_expiring(pool: Pool) -> int:
    """Unused ready samples the pool's next version bump would evict: min version ≤ v - δ (O(that bucket))."""
    cutoff, samples = pool.version - pool.delta, pool.samples
    return sum(1 for ver, q in pool.ready_by_version.items() if ver <= cutoff
               for sid in q if (rec := samples.get(sid)) is not None and rec.state == READY)
