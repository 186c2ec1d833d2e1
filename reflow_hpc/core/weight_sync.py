"""The weight-sync round: publishing the trainer's weights to the rollout workers.

A sync falls due every ``sync_every`` steps, at the run's last step, and at an early stop whose
weights must match the checkpoint's version. It starts once no batch is in training (and, in a mode
without partial rollouts, once nothing is being generated); it publishes the trainer's current
version. Split pools: the first trainer broadcasts to every rollout worker
(:class:`~reflow_hpc.core.commands.SyncWeights` with ``src``); the other ranks of its sharded replica gather the full weights with it. Colocated
(mode ``sync``): each worker loads its own trainer's weights into its engine (``src`` None).

The round ends when every member reported. In a streaming mode the trainer that sent the weights may
train on before a slow rollout worker reports, so a report is matched against the version the round
published, not the current one.
"""

from __future__ import annotations

from .commands import SyncWeights


class WeightSyncRound:
    def __init__(self) -> None:
        self.due = False               # a sync should start at the next chance
        self.members: set[int] = set()   # workers whose report is outstanding (empty: none in flight)
        self.version = 0               # the version the sync in flight publishes
        self.slowest = 0.0
        self.last_seconds: float | None = None   # the last completed sync, as its slowest member measured it
        self.partial_rollouts = 0      # in-flight samples held and resumed at syncs so far

    @property
    def in_flight(self) -> bool:
        return bool(self.members)

    def request(self) -> None:
        """A sync is due: it starts at the next chance."""
        self.due = True

    def can_start(self, *, waiting: bool) -> bool:
        """A sync is due, none is in flight, and nothing else makes it wait."""
        return self.due and not self.members and not waiting

    def start(self, version: int, trainers: list[int], rollouts: list[int], *, replica_size: int,
              colocated: bool) -> tuple[list[SyncWeights], list[int]]:
        """The commands of a sync of ``version``, and its group (for the event log)."""
        self.due = False
        self.version = version
        self.slowest = 0.0
        if colocated:
            self.members = set(rollouts)
            return [SyncWeights(w, version, None, (w,)) for w in rollouts], list(rollouts)
        src = trainers[0]
        group = (src, *rollouts)
        # The other workers of the source's replica gather its full weights with it (sharded replicas).
        self.members = set(group) | set(trainers[:replica_size])
        return [SyncWeights(w, version, src, group) for w in (*trainers[1:replica_size], *group)], list(group)

    def loaded(self, worker: int, version: int, seconds: float, resumed: int) -> bool:
        """``worker`` reported; True when it was the last member."""
        if worker not in self.members or version != self.version:
            raise ValueError(f"sync_done: unexpected report of version {version} from rank {worker}")
        self.members.discard(worker)
        self.partial_rollouts += resumed
        self.slowest = max(self.slowest, seconds)
        if self.members:
            return False
        self.last_seconds = self.slowest
        return True
