"""The two-phase checkpoint round.

A checkpoint is due every ``checkpoint_every`` steps and at the run's last step, between steps (no
batch in training, no weight sync due). Phase 1: every worker but the writer (the first trainer)
flushes its trajectory shard and reports its manifest (:class:`~reflow_hpc.core.commands.FlushTrajectories`);
when the run stops early, every rollout worker also saves the samples it is generating, so that
nothing finishes after the state is taken. Phase 2: the writer flushes its own shard and writes the
model, the optimizer, the coordinator's state and every manifest
(:class:`~reflow_hpc.core.commands.SaveFlushTrajectories`); with sharded trainer replicas the other ranks of
the writer's replica get the same command and take part in gathering the model and optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .commands import FlushTrajectories, WriteCheckpoint
from .index import ReplayIndex


def checkpoint_tag(step: int) -> str:
    return f"step_{step:06d}"


@dataclass
class CheckpointRound:
    tag: str
    step: int
    writer: int
    state: dict[str, Any]                # the coordinator's state when the round began
    flushing: set[int]                   # phase 1: workers whose shard manifest is still due
    manifests: dict[int, dict[str, Any]] = field(default_factory=dict)
    writing: bool = False                # phase 2: the writer was told to write
    unwritten: set[int] = field(default_factory=set)   # phase 2: the writer and its replica, not yet done
    path: str = ""                       # where the writer wrote it
    partials: bool = False               # the run stops early: in-flight samples are saved into it
    saved: list[int] = field(default_factory=list)    # the samples the workers saved (phase 1)

    @classmethod
    def begin(cls, step: int, writer: int, state: dict[str, Any], *, workers: list[int], rollouts: list[int],
              partials: bool) -> tuple["CheckpointRound", list[FlushTrajectories]]:
        """The round and its phase-1 commands. With ``partials`` every rollout worker (the writer too, if
        it generates) saves what it is generating in phase 1."""
        tag = checkpoint_tag(step)
        others = [w for w in sorted(set(workers)) if w != writer or (partials and w in rollouts)]
        c = cls(tag, step, writer, state, set(others), partials=partials)
        return c, [FlushTrajectories(w, step, tag, partials and w in rollouts) for w in others]

    def flushed(self, worker: int, tag: str, manifest: dict[str, Any], partials: list[int]) -> None:
        if tag != self.tag or worker not in self.flushing:
            raise ValueError(f"checkpoint: unexpected shard manifest for {tag} from rank {worker}")
        self.flushing.discard(worker)
        self.manifests[worker] = manifest
        self.saved += list(partials)

    def write(self, replica: list[int], state: Callable[[], dict[str, Any]]) -> list[WriteCheckpoint]:
        """Phase 2, once phase 1 is complete (else nothing): ``replica`` are the ranks of the writer's
        replica; ``state`` the coordinator's state now, taken when the run stops early."""
        if self.flushing or self.writing:
            return []
        self.writing = True
        if self.partials:
            # Every worker that generated handed its samples over and flushed: nothing finishes any more,
            # so the state now includes every finished sample (all in flushed shards).
            self.state = state()
            self.state["partials"] = sorted(self.saved)
        self.unwritten = set(replica) | {self.writer}
        manifests = {str(w): m for w, m in sorted(self.manifests.items())}
        return [WriteCheckpoint(w, self.step, self.tag, self.state, manifests) for w in sorted(self.unwritten)]

    def written(self, worker: int, tag: str, path: str) -> bool:
        """True once the writer and its replica all reported."""
        if tag != self.tag or worker not in self.unwritten or not self.writing:
            raise ValueError(f"checkpoint: unexpected report that {tag} was written, from rank {worker}")
        self.unwritten.discard(worker)
        if worker == self.writer:
            self.path = path
        return not self.unwritten


class Checkpointing:
    """Which checkpoint is due, the round in progress, and what early stops saved."""

    def __init__(self, every: int):
        self.every = every
        self.round: CheckpointRound | None = None
        self.replica: list[int] = []                # the writer's replica (phase 2)
        self.state: Callable[[], dict[str, Any]] = dict  # the coordinator's state now (phase 2 of an early stop)
        self.tag = ""                              # the newest checkpoint taken (or resumed from)
        self.saved_partials: set[int] = set()      # in-flight samples saved into the final checkpoint
        self.kept: set[int] = set()                # live samples the resumed run continues (early stop)

    def summary(self) -> dict[str, Any]:
        return {"saved_partials": len(self.saved_partials), "kept_in_checkpoint": len(self.kept)}

    def due(self, done: int, steps: int) -> bool:
        """After ``done`` of ``steps`` steps: every ``every`` steps and at the last, once each."""
        return bool((self.every and done and done % self.every == 0) or done >= steps) \
            and checkpoint_tag(done) != self.tag

    def begin(self, step: int, replica: list[int], state: Callable[[], dict[str, Any]], *, workers: list[int],
              rollouts: list[int], partials: bool) -> list[FlushTrajectories | WriteCheckpoint]:
        """A round after ``step``, written by ``replica`` (its first rank writes) with ``state()``, the
        coordinator's state; its commands so far."""
        self.round, commands = CheckpointRound.begin(step, replica[0], state(), workers=workers, rollouts=rollouts,
                                                     partials=partials)
        self.tag, self.replica, self.state = self.round.tag, replica, state
        return [*commands, *self.progress()]

    def progress(self) -> list[WriteCheckpoint]:
        """Phase 2 of the round in progress once its phase 1 is complete (:meth:`CheckpointRound.write`)."""
        return self.round.write(self.replica, self.state) if self.round is not None else []

    def flushed(self, worker: int, tag: str, manifest: dict[str, Any], partials: list[int]) -> None:
        if self.round is None:
            raise ValueError(f"checkpoint: unexpected shard manifest for {tag} from rank {worker}")
        self.round.flushed(worker, tag, manifest, partials)

    def written(self, worker: int, tag: str, path: str, *, stopped_early: bool, steps: int,
                index: ReplayIndex) -> CheckpointRound | None:
        """The writer (or a rank of its replica) reported; the round once it is complete."""
        c = self.round
        if c is None:
            raise ValueError(f"checkpoint: unexpected report that {tag} was written, from rank {worker}")
        if not c.written(worker, tag, path):
            return None
        self.round = None
        self.saved_partials |= set(c.saved)
        if stopped_early and c.step >= steps:
            # The final round of an early stop: nothing has moved since its state was taken, so the live
            # samples now are the ones it holds, and the resumed run continues them.
            self.kept = set(index.live_ids())
        return c
