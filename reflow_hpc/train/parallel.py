"""How a trainer replica lies over its workers, decided once (after torchtitan's ``parallelize_fn``).

:func:`parallelize` takes the model and the replica's shard group (``s_T`` workers: the
``shard`` group of :class:`~reflow_hpc.comm.groups.ProcessGroups`): for more than one worker it
shards the model with FSDP2 and returns a :class:`Sharded` layout, else it leaves the model whole
and returns a :class:`Replicated` one. Both have the same methods, and the trainer calls them
without asking which it holds; everything that differs between a sharded and an unsharded replica
is here.

- **Sharded start.** Every member starts from the first member's parameters (a broadcast before
  sharding), then every decoder layer and the root are ``fully_shard``-ed
  (:mod:`reflow_hpc.train.sharding`); tied parameters stay tied. Each member holds rows of every
  parameter, its gradient and its AdamW state, and trains on its own share of the batch; FSDP
  all-gathers a layer's parameters for its forward and backward and reduce-scatters the gradients
  with a *sum* (every micro-batch loss is already divided by the batch's loss tokens).
- **Micro-batch rounds.** FSDP's collectives run at every forward and backward, so the members
  run as many micro-batches as the one with the most (:meth:`Sharded.micro_batch_rounds`); one with
  fewer runs empty rounds that add nothing.
- **Gradient norm** (clipping, ``grad_norm``): the whole model's. Unsharded it is
  ``torch.nn.utils.clip_grad_norm_``; sharded, the squares of the local shards (float64) summed over
  the shard group, so counterparts, which hold the same sums, compute the same norm.
- **Full tensors.** :meth:`full_weights` yields every parameter whole for the weight sync: sharded,
  gathered over the shard group bucket by bucket (``trainer.sync_bucket_mb``) as the sync consumes
  them, while the other members run :meth:`join_weight_gather`. :meth:`full_model` and
  :meth:`full_state` gather the model and the optimizer state to the first member, on CPU, in the
  format of an unsharded replica (a checkpoint resumes with any ``s_T``) and return None on the
  others; :meth:`load_state` takes each member's rows of the full tensors, without a collective.

:class:`Collective` is a process group's side of it all: every call waits at most ``run.timeout_s``
and fails naming the rank, the operation and the step, and a group of one (or None) makes every
call a no-op — the shard group of an unsharded replica, the replica group of a single replica.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..comm.collective import bounded
from .buckets import specs_of
from .optim import adam_state
from .sharding import ShardGather, copy_full_into, is_sharded, local, shard_mesh, shard_model

Named = Sequence[tuple[str, torch.Tensor]]


class Collective:
    """Bounded collectives over ``group`` (module docstring); ``over`` names the group in errors."""

    def __init__(self, group: Any, *, rank: int, timeout_s: float, over: str = ""):
        self.size = dist.get_world_size(group) if group is not None else 1
        self.group = group if self.size > 1 else None
        self.rank, self.timeout_s, self.over = rank, timeout_s, over

    def all_reduce(self, t: torch.Tensor, op: Any, what: str, step: int) -> torch.Tensor:
        """``t`` reduced in place over the group (``step``: the update under way, for the error)."""
        if self.group is not None:
            bounded(self.rank, f"trainer all-reduce of {what}{self.over} (step {step})", self.timeout_s,
                    lambda: dist.all_reduce(t, op=op, group=self.group, async_op=True))
        return t

    def broadcast(self, named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
        """Every tensor of ``named`` from the group's first member, in place."""
        if self.group is None:
            return
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for name, t in named:
                bounded(self.rank, f"{what}: broadcast of {name} from rank {src}", self.timeout_s,
                        lambda: dist.broadcast(t, src=src, group=self.group, async_op=True))


def parallelize(model: Any, shard_group: Any, *, device: torch.device, rank: int, timeout_s: float,
                bucket_mb: float) -> "Replicated | Sharded":
    """Lay ``model`` (already on ``device``) over its replica's shard group; returns the layout. ``bucket_mb``
    sizes the buckets of the full-tensor gathers (``trainer.sync_bucket_mb``)."""
    if shard_group is not None and dist.get_world_size(shard_group) > 1:
        return Sharded(model, shard_group, device=device, rank=rank, timeout_s=timeout_s, bucket_mb=bucket_mb)
    return Replicated(rank=rank, timeout_s=timeout_s)


class Replicated:
    """A replica on one worker: the model stays whole and every method is the plain one."""
    shards = 1

    def __init__(self, *, rank: int, timeout_s: float):
        self.shard = Collective(None, rank=rank, timeout_s=timeout_s)

    def micro_batch_rounds(self, mine: int, step: int) -> int:
        return mine

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float, step: int) -> float:
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))

    def full_weights(self, model: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in model.named_parameters():
            yield name, p.detach()

    def join_weight_gather(self, model: Any) -> None:
        pass

    def full_model(self, model: Any) -> Any:
        return model

    def full_state(self, model: Any, optimizer: torch.optim.Optimizer, include_model: bool) -> dict | None:
        return {"optimizer": optimizer.state_dict(), "model": model.state_dict() if include_model else None}

    def load_state(self, model: Any, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if "model" in state:
            model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


class Sharded:
    """A replica FSDP2-sharded over its ``s_T`` workers (module docstring); ``index`` is this rank's place
    in the shard group, and member 0 keeps what is gathered for checkpoints and snapshots."""

    def __init__(self, model: Any, group: Any, *, device: torch.device, rank: int, timeout_s: float,
                 bucket_mb: float):
        self.shard = Collective(group, rank=rank, timeout_s=timeout_s, over=" over the shard group")
        self.shards, self.index = self.shard.size, dist.get_group_rank(group, rank)
        self.device, self.rank, self.timeout_s, self.bucket_mb = device, rank, timeout_s, bucket_mb
        # What a full copy of the model needs (checkpoints, snapshots): its class before fully_shard
        # subclasses it, its config, and which parameter names are second names of a tied tensor.
        self._model_class, self._model_config = type(model), model.config
        canonical = {id(p): n for n, p in model.named_parameters()}
        self._aliases = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
                         if canonical[id(p)] != n}
        # The shards put together must make one model: every member starts from the first member's.
        self.shard.broadcast(((n, p.data) for n, p in model.named_parameters()), "trainer shard group start")
        shard_model(model, shard_mesh(group, device))
        self._weights = self._gatherer(model.named_parameters())

    def _gatherer(self, named: Iterable[tuple[str, torch.Tensor]]) -> ShardGather:
        return ShardGather(specs_of(named), group=self.shard.group, shards=self.shards, index=self.index,
                           bucket_mb=self.bucket_mb, device=self.device, rank=self.rank, timeout_s=self.timeout_s)

    @staticmethod
    def _local_weights(model: Any) -> list[tuple[str, torch.Tensor]]:
        return [(n, local(p.detach())) for n, p in model.named_parameters()]

    # ------------------------------------------------------------------ the step

    def micro_batch_rounds(self, mine: int, step: int) -> int:
        """The most micro-batches any member has this step (module docstring)."""
        n = torch.tensor([mine], dtype=torch.int64, device=self.device)
        self.shard.all_reduce(n, dist.ReduceOp.MAX, "micro-batch count max", step)
        return int(n.item())

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float, step: int) -> float:
        """Norm of the whole model's gradient (before clipping); clipped to ``max_norm`` when > 0, as
        ``torch.nn.utils.clip_grad_norm_`` does."""
        grads = [local(p.grad) for p in params if p.grad is not None]
        with torch.no_grad():
            sq = torch.zeros(1, dtype=torch.float64, device=self.device)
            for g in grads:
                if g.numel():
                    sq += g.double().square().sum()
            self.shard.all_reduce(sq, dist.ReduceOp.SUM, "gradient norm", step)
            norm = float(sq.sqrt().item())
            if max_norm > 0 and grads:
                coef = min(max_norm / (norm + 1e-6), 1.0)
                torch._foreach_mul_(grads, coef)
        return norm

    # ------------------------------------------------------------------ full tensors

    def full_weights(self, model: Any) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._weights.gather(self._local_weights(model), what="trainer weight gather")

    def join_weight_gather(self, model: Any) -> None:
        for _ in self._weights.gather(self._local_weights(model), what="trainer weight gather", keep=False):
            pass

    def _gather_model(self, model: Any, keep: bool) -> dict[str, torch.Tensor]:
        weights = dict(self._weights.gather(self._local_weights(model), what="trainer full model gather",
                                            keep=keep, to_cpu=True))
        if keep:
            for alias, name in self._aliases.items():    # a tied tensor is the same tensor under both names
                weights[alias] = weights[name]
        return weights

    def full_model(self, model: Any) -> Any:
        keep = self.index == 0
        weights = self._gather_model(model, keep)
        if not keep:
            return None
        with torch.device("meta"):
            shell = self._model_class(self._model_config)
        shell.load_state_dict(weights, strict=False, assign=True)
        missing = [n for n, p in shell.named_parameters() if p.is_meta]
        if missing:
            raise RuntimeError(f"rank {self.rank}: full model: {len(missing)} parameters were not gathered, "
                               f"first {missing[0]}")
        return shell.eval()

    def full_state(self, model: Any, optimizer: torch.optim.Optimizer, include_model: bool) -> dict | None:
        keep = self.index == 0
        weights = self._gather_model(model, keep) if include_model else None
        osd = optimizer.state_dict()        # DTensors in "state"; their order is the same on every member
        entries = sorted(osd["state"].items())
        pieces = [(f"{i}.{k}", v) for i, st in entries for k, v in sorted(st.items()) if is_sharded(v)]
        full = dict(self._gatherer(pieces).gather([(n, local(v)) for n, v in pieces],
                                                  what="trainer optimizer state gather", keep=keep, to_cpu=True))
        if not keep:
            return None
        state = {i: {k: full[f"{i}.{k}"] if is_sharded(v) else v.detach().cpu().clone() for k, v in st.items()}
                 for i, st in entries}
        return {"optimizer": {"state": state, "param_groups": osd["param_groups"]}, "model": weights}

    def load_state(self, model: Any, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if "model" in state:
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name, value in state["model"].items():
                    if name in params:
                        copy_full_into(params[name].data, value.to(self.device))
        osd = state["optimizer"]
        params = [p for g in optimizer.param_groups for p in g["params"]]
        saved = [i for g in osd["param_groups"] for i in g["params"]]
        if len(saved) != len(params) or len(osd["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(f"rank {self.rank}: optimizer state of {len(saved)} parameters in "
                             f"{len(osd['param_groups'])} groups, this trainer has {len(params)} in "
                             f"{len(optimizer.param_groups)}")
        for group, saved_group in zip(optimizer.param_groups, osd["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        index = {i: p for i, p in zip(saved, params)}
        with torch.no_grad():
            for i, st in osd["state"].items():
                p = index[int(i)]
                mine = adam_state(optimizer, p)
                for key, value in st.items():
                    if key == "step":
                        mine["step"] = value.detach().to(dtype=mine["step"].dtype).clone()
                    else:
                        copy_full_into(mine[key], value.to(self.device, dtype=p.dtype))
