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

A sample that leaves the index ends in exactly one terminal state, each with a counter:
``trained`` (trained on, replay disabled: σ = 0), ``filtered`` (trained on, the replay filter
declined it), ``evicted_stale`` (staleness > δ), ``aborted`` (shutdown, explicit abort, or in flight
at a restore), ``failed`` (generation failed, or its worker was lost while generating), ``lost``
(payload unreadable: its owner was lost or its shard is damaged). Nothing disappears silently:
``created == live + Σ terminal`` at all times (:meth:`ReplayIndex.check_accounting`).

The rules
---------
σ (sigma) — replay cap.
    A batch of ``b`` samples needs at least ``ceil(b(1-σ))`` unused ready samples; until then
    :meth:`~ReplayIndex.compose_batch` returns None and changes nothing. Otherwise it takes
    ``u = min(ready unused, b)`` unused samples, oldest first (lowest min version, then completion
    order), and fills the ``r = b - u`` remaining slots with replay samples chosen by the sampler;
    if the sampler cannot supply ``r``, the batch is not ready either. The replay fraction
    ``λ = r/b`` therefore follows production and never exceeds σ. σ = 0 disables replay.
τ (tau) — replay loss weight.
    ``w_i = ω_i`` (unused) or ``τ·ω_i`` (replay), normalised so that the token-weighted mean weight
    is 1 (:mod:`reflow_hpc.core.mixing`). Each batch reports ``α = τλ/(1-λ+τλ) ≤ τσ/(1-σ+τσ)``.
δ (delta) — staleness bound.
    At every version bump, finished, ready and replay samples with staleness > δ end as
    ``evicted_stale`` — unused and replayed alike — and the bump returns them so owners can drop
    the payloads. A sample that finishes already staler than δ is evicted on arrival. Samples in
    ``training`` are left alone during their step; when it ends they are reinserted only if still
    within δ. Hence no trainable sample is ever staler than δ.
Groups (GRPO, size n).
    :meth:`~ReplayIndex.new_group` creates the n samples of one prompt. Finished samples become
    ``ready`` together when the group is complete — every member finished or terminal — with
    advantages ``(r_i - mean r) / (std r + eps)`` over the finished members
    (:mod:`reflow_hpc.core.advantages`). Replay samples keep the advantage they got then.
After a step (:meth:`~ReplayIndex.step_done`).
    Every sample of the batch gets ``times_used += 1`` and then, first matching rule wins: owner
    lost → ``lost``; σ = 0 → ``trained``; staleness > δ → ``evicted_stale``; filter declines →
    ``filtered``; else → ``replay``.
b_max — dispatch budget.
    Outstanding (pending) samples never exceed ``b_max``, and one step dispatches at most
    ``b_max`` samples: a dispatch window opens with budget ``b_max - outstanding`` when a batch is
    composed (the trainer starts a step) and each dispatched sample spends one. Groups are
    dispatched whole — a group of n needs n budget; a remainder smaller than n is not carried over —
    so ``b_max`` must be at least n. One exception keeps a run live: when the next batch cannot be
    composed from the pool and nothing is outstanding (failures, evictions or filters drained it),
    a fresh window of ``b_max`` opens; otherwise nothing could ever become ready again.

Checkpoints
-----------
:meth:`~ReplayIndex.state_dict` is plain JSON-able data (RNG state, sampler state and the order of
the ready queue included); :meth:`~ReplayIndex.from_state_dict` / :meth:`~ReplayIndex.load_state_dict`
rebuild an index that behaves identically. With ``resume=True`` (a restart) samples that were
pending at checkpoint time end as ``aborted`` — their generation state died with the old
processes — which may complete their groups; samples that were in ``training`` go back to where they
came from (ready or replay), since a checkpoint taken mid-step holds no finished step for them.
Afterwards :meth:`~ReplayIndex.recover` takes, in one call and before any new group, the finished
samples found in shards that the checkpoint does not know (created after it): each re-enters as
ready with its recovered group, or is evicted if its versions fall outside ``[v-δ, v]``.

Drivers
-------
The coordinator calls the events below as worker messages arrive and acts on what they return;
the simulator calls the same events from its event queue. Events that end samples return
:class:`Release` commands: the rank named may free the payload (``has_payload``) or stop generating.
"""

from __future__ import annotations

import math
import numbers
import random
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

from reflow_hpc.core.advantages import group_advantages
from reflow_hpc.core.filters import ReplayFilter, make_replay_filter
from reflow_hpc.core.mixing import loss_weights, max_replay_slots, mixing_weight
from reflow_hpc.core.modes import check
from reflow_hpc.core.sample import (ABORTED, EVICTED_STALE, FAILED, FILTERED, FINISHED, GENERATING, LIVE_STATES, LOST,
                                    PENDING, POOLED, READY, REPLAY, TERMINAL_REASONS, TRAINED, TRAINING, SampleRecord)
from reflow_hpc.core.samplers import Sampler, make_sampler

STATE_FORMAT = 1

# Stable metric names (DESIGN §10): gauges() returns exactly these keys.
GAUGE_NAMES = (tuple(f"buffer/{s}" for s in (READY, REPLAY, TRAINING, PENDING, FINISHED))
               + tuple(f"buffer/{r}" for r in TERMINAL_REASONS)
               + ("buffer/evicted_unused", "buffer/created", "dispatch/budget", "step", "version"))


# ----------------------------------------------------------------------------------------------
# Outbound results
# ----------------------------------------------------------------------------------------------

class Release(NamedTuple):
    """A sample ended: ``rank`` may drop its payload (``has_payload``) or stop generating it."""
    sample_id: int
    rank: int            # owner of the payload, or the worker generating it; -1 when unknown
    reason: str          # one of TERMINAL_REASONS
    has_payload: bool


@dataclass(frozen=True)
class Group:
    """The samples created by one :meth:`ReplayIndex.new_group` (one prompt, n samples)."""
    group_id: int
    prompt_id: int
    sample_ids: tuple[int, ...]


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


@dataclass(frozen=True)
class RecoveredSample:
    """A finished sample found in a shard after a restart that the restored index does not know."""
    sample_id: int
    group_id: int
    prompt_id: int
    owner: int
    reward: float
    min_version: int
    max_version: int
    loss_tokens: int
    location: Any = None
    base_weight: float = 1.0


class _GroupState:
    """An incomplete group: members still to finish or end. Dropped once complete."""
    __slots__ = ("group_id", "prompt_id", "members", "outstanding")

    def __init__(self, group_id: int, prompt_id: int, members: tuple[int, ...], outstanding: int):
        self.group_id, self.prompt_id, self.members, self.outstanding = group_id, prompt_id, members, outstanding


# ----------------------------------------------------------------------------------------------
# The index
# ----------------------------------------------------------------------------------------------

class ReplayIndex:
    """Sample metadata, the σ/τ/δ rules, group advantages and the b_max budget (module docstring)."""

    def __init__(self, *, group_size: int, batch_size: int, sigma: float, tau: float, delta: int,
                 b_max: int, sampler: Sampler, replay_filter: ReplayFilter, seed: int = 0,
                 adv_eps: float = 1e-6, adv_std_norm: bool = True):
        _require(isinstance(group_size, int) and group_size >= 1, "group_size", group_size, "must be an integer ≥ 1")
        _require(isinstance(batch_size, int) and batch_size >= 1, "batch_size", batch_size, "must be an integer ≥ 1")
        _require(0.0 <= sigma < 1.0, "sigma", sigma, "must be in [0, 1)")
        _require(0.0 < tau <= 1.0, "tau", tau, "must be in (0, 1]")
        _require(isinstance(delta, int) and delta >= 0, "delta", delta, "must be an integer ≥ 0")
        _require(isinstance(b_max, int) and b_max >= group_size, "b_max", b_max,
                 f"must be ≥ the group size {group_size} (groups are dispatched whole)")
        _require(adv_eps > 0.0, "adv_eps", adv_eps, "must be > 0")
        _require(isinstance(sampler, Sampler), "sampler", type(sampler).__name__, "must be a Sampler")
        _require(isinstance(replay_filter, ReplayFilter), "replay_filter", type(replay_filter).__name__,
                 "must be a ReplayFilter")
        self.group_size, self.batch_size, self.b_max = group_size, batch_size, b_max
        self.sigma, self.tau, self.delta = float(sigma), float(tau), delta
        self.adv_eps, self.adv_std_norm = float(adv_eps), bool(adv_std_norm)
        self.sampler, self.replay_filter = sampler, replay_filter
        self._max_replay = max_replay_slots(batch_size, sigma)
        self._min_unused = batch_size - self._max_replay
        self._rng = random.Random(seed)

        self._samples: dict[int, SampleRecord] = {}            # live samples
        self._groups: dict[int, _GroupState] = {}              # incomplete groups
        self._count = dict.fromkeys(LIVE_STATES, 0)
        self._terminal = dict.fromkeys(TERMINAL_REASONS, 0)
        self._evicted_unused = 0        # evicted stale before any training: generation spent for nothing
        self._created = 0
        # Staleness eviction without scans: pooled samples bucketed by min version. The values are
        # dicts used as insertion-ordered sets; a defaultdict, so that adding and discarding are one call
        # each (a bucket emptied by a discard stays until its version is evicted).
        self._pool_by_version: defaultdict[int, dict[int, None]] = defaultdict(dict)
        # Unused ready samples per min version in completion order; entries of samples that left
        # `ready` another way than compose (abort, lost) are skipped when reached.
        self._ready_by_version: dict[int, deque[int]] = {}
        self._version = 0
        self._step = 0
        self._next_sample_id = 0
        self._next_group_id = 0
        self._finish_seq = 0
        self._budget = b_max
        self._recover_open = True                              # until the first new_group

    # ------------------------------------------------------------------------------------------
    # Queries
    # ------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def step(self) -> int:
        """Batches composed so far (the step number of the next batch)."""
        return self._step

    @property
    def outstanding(self) -> int:
        """Samples dispatched and not finished (pending)."""
        return self._count[PENDING]

    @property
    def dispatch_budget(self) -> int:
        """Samples that may still be dispatched in this window (module docstring, "b_max")."""
        if self._budget < self.b_max and self.outstanding == 0 and not self.batch_ready():
            return self.b_max        # starving with nothing in flight: a fresh window
        return self._budget

    def can_dispatch_group(self) -> bool:
        return self.dispatch_budget >= self.group_size

    def batch_ready(self) -> bool:
        """Would :meth:`compose_batch` return a batch now? (σ rule; O(1))"""
        u = min(self._count[READY], self.batch_size)
        r = self.batch_size - u
        return u >= self._min_unused and (r == 0 or self.sampler.available() >= r)

    def count(self, state: str) -> int:
        """Live samples in ``state``."""
        return self._count[state]

    def terminal_counts(self) -> dict[str, int]:
        return dict(self._terminal)

    @property
    def created(self) -> int:
        return self._created

    def sample(self, sample_id: int) -> SampleRecord:
        """The live record of ``sample_id`` (read it, do not change it)."""
        rec = self._samples.get(sample_id)
        if rec is None:
            raise KeyError(f"sample {sample_id} is not live in the index ({self._fate(sample_id)})")
        return rec

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._samples

    def __len__(self) -> int:
        return len(self._samples)

    def knows(self, sample_id: int) -> bool:
        """True when the id was created by this index (live or ended)."""
        return 0 <= sample_id < self._next_sample_id

    def live_ids(self) -> Iterator[int]:
        """Every live sample id (a full scan: for tests, checkpoints and debugging)."""
        return iter(list(self._samples))

    def gauges(self) -> dict[str, int]:
        """Metrics under the stable names of GAUGE_NAMES."""
        g = {f"buffer/{s}": self._count[s] for s in (READY, REPLAY, TRAINING, PENDING, FINISHED)}
        g.update({f"buffer/{r}": n for r, n in self._terminal.items()})
        g["buffer/evicted_unused"] = self._evicted_unused
        g["buffer/created"] = self._created
        g["dispatch/budget"] = self.dispatch_budget
        g["step"] = self._step
        g["version"] = self._version
        return g

    # ------------------------------------------------------------------------------------------
    # Inbound events: rollout side
    # ------------------------------------------------------------------------------------------

    def new_group(self, prompt_id: int, *, now: float = 0.0, worker: int | Sequence[int] | None = None) -> Group:
        """Dispatch one prompt: create its n samples in ``pending``; spends n of the budget.

        ``worker`` is the rank generating all of them, one rank per sample, or None when not known
        (a driver that never loses workers).
        """
        n = self.group_size
        budget = self.dispatch_budget
        if budget < n:
            raise ValueError(f"new_group: dispatch budget {budget} < group size {n} "
                             f"(b_max = {self.b_max}, outstanding = {self.outstanding}); "
                             f"check can_dispatch_group() first")
        prompt_id = int(prompt_id)
        if worker is None or isinstance(worker, numbers.Integral):
            workers = [-1 if worker is None else int(worker)] * n
        else:
            workers = [int(w) for w in worker]
            if len(workers) != n:
                raise ValueError(f"new_group: {len(workers)} workers given for a group of {n}")
        first = self._next_sample_id
        ids = tuple(range(first, first + n))
        gid = self._next_group_id
        self._next_sample_id += n
        self._next_group_id += 1
        for sid, w in zip(ids, workers):
            self._samples[sid] = SampleRecord(sid, gid, prompt_id, PENDING, w, created_at=now)
        self._groups[gid] = _GroupState(gid, prompt_id, ids, n)
        self._count[PENDING] += n
        self._created += n
        self._budget = budget - n
        self._recover_open = False
        return Group(gid, prompt_id, ids)

    def reassign(self, sample_id: int, worker: int) -> None:
        """A pending sample moves to another rollout worker (its first worker left rollout)."""
        rec = self._live(sample_id, GENERATING, "reassign")
        rec.worker = int(worker)

    def finished(self, sample_id: int, *, owner: int, reward: float, min_version: int, max_version: int,
                 loss_tokens: int, now: float = 0.0, location: Any = None,
                 base_weight: float = 1.0) -> list[Release]:
        """Generation ended; ``owner`` holds the payload. Returns the sample's release when it is
        already staler than δ."""
        rec = self._samples.get(sample_id)
        if rec is None or rec.state not in GENERATING:
            rec = self._live(sample_id, GENERATING, "finished")        # raises
        # Fast path of the field checks (x - x == 0 rejects inf and nan); the full check names the fault.
        if not (0 <= min_version <= max_version <= self._version and type(loss_tokens) is int and loss_tokens >= 0
                and type(reward) in _NUMBERS and reward - reward == 0
                and type(base_weight) in _NUMBERS and base_weight >= 0 and base_weight - base_weight == 0):
            self._check_finished_fields(sample_id, reward, min_version, max_version, loss_tokens, base_weight,
                                        max_allowed_version=self._version)
        self._count[rec.state] -= 1
        rec.state = FINISHED
        self._count[FINISHED] += 1
        # Plain Python numbers: the record must stay JSON-able when a driver passes numpy scalars.
        owner = int(owner)
        rec.owner, rec.reward, rec.location = owner, float(reward), location
        rec.min_version, rec.max_version = int(min_version), int(max_version)
        rec.loss_tokens, rec.base_weight, rec.finished_at = int(loss_tokens), float(base_weight), now
        rec.finish_seq = self._finish_seq
        self._finish_seq += 1
        out: list[Release] = []
        if self._version - min_version > self.delta:
            self._end(rec, EVICTED_STALE, out)
        else:
            self._pool_by_version[rec.min_version][sample_id] = None
        group = self._groups[rec.group_id]
        group.outstanding -= 1
        if group.outstanding == 0:
            self._complete_group(group)
        return out

    def failed(self, sample_id: int, *, now: float = 0.0) -> list[Release]:
        """Generation of ``sample_id`` failed (``now`` is taken like on every event)."""
        rec = self._live(sample_id, GENERATING, "failed")
        out: list[Release] = []
        self._end(rec, FAILED, out)
        return out

    def lost(self, sample_id: int) -> list[Release]:
        """The payload of ``sample_id`` cannot be read back (damaged shard, unreachable owner)."""
        rec = self._live(sample_id, (FINISHED, READY, REPLAY, TRAINING), "lost")
        out: list[Release] = []
        self._end(rec, LOST, out)
        return out

    def worker_lost(self, rank: int) -> list[Release]:
        """``rank`` died: what it generated ends as ``failed``, what it held as ``lost``; samples it
        owns that are in a batch end as ``lost`` when their step is done.

        A scan of the live samples: a rank is lost rarely, while a per-rank set would be kept up to date
        four times per sample."""
        out: list[Release] = []
        if rank < 0:
            return out                                    # -1 is "not known", never a rank
        mine = [rec for rec in self._samples.values()
                if (rec.worker if rec.state in GENERATING else rec.owner) == rank and not rec.owner_lost]
        for rec in sorted(mine, key=_by_sample_id):
            if rec.state in GENERATING:
                self._end(rec, FAILED, out)
            elif rec.state == TRAINING:
                rec.owner_lost = True
            else:
                self._end(rec, LOST, out)
        return out

    def abort(self, sample_ids: Iterable[int]) -> list[Release]:
        """Cancel samples in any live state; ids that already ended are skipped."""
        out: list[Release] = []
        for sid in sample_ids:
            rec = self._samples.get(sid)
            if rec is None:
                if self.knows(sid):
                    continue
                raise ValueError(f"abort: unknown sample {sid}")
            self._end(rec, ABORTED, out)
        return out

    def shutdown(self) -> list[Release]:
        """End of run: abort every live sample."""
        return self.abort(sorted(self._samples))

    # ------------------------------------------------------------------------------------------
    # Inbound events: trainer side
    # ------------------------------------------------------------------------------------------

    def compose_batch(self, *, now: float = 0.0) -> Batch | None:
        """The next batch (σ rule, module docstring), or None — changing nothing — when not ready."""
        if not self.batch_ready():
            return None
        b = self.batch_size
        u = min(self._count[READY], b)
        r = b - u
        unused = self._take_oldest_ready(u)
        replay = self._take_replay(r) if r else []
        recs = unused + replay
        count, pools = self._count, self._pool_by_version
        for rec in recs:
            count[rec.state] -= 1
            pools[rec.min_version].pop(rec.sample_id, None)
            rec.state = TRAINING
        self._count[TRAINING] += len(recs)
        version = self._version
        # (list comprehensions: a batch is thousands of samples in the simulator, and tuple(generator) is slower)
        is_replay = tuple([rec.times_used > 0 for rec in recs])
        tokens = tuple([rec.loss_tokens for rec in recs])
        lam = r / b
        batch = Batch(
            step=self._step, version=version,
            sample_ids=tuple([rec.sample_id for rec in recs]),
            owners=tuple([rec.owner for rec in recs]),
            is_replay=is_replay,
            advantages=tuple([rec.advantage for rec in recs]),
            loss_weights=tuple(loss_weights(is_replay, tokens, self.tau, [rec.base_weight for rec in recs])),
            loss_tokens=tokens,
            staleness=tuple([version - rec.min_version for rec in recs]),
            rewards=tuple([rec.reward for rec in recs]),
            times_used=tuple([rec.times_used for rec in recs]),
            queue_s=tuple([now - rec.finished_at for rec in recs]),
            replay_fraction=lam,
            alpha=mixing_weight(lam, self.tau),
        )
        self._step += 1
        self._budget = self.b_max - self.outstanding     # the trainer starts a step: new dispatch window
        return batch

    def step_done(self, batch: Batch | Iterable[int]) -> list[Release]:
        """The step that trained on ``batch`` finished: reinsert or end each sample (module docstring).
        Samples that ended during the step (aborted, lost) are skipped."""
        ids = batch.sample_ids if isinstance(batch, Batch) else batch
        out: list[Release] = []
        for sid in ids:
            rec = self._samples.get(sid)
            if rec is None:
                if self.knows(sid):
                    continue
                raise ValueError(f"step_done: unknown sample {sid}")
            if rec.state != TRAINING:
                raise ValueError(f"step_done: sample {sid} is {rec.state}, not training")
            rec.times_used += 1
            if rec.owner_lost:
                self._end(rec, LOST, out)
            elif self.sigma == 0.0:
                self._end(rec, TRAINED, out)
            elif self._version - rec.min_version > self.delta:
                self._end(rec, EVICTED_STALE, out)
            elif not self.replay_filter.accept(rec):
                self._end(rec, FILTERED, out)
            else:
                rec.state = REPLAY
                self._count[TRAINING] -= 1
                self._count[REPLAY] += 1
                self._pool_by_version[rec.min_version][sid] = None
                self.sampler.add(rec)
        return out

    def bump_version(self) -> list[Release]:
        """The trainer's weights are now version v+1 (a step ended): evict pooled samples staler than δ."""
        self._version += 1
        out: list[Release] = []
        self._evict_stale(out)
        return out

    # ------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain JSON-able state; see :meth:`load_state_dict`."""
        ready_order = [sid for v in sorted(self._ready_by_version) for sid in self._ready_by_version[v]
                       if sid in self._samples and self._samples[sid].state == READY]
        replay_order = sorted(sid for sid, rec in self._samples.items() if rec.state == REPLAY)
        version, internal, gauss = self._rng.getstate()
        return {
            "format": STATE_FORMAT,
            "params": {"group_size": self.group_size, "batch_size": self.batch_size, "sigma": self.sigma,
                       "tau": self.tau, "delta": self.delta, "b_max": self.b_max,
                       "adv_eps": self.adv_eps, "adv_std_norm": self.adv_std_norm},
            "version": self._version,
            "step": self._step,
            "next_sample_id": self._next_sample_id,
            "next_group_id": self._next_group_id,
            "finish_seq": self._finish_seq,
            "created": self._created,
            "terminal": dict(self._terminal),
            "evicted_unused": self._evicted_unused,
            "budget": self._budget,
            "rng": [version, list(internal), gauss],
            "samples": [self._samples[sid].to_row() for sid in sorted(self._samples)],
            "groups": [[g.group_id, g.prompt_id, list(g.members), g.outstanding]
                       for g in sorted(self._groups.values(), key=lambda g: g.group_id)],
            "ready_order": ready_order,
            "replay_order": replay_order,
            "sampler": {"name": self.sampler.name, "state": self.sampler.state_dict()},
            "replay_filter": {"name": self.replay_filter.name},
        }

    @classmethod
    def from_state_dict(cls, state: dict, *, sampler: Sampler | None = None,
                        replay_filter: ReplayFilter | None = None, resume: bool = True) -> "ReplayIndex":
        """An index with the checkpoint's parameters and state.

        ``sampler`` / ``replay_filter`` default to fresh instances of the checkpoint's registered
        names with default settings; pass configured ones when they take parameters.
        """
        _check_format(state)
        if sampler is None:
            sampler = make_sampler(state["sampler"]["name"])
        if replay_filter is None:
            replay_filter = make_replay_filter(state["replay_filter"]["name"])
        index = cls(**state["params"], sampler=sampler, replay_filter=replay_filter)
        index.load_state_dict(state, resume=resume)
        return index

    def load_state_dict(self, state: dict, *, resume: bool = True, keep: Iterable[int] = ()) -> list[Release]:
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
        _check_format(state)
        if self._created or self._next_sample_id:
            raise ValueError("load_state_dict: the index already holds samples; load into a fresh index")
        self._version, self._step = state["version"], state["step"]
        self._next_sample_id, self._next_group_id = state["next_sample_id"], state["next_group_id"]
        self._finish_seq, self._created = state["finish_seq"], state["created"]
        self._terminal.update(state["terminal"])
        self._evicted_unused = state.get("evicted_unused", 0)      # absent in checkpoints before it was counted
        rng_version, internal, gauss = state["rng"]
        self._rng.setstate((rng_version, tuple(internal), gauss))
        for row in state["samples"]:
            rec = SampleRecord.from_row(list(row))
            self._samples[rec.sample_id] = rec
            self._count[rec.state] += 1
            if rec.state in POOLED:
                self._pool_by_version[rec.min_version][rec.sample_id] = None
        for gid, prompt_id, members, outstanding in state["groups"]:
            self._groups[gid] = _GroupState(gid, prompt_id, tuple(members), outstanding)
        for sid in state["ready_order"]:
            self._ready_by_version.setdefault(self._samples[sid].min_version, deque()).append(sid)
        replay = [self._samples[sid] for sid in state["replay_order"]]
        saved = state["sampler"]
        self.sampler.load_state_dict(saved["state"] if saved["name"] == self.sampler.name else None, replay)
        self._budget = max(0, min(state["budget"], self.b_max - self.outstanding))   # b_max may have changed
        out: list[Release] = []
        self._evict_stale(out)                      # δ may have shrunk since the checkpoint
        if resume:
            self._resume(out, set(keep))
        self._recover_open = True
        return out

    def _resume(self, out: list[Release], keep: set[int]) -> None:
        training = sorted((rec for rec in self._samples.values() if rec.state == TRAINING),
                          key=lambda rec: (rec.min_version, rec.finish_seq, rec.sample_id), reverse=True)
        for rec in training:
            if self._version - rec.min_version > self.delta:
                self._end(rec, EVICTED_STALE, out)
                continue
            self._count[TRAINING] -= 1
            rec.owner_lost = False
            if rec.times_used > 0:
                rec.state = REPLAY
                self._count[REPLAY] += 1
                self._pool_by_version[rec.min_version][rec.sample_id] = None
                self.sampler.add(rec)
            else:
                rec.state = READY
                self._count[READY] += 1
                self._pool_by_version[rec.min_version][rec.sample_id] = None
                self._ready_by_version.setdefault(rec.min_version, deque()).appendleft(rec.sample_id)
        in_flight = sorted(sid for sid, rec in self._samples.items() if rec.state in GENERATING)
        out.extend(self.abort(sid for sid in in_flight if sid not in keep))
        for sid in in_flight:
            if sid in keep:                                  # its worker's process is gone: reassigned later
                self.reassign(sid, -1)
        self._budget = max(0, self.b_max - self.outstanding)

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
        items = sorted(samples, key=lambda s: (s.group_id, s.sample_id))
        seen: set[int] = set()
        for s in items:
            if s.sample_id < self._next_sample_id or s.sample_id in seen:
                raise ValueError(f"recover: sample {s.sample_id} is already known to the index "
                                 f"(ids below {self._next_sample_id} were created by it)")
            if s.group_id < self._next_group_id:
                raise ValueError(f"recover: group {s.group_id} of sample {s.sample_id} is already known to "
                                 f"the index (group ids below {self._next_group_id} were created by it)")
            seen.add(s.sample_id)
            self._check_finished_fields(s.sample_id, s.reward, s.min_version, s.max_version, s.loss_tokens,
                                        s.base_weight, max_allowed_version=None)
        out: list[Release] = []
        groups: dict[int, list[SampleRecord]] = {}
        for s in items:
            rec = SampleRecord(int(s.sample_id), int(s.group_id), int(s.prompt_id), FINISHED, -1, int(s.owner),
                               float(s.reward), int(s.min_version), int(s.max_version), int(s.loss_tokens),
                               float(s.base_weight),
                               location=s.location, created_at=now, finished_at=now,
                               finish_seq=self._finish_seq)
            self._finish_seq += 1
            self._samples[rec.sample_id] = rec
            self._count[FINISHED] += 1
            self._created += 1
            groups.setdefault(rec.group_id, []).append(rec)
            if rec.min_version < self._version - self.delta or rec.max_version > self._version:
                self._end(rec, EVICTED_STALE, out)
            else:
                self._pool_by_version[rec.min_version][rec.sample_id] = None
        for gid, recs in groups.items():
            group = _GroupState(gid, recs[0].prompt_id, tuple(r.sample_id for r in recs), 0)
            self._groups[gid] = group
            self._complete_group(group)
        if items:
            self._next_sample_id = max(s.sample_id for s in items) + 1
            self._next_group_id = max(self._next_group_id, max(s.group_id for s in items) + 1)
        return out

    # ------------------------------------------------------------------------------------------
    # Checks (tests and debugging)
    # ------------------------------------------------------------------------------------------

    def check_accounting(self) -> None:
        """created == live + Σ terminal (O(1))."""
        live = sum(self._count.values())
        ended = sum(self._terminal.values())
        if self._created != live + ended or live != len(self._samples):
            raise AssertionError(f"accounting: created {self._created} != live {live} "
                                 f"({len(self._samples)} records) + ended {ended} {self._terminal}")
        if not 0 <= self._evicted_unused <= self._terminal[EVICTED_STALE]:
            raise AssertionError(f"accounting: evicted_unused {self._evicted_unused} outside "
                                 f"[0, evicted_stale {self._terminal[EVICTED_STALE]}]")

    def check_invariants(self) -> None:
        """Every structural invariant, by a full scan; raises AssertionError naming the first broken."""
        self.check_accounting()

        def fail(msg: str) -> None:
            raise AssertionError(msg)

        counts = dict.fromkeys(LIVE_STATES, 0)
        v, delta = self._version, self.delta
        for sid, rec in self._samples.items():
            counts[rec.state] += 1
            if rec.sample_id != sid or not 0 <= sid < self._next_sample_id:
                fail(f"sample {sid}: bad id")
            pooled = rec.state in POOLED
            in_bucket = sid in self._pool_by_version.get(rec.min_version, ())
            if pooled != in_bucket:
                fail(f"sample {sid} ({rec.state}): version bucket membership {in_bucket}")
            if pooled and v - rec.min_version > delta:
                fail(f"sample {sid} ({rec.state}): staleness {v - rec.min_version} > δ = {delta}")
            if rec.state not in GENERATING and not 0 <= rec.min_version <= rec.max_version:
                fail(f"sample {sid}: versions {rec.min_version}..{rec.max_version}")
            if rec.state in (PENDING, FINISHED) and rec.group_id not in self._groups:
                fail(f"sample {sid} ({rec.state}): its group {rec.group_id} is not open")
            if rec.state in (READY, TRAINING, REPLAY) and rec.group_id in self._groups:
                fail(f"sample {sid} ({rec.state}): its group {rec.group_id} is still open")
            if (rec.state == READY) == rec.is_replay and rec.state in (READY, REPLAY):
                fail(f"sample {sid}: state {rec.state} with times_used {rec.times_used}")
        if counts != self._count:
            fail(f"state counts {self._count} != scanned {counts}")
        for ver, bucket in self._pool_by_version.items():
            for sid in bucket:
                if sid not in self._samples:
                    fail(f"version bucket {ver} holds ended sample {sid}")
        ready_in_queue = [sid for dq in self._ready_by_version.values() for sid in dq
                          if sid in self._samples and self._samples[sid].state == READY]
        if len(ready_in_queue) != len(set(ready_in_queue)) or len(ready_in_queue) != self._count[READY]:
            fail(f"ready queues hold {len(ready_in_queue)} ready entries, {self._count[READY]} ready samples")
        for ver, dq in self._ready_by_version.items():
            for sid in dq:
                rec = self._samples.get(sid)
                if rec is not None and rec.state == READY and rec.min_version != ver:
                    fail(f"ready sample {sid} queued under version {ver}, min version {rec.min_version}")
        for gid, group in self._groups.items():
            outstanding = sum(1 for m in group.members
                              if m in self._samples and self._samples[m].state in GENERATING)
            if outstanding != group.outstanding or outstanding == 0:
                fail(f"group {gid}: outstanding {group.outstanding}, scanned {outstanding}")
        if self.sampler.available() > self._count[REPLAY]:
            fail(f"sampler offers {self.sampler.available()} samples, replay pool has {self._count[REPLAY]}")
        if self.outstanding > self.b_max:
            fail(f"outstanding {self.outstanding} > b_max {self.b_max}")
        if not 0 <= self._budget <= self.b_max - self.outstanding:
            fail(f"dispatch budget {self._budget} outside [0, b_max - outstanding = {self.b_max - self.outstanding}]")

    # ------------------------------------------------------------------------------------------
    # Internals
    # ------------------------------------------------------------------------------------------

    def _live(self, sample_id: int, allowed: Iterable[str], op: str) -> SampleRecord:
        rec = self._samples.get(sample_id)
        if rec is None:
            raise ValueError(f"{op}: sample {sample_id} is not live ({self._fate(sample_id)})")
        if rec.state not in allowed:
            raise ValueError(f"{op}: sample {sample_id} is {rec.state}; expected one of {', '.join(sorted(allowed))}")
        return rec

    def _fate(self, sample_id: int) -> str:
        return "it already ended" if self.knows(sample_id) else "unknown id"

    @staticmethod
    def _check_finished_fields(sid: int, reward: float, min_version: int, max_version: int, loss_tokens: int,
                               base_weight: float, *, max_allowed_version: int | None) -> None:
        if not (isinstance(reward, numbers.Real) and math.isfinite(reward)):
            raise ValueError(f"sample {sid}: reward {reward!r} is not a finite number")
        if not 0 <= min_version <= max_version:
            raise ValueError(f"sample {sid}: token versions {min_version}..{max_version} must satisfy 0 ≤ min ≤ max")
        if max_allowed_version is not None and max_version > max_allowed_version:
            raise ValueError(f"sample {sid}: max token version {max_version} is newer than the published "
                             f"version {max_allowed_version}")
        if not (isinstance(loss_tokens, numbers.Integral) and loss_tokens >= 0):
            raise ValueError(f"sample {sid}: loss_tokens {loss_tokens!r} must be an integer ≥ 0")
        if not (isinstance(base_weight, numbers.Real) and math.isfinite(base_weight) and base_weight >= 0.0):
            raise ValueError(f"sample {sid}: base_weight {base_weight!r} must be a finite number ≥ 0")

    def _end(self, rec: SampleRecord, reason: str, out: list[Release]) -> None:
        """Move a live sample to a terminal state (exactly once: the record leaves the index)."""
        state, sid = rec.state, rec.sample_id
        self._count[state] -= 1
        if state in POOLED:
            self._pool_by_version[rec.min_version].pop(sid, None)
        if state == REPLAY:
            self.sampler.remove(sid)
        generating = state in GENERATING
        rank = rec.worker if generating else rec.owner
        del self._samples[sid]
        self._terminal[reason] += 1
        if reason == EVICTED_STALE and rec.times_used == 0:
            self._evicted_unused += 1
        out.append(Release(sid, rank, reason, not generating))
        if generating:
            group = self._groups[rec.group_id]
            group.outstanding -= 1
            if group.outstanding == 0:
                self._complete_group(group)

    def _complete_group(self, group: _GroupState) -> None:
        """Every member finished or ended: finished members become ready with group advantages."""
        del self._groups[group.group_id]
        samples = self._samples
        members = [samples[m] for m in group.members if m in samples and samples[m].state == FINISHED]
        if not members:
            return
        members.sort(key=_by_finish_seq)
        advantages = group_advantages([m.reward for m in members], eps=self.adv_eps, std_norm=self.adv_std_norm)
        queues = self._ready_by_version
        for rec, adv in zip(members, advantages):
            rec.advantage = adv
            rec.state = READY
            q = queues.get(rec.min_version)
            if q is None:
                queues[rec.min_version] = q = deque()
            q.append(rec.sample_id)
        self._count[FINISHED] -= len(members)
        self._count[READY] += len(members)

    def _evict_stale(self, out: list[Release]) -> None:
        """End every pooled sample with min version < v - δ. After a bump that is one bucket: the
        pool never holds a staler one, since every way into it checks δ."""
        cutoff = self._version - self.delta
        for ver in sorted(v for v in self._pool_by_version if v < cutoff):
            self._ready_by_version.pop(ver, None)
            for sid in sorted(self._pool_by_version.pop(ver)):   # canonical order: restored indexes evict alike
                self._end(self._samples[sid], EVICTED_STALE, out)
        for ver in [v for v in self._ready_by_version if v < cutoff]:
            del self._ready_by_version[ver]

    def _take_oldest_ready(self, u: int) -> list[SampleRecord]:
        taken: list[SampleRecord] = []
        samples, queues = self._samples, self._ready_by_version
        for ver in sorted(queues):       # at most δ + 1 versions
            q = queues[ver]
            while q and len(taken) < u:
                rec = samples.get(q.popleft())
                if rec is not None and rec.state == READY:
                    taken.append(rec)
            if not q:
                del queues[ver]
            if len(taken) == u:
                break
        if len(taken) != u:
            raise AssertionError(f"ready queues yielded {len(taken)} of {u} ready samples")
        return taken

    def _take_replay(self, r: int) -> list[SampleRecord]:
        picked = self.sampler.pick(r, self._rng)
        recs = [self._samples.get(sid) for sid in picked]
        if len(picked) != r or len(set(picked)) != r or [rec for rec in recs if rec is None or rec.state != REPLAY]:
            raise RuntimeError(f'replay sampler "{self.sampler.name}" returned {picked[:8]} for {r} slots: '
                               f"expected {r} distinct ids of samples in the replay state")
        for sid in picked:
            self.sampler.remove(sid)
        return recs


_NUMBERS = (float, int)


def _by_finish_seq(rec: SampleRecord) -> int:
    return rec.finish_seq


def _by_sample_id(rec: SampleRecord) -> int:
    return rec.sample_id


def _require(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"replay index: {name} = {value!r}: {why}")


def _check_format(state: dict) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"replay index state: format {found!r}, expected {STATE_FORMAT}")


# ----------------------------------------------------------------------------------------------
# Construction from the config
# ----------------------------------------------------------------------------------------------

def build_index(reflow: Any, *, group_size: int, batch_size: int, seed: int, adv_eps: float = 1e-6,
                adv_std_norm: bool = True) -> ReplayIndex:
    """The index, sampler and replay filter that a ``[reflow]`` config section describes.

    ``reflow`` is read by attribute (mode, sigma, tau, delta, b_max, sampler, replay_filter,
    reward_low, reward_high). ``b_max = 0`` means ``batch_size``. The settings are checked against
    the mode's rules (:func:`reflow_hpc.core.modes.check`): a baseline given σ > 0 is refused, not
    run with σ = 0.
    """
    b_max = reflow.b_max or batch_size
    check(reflow.mode, sigma=reflow.sigma, delta=reflow.delta, b_max=b_max, batch_size=batch_size,
          sync_every=reflow.sync_every)
    return ReplayIndex(
        group_size=group_size, batch_size=batch_size, sigma=reflow.sigma, tau=reflow.tau, delta=reflow.delta,
        b_max=b_max,
        sampler=make_sampler(reflow.sampler, reflow),
        replay_filter=make_replay_filter(reflow.replay_filter, reflow),
        seed=seed, adv_eps=adv_eps, adv_std_norm=adv_std_norm,
    )
