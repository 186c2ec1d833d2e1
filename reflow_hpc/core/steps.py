"""The training step: the batch in training, the trainer ranks' reports, and the step's record.

A batch is composed by the replay index (:meth:`~reflow_hpc.core.index.ReplayIndex.compose_batch`, the
σ rule) as soon as it can be, while no other batch trains (colocated: only once nothing is being
generated). It is split over the trainer ranks in shares of near-equal token count, one
:class:`~reflow_hpc.core.commands.Train` each; every rank normalises by the whole batch's loss tokens.
The step ends when every trainer rank reported; its :class:`~reflow_hpc.core.outputs.StepRecord` holds
what the step's metrics need, including the rollout workers' idle time and generated tokens over the
step, from the cumulative figures they report.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Sequence

from .commands import Train, train_samples
from .index import Batch, ReplayIndex
from .outputs import ReplicaReport, StepRecord


class TrainingStep:
    def __init__(self, workers: list[int], production: bool = False):
        self.batch: Batch | None = None          # the batch in training
        self.composed_at = 0.0
        self.waiting: set[int] = set()           # trainer ranks whose report is outstanding
        self.reports: list[ReplicaReport] = []
        self.last_step_end = 0.0                 # end of the previous step (or the start of the run)
        self.rollout_idle = {w: 0.0 for w in workers}   # cumulative, as reported
        self.idle_at_last_step = dict(self.rollout_idle)
        self.generated = {w: 0 for w in workers}        # cumulative generated tokens, as reported
        self.generated_at_last_step = 0
        self.produced = 0                        # fresh samples finished since the last step
        self.production: list[tuple[int, float, int]] = []   # their (tokens, production s, prompt tokens), for the
                                                             # placement planner
        self.records_production = production     # (only the elastic pool's planner reads them)
        self.switches: list[dict[str, Any]] = []  # role switches completed since the last step
        self.fresh_rewards: list[float] = []     # mean reward of each step's unused samples

    def summary(self) -> dict[str, Any]:
        """The mean reward of the fresh samples of the first and the last tenth of the run's steps."""
        rewards = [r for r in self.fresh_rewards if r == r]
        k = max(1, min(50, len(rewards) // 10))
        return {"reward_first_steps": _mean(rewards[:k]), "reward_last_steps": _mean(rewards[-k:])}

    def progress(self, worker: int, idle_s: float, generated_tokens: int, samples: Sequence[tuple[Any, ...]] = (),
                 index: ReplayIndex | None = None, now: float = 0.0) -> None:
        """A worker's cumulative rollout idle time and generated tokens (they only grow), and the tokens and
        dispatch-to-finish seconds of the ``samples`` it finished that the index still holds."""
        if self.records_production and index is not None:
            self.production.extend((s[4], now - index.sample(s[0]).created_at, _prompt_tokens(s))
                                   for s in samples if s[0] in index)
        if idle_s > self.rollout_idle[worker]:          # (comparisons: it runs for every finished sample)
            self.rollout_idle[worker] = idle_s
        if generated_tokens > self.generated[worker]:
            self.generated[worker] = generated_tokens

    def compose(self, index: ReplayIndex, trainers: list[int], now: float,
                log: Callable[..., None] | None) -> list[Train]:
        """The next batch when the index can compose one (and ``log`` it): one share per trainer rank."""
        batch = index.compose_batch(now=now)
        if batch is None:
            return []
        if log is not None:
            log(now, "compose", step=batch.step, ids=list(batch.sample_ids), replay=[int(r) for r in batch.is_replay],
                weights=[round(w, 6) for w in batch.loss_weights], stale=list(batch.staleness))
        return self.start(batch, trainers, now)

    def start(self, batch: Batch, trainers: list[int], now: float) -> list[Train]:
        """Train ``batch`` on ``trainers``: one share each."""
        self.batch, self.composed_at = batch, now
        self.waiting = set(trainers)
        self.reports = []
        total_tokens = sum(batch.loss_tokens)
        shares = split_balanced(batch.loss_tokens, len(trainers))
        items = train_samples(batch.sample_ids, batch.owners, batch.advantages, batch.loss_weights, batch.is_replay,
                              batch.staleness)
        return [Train(worker, batch.step, batch.version, tuple([items[i] for i in idx]), total_tokens, replica,
                      len(trainers))
                for replica, (worker, idx) in enumerate(zip(trainers, shares))]

    def reported(self, worker: int, step: int, stats: dict[str, float], idle_s: float,
                 fetch_s: float) -> Batch | None:
        """A trainer rank finished its share; the batch once every rank did."""
        if self.batch is None or step != self.batch.step or worker not in self.waiting:
            raise ValueError(f"step_done: unexpected report of step {step} from rank {worker}")
        self.waiting.discard(worker)
        self.reports.append(ReplicaReport(worker, stats, idle_s, fetch_s))
        if self.waiting:
            return None
        batch, self.batch = self.batch, None
        return batch

    def record(self, batch: Batch, now: float, rollouts: list[int], **known: Any) -> StepRecord:
        """The step that trained ``batch`` ended at ``now``; ``known``: the record's other fields."""
        idle = sum(max(0.0, self.rollout_idle[w] - self.idle_at_last_step.get(w, 0.0)) for w in rollouts)
        self.idle_at_last_step = dict(self.rollout_idle)
        generated = sum(self.generated.values())
        fresh = [r for r, rep in zip(batch.rewards, batch.is_replay) if not rep]
        self.fresh_rewards.append(_mean(fresh))
        rec = StepRecord(step=batch.step, version=batch.version, batch=batch, started_at=self.last_step_end,
                         composed_at=self.composed_at, done_at=now, replicas=self.reports,
                         rollout_idle_s=idle, rollout_workers=len(rollouts),
                         generated_tokens=generated - self.generated_at_last_step, switches=self.switches,
                         produced=self.produced, production=self.production, **known)
        self.switches, self.produced, self.reports, self.production = [], 0, [], []
        self.generated_at_last_step = generated
        self.last_step_end = now
        return rec


def split_balanced(loss_tokens: tuple[int, ...], parts: int) -> list[list[int]]:
    """Indices split into ``parts`` shares of near-equal token count (largest first, greedy; a heap keeps
    it O(n log p) for the simulator's thousand-worker runs)."""
    shares: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, 0, p) for p in range(parts)]                  # (load, count, part): ties go to the lower part
    for i in sorted(range(len(loss_tokens)), key=loss_tokens.__getitem__, reverse=True):   # stable, as ascending -n
        load, count, j = heap[0]
        shares[j].append(i)
        heapq.heapreplace(heap, (load + loss_tokens[i], count + 1, j))
    return [sorted(s) for s in shares]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _prompt_tokens(s: Sequence[Any]) -> int:
    """Prompt tokens of a finished sample (its total less its response; 0 where the total is not known)."""
    return max(int(s[7]) - int(s[4]), 0) if len(s) > 7 and s[7] else 0
