"""The coordinator's phase, and what may move in each (its precedence).

The coordinator is in exactly one phase. Two of them stop everything else while they last: a role
switch and a checkpoint round each need a state in which nothing moves. Weight syncs and training
steps are not phases: they overlap generation (split pools) and each other's tails, so they are
sub-machines of ``RUNNING`` (:mod:`reflow_hpc.core.weight_sync`, :mod:`reflow_hpc.core.steps`).

=================  ========================================  ========================================
phase              entered when                              what moves meanwhile
=================  ========================================  ========================================
``NEW``            constructed                               nothing
``SETUP``          the run starts: every worker gets Setup   nothing; a worker silent longer than
                                                             ``setup_timeout_s`` ends the run
``RUNNING``        every worker reported ready               everything, in the order below
``SWITCHING``      a new split is due at a sync point        nothing, until every worker switched
``CHECKPOINTING``  a checkpoint is due between steps         a weight sync that falls due (an early
                                                             stop) may start; nothing else
``FINISHED``       the steps are done and nothing trains     nothing
                   or syncs any more
=================  ========================================  ========================================

In ``RUNNING``, after every event, the first of these that applies acts (``Coordinator._advance``):

1. a split is pending and this is a sync point (a sync is due, nothing trains, syncs or checkpoints):
   start the switch → ``SWITCHING``;
2. a weight sync is due and can start: start it (then go on);
3. colocated weights are loading: wait;
4. a checkpoint is due: start its round → ``CHECKPOINTING``;
5. the run's steps are done: once nothing trains or syncs → ``FINISHED``;
6. compose a batch if none is training, and dispatch what the ``b_max`` window allows.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    NEW = "new"
    SETUP = "setup"
    RUNNING = "running"
    SWITCHING = "switching"
    CHECKPOINTING = "checkpointing"
    FINISHED = "finished"

    @property
    def started(self) -> bool:
        """Every worker is ready and the run has not finished (training time counts)."""
        return self._value_ in _STARTED          # (by value: an enum member's hash is a Python call)


_STARTED = frozenset({"running", "switching", "checkpointing"})
