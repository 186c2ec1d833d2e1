"""One trainer replica: GRPO steps on τ-weighted samples, data parallel over ``n_T`` replicas of ``s_T``
workers each (``s_T > 1``: the replica is FSDP2-sharded, :mod:`reflow_hpc.train.sharding`).

Rules it implements (DESIGN §7; the loss itself is :mod:`reflow_hpc.train.loss`):

- **A step.** ``train_step(items, batch_loss_tokens)`` gets this trainer rank's share of the batch
  (each item: trajectory, advantage, normalised weight, replay flag) and ``N_batch``, the loss tokens
  of the whole batch over all ``n_T·s_T`` trainer ranks. Samples are sorted by length (less padding)
  and run in micro-batches of ``trainer.micro_batch_size``: right padding, an attention mask,
  position ids ``0..L-1``; log-probs are recomputed as ``log_softmax(logits / rollout.temperature)``,
  as the rollout engine recorded them. Gradients accumulate over micro-batches.
- **Replicas.** Every micro-batch loss is already divided by ``N_batch``, so the gradients are
  *summed* across the replica group (bucketed all-reduce, ``trainer.allreduce_bucket_mb``): the
  result is the gradient of one replica on the full batch. Replicas start from the parameters of
  the group's first rank (broadcast at construction) and apply identical updates to identical
  sums, so they stay bit-identical; :meth:`Trainer.check_replicas` verifies that cheaply. Every
  collective waits at most ``run.timeout_s`` and fails naming the rank, the step and the bucket.
- **Shards.** A replica of ``s_T > 1`` workers is one shard group (``shard_group``): every decoder
  layer and the root are ``fully_shard``-ed over it, each member holding rows of every parameter,
  its gradient and its AdamW state. Each member trains on its own share; FSDP all-gathers the
  parameters of a layer for its forward and backward and reduce-scatters the gradients with a
  *sum* (divide factor 1, for the reason above). The members must run as many micro-batches: one
  with fewer runs empty ones that add nothing. The replica group is then the member's
  *counterparts* — the ranks with the same shard index in every replica — and the bucketed
  all-reduce sums local gradient shards among them. The gradient norm (clipping, ``grad_norm``) is
  the whole model's: squares of the local shards summed over the shard group. Metric sums and
  maxima cover every trainer rank (the shard group, then the counterparts). The members start
  from the first member's parameters (broadcast before sharding); tied parameters stay tied. FSDP's
  own all-gathers and reduce-scatters are bounded by the shard group's timeout (``run.timeout_s``
  when the runtime makes it) and a failure in them names the rank and the step.
- **Update.** Clip the global gradient norm to ``trainer.grad_clip`` (0 = report only), AdamW step,
  schedule step (:mod:`reflow_hpc.train.optim`). A non-finite gradient norm skips the update on
  every replica alike (metric ``nonfinite_grad``) instead of poisoning the weights.
- **Replicas join.** When the elastic pool turns a worker into a new trainer replica, an existing
  replica sends it its parameters, its AdamW state and its schedule point (:meth:`send_state` /
  :meth:`recv_state`: point to point, in buckets of ``trainer.sync_bucket_mb``, every wait bounded);
  then both use the new replica group (:meth:`set_group`). No full gather, no restart. Sharded, the
  pool moves whole replicas and each worker sends its local shards to its counterpart in the new
  replica. ``trainer.check_replicas_every`` compares every replica's parameters and optimizer state
  (sharded: each shard with its counterparts'; the shard group shares the verdict).
- **Full tensors.** :meth:`named_weights` yields every parameter whole for the weight sync; sharded,
  it gathers them over the shard group bucket by bucket (buckets of ``trainer.sync_bucket_mb``) as
  the sync consumes them, while the other members run :meth:`join_weight_gather`. For checkpoints
  and evaluation snapshots :meth:`full_model` and :meth:`state_dict` gather the model and the
  optimizer state to the first member, on CPU, in the format of an unsharded replica (a checkpoint
  resumes with any ``s_T``); :meth:`load_state_dict` takes each member's rows, without a collective.
- **Checks.** A sample whose first token is marked generated (nothing predicts it), a token outside
  the vocabulary, a non-finite advantage or weight, or an ``N_batch`` that differs from the loss
  tokens the trainer ranks actually hold fails with one line naming the sample or the numbers.
- **Colocated mode.** :meth:`offload` frees gradients and, on CUDA, moves the optimizer state to
  CPU memory (sharded: the shards' storage, the DTensors stay in place); :meth:`onload` brings it
  back. On CPU both are cheap no-ops, but a step between them still fails, so a loop that forgets
  :meth:`onload` is caught on a laptop too.

Metrics of a step: those of :func:`reflow_hpc.train.loss.loss_metrics` plus ``samples``,
``replay_samples``, ``tokens`` (prompt + response, all trainer ranks), ``loss_tokens``, ``lr`` (of this
update), ``grad_norm`` (before clipping), ``nonfinite_grad``, ``step`` (updates done), ``seconds``,
``forward_backward_seconds`` (sharded: with FSDP's all-gathers and reduce-scatters),
``allreduce_seconds`` (across replicas, and the metric sums), ``optimizer_seconds``.
"""

from __future__ import annotations

import math
import pickle
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..comm.collective import bounded
from ..comm.dist import guarded
from ..trajectory import Trajectory
from .buckets import MB, pack, plan_buckets, specs_of, unpack
from .loss import SUM_KEYS, empty_stats, loss_metrics, policy_loss, token_logprobs
from .optim import build_optimizer, build_scheduler
from .sharding import ShardGather, copy_full_into, is_sharded, local, shard_mesh, shard_model

if TYPE_CHECKING:
    from ..config import Config


@dataclass
class WeightedSample:
    """One sample of a batch as the trainer sees it."""
    trajectory: Trajectory
    advantage: float        # A_i, group-normalised when the group completed
    weight: float           # w̃_i, normalised over the whole batch by the coordinator
    is_replay: bool = False


@dataclass
class MicroBatch:
    input_ids: torch.Tensor        # [B, L] right-padded
    attention_mask: torch.Tensor   # [B, L]
    position_ids: torch.Tensor     # [B, L]
    behaviour_logp: torch.Tensor   # [B, L-1], aligned with the predicted tokens input_ids[:, 1:]
    loss_mask: torch.Tensor        # [B, L-1]
    advantages: torch.Tensor       # [B]
    weights: torch.Tensor          # [B]
    tokens: int


def collate(items: Sequence[WeightedSample], pad_id: int, device: torch.device) -> MicroBatch:
    """Right-padded tensors of a micro-batch; position t predicts token t + 1."""
    width = max(len(it.trajectory.tokens) for it in items)
    b = len(items)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    attn = np.zeros((b, width), dtype=np.int64)
    beh = np.zeros((b, max(width - 1, 0)), dtype=np.float32)
    mask = np.zeros((b, max(width - 1, 0)), dtype=bool)
    for row, it in enumerate(items):
        t = it.trajectory
        n = len(t.tokens)
        ids[row, :n] = t.tokens
        attn[row, :n] = 1
        beh[row, :n - 1] = t.logprobs[1:]
        mask[row, :n - 1] = t.versions[1:] >= 0
    pos = np.tile(np.arange(width, dtype=np.int64), (b, 1))
    as_t = lambda a: torch.from_numpy(a).to(device, non_blocking=True)
    return MicroBatch(
        input_ids=as_t(ids), attention_mask=as_t(attn), position_ids=as_t(pos),
        behaviour_logp=as_t(beh), loss_mask=as_t(mask),
        advantages=as_t(np.array([it.advantage for it in items], dtype=np.float32)),
        weights=as_t(np.array([it.weight for it in items], dtype=np.float32)),
        tokens=int(attn.sum()))


class Trainer:
    """A trainer replica over ``model`` (a ``transformers`` causal LM); see the module docstring.

    ``cfg`` is the whole :class:`~reflow_hpc.config.Config` (``[trainer]``, ``[algorithm]`` and
    ``rollout.temperature`` are read). ``group`` is the torch.distributed process group of the
    trainer replicas — with sharding, of this rank's counterparts (the same shard index in every
    replica) — None for a single replica. ``shard_group`` is the process group of this replica's
    ``s_T`` workers, None (or a group of one) for an unsharded replica; the model is then
    ``fully_shard``-ed over it (:mod:`reflow_hpc.train.sharding`). ``ref_model`` is the frozen
    reference policy (held whole on every rank), required when ``algorithm.kl_coef > 0`` and
    ignored otherwise.
    """

    def __init__(self, model: Any, cfg: "Config", device: str | torch.device, group: Any = None,
                 ref_model: Any = None, shard_group: Any = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.group = group
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.replicas = dist.get_world_size(group) if group is not None else 1
        self.temperature = float(cfg.rollout.temperature)
        self.timeout_s = float(cfg.run.timeout_s)
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self.vocab_size = int(model.config.vocab_size)
        alg = cfg.algorithm
        if alg.kl_coef > 0 and ref_model is None:
            raise ValueError(f"algorithm.kl_coef = {alg.kl_coef}: a reference model is needed (pass ref_model)")
        self.ref_model = None
        if alg.kl_coef > 0:
            self.ref_model = ref_model.to(self.device).eval().requires_grad_(False)
        model = model.to(self.device)
        sharded = shard_group is not None and dist.get_world_size(shard_group) > 1
        self.shard_group = shard_group if sharded else None
        self.shards = dist.get_world_size(shard_group) if sharded else 1
        self.shard_index = dist.get_group_rank(shard_group, self.rank) if sharded else 0
        if sharded:
            # What a full copy of the model needs (checkpoints, snapshots): its class before fully_shard
            # subclasses it, its config, and which parameter names are second names of a tied tensor.
            self._model_class, self._model_config = type(model), model.config
            canonical = {id(p): n for n, p in model.named_parameters()}
            self._aliases = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
                             if canonical[id(p)] != n}
            self._broadcast_full_model(model)
            shard_model(model, shard_mesh(shard_group, self.device))
        self.model = model
        self._params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self._params, cfg.trainer)
        self.scheduler = build_scheduler(self.optimizer, cfg.trainer)
        self.step = 0
        self._offloaded = False
        self._moved: list[tuple[dict, str, Any]] = []
        # Gradients are summed across counterparts shard by shard: the plan is over this rank's local
        # shards, which every counterpart shapes alike (empty shards stay out of every bucket).
        self._grad_buckets = plan_buckets(self._local_specs(self._params), int(cfg.trainer.allreduce_bucket_mb * MB))
        self._weight_gather: ShardGather | None = None
        if sharded:
            self._weight_gather = self._gatherer(self.model.named_parameters())
        if self.replicas > 1:
            self._broadcast_parameters()

    def set_group(self, group: Any) -> None:
        """The replica group changed (a role switch): ``group`` holds every replica — with sharding, this
        rank's counterparts — None for one replica. The shard group never changes."""
        self.group = group
        self.replicas = dist.get_world_size(group) if group is not None else 1

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    @staticmethod
    def _local_specs(named: Sequence[tuple[str, torch.Tensor]]) -> list:
        return [s for s in specs_of((n, local(t)) for n, t in named) if s.numel > 0]

    def _gatherer(self, named: Iterator[tuple[str, torch.Tensor]] | Sequence[tuple[str, torch.Tensor]]) -> ShardGather:
        return ShardGather(specs_of(named), group=self.shard_group, shards=self.shards, index=self.shard_index,
                           bucket_mb=self.cfg.trainer.sync_bucket_mb, device=self.device, rank=self.rank,
                           timeout_s=self.timeout_s)

    # ------------------------------------------------------------------ the step

    def train_step(self, items: Sequence[WeightedSample], batch_loss_tokens: int) -> dict[str, float]:
        """One optimizer update on this replica's ``items``; collective over ``group``."""
        if self._offloaded:
            raise RuntimeError(f"rank {self.rank}: train_step on an offloaded trainer: call onload() first")
        t0 = time.perf_counter()
        self._check_items(items, batch_loss_tokens)
        self.model.train()
        tc = self.cfg.trainer
        lr = float(self.optimizer.param_groups[0]["lr"])
        sums, maxima = empty_stats(self.device)
        tokens = replay = 0
        order = sorted(items, key=lambda it: len(it.trajectory.tokens))
        chunks = [order[i:i + tc.micro_batch_size] for i in range(0, len(order), tc.micro_batch_size)]
        rounds = self._micro_batch_rounds(len(chunks))
        with guarded(self.rank, f"trainer forward/backward over the shard group (step {self.step + 1})"):
            for i in range(rounds):
                if i >= len(chunks):
                    self._idle_micro_step()
                    continue
                chunk = chunks[i]
                mb = collate(chunk, self.pad_id, self.device)
                loss, s, m = self._micro_step(mb, batch_loss_tokens)
                loss.backward()
                sums += s
                maxima = torch.maximum(maxima, m)
                tokens += mb.tokens
                replay += sum(1 for it in chunk if it.is_replay)
        t1 = self._now()

        self._allreduce_grads()
        extra = torch.tensor([tokens, replay], dtype=torch.float64, device=self.device)
        totals = self._allreduce_all(torch.cat([sums, extra]), dist.ReduceOp.SUM, "step metrics sum")
        maxima = self._allreduce_all(maxima, dist.ReduceOp.MAX, "step metrics max")
        sums, (tokens_all, replay_all) = totals[:len(SUM_KEYS)], totals[len(SUM_KEYS):].tolist()
        held = int(round(float(sums[SUM_KEYS.index("loss_tokens")])))
        if held != int(batch_loss_tokens):
            self.optimizer.zero_grad(set_to_none=True)
            raise ValueError(f"rank {self.rank}: batch_loss_tokens = {batch_loss_tokens}, but the samples of the "
                             f"batch carry {held} loss tokens over all {self.replicas * self.shards} trainer ranks")
        t2 = self._now()

        grad_norm = self._clip_grad_norm(tc.grad_clip)
        finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        else:
            with warnings.catch_warnings():   # torch warns when the schedule moves without an update
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        every = tc.check_replicas_every
        if every and self.step % every == 0:
            self.check_replicas()
        t3 = self._now()

        metrics = loss_metrics(sums, maxima)
        metrics.update({
            "samples": float(sums[SUM_KEYS.index("samples")]), "replay_samples": replay_all,
            "tokens": tokens_all, "loss_tokens": float(held), "lr": lr, "grad_norm": grad_norm,
            "nonfinite_grad": 0.0 if finite else 1.0, "step": float(self.step),
            "seconds": t3 - t0, "forward_backward_seconds": t1 - t0, "allreduce_seconds": t2 - t1,
            "optimizer_seconds": t3 - t2})
        return metrics

    def _micro_batch_rounds(self, mine: int) -> int:
        """Micro-batches every member of the shard group runs this step: the most any member has. FSDP
        all-gathers at every forward and reduce-scatters at every backward, so the members must run as
        many; one with fewer samples runs empty rounds."""
        if not self.sharded:
            return mine
        n = torch.tensor([mine], dtype=torch.int64, device=self.device)
        self._shard_allreduce(n, dist.ReduceOp.MAX, "micro-batch count max")
        return int(n.item())

    def _idle_micro_step(self) -> None:
        """A forward and backward that adds nothing to any gradient, so this member takes part in the
        shard group's all-gathers and reduce-scatters of a micro-batch it does not have."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits
        (logits.sum() * 0.0).backward()

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Norm of the whole model's gradient (before clipping); clipped to ``max_norm`` when > 0, as
        ``torch.nn.utils.clip_grad_norm_`` does. Sharded: the squares of the local shards summed over the
        shard group (counterparts hold the same sums, so every rank computes the same norm)."""
        params = [p for _, p in self._params]
        if not self.sharded:
            if max_norm > 0:
                return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            return float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        grads = [local(p.grad) for p in params if p.grad is not None]
        with torch.no_grad():
            sq = torch.zeros(1, dtype=torch.float64, device=self.device)
            for g in grads:
                if g.numel():
                    sq += g.double().square().sum()
            self._shard_allreduce(sq, dist.ReduceOp.SUM, "gradient norm")
            norm = float(sq.sqrt().item())
            if max_norm > 0 and grads:
                coef = min(max_norm / (norm + 1e-6), 1.0)
                torch._foreach_mul_(grads, coef)
        return norm

    def _micro_step(self, mb: MicroBatch, batch_loss_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                            position_ids=mb.position_ids, use_cache=False).logits
        logp, entropy = token_logprobs(logits[:, :-1], mb.input_ids[:, 1:], self.temperature)
        del logits
        ref_logp = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logits = self.ref_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                            position_ids=mb.position_ids, use_cache=False).logits
                ref_logp, _ = token_logprobs(ref_logits[:, :-1], mb.input_ids[:, 1:], self.temperature)
                del ref_logits
        alg = self.cfg.algorithm
        return policy_loss(logp, mb.behaviour_logp, mb.loss_mask, mb.advantages, mb.weights,
                           clip_low=alg.clip_low, clip_high=alg.clip_high, batch_loss_tokens=batch_loss_tokens,
                           ref_logp=ref_logp, kl_coef=alg.kl_coef, entropy=entropy)

    def _check_items(self, items: Sequence[WeightedSample], batch_loss_tokens: int) -> None:
        if batch_loss_tokens < 0:
            raise ValueError(f"rank {self.rank}: batch_loss_tokens = {batch_loss_tokens}: must be ≥ 0")
        for it in items:
            t = it.trajectory
            if len(t.versions) and t.versions[0] >= 0:
                raise ValueError(f"rank {self.rank}: sample {t.sample_id}: its first token is marked generated "
                                 f"(version {t.versions[0]}), but no position predicts it (prompt_len must be ≥ 1)")
            if len(t.tokens) and (int(t.tokens.max()) >= self.vocab_size or int(t.tokens.min()) < 0):
                raise ValueError(f"rank {self.rank}: sample {t.sample_id}: token ids outside the vocabulary "
                                 f"[0, {self.vocab_size})")
            if not (math.isfinite(it.advantage) and math.isfinite(it.weight) and it.weight >= 0):
                raise ValueError(f"rank {self.rank}: sample {t.sample_id}: advantage {it.advantage} and weight "
                                 f"{it.weight} must be finite, the weight ≥ 0")

    # ------------------------------------------------------------------ collectives

    def _allreduce(self, t: torch.Tensor, op: Any, what: str) -> torch.Tensor:
        """Over the replica group (with sharding: this rank's counterparts)."""
        if self.replicas > 1:
            bounded(self.rank, f"trainer all-reduce of {what} (step {self.step + 1})", self.timeout_s,
                    lambda: dist.all_reduce(t, op=op, group=self.group, async_op=True))
        return t

    def _shard_allreduce(self, t: torch.Tensor, op: Any, what: str) -> torch.Tensor:
        if self.sharded:
            bounded(self.rank, f"trainer all-reduce of {what} over the shard group (step {self.step + 1})",
                    self.timeout_s, lambda: dist.all_reduce(t, op=op, group=self.shard_group, async_op=True))
        return t

    def _allreduce_all(self, t: torch.Tensor, op: Any, what: str) -> torch.Tensor:
        """Over every trainer rank: the shard group, then the counterparts (a sum or maximum of sums or
        maxima over the shard groups)."""
        return self._allreduce(self._shard_allreduce(t, op, what), op, what)

    def _allreduce_grads(self) -> None:
        """Sum gradients across replicas bucket by bucket; a parameter without a gradient sends zeros. With
        sharding each rank sums its local gradient shard with its counterparts' (the shard group's
        reduce-scatter already summed the members' gradients into it)."""
        if self.replicas == 1:
            return
        params = dict(self._params)
        n = len(self._grad_buckets)
        for bucket in self._grad_buckets:
            grads = []
            for spec in bucket.specs:
                p = params[spec.name]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(local(p.grad))
            flat = pack(bucket, grads, self.device)
            self._allreduce(flat, dist.ReduceOp.SUM, f"gradients, {bucket.describe(n)}")
            if flat.data_ptr() != grads[0].data_ptr():    # packed into a new buffer: copy the sums back
                for g, v in zip(grads, unpack(bucket, flat)):
                    g.copy_(v)

    def _broadcast_parameters(self) -> None:
        """Replicas start from the first replica's parameters (with sharding: each shard from its
        counterpart in the first replica)."""
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for name, p in self._params:
                t = local(p.data)
                if t.numel():
                    bounded(self.rank, f"trainer replica start: broadcast of {name} from rank {src}", self.timeout_s,
                            lambda: dist.broadcast(t, src=src, group=self.group, async_op=True))

    def _broadcast_full_model(self, model: Any) -> None:
        """Before sharding: every member of the shard group starts from its first member's parameters, so
        that the shards put together make one model."""
        src = dist.get_global_rank(self.shard_group, 0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                bounded(self.rank, f"trainer shard group start: broadcast of {name} from rank {src}", self.timeout_s,
                        lambda: dist.broadcast(p.data, src=src, group=self.shard_group, async_op=True))

    def check_replicas(self) -> None:
        """Raise unless every replica holds the same parameters and optimizer state (per-tensor sums and
        sums of squares, compared by an all-reduce of their maxima and minima). With sharding each rank
        compares its local shards with its counterparts'."""
        if self.replicas == 1:
            return
        named = self.state_tensors()
        with torch.no_grad():
            checks = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()])
                                  for _, t in named]).reshape(-1)
        both = torch.cat([checks, -checks])
        self._allreduce(both, dist.ReduceOp.MAX, "replica checksums")
        hi, lo = both[:len(checks)], -both[len(checks):]
        differ = (hi != lo).reshape(-1, 2).any(dim=1).nonzero().flatten().tolist()
        # A shard that differs is seen by its counterparts only: the shard group shares the verdict, so
        # that every trainer rank fails alike.
        seen = self._shard_allreduce(torch.tensor([len(differ)], dtype=torch.int64, device=self.device),
                                     dist.ReduceOp.MAX, "replica check verdict")
        if differ:
            names = [named[i][0] for i in differ]
            raise RuntimeError(f"rank {self.rank}: trainer replicas diverged after step {self.step}: "
                               f"{len(names)} tensors differ, first {names[0]}")
        if int(seen.item()):
            raise RuntimeError(f"rank {self.rank}: trainer replicas diverged after step {self.step}: "
                               f"{int(seen.item())} tensors differ in another shard of this replica")

    # ------------------------------------------------------------------ a replica joins

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) in a fixed order — with
        sharding, this rank's local shards of them; state that does not exist yet (no update so far) is
        created as AdamW would, zero."""
        out = []
        for name, p in self._params:
            st = self._adam_state(p)
            out += [(name, local(p.data)), (f"{name}.exp_avg", local(st["exp_avg"])),
                    (f"{name}.exp_avg_sq", local(st["exp_avg_sq"])), (f"{name}.step", st["step"])]
        return out

    def _adam_state(self, p: torch.Tensor) -> dict:
        st = self.optimizer.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    def send_state(self, dst: int) -> int:
        """Send parameters, optimizer state and schedule to a new replica on rank ``dst``; returns bytes.
        With sharding ``dst`` is this rank's counterpart in the new replica and gets this rank's shards."""
        if self._offloaded:
            raise RuntimeError(f"rank {self.rank}: send_state from an offloaded trainer: call onload() first")
        meta = pickle.dumps({"step": self.step, "scheduler": self.scheduler.state_dict(),
                             "lrs": [g["lr"] for g in self.optimizer.param_groups]})
        head = torch.tensor([len(meta)], dtype=torch.int64, device=self.device)
        self._p2p(dist.isend, head, dst, "send_state: size")
        self._p2p(dist.isend, torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device), dst,
                  "send_state: schedule")
        named = self.state_tensors()
        tensors = dict(named)
        sent = 0
        buckets = self._state_buckets(named)
        for b in buckets:
            flat = pack(b, [tensors[sp.name] for sp in b.specs], self.device)
            self._p2p(dist.isend, flat, dst, f"send_state: {b.describe(len(buckets))}")
            sent += b.nbytes
        return sent

    def recv_state(self, src: int) -> int:
        """Receive what :meth:`send_state` on rank ``src`` sends: this replica becomes an exact copy."""
        if self._offloaded:
            self.onload()
        head = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._p2p(dist.irecv, head, src, "recv_state: size")
        raw = torch.empty(int(head[0]), dtype=torch.uint8, device=self.device)
        self._p2p(dist.irecv, raw, src, "recv_state: schedule")
        meta = pickle.loads(raw.cpu().numpy().tobytes())
        named = self.state_tensors()
        tensors = dict(named)
        got = 0
        buckets = self._state_buckets(named)
        with torch.no_grad():
            for b in buckets:
                flat = torch.empty(b.numel, dtype=b.dtype, device=self.device)
                self._p2p(dist.irecv, flat, src, f"recv_state: {b.describe(len(buckets))}")
                for sp, value in zip(b.specs, unpack(b, flat)):
                    tensors[sp.name].copy_(value)
                got += b.nbytes
        self.scheduler.load_state_dict(meta["scheduler"])
        for g, lr in zip(self.optimizer.param_groups, meta["lrs"]):
            g["lr"] = lr
        self.step = int(meta["step"])
        self.optimizer.zero_grad(set_to_none=True)
        return got

    def _state_buckets(self, named: list[tuple[str, torch.Tensor]]) -> list:
        return plan_buckets(self._local_specs(named), int(self.cfg.trainer.sync_bucket_mb * MB))

    def _p2p(self, op: Any, tensor: torch.Tensor, peer: int, what: str) -> None:
        bounded(self.rank, f"{what} ({'to' if op is dist.isend else 'from'} rank {peer})", self.timeout_s,
                lambda: op(tensor, peer))

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ weights and state

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every parameter, as weight sync sends them (tied tensors once). Sharded: full
        tensors, gathered bucket by bucket over the shard group — a collective, so every other member
        runs :meth:`join_weight_gather` meanwhile (or consumes its own :meth:`named_weights`)."""
        if not self.sharded:
            for name, p in self.model.named_parameters():
                yield name, p.detach()
            return
        yield from self._weight_gather.gather(self._local_weights(), what="trainer weight gather")

    def join_weight_gather(self) -> None:
        """A member of a sharded replica's side of :meth:`named_weights` on another member: the same
        gathers, nothing kept (a no-op for an unsharded replica)."""
        if self.sharded:
            for _ in self._weight_gather.gather(self._local_weights(), what="trainer weight gather", keep=False):
                pass

    def _local_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, local(p.detach())) for n, p in self.model.named_parameters()]

    def full_model(self) -> Any:
        """The model with full parameters, for ``save_pretrained`` (checkpoints, snapshots). Sharded: a
        collective over the shard group that returns, on its first member, a copy of the model on CPU
        assembled from the gathered tensors, and None on the others."""
        if not self.sharded:
            return self.model
        keep = self.shard_index == 0
        weights = dict(self._weight_gather.gather(self._local_weights(), what="trainer full model gather",
                                                  keep=keep, to_cpu=True))
        if not keep:
            return None
        for alias, name in self._aliases.items():       # a tied tensor is the same tensor under both names
            weights[alias] = weights[name]
        with torch.device("meta"):
            shell = self._model_class(self._model_config)
        shell.load_state_dict(weights, strict=False, assign=True)
        missing = [n for n, p in shell.named_parameters() if p.is_meta]
        if missing:
            raise RuntimeError(f"rank {self.rank}: full model: {len(missing)} parameters were not gathered, "
                               f"first {missing[0]}")
        return shell.eval()

    def checkpoint_state(self) -> tuple[Any, dict[str, Any] | None]:
        """(model with full parameters, :meth:`state_dict` without the model) for a checkpoint: on a
        sharded replica a collective over the shard group whose first member gets both and the others
        (None, None)."""
        return self.full_model(), self.state_dict(include_model=False)

    @property
    def lr(self) -> float:
        """Learning rate of the next update."""
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self, include_model: bool = True) -> dict[str, Any] | None:
        """Optimizer, schedule, step and (``include_model``) the model's state dict. Sharded: a collective
        over the shard group that returns on its first member the state an unsharded replica would
        (full tensors on CPU, the same format, so a checkpoint resumes with any ``s_T``), None on the
        others."""
        if self.sharded:
            return self._full_state_dict(include_model)
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "step": self.step}
        if include_model:
            state["model"] = self.model.state_dict()
        return state

    def _full_state_dict(self, include_model: bool) -> dict[str, Any] | None:
        keep = self.shard_index == 0
        model = None
        if include_model:
            model = dict(self._weight_gather.gather(self._local_weights(), what="trainer full model gather",
                                                    keep=keep, to_cpu=True))
            if keep:
                for alias, name in self._aliases.items():
                    model[alias] = model[name]
        osd = self.optimizer.state_dict()        # DTensors in "state"; their order is the same on every member
        entries = sorted(osd["state"].items())
        pieces = [(f"{i}.{k}", v) for i, st in entries for k, v in sorted(st.items()) if is_sharded(v)]
        full = dict(self._gatherer(pieces).gather([(n, local(v)) for n, v in pieces],
                                                  what="trainer optimizer state gather", keep=keep, to_cpu=True))
        if not keep:
            return None
        state = {i: {k: full[f"{i}.{k}"] if is_sharded(v) else v.detach().cpu().clone() for k, v in st.items()}
                 for i, st in entries}
        optimizer = {"state": state, "param_groups": osd["param_groups"]}
        out = {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(), "step": self.step}
        if include_model:
            out["model"] = model
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the model only when it is included). A sharded
        replica takes its rows of every full tensor: no collective."""
        if self.sharded:
            self._load_full_state(state)
        else:
            if "model" in state:
                self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        if self._offloaded:   # the optimizer moved its loaded state next to the parameters
            self._moved.clear()
            self._offloaded = False
            self.offload()

    def _load_full_state(self, state: dict[str, Any]) -> None:
        if "model" in state:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, value in state["model"].items():
                    if name in params:
                        copy_full_into(params[name].data, value.to(self.device))
        osd = state["optimizer"]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        saved = [i for g in osd["param_groups"] for i in g["params"]]
        if len(saved) != len(params) or len(osd["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(f"rank {self.rank}: optimizer state of {len(saved)} parameters in "
                             f"{len(osd['param_groups'])} groups, this trainer has {len(params)} in "
                             f"{len(self.optimizer.param_groups)}")
        for group, saved_group in zip(self.optimizer.param_groups, osd["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        index = {i: p for i, p in zip(saved, params)}
        with torch.no_grad():
            for i, st in osd["state"].items():
                p = index[int(i)]
                mine = self._adam_state(p)
                for key, value in st.items():
                    if key == "step":
                        mine["step"] = value.detach().to(dtype=mine["step"].dtype).clone()
                    else:
                        copy_full_into(mine[key], value.to(self.device, dtype=p.dtype))

    # ------------------------------------------------------------------ colocated mode

    def offload(self) -> None:
        """Free the gradients and move the optimizer state to CPU memory (a no-op on CPU)."""
        if self._offloaded:
            return
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type != "cpu":
            pin = self.device.type == "cuda"
            freed = []
            for st in self.optimizer.state.values():
                for key, value in st.items():
                    if not torch.is_tensor(value) or value.device.type == "cpu":
                        continue
                    mine = local(value)
                    cpu = torch.empty(mine.shape, dtype=mine.dtype, pin_memory=pin)
                    cpu.copy_(mine, non_blocking=True)
                    if is_sharded(value):
                        # A DTensor stays in the state (it carries the mesh and placement); only the
                        # storage of its shard is emptied, and refilled by onload().
                        storage = mine.untyped_storage()
                        self._moved.append((st, key, (cpu, storage.nbytes())))
                        freed.append(storage)
                    else:
                        st[key] = cpu
                        self._moved.append((st, key, None))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for storage in freed:
                storage.resize_(0)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._offloaded = True

    def onload(self) -> None:
        """Undo :meth:`offload`."""
        if not self._offloaded:
            return
        for st, key, kept in self._moved:
            if kept is None:
                st[key] = st[key].to(self.device, non_blocking=True)
            else:
                cpu, nbytes = kept
                mine = local(st[key])
                mine.untyped_storage().resize_(nbytes)
                mine.copy_(cpu, non_blocking=True)
        self._moved.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._offloaded = False

    @property
    def offloaded(self) -> bool:
        return self._offloaded
