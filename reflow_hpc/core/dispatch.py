"""Dispatch: which rollout worker generates which sample, and how generation ends.

Samples are dispatched as whole groups, under the ``b_max`` window of the replay index and each
worker's concurrency cap, to the worker the token-aware admission of the generation scheduler
(:mod:`reflow_hpc.core.scheduling`) prefers. The dispatcher counts what each worker has in flight,
passes finished and failed samples to the index, turns the samples the index ends into commands for
the workers that hold them (:class:`~reflow_hpc.core.commands.Drop` a payload,
:class:`~reflow_hpc.core.commands.Cancel` a generation), and lets the scheduler's slow controller set
each worker's concurrency cap from its engine's load.

Held samples — in flight on a worker that left rollout at a role switch, or saved in the checkpoint a
run resumed from — are re-dispatched by one rule (:meth:`Dispatcher.redispatch`): each sample alone,
to the worker the scheduler prefers for one sample (the least loaded one when none has room), so that
a hand-off of a full engine spreads over the remaining workers. A group's samples may then finish on
different workers; nothing depends on where (advantages are computed on rank 0).
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Callable, Iterable

from .commands import Cancel, Dispatch, DispatchedSample, Drop, Resume, SetCap, dispatched_samples
from .events import FinishedSample
from .index import Release, ReplayIndex
from .sample import GENERATING
from .scheduling import EngineLoad, GenerationScheduler

Log = Callable[..., None]


class Dispatcher:
    def __init__(self, workers: list[int], generation: GenerationScheduler):
        self.generation = generation
        self.outstanding = {w: 0 for w in workers}     # dispatched to w and not finished
        self.generating: dict[int, int] = {}            # sample id -> worker
        self.next_prompt = 0
        self.finish_reasons: dict[str, int] = {}       # finished samples by how generation ended

    def restore(self, next_prompt: int, finish_reasons: dict[str, int]) -> None:
        self.next_prompt, self.finish_reasons = next_prompt, dict(finish_reasons)

    def caps(self, rollouts: list[int]) -> dict[int, int]:
        return {w: self.generation.caps.get(w, self.generation.cap_max) for w in rollouts}

    # -- new and held samples --------------------------------------------------------------------

    def dispatch(self, index: ReplayIndex, rollouts: list[int], now: float, log: Log | None) -> list[Dispatch]:
        """New groups while the window and the workers allow."""
        n = index.group_size
        per_worker: dict[int, list[DispatchedSample]] = {}
        outstanding, choose = self.outstanding, self.generation.choose
        while index.can_dispatch_group():
            worker = choose(outstanding, n, rollouts)
            if worker is None:
                break
            group = index.new_group(self.next_prompt, now=now, worker=worker)
            if log is not None:
                log(now, "dispatch", w=worker, group=group.group_id, prompt=group.prompt_id,
                    ids=list(group.sample_ids))
            self.next_prompt += 1
            outstanding[worker] += n
            self.generating.update(zip(group.sample_ids, repeat(worker)))
            per_worker.setdefault(worker, []).extend(dispatched_samples(group.sample_ids, group.group_id,
                                                                        group.prompt_id))
        return [Dispatch(w, tuple(samples)) for w, samples in sorted(per_worker.items())]

    def redispatch(self, ids: Iterable[int], source: int, index: ReplayIndex, rollouts: list[int], now: float,
                   log: Log) -> list[Resume]:
        """Held samples to the remaining rollout workers (module docstring); ids that ended meanwhile are
        skipped. ``source``: the worker that holds them (-1: the checkpoint the run resumed from)."""
        per_worker: dict[int, list[DispatchedSample]] = {}
        for sid in ids:
            if sid not in index or index.sample(sid).state not in GENERATING:
                continue                         # it ended meanwhile (cancelled, shut down)
            rec = index.sample(sid)
            worker = self.generation.choose(self.outstanding, 1, rollouts) \
                or min(rollouts, key=lambda w: (self.outstanding[w], w))
            self.forget(sid)
            index.reassign(sid, worker)
            self.generating[sid] = worker
            self.outstanding[worker] += 1
            per_worker.setdefault(worker, []).append(DispatchedSample(sid, rec.group_id, rec.prompt_id))
        for worker, samples in sorted(per_worker.items()):
            log(now, "resume", ids=[x.sample_id for x in samples], source=source, w=worker)
        return [Resume(w, tuple(samples), source) for w, samples in sorted(per_worker.items())]

    # -- how generation ends ---------------------------------------------------------------------

    def finished(self, worker: int, s: FinishedSample | tuple[int, float, int, int, int, str, Any, int],
                 index: ReplayIndex, now: float) -> list[Release] | None:
        """``s`` finished on ``worker``: the samples the index ends with it, None when it had ended already
        (cancelled while in flight, shut down)."""
        sid, reward, lo, hi, tokens, reason, location, total = s    # (once per sample: one unpacking)
        owner = self.generating.pop(sid, None)          # (forget, inlined)
        if owner is not None:
            self.outstanding[owner] -= 1
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        self.generation.finished(total or tokens)
        if sid not in index:
            return None
        return index.finished(sid, owner=worker, reward=reward, min_version=lo, max_version=hi, loss_tokens=tokens,
                              now=now, location=location)

    def failed(self, sid: int, index: ReplayIndex, now: float) -> list[Release]:
        self.forget(sid)
        return index.failed(sid, now=now) if sid in index else []

    def release(self, releases: list[Release], *, cancel: bool) -> list[Any]:
        """Samples ended: their owners drop the payloads, and (with ``cancel``) the workers still generating
        them stop."""
        drop: dict[int, list[int]] = {}
        stop: dict[int, list[int]] = {}
        for rel in releases:
            if rel.rank < 0:
                continue
            if rel.has_payload:
                drop.setdefault(rel.rank, []).append(rel.sample_id)
            else:
                stop.setdefault(rel.rank, []).append(rel.sample_id)
                self.forget(rel.sample_id)
        commands: list[Any] = [Drop(w, tuple(ids)) for w, ids in sorted(drop.items())]
        if cancel:
            commands += [Cancel(w, tuple(ids)) for w, ids in sorted(stop.items())]
        return commands

    def forget(self, sample_id: int) -> None:
        """``sample_id`` is no longer generated where it was dispatched."""
        worker = self.generating.pop(sample_id, None)
        if worker is not None:
            self.outstanding[worker] -= 1

    def abandon(self) -> None:
        """The run ended: nothing is generated any more."""
        self.generating.clear()

    # -- engine load -----------------------------------------------------------------------------

    def load(self, worker: int, load: EngineLoad, now: float) -> SetCap | None:
        """The slow controller may change a rollout worker's concurrency cap."""
        if self.generation.observe(worker, load, now):
            return SetCap(worker, self.generation.caps[worker])
        return None

    def cap(self, worker: int) -> SetCap:
        return SetCap(worker, self.generation.caps[worker])
