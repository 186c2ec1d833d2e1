"""A resumed run's buffer against what the workers found in their trajectory shards.

The checkpoint's index (restored by :meth:`~reflow_hpc.core.index.ReplayIndex.load_state_dict`) knows
every sample up to the checkpoint. At start-up each worker reports the finished samples its shards hold
and the ids it could not read back. Then: a finished sample the index does not know (it finished after
the checkpoint) is recovered; a known one whose payload is unreadable, or that no worker holds any
more (its shard was on another node, or its scratch was wiped), ends as ``lost``. Every sample that
ends here is logged when the run starts, so the event log says how each sample ended across restarts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .index import RecoveredSample, Release, ReplayIndex
from .sample import FINISHED, READY, REPLAY


@dataclass
class Resumed:
    """What a resume brought (all empty for a fresh start)."""
    path: str | None = None                       # the checkpoint directory
    partials: list[int] = field(default_factory=list)    # in-flight samples it saved, to continue
    releases: list[Release] = field(default_factory=list)    # samples that ended at the resume, logged at start
    recovered_ids: list[int] = field(default_factory=list)   # finished after the checkpoint, found in shards
    shards: dict[int, tuple[Sequence[RecoveredSample], Sequence[int]]] = field(default_factory=dict)

    def load(self, index: ReplayIndex, state: dict[str, Any], partials: list[int]) -> None:
        """The checkpoint's index, its in-flight samples kept (``partials``) and the others ended."""
        self.partials = sorted(partials)
        self.releases = index.load_state_dict(state, resume=True, keep=self.partials)

    def take_releases(self) -> list[Release]:
        releases, self.releases = self.releases, []
        return releases

    def notice(self, gauges: Mapping[str, int]) -> str:
        return (f"buffer after resume: {gauges['buffer/ready']} ready, {gauges['buffer/replay']} replay, "
                f"{len(self.recovered_ids)} recovered from shards, {gauges['buffer/lost']} lost, "
                f"{gauges['buffer/aborted']} aborted")

    def summary(self) -> dict[str, Any]:
        return {"recovered": len(self.recovered_ids), "resumed_partials": len(self.partials)}

    def reconcile(self, index: ReplayIndex) -> None:
        """The restored index against every worker's report (module docstring)."""
        if self.path is None:
            return
        recovered: list[RecoveredSample] = []
        present: set[int] = set()
        for _, (inventory, lost) in sorted(self.shards.items()):
            for s in inventory:
                present.add(s.sample_id)
                if not index.knows(s.sample_id):
                    recovered.append(s)
            for sid in lost:
                if sid in index:
                    self.releases += index.lost(sid)
        for sid in list(index.live_ids()):
            if index.sample(sid).state in (FINISHED, READY, REPLAY) and sid not in present:
                self.releases += index.lost(sid)
        if recovered:
            self.releases += index.recover(recovered)
        self.recovered_ids = sorted(s.sample_id for s in recovered)
        index.check_accounting()
