"""One trainer replica: GRPO steps on τ-weighted samples, data parallel over ``n_T`` replicas.

Rules it implements (DESIGN §7; the loss itself is :mod:`reflow_hpc.train.loss`):

- **A step.** ``train_step(items, batch_loss_tokens)`` gets this replica's share of the batch (each
  item: trajectory, advantage, normalised weight, replay flag) and ``N_batch``, the loss tokens of
  the whole batch over all replicas. Samples are sorted by length (less padding) and run in
  micro-batches of ``trainer.micro_batch_size``: right padding, an attention mask, position ids
  ``0..L-1``; log-probs are recomputed as ``log_softmax(logits / rollout.temperature)``, as the
  rollout engine recorded them. Gradients accumulate over micro-batches.
- **Replicas.** Every micro-batch loss is already divided by ``N_batch``, so the gradients are
  *summed* across the replica group (bucketed all-reduce, ``trainer.allreduce_bucket_mb``): the
  result is the gradient of one replica on the full batch. Replicas start from the parameters of
  the group's first rank (broadcast at construction) and apply identical updates to identical
  sums, so they stay bit-identical; :meth:`Trainer.check_replicas` verifies that cheaply. Every
  collective waits at most ``run.timeout_s`` and fails naming the rank, the step and the bucket.
- **Update.** Clip the global gradient norm to ``trainer.grad_clip`` (0 = report only), AdamW step,
  schedule step (:mod:`reflow_hpc.train.optim`). A non-finite gradient norm skips the update on
  every replica alike (metric ``nonfinite_grad``) instead of poisoning the weights.
- **Replicas join.** When the elastic pool turns a worker into a new trainer replica, an existing
  replica sends it its parameters, its AdamW state and its schedule point (:meth:`send_state` /
  :meth:`recv_state`: point to point, in buckets of ``trainer.sync_bucket_mb``, every wait bounded);
  then both use the new replica group (:meth:`set_group`). No full gather, no restart.
  ``trainer.check_replicas_every`` compares every replica's parameters and optimizer state.
- **Checks.** A sample whose first token is marked generated (nothing predicts it), a token outside
  the vocabulary, a non-finite advantage or weight, or an ``N_batch`` that differs from the loss
  tokens the replicas actually hold fails with one line naming the sample or the numbers.
- **Colocated mode.** :meth:`offload` frees gradients and, on CUDA, moves the optimizer state to
  CPU memory; :meth:`onload` brings it back. On CPU both are cheap no-ops, but a step between them
  still fails, so a loop that forgets :meth:`onload` is caught on a laptop too.

Metrics of a step: those of :func:`reflow_hpc.train.loss.loss_metrics` plus ``samples``,
``replay_samples``, ``tokens`` (prompt + response, all replicas), ``loss_tokens``, ``lr`` (of this
update), ``grad_norm`` (before clipping), ``nonfinite_grad``, ``step`` (updates done), ``seconds``,
``forward_backward_seconds``, ``allreduce_seconds``, ``optimizer_seconds``.
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
from ..trajectory import Trajectory
from .buckets import MB, pack, plan_buckets, specs_of, unpack
from .loss import SUM_KEYS, empty_stats, loss_metrics, policy_loss, token_logprobs
from .optim import build_optimizer, build_scheduler

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
    trainer replicas, None for a single replica. ``ref_model`` is the frozen reference policy,
    required when ``algorithm.kl_coef > 0`` and ignored otherwise.
    """

    def __init__(self, model: Any, cfg: "Config", device: str | torch.device, group: Any = None,
                 ref_model: Any = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.model = model.to(self.device)
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
        self._params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self._params, cfg.trainer)
        self.scheduler = build_scheduler(self.optimizer, cfg.trainer)
        self.step = 0
        self._offloaded = False
        self._moved: list[tuple[dict, str]] = []
        self._grad_buckets = plan_buckets(specs_of(self._params), int(cfg.trainer.allreduce_bucket_mb * MB))
        if self.replicas > 1:
            self._broadcast_parameters()

    def set_group(self, group: Any) -> None:
        """The replica group changed (a role switch): ``group`` holds every replica, None for one replica."""
        self.group = group
        self.replicas = dist.get_world_size(group) if group is not None else 1

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
        for start in range(0, len(order), tc.micro_batch_size):
            chunk = order[start:start + tc.micro_batch_size]
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
        totals = self._allreduce(torch.cat([sums, extra]), dist.ReduceOp.SUM, "step metrics sum")
        maxima = self._allreduce(maxima, dist.ReduceOp.MAX, "step metrics max")
        sums, (tokens_all, replay_all) = totals[:len(SUM_KEYS)], totals[len(SUM_KEYS):].tolist()
        held = int(round(float(sums[SUM_KEYS.index("loss_tokens")])))
        if held != int(batch_loss_tokens):
            self.optimizer.zero_grad(set_to_none=True)
            raise ValueError(f"rank {self.rank}: batch_loss_tokens = {batch_loss_tokens}, but the samples of the "
                             f"batch carry {held} loss tokens over all {self.replicas} trainer replicas")
        t2 = self._now()

        params = [p for _, p in self._params]
        if tc.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip))
        else:
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
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
        if self.replicas > 1:
            bounded(self.rank, f"trainer all-reduce of {what} (step {self.step + 1})", self.timeout_s,
                    lambda: dist.all_reduce(t, op=op, group=self.group, async_op=True))
        return t

    def _allreduce_grads(self) -> None:
        """Sum gradients across replicas bucket by bucket; a parameter without a gradient sends zeros."""
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
                grads.append(p.grad)
            flat = pack(bucket, grads, self.device)
            self._allreduce(flat, dist.ReduceOp.SUM, f"gradients, {bucket.describe(n)}")
            if flat.data_ptr() != grads[0].data_ptr():    # packed into a new buffer: copy the sums back
                for g, v in zip(grads, unpack(bucket, flat)):
                    g.copy_(v)

    def _broadcast_parameters(self) -> None:
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for name, p in self._params:
                bounded(self.rank, f"trainer replica start: broadcast of {name} from rank {src}", self.timeout_s,
                        lambda: dist.broadcast(p.data, src=src, group=self.group, async_op=True))

    def check_replicas(self) -> None:
        """Raise unless every replica holds the same parameters and optimizer state (per-tensor sums and
        sums of squares, compared by an all-reduce of their maxima and minima)."""
        if self.replicas == 1:
            return
        named = self.state_tensors()
        with torch.no_grad():
            local = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()])
                                 for _, t in named]).reshape(-1)
        both = torch.cat([local, -local])
        self._allreduce(both, dist.ReduceOp.MAX, "replica checksums")
        hi, lo = both[:len(local)], -both[len(local):]
        differ = (hi != lo).reshape(-1, 2).any(dim=1).nonzero().flatten().tolist()
        if differ:
            names = [named[i][0] for i in differ]
            raise RuntimeError(f"rank {self.rank}: trainer replicas diverged after step {self.step}: "
                               f"{len(names)} tensors differ, first {names[0]}")

    # ------------------------------------------------------------------ a replica joins

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) in a fixed order; state that
        does not exist yet (no update so far) is created as AdamW would, zero."""
        out = []
        for name, p in self._params:
            st = self.optimizer.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out += [(name, p.data), (f"{name}.exp_avg", st["exp_avg"]), (f"{name}.exp_avg_sq", st["exp_avg_sq"]),
                    (f"{name}.step", st["step"])]
        return out

    def send_state(self, dst: int) -> int:
        """Send parameters, optimizer state and schedule to a new replica on rank ``dst``; returns bytes."""
        if self._offloaded:
            raise RuntimeError(f"rank {self.rank}: send_state from an offloaded trainer: call onload() first")
        meta = pickle.dumps({"step": self.step, "scheduler": self.scheduler.state_dict(),
                             "lrs": [g["lr"] for g in self.optimizer.param_groups]})
        head = torch.tensor([len(meta)], dtype=torch.int64)
        self._p2p(dist.isend, head, dst, "send_state: size")
        self._p2p(dist.isend, torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst, "send_state: schedule")
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
        head = torch.zeros(1, dtype=torch.int64)
        self._p2p(dist.irecv, head, src, "recv_state: size")
        raw = torch.empty(int(head[0]), dtype=torch.uint8)
        self._p2p(dist.irecv, raw, src, "recv_state: schedule")
        meta = pickle.loads(raw.numpy().tobytes())
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
        return plan_buckets(specs_of(named), int(self.cfg.trainer.sync_bucket_mb * MB))

    def _p2p(self, op: Any, tensor: torch.Tensor, peer: int, what: str) -> None:
        bounded(self.rank, f"{what} ({'to' if op is dist.isend else 'from'} rank {peer})", self.timeout_s,
                lambda: op(tensor, peer))

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ weights and state

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every parameter, as weight sync sends them (tied tensors once)."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    @property
    def lr(self) -> float:
        """Learning rate of the next update."""
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self, include_model: bool = True) -> dict[str, Any]:
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "step": self.step}
        if include_model:
            state["model"] = self.model.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the model only when it is included)."""
        if "model" in state:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        if self._offloaded:   # the optimizer moved its loaded state next to the parameters
            self._moved.clear()
            self._offloaded = False
            self.offload()

    # ------------------------------------------------------------------ colocated mode

    def offload(self) -> None:
        """Free the gradients and move the optimizer state to CPU memory (a no-op on CPU)."""
        if self._offloaded:
            return
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type != "cpu":
            pin = self.device.type == "cuda"
            for st in self.optimizer.state.values():
                for key, value in st.items():
                    if torch.is_tensor(value) and value.device.type != "cpu":
                        cpu = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin)
                        cpu.copy_(value, non_blocking=True)
                        st[key] = cpu
                        self._moved.append((st, key))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
        self._offloaded = True

    def onload(self) -> None:
        """Undo :meth:`offload`."""
        if not self._offloaded:
            return
        for st, key in self._moved:
            st[key] = st[key].to(self.device, non_blocking=True)
        self._moved.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._offloaded = False

    @property
    def offloaded(self) -> bool:
        return self._offloaded
