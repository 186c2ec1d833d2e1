"""The replay-buffer index: a pure state machine over sample metadata (ReFlow §4).

The index lives with the coordinator on rank 0; payloads stay on the workers that produced them. It
owns no I/O and reads no clock: drivers (the MPI runtime, the simulator, tests) feed it events and
act on what the events return. Randomness comes only from the seeded ``random.Random`` it owns, so
the same events give the same batches.

Vocabulary
----------
version ``v``
    The trainer's policy version: the number of optimizer steps in its weights, 0 at the start, +1
    when a step ends (:meth:`ReplayIndex.bump_version`). Rollout workers generate with the version
    the last sync published, so staleness counts optimizer steps (:mod:`reflow_hpc.core.modes`).
staleness of a sample
    ``v - min(token versions)``. A partial rollout gives one sample tokens of several versions; the
    finished event carries the smallest and the largest.
unused / replay sample
    A trainable sample never trained on / one trained on and reinserted by the replay filter.

Lifecycle
---------
::

    new_group ──> pending ──finished──> finished ──group complete──> ready
                                                                        │ compose_batch
      replay <──step_done, σ > 0, filter accepts, staleness ≤ δ── training <─┘
         └──────────────────────── compose_batch ────────────────────^

A sample that leaves the index ends in exactly one terminal state, each with a counter
(``trained``, ``filtered``, ``evicted_stale``, ``aborted``, ``failed``, ``lost``, ``uninformative``). Nothing disappears
silently: ``created == live + Σ terminal`` at all times, computed and checked by
:meth:`ReplayIndex.accounting` (:mod:`reflow_hpc.core.accounting`).

The rules, and the part that holds each
---------------------------------------
σ (sigma) — replay cap (:mod:`~reflow_hpc.core.composition`).
    A batch of ``b`` samples needs at least ``ceil(b(1-σ))`` unused ready samples, oldest first;
    replay samples chosen by the sampler fill the rest. The batch fill decides how many unused
    samples it takes: all ready ones up to ``b`` (``unused_first``: the replay fraction ``λ`` follows
    production) or ``ceil(b(1-σ))`` whenever replay covers the rest (``fixed_share``: ``λ = σ``),
    more when that many unused samples would otherwise go stale at the next version bump.
    ``λ`` never exceeds σ; σ = 0 disables replay.
τ (tau) — replay loss weight (:mod:`~reflow_hpc.core.composition`, :mod:`~reflow_hpc.core.mixing`).
    ``w_i = ω_i`` (unused) or ``τ·ω_i`` (replay), normalised so that the token-weighted mean weight
    is 1. Each batch reports ``α = τλ/(1-λ+τλ) ≤ τσ/(1-σ+τσ)``.
δ (delta) — staleness bound (:mod:`~reflow_hpc.core.pool`).
    At every version bump, pooled samples with staleness > δ end as ``evicted_stale``; a sample that
    finishes already staler than δ is evicted on arrival; training samples are checked when their
    step ends. No trainable sample is ever staler than δ.
Groups (:mod:`~reflow_hpc.core.pool`, :mod:`~reflow_hpc.core.fresh`).
    A group's finished samples become ready together, with group-normalised advantages, once every
    member finished or ended — those the fresh filter keeps (``reflow.fresh_filter``; dynamic
    sampling drops groups whose rewards are all equal, up to ``algorithm.max_gen_batches`` batches
    of generation per step), with the ω the sample-weight hook gives them; the others end as
    ``uninformative``.
Replayed advantages (:mod:`~reflow_hpc.core.replay_advantage`).
    Kept from the sample's group, or recomputed against its prompt's newest group when composed.
After a step (:mod:`~reflow_hpc.core.pool`, :mod:`~reflow_hpc.core.filters`).
    First matching rule wins: owner lost → ``lost``; σ = 0 → ``trained``; staleness > δ →
    ``evicted_stale``; filter declines → ``filtered``; else → ``replay``.
b_max — dispatch budget (:mod:`~reflow_hpc.core.dispatch_window`).
    At most ``b_max`` samples outstanding and dispatched per step, whole groups only; a starving
    pool with nothing in flight reopens the window.
Checkpoints (:mod:`~reflow_hpc.core.index_state`).
    Plain JSON-able state; a restart aborts what was pending, returns what was training, and
    :meth:`ReplayIndex.recover` re-admits finished samples found in shards.

Drivers
-------
The coordinator calls the events below as worker messages arrive and acts on what they return;
the simulator calls the same events from its event queue. Events that end samples return
:class:`Release` commands: the rank named may free the payload (``has_payload``) or stop generating.
:class:`ReplayIndex` is a façade over the parts named above, which know nothing of one another
except that the pool tells the sampler and the accounting what happens to samples, and that the
checkpoint code reads and writes them all (handed over as ``index_state.IndexParts``, never the façade).
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Iterable, Iterator, Sequence

from reflow_hpc.core import index_state
from reflow_hpc.core.accounting import Accounting
from reflow_hpc.core.advantages import ESTIMATORS
from reflow_hpc.core.composition import BATCH_FILLS, Batch, Composer
from reflow_hpc.core.dispatch_window import DispatchWindow
from reflow_hpc.core.filters import ReplayFilter, make_replay_filter
from reflow_hpc.core.fresh import (FreshFilter, GroupGate, SampleWeight, make_fresh_filter,
                                   make_sample_weight)
from reflow_hpc.core.index_state import STATE_FORMAT, IndexParts, RecoveredSample
from reflow_hpc.core.modes import check
from reflow_hpc.core.pool import Group, Pool, Release
from reflow_hpc.core.pool_checks import check_pool
from reflow_hpc.core.replay_advantage import REPLAY_ADVANTAGES, LatestGroups
from reflow_hpc.core.sample import (ABORTED, EVICTED_STALE, FAILED, FILTERED, FINISHED, GENERATING, LOST, PENDING,
                                    READY, REPLAY, TRAINED, TRAINING, UNINFORMATIVE, SampleRecord)
from reflow_hpc.core.samplers import Sampler, make_sampler

__all__ = ["GAUGE_NAMES", "STATE_FORMAT", "Batch", "Group", "RecoveredSample", "Release", "ReplayIndex",
           "build_index"]

# Stable metric names (DESIGN §10): gauges() returns exactly these keys, in this order; names are
# only ever added, at the end.
_FIRST_REASONS = (TRAINED, FILTERED, EVICTED_STALE, ABORTED, FAILED, LOST)     # the reasons of the first gauges
GAUGE_NAMES = (tuple(f"buffer/{s}" for s in (READY, REPLAY, TRAINING, PENDING, FINISHED))
               + tuple(f"buffer/{r}" for r in _FIRST_REASONS)
               + ("buffer/evicted_unused", "buffer/created", "dispatch/budget", "step", "version",
                  "buffer/trained_samples", "buffer/replayed_uses", f"buffer/{UNINFORMATIVE}",
                  "buffer/groups_completed", "buffer/groups_dropped", "buffer/groups_over_cap"))


class ReplayIndex:
    """Sample metadata, the σ/τ/δ rules, group advantages and the b_max budget (module docstring)."""

    def __init__(self, *, group_size: int, batch_size: int, sigma: float, tau: float, delta: int,
                 b_max: int, sampler: Sampler, replay_filter: ReplayFilter, seed: int = 0,
                 adv_eps: float = 1e-6, adv_std_norm: bool = True, adv_estimator: str = "group_norm",
                 per_sample_weights: bool = False, fresh_filter: FreshFilter | None = None,
                 sample_weight: SampleWeight | None = None, max_gen_batches: int = 0, replay_advantage: str = "keep",
                 prompt_key: Callable[[int], int] | None = None, batch_fill: str = "unused_first"):
        _require(isinstance(group_size, int) and group_size >= 1, "group_size", group_size, "must be an integer ≥ 1")
        _require(isinstance(batch_size, int) and batch_size >= 1, "batch_size", batch_size, "must be an integer ≥ 1")
        _require(0.0 <= sigma < 1.0, "sigma", sigma, "must be in [0, 1)")
        _require(0.0 < tau <= 1.0, "tau", tau, "must be in (0, 1]")
        _require(isinstance(delta, int) and delta >= 0, "delta", delta, "must be an integer ≥ 0")
        _require(isinstance(b_max, int) and b_max >= group_size, "b_max", b_max,
                 f"must be ≥ the group size {group_size} (groups are dispatched whole)")
        _require(adv_eps > 0.0, "adv_eps", adv_eps, "must be > 0")
        _require(batch_fill in BATCH_FILLS, "batch_fill", batch_fill, "allowed: " + ", ".join(BATCH_FILLS))
        _require(adv_estimator in ESTIMATORS, "adv_estimator", adv_estimator, "allowed: " + ", ".join(ESTIMATORS))
        _require(isinstance(sampler, Sampler), "sampler", type(sampler).__name__, "must be a Sampler")
        _require(isinstance(replay_filter, ReplayFilter), "replay_filter", type(replay_filter).__name__,
                 "must be a ReplayFilter")
        self.group_size, self.batch_size, self.b_max = group_size, batch_size, b_max
        self.sigma, self.tau, self.delta = float(sigma), float(tau), delta
        self.adv_eps, self.adv_std_norm = float(adv_eps), bool(adv_std_norm)
        self.sampler, self.replay_filter, self.batch_fill = sampler, replay_filter, batch_fill
        self._accounts = Accounting()
        gate, latest = _group_hooks(batch_size, fresh_filter, sample_weight, max_gen_batches, replay_advantage,
                                    LatestGroups(estimator=adv_estimator, eps=self.adv_eps,
                                                 std_norm=self.adv_std_norm, prompt_key=prompt_key))
        self._pool = Pool(delta=delta, sampler=sampler, accounts=self._accounts, adv_eps=self.adv_eps,
                          adv_std_norm=self.adv_std_norm, adv_estimator=adv_estimator, gate=gate, latest=latest)
        self._composer = Composer(batch_size=batch_size, sigma=self.sigma, tau=self.tau, pool=self._pool,
                                  sampler=sampler, seed=seed, per_sample_weights=per_sample_weights, fill=batch_fill)
        self._window = DispatchWindow(b_max, self._pool.count, self._composer.ready)
        self._parts = IndexParts(self._pool, self._accounts, self._composer, self._window, sampler, replay_filter)
        self._samples, self._count = self._pool.samples, self._pool.count    # the pool's own, for O(1) queries
        self._recover_open = True                              # until the first new_group
        # The hottest calls go straight to the part that answers them, with no façade call in between
        # (the methods of the same names below document them and do the same). Replacing a method per
        # instance is deliberate here (mypy's method-assign); the signatures are the same.
        self.finished = self._pool.finished             # type: ignore[method-assign]
        self.batch_ready = self._composer.ready         # type: ignore[method-assign]

    # ------------------------------------------------------------------------------------------
    # Queries
    # ------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._pool.version

    @property
    def step(self) -> int:
        """Batches composed so far (the step number of the next batch)."""
        return self._composer.step

    @property
    def outstanding(self) -> int:
        """Samples dispatched and not finished (pending)."""
        return self._count[PENDING]

    @property
    def dispatch_budget(self) -> int:
        """Samples that may still be dispatched in this window (module docstring, "b_max")."""
        return self._window.budget()

    def can_dispatch_group(self) -> bool:
        return self._window.budget() >= self.group_size

    def batch_ready(self) -> bool:
        """Would :meth:`compose_batch` return a batch now? (σ rule; O(1))"""
        return self._composer.ready()

    def count(self, state: str) -> int:
        """Live samples in ``state``."""
        return self._count[state]

    def terminal_counts(self) -> dict[str, int]:
        return dict(self._accounts.ended)

    @property
    def created(self) -> int:
        return self._accounts.created

    def sample(self, sample_id: int) -> SampleRecord:
        """The live record of ``sample_id`` (read it, do not change it)."""
        rec = self._samples.get(sample_id)
        if rec is None:
            raise KeyError(f"sample {sample_id} is not live in the index ({self._pool.fate(sample_id)})")
        return rec

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._samples

    def __len__(self) -> int:
        return len(self._samples)

    def knows(self, sample_id: int) -> bool:
        """True when the id was created by this index (live or ended)."""
        return self._pool.knows(sample_id)

    def live_ids(self) -> Iterator[int]:
        """Every live sample id (a full scan: for tests, checkpoints and debugging)."""
        return iter(list(self._samples))

    def gauges(self) -> dict[str, int]:
        """Metrics under the stable names of GAUGE_NAMES."""
        acc = self._accounts
        g = {f"buffer/{s}": self._count[s] for s in (READY, REPLAY, TRAINING, PENDING, FINISHED)}
        g.update({f"buffer/{r}": acc.ended[r] for r in _FIRST_REASONS})
        g["buffer/evicted_unused"] = acc.evicted_unused
        g["buffer/created"] = acc.created
        g["dispatch/budget"] = self.dispatch_budget
        g["step"] = self._composer.step
        g["version"] = self._pool.version
        g["buffer/trained_samples"] = acc.trained
        g["buffer/replayed_uses"] = acc.replayed
        gate = self._pool.gate
        g[f"buffer/{UNINFORMATIVE}"] = acc.ended[UNINFORMATIVE]
        g["buffer/groups_completed"], g["buffer/groups_dropped"] = gate.completed, gate.dropped
        g["buffer/groups_over_cap"] = gate.passed
        return g

    def accounting(self) -> dict[str, Any]:
        """The accounting, computed and checked now (O(1)): ``{"created", "live", "ended": {reason: n},
        "evicted_unused", "trained", "replayed", "ok", "why"}``; ``why`` names the first broken check
        (:mod:`reflow_hpc.core.accounting`)."""
        return self._accounts.report(self._count, len(self._samples))

    # ------------------------------------------------------------------------------------------
    # Inbound events: rollout side
    # ------------------------------------------------------------------------------------------

    def new_group(self, prompt_id: int, *, now: float = 0.0, worker: int | Sequence[int] | None = None) -> Group:
        """Dispatch one prompt: create its n samples in ``pending``; spends n of the budget.

        ``worker`` is the rank generating all of them, one rank per sample, or None when not known
        (a driver that never loses workers).
        """
        n = self.group_size
        budget = self._window.budget()
        if budget < n:
            raise ValueError(f"new_group: dispatch budget {budget} < group size {n} "
                             f"(b_max = {self.b_max}, outstanding = {self.outstanding}); "
                             f"check can_dispatch_group() first")
        prompt_id = int(prompt_id)
        if worker is None or isinstance(worker, (int, numbers.Integral)):
            workers = [-1 if worker is None else int(worker)] * n
        else:
            workers = [int(w) for w in worker]
            if len(workers) != n:
                raise ValueError(f"new_group: {len(workers)} workers given for a group of {n}")
        group = self._pool.new_group(prompt_id, workers, now)
        self._window.spend(budget, n)
        self._recover_open = False
        return group

    def reassign(self, sample_id: int, worker: int) -> None:
        """A pending sample moves to another rollout worker (its first worker left rollout)."""
        self._pool.live(sample_id, GENERATING, "reassign").worker = int(worker)

    def finished(self, sample_id: int, *, owner: int, reward: float, min_version: int, max_version: int,
                 loss_tokens: int, now: float = 0.0, location: Any = None,
                 base_weight: float = 1.0) -> list[Release]:
        """Generation ended; ``owner`` holds the payload. Returns the sample's release when it is
        already staler than δ."""
        return self._pool.finished(sample_id, owner=owner, reward=reward, min_version=min_version,
                                   max_version=max_version, loss_tokens=loss_tokens, now=now, location=location,
                                   base_weight=base_weight)

    def failed(self, sample_id: int, *, now: float = 0.0) -> list[Release]:
        """Generation of ``sample_id`` failed (``now`` is taken like on every event)."""
        return self._pool.end_live(sample_id, GENERATING, FAILED, "failed")

    def lost(self, sample_id: int) -> list[Release]:
        """The payload of ``sample_id`` cannot be read back (damaged shard, unreachable owner)."""
        return self._pool.end_live(sample_id, (FINISHED, READY, REPLAY, TRAINING), LOST, "lost")

    def worker_lost(self, rank: int) -> list[Release]:
        """``rank`` died: what it generated ends as ``failed``, what it held as ``lost``; samples it
        owns that are in a batch end as ``lost`` when their step is done."""
        return self._pool.worker_lost(rank)

    def abort(self, sample_ids: Iterable[int]) -> list[Release]:
        """Cancel samples in any live state; ids that already ended are skipped."""
        return self._pool.abort(sample_ids)

    def shutdown(self) -> list[Release]:
        """End of run: abort every live sample."""
        return self._pool.abort(sorted(self._samples))

    # ------------------------------------------------------------------------------------------
    # Inbound events: trainer side
    # ------------------------------------------------------------------------------------------

    def compose_batch(self, *, now: float = 0.0) -> Batch | None:
        """The next batch (σ rule, module docstring), or None — changing nothing — when not ready.
        A batch opens a new dispatch window: the trainer starts a step."""
        batch = self._composer.compose(now)
        if batch is not None:
            self._window.open()
        return batch

    def step_done(self, batch: Batch | Iterable[int]) -> list[Release]:
        """The step that trained on ``batch`` finished: reinsert or end each sample (module docstring).
        Samples that ended during the step (aborted, lost) are skipped."""
        ids = batch.sample_ids if isinstance(batch, Batch) else batch
        return self._pool.after_step(ids, self.replay_filter if self.sigma != 0.0 else None)

    def bump_version(self) -> list[Release]:
        """The trainer's weights are now version v+1 (a step ended): evict pooled samples staler than δ."""
        return self._pool.bump()

    # ------------------------------------------------------------------------------------------
    # Checkpoints (reflow_hpc.core.index_state)
    # ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state; see :meth:`load_state_dict`."""
        params = {"group_size": self.group_size, "batch_size": self.batch_size, "sigma": self.sigma,
                  "tau": self.tau, "delta": self.delta, "b_max": self.b_max, "adv_eps": self.adv_eps,
                  "adv_std_norm": self.adv_std_norm, "max_gen_batches": self._pool.gate.cap // self.batch_size,
                  "replay_advantage": "keep" if self._pool.latest is None else "recompute",
                  "batch_fill": self.batch_fill}
        return index_state.state_dict(self._parts, params)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], *, sampler: Sampler | None = None,
                        replay_filter: ReplayFilter | None = None, resume: bool = True) -> "ReplayIndex":
        """An index with the checkpoint's parameters and state.

        ``sampler`` / ``replay_filter`` (and the fresh-sample hooks) default to fresh instances of the
        checkpoint's registered names with default settings; pass configured ones when they take
        parameters.
        """
        index_state.check_format(state)
        if sampler is None:
            sampler = make_sampler(state["sampler"]["name"])
        if replay_filter is None:
            replay_filter = make_replay_filter(state["replay_filter"]["name"])
        fresh = state.get("fresh") or {"fresh_filter": "accept_all", "sample_weight": "uniform"}
        index = cls(**state["params"], sampler=sampler, replay_filter=replay_filter,
                    fresh_filter=make_fresh_filter(fresh["fresh_filter"]),
                    sample_weight=make_sample_weight(fresh["sample_weight"]))
        index.load_state_dict(state, resume=resume)
        return index

    def load_state_dict(self, state: dict[str, Any], *, resume: bool = True, keep: Iterable[int] = ()) -> list[Release]:
        """Load a checkpoint into this fresh index; its own parameters (σ, τ, δ, b, b_max, sampler,
        filter) stay, so a restart may change them. The RNG continues from the checkpoint.

        resume=True: samples pending at checkpoint time end as ``aborted`` — except those in ``keep``,
        whose partial responses the checkpoint saved: they stay pending, with no worker, until a
        driver reassigns them; samples in ``training`` return to ``ready`` (front of their queue) or
        ``replay``; the dispatch window reopens with what ``b_max`` leaves beside the kept ones.
        resume=False: an exact copy (same future behaviour).
        Returns the releases of the samples that ended while loading (those, and samples staler
        than this index's δ).
        """
        out = index_state.load_state_dict(self._parts, state, resume=resume, keep=keep)
        self._recover_open = True
        return out

    def recover(self, samples: Iterable[RecoveredSample], *, now: float = 0.0) -> list[Release]:
        """Re-admit finished samples found in shards after a restart that the index does not know.

        Call once, after loading the checkpoint and before any :meth:`new_group`, with every such
        sample from every worker (a group's members may sit on several workers). Their groups are
        complete (members that never finished are gone with the crash), so samples re-enter as
        ``ready`` with fresh group advantages, or end as ``evicted_stale`` when their versions fall
        outside ``[v-δ, v]`` (a version newer than ``v`` came from updates lost with the crash).
        Id counters move past the recovered ids.
        """
        if not self._recover_open:
            raise ValueError("recover: new groups were dispatched since the restore; recovered ids could "
                             "collide with them (call recover before any new_group)")
        return index_state.recover(self._parts, samples, now)

    # ------------------------------------------------------------------------------------------
    # Checks (tests and debugging)
    # ------------------------------------------------------------------------------------------

    def check_accounting(self) -> None:
        """The checks of :meth:`accounting`, raising AssertionError naming the first broken (O(1))."""
        self._accounts.check(self._count, len(self._samples))

    def check_invariants(self) -> None:
        """Every structural invariant, by a full scan; raises AssertionError naming the first broken."""
        self.check_accounting()
        check_pool(self._pool, self.sampler)
        self._window.check()


def _require(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"replay index: {name} = {value!r}: {why}")


def _group_hooks(batch_size: int, fresh_filter: FreshFilter | None, sample_weight: SampleWeight | None,
                 max_gen_batches: int, replay_advantage: str,
                 latest: LatestGroups) -> tuple[GroupGate, LatestGroups | None]:
    """The pool's group gate, and ``latest`` when replayed advantages are recomputed (else None)."""
    _require(isinstance(max_gen_batches, int) and max_gen_batches >= 0, "max_gen_batches", max_gen_batches,
             "must be an integer ≥ 0 (0: no cap)")
    _require(replay_advantage in REPLAY_ADVANTAGES, "replay_advantage", replay_advantage,
             "allowed: " + ", ".join(REPLAY_ADVANTAGES))
    _require(fresh_filter is None or isinstance(fresh_filter, FreshFilter), "fresh_filter",
             type(fresh_filter).__name__, "must be a FreshFilter")
    _require(sample_weight is None or isinstance(sample_weight, SampleWeight), "sample_weight",
             type(sample_weight).__name__, "must be a SampleWeight")
    gate = GroupGate(fresh_filter, sample_weight, max_gen_batches * batch_size)
    return gate, latest if replay_advantage == "recompute" else None


# ----------------------------------------------------------------------------------------------
# Construction from the config
# ----------------------------------------------------------------------------------------------

def build_index(reflow: Any, *, group_size: int, batch_size: int, seed: int, adv_eps: float = 1e-6,
                adv_std_norm: bool = True, adv_estimator: str = "group_norm", per_sample_weights: bool = False,
                dynamic_sampling: bool = False, max_gen_batches: int = 0, replay_advantage: str = "keep",
                prompt_key: Callable[[int], int] | None = None) -> ReplayIndex:
    """The index, sampler, replay filter and fresh-sample hooks that a ``[reflow]`` config section
    describes, with the ``[algorithm]`` settings passed by keyword.

    ``reflow`` is read by attribute (mode, sigma, tau, delta, b_max, sampler, replay_filter,
    reward_low, reward_high, and fresh_filter, sample_weight and batch_fill when it has them). ``b_max = 0``
    means ``batch_size``. ``dynamic_sampling`` selects the fresh filter ``informative_groups`` in
    place of ``accept_all``. The settings are checked against the mode's rules
    (:func:`reflow_hpc.core.modes.check`): a baseline given σ > 0 is refused, not run with σ = 0.
    """
    b_max = reflow.b_max or batch_size
    fresh = getattr(reflow, "fresh_filter", "accept_all")
    if dynamic_sampling and fresh == "accept_all":
        fresh = "informative_groups"
    mode = check(reflow.mode, sigma=reflow.sigma, delta=reflow.delta, b_max=b_max, batch_size=batch_size,
                 sync_every=reflow.sync_every, refills=fresh != "accept_all")
    return ReplayIndex(
        group_size=group_size, batch_size=batch_size, sigma=reflow.sigma, tau=reflow.tau,
        delta=mode.pool_delta(reflow.delta),
        b_max=b_max,
        sampler=make_sampler(reflow.sampler, reflow),
        replay_filter=make_replay_filter(reflow.replay_filter, reflow),
        seed=seed, adv_eps=adv_eps, adv_std_norm=adv_std_norm, adv_estimator=adv_estimator,
        per_sample_weights=per_sample_weights, fresh_filter=make_fresh_filter(fresh, reflow),
        sample_weight=make_sample_weight(getattr(reflow, "sample_weight", "uniform"), reflow),
        max_gen_batches=max_gen_batches, replay_advantage=replay_advantage, prompt_key=prompt_key,
        batch_fill=getattr(reflow, "batch_fill", "unused_first"),
    )
