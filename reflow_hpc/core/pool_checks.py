"""Full-scan checks of the pool's structures (tests, the simulator's checked mode, debugging).

Each raises AssertionError naming the first broken invariant. They cost O(live samples), so no event
calls them; :meth:`~reflow_hpc.core.index.ReplayIndex.check_invariants` runs them all.
"""

from __future__ import annotations

from reflow_hpc.core.pool import Pool
from reflow_hpc.core.sample import FINISHED, GENERATING, LIVE_STATES, PENDING, POOLED, READY, REPLAY, TRAINING
from reflow_hpc.core.samplers import Sampler


def check_pool(pool: Pool, sampler: Sampler) -> None:
    """Records, state counts, version buckets, ready queues, open groups and the sampler agree."""
    check_records(pool)
    check_queues(pool)
    if sampler.available() > pool.count[REPLAY]:
        _fail(f"sampler offers {sampler.available()} samples, replay pool has {pool.count[REPLAY]}")


def check_records(pool: Pool) -> None:
    """Every live record against its state: counts, bucket membership, δ, versions, its group."""
    counts = dict.fromkeys(LIVE_STATES, 0)
    v, delta, groups = pool.version, pool.delta, pool.groups
    for sid, rec in pool.samples.items():
        counts[rec.state] += 1
        if rec.sample_id != sid or not 0 <= sid < pool.next_sample_id:
            _fail(f"sample {sid}: bad id")
        pooled = rec.state in POOLED
        in_bucket = sid in pool.by_version.get(rec.min_version, ())
        if pooled != in_bucket:
            _fail(f"sample {sid} ({rec.state}): version bucket membership {in_bucket}")
        if pooled and v - rec.min_version > delta:
            _fail(f"sample {sid} ({rec.state}): staleness {v - rec.min_version} > δ = {delta}")
        if rec.state not in GENERATING and not 0 <= rec.min_version <= rec.max_version:
            _fail(f"sample {sid}: versions {rec.min_version}..{rec.max_version}")
        if rec.state in (PENDING, FINISHED) and rec.group_id not in groups:
            _fail(f"sample {sid} ({rec.state}): its group {rec.group_id} is not open")
        if rec.state in (READY, TRAINING, REPLAY) and rec.group_id in groups:
            _fail(f"sample {sid} ({rec.state}): its group {rec.group_id} is still open")
        if (rec.state == READY) == rec.is_replay and rec.state in (READY, REPLAY):
            _fail(f"sample {sid}: state {rec.state} with times_used {rec.times_used}")
    if counts != pool.count:
        _fail(f"state counts {pool.count} != scanned {counts}")


def check_queues(pool: Pool) -> None:
    """Version buckets hold live samples only; each ready sample is queued once, under its min
    version; each open group counts its generating members."""
    samples = pool.samples
    for ver, bucket in pool.by_version.items():
        for sid in bucket:
            if sid not in samples:
                _fail(f"version bucket {ver} holds ended sample {sid}")
    ready_in_queue = [sid for dq in pool.ready_by_version.values() for sid in dq
                      if sid in samples and samples[sid].state == READY]
    if len(ready_in_queue) != len(set(ready_in_queue)) or len(ready_in_queue) != pool.count[READY]:
        _fail(f"ready queues hold {len(ready_in_queue)} ready entries, {pool.count[READY]} ready samples")
    for ver, dq in pool.ready_by_version.items():
        for sid in dq:
            rec = samples.get(sid)
            if rec is not None and rec.state == READY and rec.min_version != ver:
                _fail(f"ready sample {sid} queued under version {ver}, min version {rec.min_version}")
    for gid, group in pool.groups.items():
        outstanding = sum(1 for m in group.members if m in samples and samples[m].state in GENERATING)
        if outstanding != group.outstanding or outstanding == 0:
            _fail(f"group {gid}: outstanding {group.outstanding}, scanned {outstanding}")


def _fail(msg: str) -> None:
    raise AssertionError(msg)
