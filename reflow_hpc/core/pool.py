"""The pool: every live sample's record, by state, under the staleness bound δ.

A sample moves through the live states of :mod:`reflow_hpc.core.sample`::

    new_group ──> pending ──finished──> finished ──group complete──> ready
                                                                        │ compose_batch
      replay <──step_done, σ > 0, filter accepts, staleness ≤ δ── training <─┘
         └──────────────────────── compose_batch ────────────────────^

and leaves it exactly once, through :meth:`Pool.end`, with one terminal reason that
:mod:`reflow_hpc.core.accounting` counts. Every operation is O(1) per sample it touches: nothing
scans the resident samples except :meth:`Pool.worker_lost` (rare) and the checks.

Groups (GRPO, size n).
    :meth:`Pool.new_group` creates the n samples of one prompt. Finished samples become ``ready``
    together when the group is complete — every member finished or terminal — with advantages
    ``(r_i - mean r) / (std r + eps)`` over the finished members, in completion order
    (:mod:`reflow_hpc.core.advantages`). Replay samples keep the advantage they got then, unless
    ``algorithm.replay_advantage = "recompute"`` (:mod:`reflow_hpc.core.replay_advantage`). Then the
    fresh filter may drop members — they end as ``uninformative`` — and the sample-weight hook sets
    the kept members' ω (:mod:`reflow_hpc.core.fresh`).
δ (delta) — staleness bound.
    The staleness of a sample is ``v - min(token versions)``. At every version bump
    (:meth:`Pool.bump`) finished, ready and replay samples with staleness > δ end as
    ``evicted_stale`` — unused and replayed alike — and the bump returns them so that owners can drop
    the payloads. A sample that finishes already staler than δ is evicted on arrival. Samples in
    ``training`` are left alone during their step; when it ends they are reinserted only if still
    within δ. Hence no trainable sample is ever staler than δ.
After a step (:meth:`Pool.after_step`).
    Every sample of the batch gets ``times_used += 1`` and then, first matching rule wins: owner
    lost → ``lost``; σ = 0 → ``trained``; staleness > δ → ``evicted_stale``; the replay filter
    declines (:mod:`reflow_hpc.core.filters`) → ``filtered``; else → ``replay``, and the sampler is
    told (:mod:`reflow_hpc.core.samplers`).

Two indexes keep eviction and composition free of scans: pooled (finished, ready, replay) samples
bucketed by min version — a bump ends whole buckets — and, per min version, a queue of unused ready
samples in completion order, from which a batch takes the oldest first.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Sequence

from reflow_hpc.core.accounting import Accounting
from reflow_hpc.core.advantages import group_advantages
from reflow_hpc.core.filters import ReplayFilter
from reflow_hpc.core.fresh import GroupGate
from reflow_hpc.core.replay_advantage import LatestGroups
from reflow_hpc.core.sample import (ABORTED, EVICTED_STALE, FAILED, FILTERED, FINISHED, GENERATING, LIVE_STATES,
                                    LOST, PENDING, POOLED, READY, REPLAY, TRAINED, TRAINING, UNINFORMATIVE,
                                    SampleRecord, check_finished)
from reflow_hpc.core.samplers import Sampler

_NUMBERS = (float, int)


class Release(NamedTuple):
    """A sample ended: ``rank`` may drop its payload (``has_payload``) or stop generating it."""
    sample_id: int
    rank: int            # owner of the payload, or the worker generating it; -1 when unknown
    reason: str          # one of TERMINAL_REASONS
    has_payload: bool


@dataclass(frozen=True)
class Group:
    """The samples created by one ``new_group`` (one prompt, n samples)."""
    group_id: int
    prompt_id: int
    sample_ids: tuple[int, ...]


class OpenGroup:
    """An incomplete group: members still to finish or end. Dropped once complete."""
    __slots__ = ("group_id", "prompt_id", "members", "outstanding")

    def __init__(self, group_id: int, prompt_id: int, members: tuple[int, ...], outstanding: int):
        self.group_id, self.prompt_id, self.members, self.outstanding = group_id, prompt_id, members, outstanding


class Pool:
    """Live sample records, their states, groups and the δ rule (module docstring).

    ``sampler`` mirrors the replay state (told on every entry and exit); ``accounts`` counts every
    creation, end and training use; ``gate`` applies the fresh-sample hooks to completed groups and
    ``latest`` (None unless replayed advantages are recomputed) keeps each prompt's newest group.
    """

    def __init__(self, *, delta: int, sampler: Sampler, accounts: Accounting, adv_eps: float = 1e-6,
                 adv_std_norm: bool = True, adv_estimator: str = "group_norm", gate: GroupGate | None = None,
                 latest: LatestGroups | None = None):
        self.delta = delta
        self.gate = gate if gate is not None else GroupGate()
        self.latest = latest
        self.adv_eps, self.adv_std_norm, self.adv_estimator = adv_eps, adv_std_norm, adv_estimator
        self.sampler, self.accounts = sampler, accounts
        self._ended = accounts.ended    # the accounting's own counters, bumped at every end
        self.samples: dict[int, SampleRecord] = {}
        self.groups: dict[int, OpenGroup] = {}
        self.count = dict.fromkeys(LIVE_STATES, 0)
        # Pooled samples by min version; the values are dicts used as insertion-ordered sets, in a
        # defaultdict so that adding and discarding are one call each (a bucket emptied by a discard
        # stays until its version is evicted).
        self.by_version: defaultdict[int, dict[int, None]] = defaultdict(dict)
        # Unused ready samples per min version in completion order; entries of samples that left
        # `ready` another way than a batch (abort, lost) are skipped when reached.
        self.ready_by_version: dict[int, deque[int]] = {}
        self.version = 0
        self.next_sample_id = 0
        self.next_group_id = 0
        self.finish_seq = 0

    # -- lookups ---------------------------------------------------------------------------------

    def knows(self, sample_id: int) -> bool:
        """True when the id was created here (live or ended)."""
        return 0 <= sample_id < self.next_sample_id

    def fate(self, sample_id: int) -> str:
        return "it already ended" if self.knows(sample_id) else "unknown id"

    def live(self, sample_id: int, allowed: Iterable[str], op: str) -> SampleRecord:
        """The record of a live sample in one of the ``allowed`` states; ValueError naming ``op`` otherwise."""
        rec = self.samples.get(sample_id)
        if rec is None:
            raise ValueError(f"{op}: sample {sample_id} is not live ({self.fate(sample_id)})")
        if rec.state not in allowed:
            raise ValueError(f"{op}: sample {sample_id} is {rec.state}; expected one of {', '.join(sorted(allowed))}")
        return rec

    # -- rollout side ----------------------------------------------------------------------------

    def new_group(self, prompt_id: int, workers: Sequence[int], now: float) -> Group:
        """Create one group's samples in ``pending``, one per entry of ``workers``."""
        n = len(workers)
        first = self.next_sample_id
        ids = tuple(range(first, first + n))
        gid = self.next_group_id
        self.next_sample_id += n
        self.next_group_id += 1
        samples = self.samples
        for sid, w in zip(ids, workers):
            samples[sid] = SampleRecord(sid, gid, prompt_id, PENDING, w, created_at=now)
        self.groups[gid] = OpenGroup(gid, prompt_id, ids, n)
        self.count[PENDING] += n
        self.accounts.created += n
        return Group(gid, prompt_id, ids)

    def finished(self, sample_id: int, *, owner: int, reward: float, min_version: int, max_version: int,
                 loss_tokens: int, now: float = 0.0, location: Any = None, base_weight: float = 1.0) -> list[Release]:
        """Generation ended; ``owner`` holds the payload. Returns its release when already staler than δ."""
        rec = self.samples.get(sample_id)
        if rec is None or rec.state not in GENERATING:
            rec = self.live(sample_id, GENERATING, "finished")        # raises
        version, count = self.version, self.count
        # Fast path of the field checks (x - x == 0 rejects inf and nan); the full check names the fault.
        if not (0 <= min_version <= max_version <= version and type(loss_tokens) is int and loss_tokens >= 0
                and type(reward) in _NUMBERS and reward - reward == 0
                and type(base_weight) in _NUMBERS and base_weight >= 0 and base_weight - base_weight == 0):
            check_finished(sample_id, reward, min_version, max_version, loss_tokens, base_weight,
                           max_allowed_version=version)
        count[rec.state] -= 1
        rec.state = FINISHED
        count[FINISHED] += 1
        # Plain Python numbers: the record must stay JSON-able when a driver passes numpy scalars.
        rec.owner, rec.reward, rec.location = int(owner), float(reward), location
        rec.min_version, rec.max_version = int(min_version), int(max_version)
        rec.loss_tokens, rec.base_weight, rec.finished_at = int(loss_tokens), float(base_weight), now
        rec.finish_seq = self.finish_seq
        self.finish_seq += 1
        out: list[Release] = []
        if version - min_version > self.delta:
            self.end(rec, EVICTED_STALE, out)
        else:
            self.by_version[rec.min_version][sample_id] = None
        group = self.groups[rec.group_id]
        group.outstanding -= 1
        if group.outstanding == 0:
            self.complete_group(group, out)
        return out

    def end_live(self, sample_id: int, allowed: Iterable[str], reason: str, op: str) -> list[Release]:
        """End one live sample in an ``allowed`` state (failed, lost)."""
        out: list[Release] = []
        self.end(self.live(sample_id, allowed, op), reason, out)
        return out

    def abort(self, sample_ids: Iterable[int]) -> list[Release]:
        """End samples in any live state as ``aborted``; ids that already ended are skipped."""
        out: list[Release] = []
        for sid in sample_ids:
            rec = self.samples.get(sid)
            if rec is None:
                if self.knows(sid):
                    continue
                raise ValueError(f"abort: unknown sample {sid}")
            self.end(rec, ABORTED, out)
        return out

    def worker_lost(self, rank: int) -> list[Release]:
        """What ``rank`` generated ends as ``failed``, what it holds as ``lost``; samples it owns that
        are in a batch are marked and end as ``lost`` when their step is done. A scan: a rank is lost
        rarely, while a per-rank set would be kept up to date four times per sample."""
        out: list[Release] = []
        if rank < 0:
            return out                                    # -1 is "not known", never a rank
        mine = [rec for rec in self.samples.values()
                if (rec.worker if rec.state in GENERATING else rec.owner) == rank and not rec.owner_lost]
        for rec in sorted(mine, key=_by_sample_id):
            if rec.sample_id not in self.samples:
                continue                                  # ended meanwhile: a failure completed its group, and
            if rec.state in GENERATING:                   # the fresh filter dropped it
                self.end(rec, FAILED, out)
            elif rec.state == TRAINING:
                rec.owner_lost = True
            else:
                self.end(rec, LOST, out)
        return out

    # -- trainer side ----------------------------------------------------------------------------

    def take_ready(self, u: int) -> list[SampleRecord]:
        """The ``u`` oldest unused ready samples: lowest min version, then completion order."""
        taken: list[SampleRecord] = []
        samples, queues = self.samples, self.ready_by_version
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

    def start_training(self, recs: list[SampleRecord]) -> None:
        """Ready and replay samples picked into a batch leave the pool for their step."""
        count, pools = self.count, self.by_version
        for rec in recs:
            count[rec.state] -= 1
            pools[rec.min_version].pop(rec.sample_id, None)
            rec.state = TRAINING
        count[TRAINING] += len(recs)

    def after_step(self, ids: Iterable[int], replay_filter: ReplayFilter | None) -> list[Release]:
        """The step that trained on ``ids`` is done (module docstring); ``replay_filter`` is None when
        replay is disabled (σ = 0). Samples that ended during the step (aborted, lost) are skipped."""
        out: list[Release] = []
        samples, count, by_version, add = self.samples, self.count, self.by_version, self.sampler.add
        version, delta, end = self.version, self.delta, self.end
        accept = replay_filter.accept if replay_filter is not None else None
        first = used = 0
        try:
            for sid in ids:
                rec = samples.get(sid)
                if rec is None:
                    if self.knows(sid):
                        continue
                    raise ValueError(f"step_done: unknown sample {sid}")
                if rec.state != TRAINING:
                    raise ValueError(f"step_done: sample {sid} is {rec.state}, not training")
                times = rec.times_used = rec.times_used + 1
                used += 1
                if times == 1:
                    first += 1
                if rec.owner_lost:
                    end(rec, LOST, out)
                elif accept is None:
                    end(rec, TRAINED, out)
                elif version - rec.min_version > delta:
                    end(rec, EVICTED_STALE, out)
                elif not accept(rec):
                    end(rec, FILTERED, out)
                else:
                    rec.state = REPLAY
                    count[TRAINING] -= 1
                    count[REPLAY] += 1
                    by_version[rec.min_version][sid] = None
                    add(rec)
        finally:                           # counted even when a bad id stops the loop half-way
            self.accounts.trained += first
            self.accounts.replayed += used - first
        return out

    def bump(self) -> list[Release]:
        """The trainer's weights are now version v+1: evict pooled samples staler than δ."""
        self.version += 1
        out: list[Release] = []
        self.evict_stale(out)
        if self.latest is not None:
            self.latest.prune(self.samples.values())
        return out

    # -- transitions -----------------------------------------------------------------------------

    def end(self, rec: SampleRecord, reason: str, out: list[Release]) -> None:
        """Move a live sample to a terminal state (exactly once: the record leaves the pool)."""
        state, sid = rec.state, rec.sample_id
        self.count[state] -= 1
        if state in POOLED:
            self.by_version[rec.min_version].pop(sid, None)
        if state == REPLAY:
            self.sampler.remove(sid)
        generating = state in GENERATING
        rank = rec.worker if generating else rec.owner
        del self.samples[sid]
        self._ended[reason] += 1
        if reason == EVICTED_STALE and rec.times_used == 0:
            self.accounts.evicted_unused += 1
        out.append(Release(sid, rank, reason, not generating))
        if generating:
            group = self.groups[rec.group_id]
            group.outstanding -= 1
            if group.outstanding == 0:
                self.complete_group(group, out)

    def complete_group(self, group: OpenGroup, out: list[Release]) -> None:
        """Every member finished or ended: finished members get group advantages, then those the fresh
        filter keeps become ready and the others end as ``uninformative`` (into ``out``)."""
        del self.groups[group.group_id]
        samples = self.samples
        members = [samples[m] for m in group.members if m in samples and samples[m].state == FINISHED]
        if not members:
            return
        members.sort(key=_by_finish_seq)
        advantages = group_advantages([m.reward for m in members], eps=self.adv_eps, std_norm=self.adv_std_norm,
                                      estimator=self.adv_estimator)
        for rec, adv in zip(members, advantages):
            rec.advantage = adv
        if self.latest is not None:
            self.latest.record(group.prompt_id, group.group_id, members)
        declined = self.gate.admit(members)
        if declined:
            for rec in declined:
                self.end(rec, UNINFORMATIVE, out)
            members = [rec for rec in members if rec.sample_id in samples]
        queues = self.ready_by_version
        for rec in members:
            rec.state = READY
            q = queues.get(rec.min_version)
            if q is None:
                queues[rec.min_version] = q = deque()
            q.append(rec.sample_id)
        self.count[FINISHED] -= len(members)
        self.count[READY] += len(members)

    def evict_stale(self, out: list[Release]) -> None:
        """End every pooled sample with min version < v - δ. After a bump that is one bucket: the
        pool never holds a staler one, since every way into it checks δ."""
        cutoff = self.version - self.delta
        for ver in sorted(v for v in self.by_version if v < cutoff):
            self.ready_by_version.pop(ver, None)
            for sid in sorted(self.by_version.pop(ver)):   # canonical order: restored pools evict alike
                self.end(self.samples[sid], EVICTED_STALE, out)
        for ver in [v for v in self.ready_by_version if v < cutoff]:
            del self.ready_by_version[ver]

    def insert(self, rec: SampleRecord) -> None:
        """Place a record as it is (a checkpoint row, a recovered sample): live, counted, bucketed."""
        self.samples[rec.sample_id] = rec
        self.count[rec.state] += 1
        if rec.state in POOLED:
            self.by_version[rec.min_version][rec.sample_id] = None

    def untrain(self, rec: SampleRecord) -> None:
        """A sample whose step never ended (a restart) returns: to the front of its ready queue when
        unused, to the replay pool when already trained on."""
        self.count[TRAINING] -= 1
        rec.owner_lost = False
        rec.state = REPLAY if rec.times_used > 0 else READY
        self.count[rec.state] += 1
        self.by_version[rec.min_version][rec.sample_id] = None
        if rec.state == REPLAY:
            self.sampler.add(rec)
        else:
            self.ready_by_version.setdefault(rec.min_version, deque()).appendleft(rec.sample_id)


def _by_finish_seq(rec: SampleRecord) -> int:
    return rec.finish_seq


def _by_sample_id(rec: SampleRecord) -> int:
    return rec.sample_id
