"""The job's process groups as plain data (after torchtitan's ``ParallelDims``): which ranks form each
group, in every split of the workers that the elastic pool may take (DESIGN §7, §8).

``W`` workers, trainer replicas of ``s_T`` workers (``resources.trainer_shard_size``), rollout
instances of ``s_R`` workers (``resources.rollout_tp_size``). The split with ``n_T`` trainer replicas
(:class:`Split`) has

- **trainers**: ranks ``0 … n_T·s_T − 1`` (colocated: every rank), in whole **replicas** of ``s_T``
  consecutive ranks. A replica's ranks are its *parameter-shard group* (FSDP2). The blocks of ``s_T``
  tile the world from rank 0 and are the same in every split, so a worker that joins the trainers
  already holds its replica's shards (every worker pre-warms a trainer);
- **counterparts**: per shard index ``j``, rank ``j`` of every replica: the group whose all-reduce sums
  the gradients (their local shards) across replicas;
- **instances**: the rollout ranks in blocks of ``s_R`` consecutive ranks from ``n_T·s_T`` (colocated:
  from 0). An instance's first rank, its *leader*, is the rollout worker the coordinator knows; the
  block is its tensor-parallel group;
- **engine blocks**: with ``s_R > 1`` every split's trainer ranks fill whole blocks of ``s_R`` (``n_T·s_T``
  and ``W`` are multiples of it), so every instance of every split is one of the fixed blocks
  ``[b·s_R, (b+1)·s_R)`` that tile the world from rank 0, over which vLLM lays its own groups. Every
  rank builds its engine for its block at set-up; the block's first rank leads it in every split,
  and a split decides only whether the block generates or trains;
- **sync**: the weight-sync broadcast group, the first trainer and every instance leader (none when
  colocated: each worker loads its own replica's weights).

:meth:`ParallelDims.plan` lists every group to create in one order that depends on the dims alone,
never on the rank, so every rank creates the same groups in the same order (torch.distributed
requires it) and a switch between splits needs no new collective. A group of one rank is left out:
nothing travels in it. :mod:`reflow_hpc.comm.groups` creates the groups and names them.
"""

from __future__ import annotations

from dataclasses import dataclass

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class GroupSpec:
    """One process group to create: its kind (``shard``, ``tp_instance``, ``replica``, ``sync``), the
    split it belongs to (None: every split) and its ranks."""
    kind: str
    split: int | None
    ranks: Ranks


@dataclass(frozen=True)
class Split:
    """One split of the workers between the trainer and the rollout pool (module docstring)."""
    n_t: int                           # trainer replicas
    trainers: Ranks
    replicas: tuple[Ranks, ...]        # each replica's ranks: its parameter-shard group
    counterparts: tuple[Ranks, ...]    # per shard index: that rank of every replica
    instances: tuple[Ranks, ...]       # each rollout instance's ranks, its leader first
    sync: Ranks                        # the first trainer and every leader; () when colocated

    @property
    def rollouts(self) -> Ranks:
        """The rollout workers the coordinator knows: every instance's leader."""
        return tuple(inst[0] for inst in self.instances)

    def counterparts_of(self, rank: int) -> Ranks | None:
        return next((c for c in self.counterparts if rank in c), None)

    def instance_of(self, rank: int) -> Ranks | None:
        return next((inst for inst in self.instances if rank in inst), None)


@dataclass(frozen=True)
class ParallelDims:
    """The groups of a job: ``world`` workers, ``shard`` = s_T, ``tp`` = s_R, ``replicas`` = every
    trainer replica count n_T the pool may take (colocated: the one, ``world // shard``)."""
    world: int
    shard: int = 1
    tp: int = 1
    replicas: tuple[int, ...] = (1,)
    colocated: bool = False

    def __post_init__(self) -> None:
        w, s, tp = self.world, self.shard, self.tp
        if w < 1 or s < 1 or tp < 1:
            raise ValueError(f"parallel dims: world {w}, s_T {s} and s_R {tp} must be ≥ 1")
        object.__setattr__(self, "replicas", tuple(sorted(set(self.replicas))))
        if not self.replicas:
            raise ValueError("parallel dims: no trainer replica count to prepare")
        if self.colocated:
            if w % s or w % tp or self.replicas != (w // s,):
                raise ValueError(f"parallel dims: colocated, every rank trains and generates: world {w} must be a "
                                 f"multiple of s_T {s} and s_R {tp}, and n_T = {w // s}, not {self.replicas}")
            return
        if w % tp:
            raise ValueError(f"parallel dims: world {w} must be a multiple of s_R {tp}: the engine blocks tile it")
        for n_t in self.replicas:
            rest = w - n_t * s
            if n_t < 1 or rest < 0 or rest % tp:
                raise ValueError(f"parallel dims: {n_t} trainer replicas of {s} leave {rest} of {w} workers, "
                                 f"which must be ≥ 0 and a multiple of s_R {tp}")

    @property
    def shard_groups(self) -> tuple[Ranks, ...]:
        """Every replica's ranks, in every split: blocks of s_T from rank 0 (a trailing part block, which no
        split trains, has none)."""
        s = self.shard
        return tuple(tuple(range(b, b + s)) for b in range(0, self.world - s + 1, s))

    def shard_group_of(self, rank: int) -> Ranks | None:
        return next((g for g in self.shard_groups if rank in g), None)

    @property
    def engine_blocks(self) -> tuple[Ranks, ...]:
        """The blocks of s_R consecutive ranks from rank 0, fixed for the run (module docstring); with s_R = 1
        every rank alone."""
        tp = self.tp
        return tuple(tuple(range(b, b + tp)) for b in range(0, self.world, tp))

    def engine_block(self, rank: int) -> Ranks:
        """The engine block of ``rank``: its first rank leads the block's engine in every split."""
        first = rank - rank % self.tp
        return tuple(range(first, first + self.tp))

    def split(self, n_t: int) -> Split:
        if n_t not in self.replicas:
            raise KeyError(f"parallel dims: {n_t} trainer replicas is not a prepared split {self.replicas}")
        s, tp = self.shard, self.tp
        trainers = tuple(range(self.world if self.colocated else n_t * s))
        first = 0 if self.colocated else len(trainers)
        instances = tuple(tuple(range(b, b + tp)) for b in range(first, self.world, tp))
        sync = () if self.colocated else tuple(sorted({trainers[0], *(inst[0] for inst in instances)}))
        return Split(n_t, trainers, tuple(trainers[b:b + s] for b in range(0, len(trainers), s)),
                     tuple(trainers[j::s] for j in range(s)), instances, sync)

    @property
    def splits(self) -> tuple[Split, ...]:
        return tuple(self.split(n) for n in self.replicas)

    def plan(self) -> tuple[GroupSpec, ...]:
        """Every group of more than one rank, in creation order: the shard groups; the tensor-parallel
        groups (an instance that recurs in several splits once); per split, the counterparts by shard
        index, then the sync group."""
        out = [GroupSpec("shard", None, g) for g in self.shard_groups if len(g) > 1]
        seen: set[Ranks] = set()
        for sp in self.splits:
            for inst in sp.instances:
                if len(inst) > 1 and inst not in seen:
                    seen.add(inst)
                    out.append(GroupSpec("tp_instance", None, inst))
        for sp in self.splits:
            out += [GroupSpec("replica", sp.n_t, c) for c in sp.counterparts if len(c) > 1]
            if len(sp.sync) > 1:
                out.append(GroupSpec("sync", sp.n_t, sp.sync))
        return tuple(out)
