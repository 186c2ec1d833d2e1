"""The coordinator's step/sync state machine for the four modes (DESIGN §9).

Events in — a sample finished or failed, a trainer replica finished its step, a worker finished a
sync or a checkpoint — and commands out (:mod:`reflow_hpc.core.commands`). Time arrives with the
events. The replay-buffer rules (σ, τ, δ, groups, ``b_max``) live in :class:`ReplayIndex`; this
object decides *when* to dispatch, train, sync and checkpoint, and *which worker* does it.

Modes
-----
``reflow``
    Split pools. Rollout workers stream single samples (whole groups per dispatch) under the
    ``b_max`` budget and each worker's concurrency cap; the trainer starts a step as soon as the
    index can compose a batch by the σ rule; every ``sync_every`` steps the weights are broadcast
    from the first trainer to every rollout worker, which pause in-flight requests and resume them
    under the new weights (partial rollout). Replayed samples weigh τ.
``fully_async``
    The same with σ = 0: no replay, every batch is b unused samples.
``one_step_off``
    Split pools, batch-level: with ``b_max = b`` the index lets one batch be dispatched per step, so
    rollout generates batch k+1 with the weights of step k−1 while the trainer trains on batch k.
    A sync waits until the rollout workers have nothing in flight (no partial rollouts).
``sync``
    Colocated: every worker generates a full batch, then every worker trains its share, then each
    loads its own new weights (no broadcast). Generation never overlaps training.

Per step the pipeline records a :class:`StepRecord` (``completed``) that the driver turns into metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .commands import Cancel, Checkpoint, Dispatch, DispatchedSample, Drop, Sync, Train, TrainItem
from .index import Batch, Release, ReplayIndex

MODES = ("sync", "one_step_off", "fully_async", "reflow")


@dataclass
class StepRecord:
    """What the coordinator knows about one finished step."""
    step: int
    version: int                 # policy version the batch was composed under
    batch: Batch
    composed_at: float
    done_at: float
    started_wait_s: float        # time the trainer waited for this batch (idle) before it was composed
    sync_seconds: float | None = None   # filled when the sync that follows the step completes
    gauges: dict = field(default_factory=dict)


class Pipeline:
    def __init__(self, *, mode: str, index: ReplayIndex, trainers: list[int], rollouts: list[int], steps: int,
                 sync_every: int, worker_cap: int, checkpoint_every: int = 0, first_prompt: int = 0,
                 steps_done: int = 0):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: allowed {', '.join(MODES)}")
        if not trainers or not rollouts:
            raise ValueError("pipeline needs at least one trainer and one rollout worker")
        if mode == "sync" and sorted(trainers) != sorted(rollouts):
            raise ValueError("sync mode is colocated: trainers and rollout workers must be the same ranks")
        if mode != "reflow" and index.sigma != 0.0:
            raise ValueError(f"mode {mode} trains without replay: the index needs sigma = 0")
        if mode in ("sync", "one_step_off") and index.b_max != index.batch_size:
            raise ValueError(f"mode {mode} dispatches one batch per step: b_max must equal the batch size")
        if worker_cap < index.group_size:
            raise ValueError(f"worker cap {worker_cap} < group size {index.group_size}: no group could be dispatched")
        self.mode, self.index = mode, index
        self.trainers, self.rollouts = list(trainers), list(rollouts)
        self.steps, self.sync_every, self.worker_cap = steps, sync_every, worker_cap
        self.checkpoint_every = checkpoint_every
        self.next_prompt = first_prompt
        self.steps_done = steps_done
        self.outstanding = {w: 0 for w in self.rollouts}   # samples dispatched to w and not finished
        self.generating: dict[int, int] = {}               # sample id -> worker
        self.batch: Batch | None = None
        self.batch_composed_at = 0.0
        self.waiting_replicas: set[int] = set()
        self.trainer_idle_since: float | None = None
        self.want_sync = False
        self.syncing: set[int] = set()
        self.sync_started_at = 0.0
        self.sync_record: StepRecord | None = None
        self.checkpointing: set[int] = set()
        self.checkpoint_tag = f"step_{steps_done:06d}" if steps_done else ""   # a resumed run starts from it
        self.finishing = False
        self.finished = False
        self.completed: list[StepRecord] = []              # drained by the driver
        self.checkpoints_done: list[tuple[str, int]] = []  # (tag, step), drained by the driver
        self.started = False

    # ------------------------------------------------------------------------------------------
    # Inbound events
    # ------------------------------------------------------------------------------------------

    def start(self, now: float) -> list[Any]:
        self.started = True
        self.trainer_idle_since = now
        out: list[Any] = []
        if self.steps_done >= self.steps:
            self._finish(out)
            return out
        self._advance(out, now)
        return out

    def sample_finished(self, worker: int, sample_id: int, *, reward: float, min_version: int, max_version: int,
                        loss_tokens: int, now: float, location: Any = None) -> list[Any]:
        out: list[Any] = []
        self._forget_generating(sample_id)
        if sample_id not in self.index:          # ended while in flight (shutdown, cancel)
            return out
        self._releases(self.index.finished(sample_id, owner=worker, reward=reward, min_version=min_version,
                                           max_version=max_version, loss_tokens=loss_tokens, now=now,
                                           location=location), out)
        self._advance(out, now)
        return out

    def sample_failed(self, worker: int, sample_id: int, *, now: float) -> list[Any]:
        out: list[Any] = []
        self._forget_generating(sample_id)
        if sample_id in self.index:
            self._releases(self.index.failed(sample_id, now=now), out)
        self._advance(out, now)
        return out

    def step_done(self, worker: int, step: int, *, now: float) -> list[Any]:
        out: list[Any] = []
        if self.batch is None or step != self.batch.step or worker not in self.waiting_replicas:
            raise ValueError(f"step_done: unexpected report of step {step} from rank {worker}")
        self.waiting_replicas.discard(worker)
        if self.waiting_replicas:
            return out
        batch, self.batch = self.batch, None
        self._releases(self.index.step_done(batch), out)
        self.steps_done += 1
        record = StepRecord(step=batch.step, version=batch.version, batch=batch, composed_at=self.batch_composed_at,
                            done_at=now, started_wait_s=self._pending_wait, gauges=self.index.gauges())
        self.completed.append(record)
        self.trainer_idle_since = now
        if self.steps_done % self.sync_every == 0 or self.steps_done >= self.steps:
            self.want_sync = True
            self.sync_record = record
        self._advance(out, now)
        return out

    def sync_done(self, worker: int, version: int, *, now: float) -> list[Any]:
        out: list[Any] = []
        if worker not in self.syncing or version != self.index.version:
            raise ValueError(f"sync_done: unexpected report of version {version} from rank {worker}")
        self.syncing.discard(worker)
        if not self.syncing and self.sync_record is not None:
            self.sync_record.sync_seconds = now - self.sync_started_at
            self.sync_record = None
        self._advance(out, now)
        return out

    def checkpoint_done(self, worker: int, tag: str, *, now: float) -> list[Any]:
        out: list[Any] = []
        if tag != self.checkpoint_tag or worker not in self.checkpointing:
            raise ValueError(f"checkpoint_done: unexpected report of {tag} from rank {worker}")
        self.checkpointing.discard(worker)
        if not self.checkpointing:
            self.checkpoints_done.append((tag, self.steps_done))
        self._advance(out, now)
        return out

    def request_stop(self, now: float) -> list[Any]:
        """Stop early (preemption, time limit): finish the step in flight, sync, checkpoint, end."""
        out: list[Any] = []
        if self.finished:
            return out
        self.steps = min(self.steps, self.steps_done + (1 if self.batch is not None else 0))
        if self.batch is None and self.steps_done % self.sync_every != 0:
            self.want_sync = True                    # checkpointed weights must match the version
        self._advance(out, now)
        return out

    # ------------------------------------------------------------------------------------------
    # Decisions
    # ------------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.finished

    @property
    def busy_training(self) -> bool:
        return self.batch is not None

    def _advance(self, out: list[Any], now: float) -> None:
        if self.finished:
            return
        self._maybe_sync(out, now)
        if self.checkpointing or (self.syncing and self.mode == "sync"):
            return                                   # consistent snapshot; colocated loads finish first
        if self._maybe_checkpoint(out):
            return
        if self.steps_done >= self.steps:
            if not self.want_sync and not self.syncing and not self.checkpointing and self.batch is None:
                self._finish(out)
            return
        self._maybe_train(out, now)
        self._dispatch(out, now)

    def _maybe_sync(self, out: list[Any], now: float) -> None:
        if not self.want_sync or self.syncing or self.batch is not None:
            return
        if self.mode == "one_step_off" and self.index.outstanding > 0:
            return                                  # waits for the batch in flight: no partial rollouts
        self.want_sync = False
        self._releases(self.index.bump_version(), out)
        v = self.index.version
        if self.mode == "sync":
            for w in self.rollouts:
                out.append(Sync(w, v, None, (w,)))
            self.syncing = set(self.rollouts)
        else:
            src = self.trainers[0]
            group = (src, *self.rollouts)
            for w in group:
                out.append(Sync(w, v, src, group))
            self.syncing = set(group)
        self.sync_started_at = now

    def _maybe_checkpoint(self, out: list[Any]) -> bool:
        due_every = self.checkpoint_every and self.steps_done and self.steps_done % self.checkpoint_every == 0
        due_final = self.steps_done >= self.steps
        tag = f"step_{self.steps_done:06d}"
        if not (due_every or due_final) or tag == self.checkpoint_tag or self.batch is not None or self.want_sync:
            return False
        self.checkpoint_tag = tag
        workers = sorted(set(self.trainers) | set(self.rollouts))
        for w in workers:
            out.append(Checkpoint(w, self.steps_done, tag, save_trainer=(w == self.trainers[0])))
        self.checkpointing = set(workers)
        return True

    def _maybe_train(self, out: list[Any], now: float) -> None:
        if self.batch is not None:
            return
        if self.mode == "sync" and self.index.outstanding > 0:
            return
        batch = self.index.compose_batch(now=now)
        if batch is None:
            return
        self.batch = batch
        self.batch_composed_at = now
        self._pending_wait = now - (self.trainer_idle_since if self.trainer_idle_since is not None else now)
        self.waiting_replicas = set(self.trainers)
        total_tokens = sum(batch.loss_tokens)
        for replica, (worker, idx) in enumerate(zip(self.trainers, _split_balanced(batch.loss_tokens,
                                                                                   len(self.trainers)))):
            items = tuple(TrainItem(batch.sample_ids[i], batch.owners[i], batch.locations[i], batch.advantages[i],
                                    batch.loss_weights[i], batch.is_replay[i], batch.staleness[i]) for i in idx)
            out.append(Train(worker, batch.step, batch.version, items, total_tokens, replica, len(self.trainers)))

    def _dispatch(self, out: list[Any], now: float) -> None:
        if self.mode == "sync" and self.batch is not None:
            return                                   # colocated: no generation while training
        n = self.index.group_size
        per_worker: dict[int, list[DispatchedSample]] = {}
        while self.index.can_dispatch_group():
            worker = min(self.rollouts, key=lambda w: (self.outstanding[w], w))
            if self.outstanding[worker] + n > self.worker_cap:
                break
            group = self.index.new_group(self.next_prompt, now=now, worker=worker)
            self.next_prompt += 1
            self.outstanding[worker] += n
            for sid in group.sample_ids:
                self.generating[sid] = worker
            per_worker.setdefault(worker, []).extend(
                DispatchedSample(sid, group.group_id, group.prompt_id) for sid in group.sample_ids)
        for worker, samples in sorted(per_worker.items()):
            out.append(Dispatch(worker, tuple(samples)))

    def _finish(self, out: list[Any]) -> None:
        self._releases(self.index.shutdown(), out)
        self.generating.clear()
        self.finished = True

    # ------------------------------------------------------------------------------------------
    # Helpers
    # ------------------------------------------------------------------------------------------

    _pending_wait = 0.0

    def _forget_generating(self, sample_id: int) -> None:
        worker = self.generating.pop(sample_id, None)
        if worker is not None:
            self.outstanding[worker] -= 1

    def _releases(self, releases: list[Release], out: list[Any]) -> None:
        drop: dict[int, list[int]] = {}
        cancel: dict[int, list[int]] = {}
        for rel in releases:
            if rel.rank < 0:
                continue
            if rel.has_payload:
                drop.setdefault(rel.rank, []).append(rel.sample_id)
            else:
                cancel.setdefault(rel.rank, []).append(rel.sample_id)
                self._forget_generating(rel.sample_id)
        for w, ids in sorted(drop.items()):
            out.append(Drop(w, tuple(ids)))
        if not self.finished:
            for w, ids in sorted(cancel.items()):
                out.append(Cancel(w, tuple(ids)))


def _split_balanced(loss_tokens: tuple[int, ...], parts: int) -> list[list[int]]:
    """Indices split into ``parts`` shares of near-equal token count (largest first, greedy)."""
    shares: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(loss_tokens)), key=lambda i: -loss_tokens[i]):
        j = min(range(parts), key=lambda p: (load[p], len(shares[p]), p))
        shares[j].append(i)
        load[j] += loss_tokens[i]
    return [sorted(s) for s in shares]
