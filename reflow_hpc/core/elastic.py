"""The elastic pool (split modes): which workers train and which generate.

Trainers are the first ``n_T·s_T`` ranks (whole replicas of ``s_T`` parameter shards), rollout instances
the rest (whole instances of ``s_R`` ranks, each known by its first rank, the rollout worker). After each
step the placement planner (:mod:`reflow_hpc.core.placement`) or a fixed schedule (``placement_schedule``:
after step k, n replicas) may ask for another ``n_T``; the switch happens at the next sync point, and
moves whole replicas and whole instances. Every worker gets a :class:`~reflow_hpc.core.commands.Switch`; a
worker that leaves rollout hands its in-flight samples over, and they are re-dispatched to the remaining
rollout workers once every worker switched (partial tokens and versions intact); a joining replica's i-th
rank receives parameters and optimizer state from the i-th rank (the same shard) of an existing replica,
the replicas taken in turn; the weight sync that follows gives the new rollout workers the current
weights.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from .commands import Setup, Switch
from .outputs import StepRecord
from .placement import PlacementPlanner, PlacementSettings, Window
from .scheduling import GenerationScheduler


class ElasticPool:
    def __init__(self, workers: list[int], trainers: list[int], rollouts: list[int], *, replica_size: int,
                 tp: int = 1, planner: PlacementSettings | None, schedule: tuple[tuple[int, int], ...]):
        self.workers, self.trainers, self.rollouts = workers, list(trainers), list(rollouts)
        self.replica_size, self.tp = replica_size, tp
        self.planner = PlacementPlanner(planner, self.replicas) if planner else None
        self.schedule = schedule
        self.pending: int | None = None                     # trainer replicas to switch to at the next sync point
        self.switching: set[int] = set()                    # workers that have not reported the switch done
        self.started_at = 0.0
        self.before: tuple[list[int], list[int]] = ([], [])   # (trainers, rollouts) before the switch
        self.handed_off: dict[int, list[int]] = {}          # leaving rollout worker -> samples it held
        self.seconds: dict[str, float] = {}                 # slowest switch per direction
        self.placements: list[tuple[int, int]] = []         # (step, trainer replicas) at every change
        self.handed_over = 0                                # samples handed from a leaving rollout worker
        self.evicted_unused = 0                             # the index's count at the previous step

    @property
    def replicas(self) -> int:
        """n_T: trainer replicas in force."""
        return len(self.trainers) // self.replica_size

    def feasible(self) -> tuple[int, ...]:
        """Trainer replica counts the pool may take (workers prepare a process group for each)."""
        if self.planner is not None:
            return tuple(self.planner.feasible())
        return tuple(sorted({self.replicas, *(n for _, n in self.schedule)}))

    def setup(self, colocated: bool, version: int, resume_from: str | None) -> list[Setup]:
        """Every worker's role at the start, and every split it must prepare for."""
        return [Setup(w, tuple(self.trainers), tuple(self.rollouts), colocated, version, resume_from, self.feasible())
                for w in self.workers]

    def roles(self) -> dict[int, str]:
        return {w: ("trainer+rollout" if w in self.trainers and w in self.rollouts else
                    "trainer" if w in self.trainers else "rollout") for w in self.workers}

    def set_replicas(self, n_replicas: int, generation: GenerationScheduler) -> None:
        n = n_replicas * self.replica_size
        self.trainers, self.rollouts = self.workers[:n], self.workers[n::self.tp]
        for w in self.workers:
            if w in self.rollouts:
                generation.add_worker(w)
            else:
                generation.remove_worker(w)

    def restore(self, placements: Iterable[Sequence[int]], n_replicas: int, generation: GenerationScheduler, *,
                colocated: bool) -> None:
        """The placements of a checkpoint's run, and the split in force when it was taken (split pools)."""
        self.placements = [(int(step), int(n)) for step, n in placements]
        if not colocated and n_replicas != self.replicas:
            self.set_replicas(n_replicas, generation)
            if self.planner is not None:
                self.planner.applied(n_replicas)

    def summary(self) -> dict[str, Any]:
        return {"roles": self.roles(), "placements": [list(p) for p in self.placements],
                "handed_over": self.handed_over}

    def plan(self, rec: StepRecord, *, steps_done: int, steps: int, replays: bool) -> None:
        """After a step: does the schedule or the planner want another split?"""
        forced = [n for step, n in self.schedule if step == steps_done]
        if forced and forced[-1] != self.replicas:
            self.pending = forced[-1]
        elif self.planner is not None:
            step_s = max(rec.done_at - rec.started_at, 1e-9)
            idle_t = _mean([r.idle_s for r in rec.replicas]) / step_s if rec.replicas else 0.0
            idle_r = rec.rollout_idle_s / (rec.rollout_workers * step_s) if rec.rollout_workers else 0.0
            evicted = rec.gauges.get("buffer/evicted_unused", 0)
            b = rec.batch
            trained_fresh = [(st, g) for st, g, rep in zip(b.staleness, b.production_s, b.is_replay) if not rep]
            window = Window(rec.produced, step_s, min(1.0, idle_t), min(1.0, idle_r),
                            replay_supply=rec.gauges.get("buffer/replay", 0) if replays else 0,
                            production=rec.production, trained_fresh=trained_fresh,
                            evicted_unused=max(0, evicted - self.evicted_unused),
                            trained=list(zip(b.is_replay, b.loss_tokens)))
            self.evicted_unused = evicted
            new = self.planner.observe(window, steps_left=steps - steps_done)
            rec.placement_mismatch = self.planner.last_mismatch
            rec.placement_coverage = self.planner.last_coverage
            rec.placement_step_s = self.planner.last_step_predicted
            if new is not None and steps_done < steps:
                self.pending = new

    def start_switch(self, version: int, now: float, generation: GenerationScheduler) -> list[Switch]:
        """Change to the pending split; its Switch commands (none when the split is already in force)."""
        n_t, self.pending = self.pending, None
        if n_t is None or n_t == self.replicas:
            return []
        old_t, old_r = list(self.trainers), list(self.rollouts)
        self.before = (old_t, old_r)
        self.set_replicas(n_t, generation)
        joining = [w for w in self.trainers if w not in old_t]
        s, old_n = self.replica_size, len(old_t) // self.replica_size
        transfers = tuple((old_t[(i // s) % old_n * s + i % s], w) for i, w in enumerate(joining))
        self.switching = set(self.workers)
        self.started_at = now
        self.seconds = {}
        self.handed_off = {}
        return [Switch(w, tuple(self.trainers), tuple(self.rollouts), version, transfers) for w in self.workers]

    def switched(self, worker: int, handed_off: list[int], seconds: float) -> bool:
        """``worker`` switched; True once every worker did."""
        if worker not in self.switching:
            raise ValueError(f"switch: unexpected report from rank {worker}")
        self.switching.discard(worker)
        old_trainers, old_rollouts = self.before
        if worker in old_rollouts and worker in self.trainers:
            self.seconds["to_trainer"] = max(self.seconds.get("to_trainer", 0.0), seconds)
        elif worker in old_trainers and worker in self.rollouts:
            self.seconds["to_rollout"] = max(self.seconds.get("to_rollout", 0.0), seconds)
        if handed_off:
            self.handed_off[worker] = list(handed_off)
        return not self.switching

    def finish_switch(self, steps_done: int, now: float) -> dict[str, Any]:
        """Every worker switched: the switch's record (for the step record and the event log)."""
        self.placements.append((steps_done, self.replicas))
        seconds = now - self.started_at
        if self.planner is not None:
            self.planner.applied(self.replicas, seconds)
        handed = sum(len(ids) for ids in self.handed_off.values())
        self.handed_over += handed
        return {"step": steps_done, "trainers": len(self.trainers), "rollouts": len(self.rollouts),
                "seconds": seconds, "handed_off": handed, **{f"{k}_s": v for k, v in self.seconds.items()}}

    def take_handed_off(self) -> list[tuple[int, list[int]]]:
        """(source, samples) of every worker that handed samples over in the switch that just ended."""
        handed, self.handed_off = sorted(self.handed_off.items()), {}
        return handed

    def new_rollouts(self) -> list[int]:
        """Rollout workers that joined in the switch that just ended."""
        return [w for w in self.rollouts if w not in self.before[1]]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan
