"""Checkpoints of the replay index: the saved state, a restart, and samples recovered from shards.

:func:`state_dict` is plain JSON-able data (RNG state, sampler state and the order of the ready queue
included); :func:`load_state_dict` rebuilds an index that behaves identically. The format is
``STATE_FORMAT`` 1; keys added since (``evicted_unused``, ``trained``, ``replayed``, ``fresh``: the
fresh-sample hooks' names and group counters, ``latest_groups``: each prompt's newest group for
recomputed replay advantages, and the ``uninformative`` terminal counter) are read with a fallback,
so checkpoints written before them load unchanged.

With ``resume=True`` (a restart) samples that were pending at checkpoint time end as ``aborted`` —
their generation state died with the old processes — which may complete their groups; samples that
were in ``training`` go back to where they came from (ready or replay), since a checkpoint taken
mid-step holds no finished step for them. Afterwards :func:`recover` takes, in one call and before any
new group, the finished samples found in shards that the checkpoint does not know (created after it):
each re-enters as ready with its recovered group, or is evicted if its versions fall outside
``[v-δ, v]``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from reflow_hpc.core.accounting import Accounting
from reflow_hpc.core.composition import Composer
from reflow_hpc.core.dispatch_window import DispatchWindow
from reflow_hpc.core.filters import ReplayFilter
from reflow_hpc.core.pool import OpenGroup, Pool, Release
from reflow_hpc.core.sample import (EVICTED_STALE, FILTERED, FINISHED, GENERATING, READY, REPLAY,
                                    TRAINED, TRAINING, SampleRecord, check_finished)
from reflow_hpc.core.samplers import Sampler

STATE_FORMAT = 1


@dataclass(frozen=True)
class IndexParts:
    """The parts of a replay index that its checkpoint code reads and writes (the index's own; the
    façade in :mod:`reflow_hpc.core.index` hands them over, so this module needs nothing of it)."""
    pool: Pool
    accounts: Accounting
    composer: Composer
    window: DispatchWindow
    sampler: Sampler
    replay_filter: ReplayFilter


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


def check_format(state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"replay index state: format {found!r}, expected {STATE_FORMAT}")


def state_dict(parts: IndexParts, params: Mapping[str, Any]) -> dict[str, Any]:
    """Plain JSON-able state of the index of ``parts``, built with ``params`` (the keyword arguments of
    :class:`~reflow_hpc.core.index.ReplayIndex` but its sampler, filter and seed); see :func:`load_state_dict`."""
    pool, acc, composer = parts.pool, parts.accounts, parts.composer
    samples, queues = pool.samples, pool.ready_by_version
    ready_order = [sid for v in sorted(queues) for sid in queues[v]
                   if sid in samples and samples[sid].state == READY]
    replay_order = sorted(sid for sid, rec in samples.items() if rec.state == REPLAY)
    version, internal, gauss = composer.rng.getstate()
    return {
        "format": STATE_FORMAT,
        "params": dict(params),
        "version": pool.version,
        "step": composer.step,
        "next_sample_id": pool.next_sample_id,
        "next_group_id": pool.next_group_id,
        "finish_seq": pool.finish_seq,
        "created": acc.created,
        "terminal": dict(acc.ended),
        "evicted_unused": acc.evicted_unused,
        "budget": parts.window.left,
        "rng": [version, list(internal), gauss],
        "samples": [samples[sid].to_row() for sid in sorted(samples)],
        "groups": [[g.group_id, g.prompt_id, list(g.members), g.outstanding]
                   for g in sorted(pool.groups.values(), key=lambda g: g.group_id)],
        "ready_order": ready_order,
        "replay_order": replay_order,
        "sampler": {"name": parts.sampler.name, "state": parts.sampler.state_dict()},
        "replay_filter": {"name": parts.replay_filter.name},
        "trained": acc.trained,
        "replayed": acc.replayed,
        "fresh": pool.gate.state_dict(),
        "latest_groups": pool.latest.state_dict() if pool.latest is not None else [],
    }


def load_state_dict(parts: IndexParts, state: dict[str, Any], *, resume: bool,
                    keep: Iterable[int]) -> list[Release]:
    """Load a checkpoint into the fresh index of ``parts`` (see :meth:`ReplayIndex.load_state_dict`)."""
    check_format(state)
    pool, acc, composer = parts.pool, parts.accounts, parts.composer
    if acc.created or pool.next_sample_id:
        raise ValueError("load_state_dict: the index already holds samples; load into a fresh index")
    pool.version, composer.step = state["version"], state["step"]
    pool.next_sample_id, pool.next_group_id = state["next_sample_id"], state["next_group_id"]
    pool.finish_seq, acc.created = state["finish_seq"], state["created"]
    acc.ended.update(state["terminal"])
    acc.evicted_unused = state.get("evicted_unused", 0)      # absent in checkpoints before it was counted
    rng_version, internal, gauss = state["rng"]
    composer.rng.setstate((rng_version, tuple(internal), gauss))
    for row in state["samples"]:
        pool.insert(SampleRecord.from_row(list(row)))
    for gid, prompt_id, members, outstanding in state["groups"]:
        pool.groups[gid] = OpenGroup(gid, prompt_id, tuple(members), outstanding)
    for sid in state["ready_order"]:
        pool.ready_by_version.setdefault(pool.samples[sid].min_version, deque()).append(sid)
    _load_training_counts(acc, state, pool.samples.values())
    replay = [pool.samples[sid] for sid in state["replay_order"]]
    saved = state["sampler"]
    parts.sampler.load_state_dict(saved["state"] if saved["name"] == parts.sampler.name else None, replay)
    parts.window.restore(state["budget"])                   # b_max may have changed
    pool.gate.load_state_dict(state.get("fresh"))
    if pool.latest is not None:
        pool.latest.load_state_dict(state.get("latest_groups"))
    out: list[Release] = []
    pool.evict_stale(out)                      # δ may have shrunk since the checkpoint
    if resume:
        _resume(parts, out, set(keep))
    return out


def _load_training_counts(acc: Accounting, state: dict[str, Any], live: Iterable[SampleRecord]) -> None:
    """``trained`` and ``replayed``; checkpoints from before they were counted give the lower bounds
    that their other counters prove (samples known to have ended after training, live uses)."""
    if "trained" in state:
        acc.trained, acc.replayed = state["trained"], state["replayed"]
        return
    used = [rec.times_used for rec in live if rec.times_used > 0]
    ended = acc.ended
    acc.trained = ended[TRAINED] + ended[FILTERED] + ended[EVICTED_STALE] - acc.evicted_unused + len(used)
    acc.replayed = sum(t - 1 for t in used)


def _resume(parts: IndexParts, out: list[Release], keep: set[int]) -> None:
    """The restart rules of the module docstring; ``keep``: pending samples whose partial responses
    the checkpoint saved, left pending with no worker until a driver reassigns them."""
    pool = parts.pool
    training = sorted((rec for rec in pool.samples.values() if rec.state == TRAINING),
                      key=lambda rec: (rec.min_version, rec.finish_seq, rec.sample_id), reverse=True)
    for rec in training:                       # newest first: each goes to the front of its queue
        if pool.version - rec.min_version > pool.delta:
            pool.end(rec, EVICTED_STALE, out)
        else:
            pool.untrain(rec)
    in_flight = sorted(sid for sid, rec in pool.samples.items() if rec.state in GENERATING)
    out.extend(pool.abort(sid for sid in in_flight if sid not in keep))
    for sid in in_flight:
        if sid in keep:                                  # its worker's process is gone: reassigned later
            pool.samples[sid].worker = -1
    parts.window.restore(parts.window.b_max)             # a fresh window beside the kept partials


def recover(parts: IndexParts, samples: Iterable[RecoveredSample], now: float) -> list[Release]:
    """Re-admit finished samples found in shards (see :meth:`ReplayIndex.recover`)."""
    pool = parts.pool
    items = sorted(samples, key=lambda s: (s.group_id, s.sample_id))
    _check_recovered(pool, items)
    out: list[Release] = []
    groups: dict[int, list[SampleRecord]] = {}
    for s in items:
        rec = SampleRecord(int(s.sample_id), int(s.group_id), int(s.prompt_id), FINISHED, -1, int(s.owner),
                           float(s.reward), int(s.min_version), int(s.max_version), int(s.loss_tokens),
                           float(s.base_weight), location=s.location, created_at=now, finished_at=now,
                           finish_seq=pool.finish_seq)
        pool.finish_seq += 1
        pool.samples[rec.sample_id] = rec
        pool.count[FINISHED] += 1
        parts.accounts.created += 1
        groups.setdefault(rec.group_id, []).append(rec)
        if rec.min_version < pool.version - pool.delta or rec.max_version > pool.version:
            pool.end(rec, EVICTED_STALE, out)
        else:
            pool.by_version[rec.min_version][rec.sample_id] = None
    for gid, recs in groups.items():
        group = OpenGroup(gid, recs[0].prompt_id, tuple(r.sample_id for r in recs), 0)
        pool.groups[gid] = group
        pool.complete_group(group, out)
    if items:
        pool.next_sample_id = max(s.sample_id for s in items) + 1
        pool.next_group_id = max(pool.next_group_id, max(s.group_id for s in items) + 1)
    return out


def _check_recovered(pool: Pool, items: list[RecoveredSample]) -> None:
    seen: set[int] = set()
    for s in items:
        if s.sample_id < pool.next_sample_id or s.sample_id in seen:
            raise ValueError(f"recover: sample {s.sample_id} is already known to the index "
                             f"(ids below {pool.next_sample_id} were created by it)")
        if s.group_id < pool.next_group_id:
            raise ValueError(f"recover: group {s.group_id} of sample {s.sample_id} is already known to "
                             f"the index (group ids below {pool.next_group_id} were created by it)")
        seen.add(s.sample_id)
        check_finished(s.sample_id, s.reward, s.min_version, s.max_version, s.loss_tokens, s.base_weight,
                       max_allowed_version=None)
