"""The coordinator with sharded trainer replicas (``replica_size`` = s_T > 1), driven by the simulator:
the pools move whole replicas, a joining worker gets the state of the worker with its shard index,
and the source replica's whole shard group takes part in every sync, snapshot and checkpoint."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from reflow_hpc.config import Config
from reflow_hpc.core.commands import Setup, Snapshot, Switch, SyncWeights, Train, WriteCheckpoint
from reflow_hpc.core.coordinator import Coordinator, Settings
from reflow_hpc.core.index import build_index
from reflow_hpc.core.modes import rules
from reflow_hpc.core.scheduling import SchedulingSettings
from reflow_hpc.sim.costs import Costs
from reflow_hpc.sim.engine import Simulation
from reflow_hpc.sim.lengths import SampleShape
from reflow_hpc.sim.workload import Placement

from conftest import ended_every_sample


class Lengths:
    def __init__(self, seed):
        self.seed = seed

    def group(self, prompt_id, size, version=0):
        rng = random.Random(self.seed * 7919 + prompt_id)
        return [SampleShape(8, (rng.choice((20, 40, 120)),), rng.random()) for _ in range(size)]


def coordinator(mode, *, workers=6, replicas=1, shard=2, steps=6, schedule=(), checkpoint_every=0, eval_every=0):
    sigma = 0.5 if rules(mode).replays else 0.0
    section = SimpleNamespace(mode=mode, sigma=sigma, tau=0.5, delta=2, b_max=0, sync_every=1, sampler="random",
                              replay_filter="accept_all", reward_low=0.0, reward_high=1.0)
    index = build_index(section, group_size=4, batch_size=8, seed=0)
    ranks = list(range(workers))
    colocated = rules(mode).colocated
    trainers = ranks if colocated else ranks[:replicas * shard]
    rollouts = ranks if colocated else ranks[replicas * shard:]
    settings = Settings(rules=rules(mode), steps=steps, sync_every=1, cap_max=16,
                        scheduling=SchedulingSettings(queue=0), checkpoint_every=checkpoint_every, timeout_s=100.0,
                        setup_timeout_s=100.0, eval_every=eval_every, placement_schedule=tuple(schedule),
                        replica_size=shard, check_invariants=True)
    c = Coordinator(settings, index, trainers=trainers, rollouts=rollouts, world=workers)
    return c, settings, Placement(workers, tuple(trainers), tuple(rollouts), 1, 1, 1, colocated)


def simulate(c, settings, place):
    """Runs ``c`` to its end; (every command, (tag, step) of every checkpoint written)."""
    cfg = Config()
    cfg.rollout.max_new_tokens = 120
    cfg.reflow.delta = 2
    cfg.sim.setup_s = 0.1
    cfg.sim.tick_s = 1e6
    costs = dataclasses.replace(
        Costs.from_config(cfg), params=0.0, layers=0, weight_bytes=0.0, kv_bytes=1e-9, memory=1e18,
        decode_base_s=0.01, decode_bw=1e30, decode_flops=1e30, prefill_base_s=0.0, prefill_flops=1e30,
        train_minibatches=1, train_update_overhead_s=0.3, logprob_recompute_modes=(), sync_base_s=0.05,
        sync_colocated_base_s=0.05, switch_fixed_s=0.1, switch_h2d_bw=1e30, switch_shard_bw=1e30)
    commands = []
    sim = Simulation(cfg, c, settings, place, lengths=Lengths(0), costs=costs,
                     on_command=lambda cmd, now: commands.append(cmd)).run()
    return commands, [(tag, step) for tag, step, _ in sim.checkpoints]


def test_switches_move_whole_replicas_and_pair_each_shard_with_its_counterpart():
    c, *setup = coordinator("reflow", steps=8, schedule=[(2, 2), (5, 1)], checkpoint_every=3, eval_every=2)
    commands, checkpoints = simulate(c, *setup)
    assert {cmd.placements for cmd in commands if isinstance(cmd, Setup)} == {(1, 2)}   # trainer replicas, not ranks
    s = c.summary()
    assert s["phase"] == "finished" and s["placements"] == [[2, 2], [5, 1]]
    assert ended_every_sample(s)
    switches = [cmd for cmd in commands if isinstance(cmd, Switch) and cmd.worker == 0]
    assert [(s.trainers, s.rollouts) for s in switches] == [((0, 1, 2, 3), (4, 5)), ((0, 1), (2, 3, 4, 5))]
    assert switches[0].transfers == ((0, 2), (1, 3))                 # shard i of the new replica from shard i
    assert switches[1].transfers == ()
    # Every trainer rank trains its own share of each batch.
    trained = {}
    for cmd in commands:
        if isinstance(cmd, Train):
            trained.setdefault(cmd.step, set()).add(cmd.worker)
    assert trained[0] == {0, 1} and trained[3] == {0, 1, 2, 3} and trained[7] == {0, 1}
    # Every sync: rank 0 broadcasts to the rollout workers, rank 1 (its shard group) gathers with it.
    syncs = {}
    for cmd in commands:
        if isinstance(cmd, SyncWeights):
            syncs.setdefault(cmd.version, []).append(cmd)
    for version, cmds in syncs.items():
        workers = {cmd.worker for cmd in cmds}
        group = set(cmds[0].group)
        assert 1 in workers and 1 not in group and workers == group | {1}, (version, workers, group)
        assert cmds[0].src == 0
    # Snapshots and checkpoints: the first replica's two workers, rank 0 writes.
    assert {cmd.worker for cmd in commands if isinstance(cmd, Snapshot)} == {0, 1}
    saves = [cmd.worker for cmd in commands if isinstance(cmd, WriteCheckpoint)]
    assert sorted(saves) == [0, 0, 0, 1, 1, 1]
    assert [step for _, step in checkpoints] == [3, 6, 8]
    assert c.state_dict()["trainer_replicas"] == 1


def test_colocated_sync_mode_with_sharded_replicas_runs_to_completion():
    c, *setup = coordinator("sync", workers=4, shard=2, steps=3)
    commands, _ = simulate(c, *setup)
    assert c.summary()["phase"] == "finished"
    assert {cmd.worker for cmd in commands if isinstance(cmd, Train)} == {0, 1, 2, 3}
    assert sorted(cmd.worker for cmd in commands if isinstance(cmd, WriteCheckpoint)) == [0, 1]
    assert all(cmd.src is None for cmd in commands if isinstance(cmd, SyncWeights))


def test_a_resumed_coordinator_restores_the_replicas_in_force():
    c, *setup = coordinator("reflow", steps=4, schedule=[(2, 2)])
    simulate(c, *setup)
    state = c.state_dict()
    assert state["trainer_replicas"] == 2
    again = coordinator("reflow", steps=6, schedule=[(2, 2)])[0]
    again.load_state_dict(state)
    assert again.summary()["roles"] == {0: "trainer", 1: "trainer", 2: "trainer", 3: "trainer", 4: "rollout",
                                        5: "rollout"}


@pytest.mark.parametrize("kw, words", [
    (dict(workers=5, shard=2, mode="sync"), "not whole replicas"),
    (dict(workers=4, shard=2, schedule=[(2, 2)]), "must leave at least one rollout worker"),
])
def test_trainers_must_be_whole_replicas(kw, words):
    mode = kw.pop("mode", "reflow")
    with pytest.raises(ValueError, match=words):
        coordinator(mode, **kw)
