"""The job's process groups as plain data (reflow_hpc/comm/dims.py) and their lookup by name
(reflow_hpc/comm/groups.py, with a stand-in for torch.distributed.new_group)."""

from __future__ import annotations

import pytest

from reflow_hpc.comm.dims import GroupSpec, ParallelDims
from reflow_hpc.comm.groups import ProcessGroups


def kinds(dims: ParallelDims) -> list[tuple[str, int | None, tuple[int, ...]]]:
    return [(g.kind, g.split, g.ranks) for g in dims.plan()]


def test_four_ranks_two_trainers_two_rollouts():
    dims = ParallelDims(world=4, replicas=(2,))
    sp = dims.split(2)
    assert sp.trainers == (0, 1) and sp.replicas == ((0,), (1,)) and sp.counterparts == ((0, 1),)
    assert sp.instances == ((2,), (3,)) and sp.rollouts == (2, 3) and sp.sync == (0, 2, 3)
    assert dims.shard_groups == ((0,), (1,), (2,), (3,))
    # Groups of one are left out: one counterparts group, one sync group.
    assert kinds(dims) == [("replica", 2, (0, 1)), ("sync", 2, (0, 2, 3))]


def test_every_feasible_split_of_four_ranks():
    dims = ParallelDims(world=4, replicas=(3, 1, 2, 2))
    assert dims.replicas == (1, 2, 3)                      # sorted, once each: the same on every rank
    assert [(sp.trainers, sp.rollouts, sp.sync) for sp in dims.splits] == [
        ((0,), (1, 2, 3), (0, 1, 2, 3)), ((0, 1), (2, 3), (0, 2, 3)), ((0, 1, 2), (3,), (0, 3))]
    assert kinds(dims) == [("sync", 1, (0, 1, 2, 3)),
                           ("replica", 2, (0, 1)), ("sync", 2, (0, 2, 3)),
                           ("replica", 3, (0, 1, 2)), ("sync", 3, (0, 3))]


def test_sharded_trainers():
    # W = 6, s_T = 2: n_T = 1 or 2; the shard groups tile the world and never change.
    dims = ParallelDims(world=6, shard=2, replicas=(1, 2))
    assert dims.shard_groups == ((0, 1), (2, 3), (4, 5))
    one, two = dims.splits
    assert one.trainers == (0, 1) and one.counterparts == ((0,), (1,)) and one.rollouts == (2, 3, 4, 5)
    assert two.replicas == ((0, 1), (2, 3)) and two.counterparts == ((0, 2), (1, 3)) and two.sync == (0, 4, 5)
    assert two.counterparts_of(3) == (1, 3) and two.counterparts_of(4) is None
    assert kinds(dims) == [("shard", None, (0, 1)), ("shard", None, (2, 3)), ("shard", None, (4, 5)),
                           ("sync", 1, (0, 2, 3, 4, 5)),
                           ("replica", 2, (0, 2)), ("replica", 2, (1, 3)), ("sync", 2, (0, 4, 5))]
    # A trailing part block trains in no split: it has no shard group.
    assert ParallelDims(world=5, shard=2, replicas=(1, 2)).shard_groups == ((0, 1), (2, 3))
    assert ParallelDims(world=5, shard=2, replicas=(1, 2)).shard_group_of(4) is None


def test_tensor_parallel_rollout_instances():
    # W = 6: 2 trainer replicas of 1 and 2 instances of s_R = 2; leaders 2 and 4.
    dims = ParallelDims(world=6, tp=2, replicas=(2,))
    sp = dims.split(2)
    assert sp.instances == ((2, 3), (4, 5)) and sp.rollouts == (2, 4) and sp.sync == (0, 2, 4)
    assert sp.instance_of(5) == (4, 5) and sp.instance_of(1) is None
    assert kinds(dims) == [("tp_instance", None, (2, 3)), ("tp_instance", None, (4, 5)),
                           ("replica", 2, (0, 1)), ("sync", 2, (0, 2, 4))]


def test_tensor_parallel_instances_in_every_split_made_once():
    # s_T = 2, s_R = 2, W = 8: n_T = 1, 2 or 3; an instance that recurs in several splits is one group.
    dims = ParallelDims(world=8, shard=2, tp=2, replicas=(1, 2, 3))
    assert [sp.instances for sp in dims.splits] == [((2, 3), (4, 5), (6, 7)), ((4, 5), (6, 7)), ((6, 7),)]
    assert [g.ranks for g in dims.plan() if g.kind == "tp_instance"] == [(2, 3), (4, 5), (6, 7)]
    assert [g.ranks for g in dims.plan() if g.kind == "shard"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert dims.split(3).counterparts == ((0, 2, 4), (1, 3, 5)) and dims.split(3).sync == (0, 6)



def test_engine_blocks_are_every_splits_instances():
    """vLLM lays its groups over blocks of s_R from rank 0, built once: every split's instances are such
    blocks, and a block's first rank leads it whichever split is in force."""
    dims = ParallelDims(world=6, tp=2, replicas=(2, 4))
    assert dims.engine_blocks == ((0, 1), (2, 3), (4, 5))
    assert dims.engine_block(3) == (2, 3) and dims.engine_block(4) == (4, 5) and dims.engine_block(0) == (0, 1)
    assert [sp.instances for sp in dims.splits] == [((2, 3), (4, 5)), ((4, 5),)]
    assert all(inst in dims.engine_blocks for sp in dims.splits for inst in sp.instances)
    # A block that generates in no split gets no group; the others one, whatever the split.
    assert [g.ranks for g in dims.plan() if g.kind == "tp_instance"] == [(2, 3), (4, 5)]
    assert ParallelDims(world=4, tp=1).engine_block(3) == (3,)
    colocated = ParallelDims(world=4, tp=2, replicas=(4,), colocated=True)
    assert colocated.engine_blocks == colocated.split(4).instances == ((0, 1), (2, 3))


def test_colocated():
    dims = ParallelDims(world=4, shard=2, replicas=(2,), colocated=True)
    sp = dims.split(2)
    assert sp.trainers == (0, 1, 2, 3) and sp.rollouts == (0, 1, 2, 3) and sp.sync == ()
    assert sp.counterparts == ((0, 2), (1, 3))
    assert kinds(dims) == [("shard", None, (0, 1)), ("shard", None, (2, 3)),
                           ("replica", 2, (0, 2)), ("replica", 2, (1, 3))]
    tp = ParallelDims(world=4, tp=2, replicas=(4,), colocated=True)
    assert tp.split(4).instances == ((0, 1), (2, 3)) and tp.split(4).rollouts == (0, 2)


@pytest.mark.parametrize("kwargs, words", [
    (dict(world=4, shard=2, replicas=(3,)), "leave -2 of 4"),
    (dict(world=5, tp=2, replicas=(2,)), "multiple of s_R 2"),
    (dict(world=5, tp=2, replicas=(1, 3)), "world 5 must be a multiple of s_R 2"),      # blocks not aligned
    (dict(world=6, tp=2, replicas=(3,)), "3 trainer replicas of 1 leave 3 of 6"),
    (dict(world=4, replicas=(0,)), "0 trainer replicas"),
    (dict(world=4, replicas=()), "no trainer replica count"),
    (dict(world=6, shard=4, replicas=(1,), colocated=True), "multiple of s_T 4"),
    (dict(world=4, replicas=(2,), colocated=True), "n_T = 4"),
])
def test_infeasible_dims_fail_naming_the_numbers(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ParallelDims(**kwargs)


def test_a_split_not_prepared_fails():
    with pytest.raises(KeyError, match="not a prepared split"):
        ParallelDims(world=4, replicas=(2,)).split(3)


def test_every_rank_creates_the_same_groups_and_finds_its_own_by_name():
    dims = ParallelDims(world=8, shard=2, tp=2, replicas=(1, 2, 3))
    made: dict[int, list[tuple[int, ...]]] = {}
    groups = {}
    for rank in range(8):
        calls = made.setdefault(rank, [])
        groups[rank] = ProcessGroups.create(dims, rank, 60.0,
                                            new_group=lambda ranks, calls=calls: calls.append(tuple(ranks)) or tuple(ranks))
    assert all(calls == made[0] for calls in made.values())
    assert made[0] == [g.ranks for g in dims.plan()] and groups[0].created == len(made[0])
    g3 = groups[3]
    assert g3.shard == (2, 3)
    assert g3.replica(1) is None                  # rank 3 generates when one replica trains
    assert g3.replica(2) == (1, 3) and g3.replica(3) == (1, 3, 5)
    assert g3.tp_instance(1) == (2, 3) and g3.tp_instance(2) is None
    assert g3.sync(1) is None                     # a follower: its leader receives for the instance
    g2 = groups[2]
    assert g2.sync(1) == (0, 2, 4, 6) and g2.sync(2) is None and g2.tp_instance(1) == (2, 3)
    assert groups[0].sync(3) == (0, 6) and groups[0].replica(1) is None     # one replica: nothing to sum
    assert GroupSpec("shard", None, (2, 3)) in dims.plan()


def test_every_rank_finds_its_engine_blocks_group_in_any_split():
    dims = ParallelDims(world=6, tp=2, replicas=(2, 4))
    groups = {rank: ProcessGroups.create(dims, rank, 60.0, new_group=tuple) for rank in range(6)}
    assert [groups[r].tp_block for r in range(6)] == [None, None, (2, 3), (2, 3), (4, 5), (4, 5)]
    assert groups[3].tp_instance(2) == (2, 3) and groups[3].tp_instance(4) is None    # trains with 4 replicas
    assert ProcessGroups.create(ParallelDims(world=4, replicas=(2,)), 2, 60.0, new_group=tuple).tp_block is None


def test_unsharded_ranks_have_no_shard_group():
    groups = ProcessGroups.create(ParallelDims(world=4, replicas=(2,)), 1, 60.0, new_group=tuple)
    assert groups.shard is None and groups.replica(2) == (0, 1) and groups.tp_instance(2) is None
