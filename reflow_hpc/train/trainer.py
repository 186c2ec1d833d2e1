"""One trainer replica: policy-gradient steps (the objective of ``algorithm.name``) on τ-weighted samples,
data parallel over ``n_T`` replicas of ``s_T``
workers each. It reads as model + optimizer + step + state; the parts around it are their own
modules: how the replica lies over its ``s_T`` workers, FSDP2-sharded or whole
(:mod:`reflow_hpc.train.parallel`), the replica group across replicas and a joining replica's state
transfer (:mod:`reflow_hpc.train.replicas`), colocated mode's offload (:mod:`reflow_hpc.train.offload`),
the loss (:mod:`reflow_hpc.train.loss`) and the schedule (:mod:`reflow_hpc.train.optim`).

- **A step.** ``train_step(items, batch_loss_tokens, batch_samples)`` gets this trainer rank's share of
  the batch (each item: trajectory, advantage, normalised weight, replay flag), ``N_batch``, the loss
  tokens of the whole batch over all ``n_T·s_T`` trainer ranks, and ``B``, its samples (by default
  ``trainer.batch_size``: every composed batch holds that many; read by the seq_mean aggregations).
  Samples are sorted by length (less padding)
  and run in micro-batches of at most ``trainer.micro_batch_size`` samples and, when
  ``trainer.micro_batch_tokens`` is set, at most that many padded tokens (:func:`micro_batches`): right
  padding, an attention mask,
  position ids ``0..L-1``; log-probs are recomputed as ``log_softmax(logits / rollout.temperature)``,
  as the rollout engine recorded them. Gradients accumulate over micro-batches; every micro-batch
  loss is already divided by the whole batch's normaliser (``N_batch``, ``B`` or ``B·L``,
  :mod:`reflow_hpc.train.loss`), so the gradients are *summed* over the replicas (and, in a
  sharded replica, over its members): the result is one replica's gradient on the full batch.
- **Update.** Clip the whole model's gradient norm to ``trainer.grad_clip`` (0 = report only), AdamW
  step, schedule step. A non-finite gradient norm skips the update on every replica alike (metric
  ``nonfinite_grad``) instead of poisoning the weights. Every ``trainer.check_replicas_every``
  steps the replicas compare their parameters and optimizer state.
- **Checks.** A sample whose first token is marked generated (nothing predicts it), a token outside
  the vocabulary, a non-finite advantage or weight, or an ``N_batch`` (or, when the aggregation
  reads it, a ``B``) that differs from what the trainer ranks actually hold fails with one line naming
  the sample or the numbers.
- **Critic.** An objective that ``uses_critic`` (ppo) gets a :class:`~reflow_hpc.train.critic.Critic`, laid out
  like the policy: before the policy's micro-batches it computes the per-token advantages (GAE, whitened over
  the batch) and takes its value loss's backward; after them it updates itself. During its warm-up
  (``critic.warmup_steps``) the policy is not run and not updated. Its parameters and optimizer state are
  part of :meth:`state_tensors` (replica checks, a joining replica's state) and of :meth:`state_dict`
  (checkpoints); never of :meth:`named_weights`.
- **State.** :meth:`named_weights` (the weight sync), :meth:`full_model` and :meth:`state_dict`
  (checkpoints, snapshots) give full tensors in the format of an unsharded replica — for a sharded
  one a collective over its shard group whose first member keeps the result (the others get None);
  :meth:`send_state` / :meth:`recv_state` make a new replica an exact copy of an existing one.

Metrics of a step: those of :func:`reflow_hpc.train.loss.loss_metrics` plus ``samples``,
``replay_samples``, ``tokens`` (prompt + response, all trainer ranks), ``loss_tokens``, ``lr`` (of this
update), ``grad_norm`` (before clipping), ``nonfinite_grad``, ``step`` (updates done), ``seconds``,
``forward_backward_seconds`` (sharded: with FSDP's all-gathers and reduce-scatters),
``allreduce_seconds`` (across replicas, and the metric sums), ``optimizer_seconds``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..comm.dist import guarded
from ..trajectory import Trajectory
from .loss import SUM_KEYS, LossSettings, empty_stats, loss_metrics, policy_loss, token_logprobs
from .offload import Offload
from .optim import adam_state, apply_update, build_optimizer, build_scheduler
from .parallel import parallelize
from .replicas import Replicas, recv_state, send_state
from .sharding import local

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
    advantages: torch.Tensor       # [B], or [B, L-1] once a critic has put per-token advantages here
    weights: torch.Tensor          # [B]
    tokens: int
    rewards: torch.Tensor          # [B], the samples' rewards (read by a critic)


def micro_batches(lengths: Sequence[int], max_samples: int, max_tokens: int = 0) -> list[slice]:
    """Consecutive runs of ``lengths`` (sorted ascending) of at most ``max_samples`` each and, with
    ``max_tokens`` > 0, at most that many padded tokens (count × the run's last, longest, length); a
    length above ``max_tokens`` is a run of its own. Greedy from the shortest, each run as long as the
    caps allow: no split of the sorted lengths into runs has fewer."""
    out: list[slice] = []
    start = 0
    for i, n in enumerate(lengths):
        count = i - start + 1
        if count > max_samples or (max_tokens > 0 and count > 1 and count * n > max_tokens):
            out.append(slice(start, i))
            start = i
    if start < len(lengths):
        out.append(slice(start, len(lengths)))
    return out


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
        tokens=int(attn.sum()), rewards=as_t(np.array([it.trajectory.reward for it in items], dtype=np.float64)))


class Trainer:
    """A trainer replica over ``model`` (a ``transformers`` causal LM); see the module docstring.

    ``cfg`` is the whole :class:`~reflow_hpc.config.Config` (``[trainer]``, ``[algorithm]`` and
    ``rollout.temperature`` are read). ``group`` is the process group of the trainer replicas — with
    sharding, of this rank's counterparts (the same shard index in every replica) — None for a single
    replica. ``shard_group`` is the process group of this replica's ``s_T`` workers, None (or a group
    of one) for an unsharded replica (:func:`~reflow_hpc.train.parallel.parallelize`). ``ref_model``
    is the frozen reference policy (held whole on every rank), required when ``algorithm.kl_coef >
    0`` and ignored otherwise.
    """

    def __init__(self, model: Any, cfg: "Config", device: str | torch.device, group: Any = None,
                 ref_model: Any = None, shard_group: Any = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.temperature = float(cfg.rollout.temperature)
        self.timeout_s = float(cfg.run.timeout_s)
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self.vocab_size = int(model.config.vocab_size)
        alg, tc = cfg.algorithm, cfg.trainer
        self.loss_settings = LossSettings.from_config(cfg)
        if alg.kl_coef > 0 and ref_model is None:
            raise ValueError(f"algorithm.kl_coef = {alg.kl_coef}: a reference model is needed (pass ref_model)")
        self.ref_model = None
        if alg.kl_coef > 0:
            self.ref_model = ref_model.to(self.device).eval().requires_grad_(False)
        self.model = model.to(self.device)
        self.critic = None
        if self.loss_settings.objective.uses_critic:     # a copy of the policy before it is laid out
            from .critic import Critic
            self.critic = Critic(self.model, cfg, self.device, group=group, shard_group=shard_group,
                                 rank=self.rank, timeout_s=self.timeout_s)
        self.parallel = parallelize(self.model, shard_group, device=self.device, rank=self.rank,
                                    timeout_s=self.timeout_s, bucket_mb=tc.sync_bucket_mb)
        self._params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self._params, tc)
        self.scheduler = build_scheduler(self.optimizer, tc)
        self.step = 0
        self._offload = Offload(self.optimizer, self.device)
        self.replicas = Replicas(group, self._params, device=self.device, rank=self.rank, timeout_s=self.timeout_s,
                                 bucket_mb=tc.allreduce_bucket_mb)
        self.replicas.start(self._params)

    def set_group(self, group: Any) -> None:
        """The replica group changed (a role switch): ``group`` holds every replica — with sharding, this
        rank's counterparts — None for one replica. The shard group never changes."""
        self.replicas.set_group(group)
        if self.critic is not None:
            self.critic.set_group(group)

    # ------------------------------------------------------------------ the step

    def train_step(self, items: Sequence[WeightedSample], batch_loss_tokens: int,
                   batch_samples: int | None = None) -> dict[str, float]:
        """One optimizer update on this replica's ``items``; collective over the replica and shard groups."""
        if batch_samples is None:
            batch_samples = int(self.cfg.trainer.batch_size)
        if self._offload.active:
            raise RuntimeError(f"rank {self.rank}: train_step on an offloaded trainer: call onload() first")
        t0 = time.perf_counter()
        self._check_items(items, batch_loss_tokens)
        self.model.train()
        tc = self.cfg.trainer
        lr = float(self.optimizer.param_groups[0]["lr"])
        sums, maxima = empty_stats(self.device)
        tokens = replay = 0
        order = sorted(items, key=lambda it: len(it.trajectory.tokens))
        chunks = [order[run] for run in micro_batches([len(it.trajectory.tokens) for it in order],
                                                      tc.micro_batch_size, tc.micro_batch_tokens)]
        rounds = self.parallel.micro_batch_rounds(len(chunks), self.step + 1)
        mbs = [collate(chunk, self.pad_id, self.device) for chunk in chunks]
        frozen = self.critic is not None and self.critic.policy_frozen
        with guarded(self.rank, f"trainer forward/backward over the shard group (step {self.step + 1})"):
            if self.critic is not None:
                ref = self._ref_logp if self.ref_model is not None else None
                self.critic.advantages(mbs, rounds, batch_loss_tokens, self.step + 1, ref)
            for i in range(rounds):
                if i >= len(chunks):
                    if not frozen:
                        self._idle_micro_step()
                    continue
                mb = mbs[i]
                if frozen:       # critic warm-up: the policy is not run; the batch is only counted
                    s, m = empty_stats(self.device)
                    s[SUM_KEYS.index("samples")], s[SUM_KEYS.index("loss_tokens")] = len(chunks[i]), mb.loss_mask.sum()
                else:
                    loss, s, m = self._micro_step(mb, batch_loss_tokens, batch_samples)
                    loss.backward()
                sums += s
                maxima = torch.maximum(maxima, m)
                tokens += mb.tokens
                replay += sum(1 for it in chunks[i] if it.is_replay)
        t1 = self._now()

        if not frozen:
            self.replicas.sum_gradients(self._params, self.step + 1)
        extra = torch.tensor([tokens, replay], dtype=torch.float64, device=self.device)
        totals = self._allreduce_all(torch.cat([sums, extra]), dist.ReduceOp.SUM, "step metrics sum")
        maxima = self._allreduce_all(maxima, dist.ReduceOp.MAX, "step metrics max")
        sums, (tokens_all, replay_all) = totals[:len(SUM_KEYS)], totals[len(SUM_KEYS):].tolist()
        held = int(round(float(sums[SUM_KEYS.index("loss_tokens")])))
        if held != int(batch_loss_tokens):
            self.optimizer.zero_grad(set_to_none=True)
            raise ValueError(f"rank {self.rank}: batch_loss_tokens = {batch_loss_tokens}, but the samples of the "
                             f"batch carry {held} loss tokens over all {self.replicas.size * self.parallel.shards} "
                             f"trainer ranks")
        held_samples = int(round(float(sums[SUM_KEYS.index("samples")])))
        if self.loss_settings.needs_samples and held_samples != int(batch_samples):
            self.optimizer.zero_grad(set_to_none=True)
            raise ValueError(f"rank {self.rank}: batch_samples = {batch_samples}, but the batch holds {held_samples} "
                             f"samples over all {self.replicas.size * self.parallel.shards} trainer ranks "
                             f"(algorithm.loss_agg = {self.loss_settings.loss_agg} divides by it)")
        t2 = self._now()

        critic_metrics = self.critic.update(self.step + 1) if self.critic is not None else {}
        grad_norm = 0.0
        if not frozen:
            grad_norm = self.parallel.clip_grad_norm([p for _, p in self._params], tc.grad_clip, self.step + 1)
        finite = math.isfinite(grad_norm)
        if frozen:          # the policy's optimizer and schedule stand still while the critic warms up
            self.optimizer.zero_grad(set_to_none=True)
        else:
            apply_update(self.optimizer, self.scheduler, finite)
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
        metrics.update(critic_metrics)
        return metrics

    def _idle_micro_step(self) -> None:
        """A forward and backward that adds nothing to any gradient: a member of a sharded replica with fewer
        micro-batches than the others takes part in FSDP's all-gathers and reduce-scatters of a round."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits
        (logits.sum() * 0.0).backward()

    def _micro_step(self, mb: MicroBatch, batch_loss_tokens: int, batch_samples: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                            position_ids=mb.position_ids, use_cache=False).logits
        logp, entropy = token_logprobs(logits[:, :-1], mb.input_ids[:, 1:], self.temperature,
                                       entropy_grad=self.loss_settings.entropy_coef > 0)
        del logits
        ref_logp = self._ref_logp(mb) if self.loss_settings.kl_coef > 0 else None
        return policy_loss(logp, mb.behaviour_logp, mb.loss_mask, mb.advantages, mb.weights,
                           batch_loss_tokens=batch_loss_tokens, batch_samples=batch_samples, ref_logp=ref_logp,
                           entropy=entropy, settings=self.loss_settings)

    def _ref_logp(self, mb: MicroBatch) -> torch.Tensor:
        """The frozen reference policy's log-probs of the micro-batch's tokens, [B, L-1]."""
        with torch.no_grad():
            ref_logits = self.ref_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                        position_ids=mb.position_ids, use_cache=False).logits
            ref_logp, _ = token_logprobs(ref_logits[:, :-1], mb.input_ids[:, 1:], self.temperature)
        return ref_logp

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

    def _allreduce_all(self, t: torch.Tensor, op: Any, what: str) -> torch.Tensor:
        """Over every trainer rank: the shard group, then the counterparts (a sum or maximum of sums or
        maxima over the shard groups)."""
        step = self.step + 1
        return self.replicas.all_reduce(self.parallel.shard.all_reduce(t, op, what, step), op, what, step)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def check_replicas(self) -> None:
        """Raise unless every replica holds the same parameters and optimizer state (sharded: each rank
        compares its local shards with its counterparts'; :meth:`~reflow_hpc.train.replicas.Replicas.check`)."""
        self.replicas.check(self.state_tensors, self.parallel.shard, self.step)

    # ------------------------------------------------------------------ a replica joins

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) in a fixed order — with
        sharding, this rank's local shards of them; state that does not exist yet (no update so far) is
        created as AdamW would, zero."""
        out = []
        for name, p in self._params:
            st = adam_state(self.optimizer, p)
            out += [(name, local(p.data)), (f"{name}.exp_avg", local(st["exp_avg"])),
                    (f"{name}.exp_avg_sq", local(st["exp_avg_sq"])), (f"{name}.step", st["step"])]
        return out + (self.critic.state_tensors() if self.critic is not None else [])

    def send_state(self, dst: int) -> int:
        """Send parameters, optimizer state and schedule to a new replica on rank ``dst``; returns bytes.
        With sharding ``dst`` is this rank's counterpart in the new replica and gets this rank's shards."""
        if self._offload.active:
            raise RuntimeError(f"rank {self.rank}: send_state from an offloaded trainer: call onload() first")
        meta = {"step": self.step, "scheduler": self.scheduler.state_dict(),
                "lrs": [g["lr"] for g in self.optimizer.param_groups]}
        if self.critic is not None:
            meta["critic"] = self.critic.meta()
        return send_state(self.state_tensors(), meta, dst, device=self.device, rank=self.rank,
                          timeout_s=self.timeout_s, bucket_mb=self.cfg.trainer.sync_bucket_mb)

    def recv_state(self, src: int) -> int:
        """Receive what :meth:`send_state` on rank ``src`` sends: this replica becomes an exact copy."""
        self.onload()
        meta, got = recv_state(self.state_tensors(), src, device=self.device, rank=self.rank,
                               timeout_s=self.timeout_s, bucket_mb=self.cfg.trainer.sync_bucket_mb)
        self.scheduler.load_state_dict(meta["scheduler"])
        for g, lr in zip(self.optimizer.param_groups, meta["lrs"]):
            g["lr"] = lr
        self.step = int(meta["step"])
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic.load_meta(meta["critic"])
        return got

    # ------------------------------------------------------------------ weights and state

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every parameter, as weight sync sends them (tied tensors once). Sharded: full
        tensors, gathered bucket by bucket over the shard group — a collective, so every other member
        runs :meth:`join_weight_gather` meanwhile (or consumes its own :meth:`named_weights`)."""
        return self.parallel.full_weights(self.model)

    def join_weight_gather(self) -> None:
        """A member of a sharded replica's side of :meth:`named_weights` on another member: the same
        gathers, nothing kept (a no-op for an unsharded replica)."""
        self.parallel.join_weight_gather(self.model)

    def full_model(self) -> Any:
        """The model with full parameters, for ``save_pretrained`` (checkpoints, snapshots). Sharded: a
        collective over the shard group that returns, on its first member, a copy of the model on CPU
        assembled from the gathered tensors, and None on the others."""
        return self.parallel.full_model(self.model)

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
        full = self.parallel.full_state(self.model, self.optimizer, include_model)
        critic = self.critic.state_dict() if self.critic is not None else None
        if full is None:
            return None
        state = {"optimizer": full["optimizer"], "scheduler": self.scheduler.state_dict(), "step": self.step}
        if critic is not None:
            state["critic"] = critic
        if include_model:
            state["model"] = full["model"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the model only when it is included). A sharded
        replica takes its rows of every full tensor: no collective."""
        self.parallel.load_state(self.model, self.optimizer, state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self._offload.reloaded()
        if self.critic is not None and "critic" in state:
            self.critic.load_state_dict(state["critic"])
        elif self.critic is not None and self.rank == 0:
            print("trainer: the checkpoint holds no critic (it was written by an objective without one): the "
                  "critic starts fresh from the policy's weights with a new value head and warms up again "
                  f"({self.cfg.critic.warmup_steps} step(s), critic.warmup_steps)", flush=True)

    # ------------------------------------------------------------------ colocated mode

    def offload(self) -> None:
        """Free the gradients and move the optimizer state (the critic's too) to CPU memory (a no-op on CPU;
        :mod:`reflow_hpc.train.offload`)."""
        self._offload.offload()
        if self.critic is not None:
            self.critic.offload.offload()

    def onload(self) -> None:
        """Undo :meth:`offload`."""
        self._offload.onload()
        if self.critic is not None:
            self.critic.offload.onload()

    @property
    def offloaded(self) -> bool:
        return self._offload.active
