"""ppo's critic on a trainer replica (``[critic]``; formulas in :mod:`reflow_hpc.train.objectives.ppo`).

- **Model.** :class:`ValueModel`: a copy of the policy's transformer body (its warm-started weights) and a
  fresh value head, a linear layer hidden → 1 with small normal weights (``critic.head_init_std``, drawn
  from a generator seeded with ``run.seed``, so every rank draws the same). V of position t is the value of
  the state that predicts token t + 1, aligned with the loss mask.
- **Layout.** Laid over the replica's shard group exactly as the policy (:func:`~reflow_hpc.train.parallel.
  parallelize`: FSDP2-sharded or whole), with its own replica group side (:class:`~reflow_hpc.train.replicas.
  Replicas`): replicas start from the first one's critic and sum their critic gradients, so they stay
  bit-identical like the policy.
- **Optimizer.** AdamW with ``critic.lr`` (0: trainer.lr), weight decay, its own gradient clip and schedule
  (``critic.lr_warmup_steps``, ``schedule``, ``min_lr_ratio`` over ``trainer.steps``); β1, β2, ε of
  ``[trainer]``. A non-finite gradient norm skips the critic's update alone (``critic/nonfinite_grad``).
- **A step** (:meth:`Critic.advantages`, before the policy's micro-batches): per micro-batch, the critic's
  forward gives V with its gradient; V_old = V detached, rewards, GAE, returns, the value loss (a slice of
  the batch's token mean) and its backward. Then the advantages are whitened with the moments of the whole
  batch (summed over the shard group and the replicas). :meth:`Critic.update` sums the gradients across
  replicas, clips and steps.
- **State.** :meth:`Critic.state_tensors` (parameters and AdamW state, local shards) join the policy's in
  the replica check and the state sent to a joining replica; :meth:`Critic.meta` is its schedule point;
  :meth:`Critic.state_dict` (full tensors, a collective over the shard group) goes into checkpoints.
  Weight sync never sees it: only the policy's weights are sent.

Metrics (``critic/...``; ``trainer/critic/...`` in metrics.jsonl): ``value_loss``, ``explained_var``
(1 − Var(Ret − V_old)/Var(Ret) over the batch's loss tokens), ``values_mean``, ``returns_mean``,
``vf_clipfrac``, ``kl_reward`` (mean KL per loss token in the reward; 0 without kl_in_reward),
``advantages_raw_mean`` / ``advantages_raw_std`` (before whitening), ``grad_norm``, ``nonfinite_grad``,
``lr``, ``step`` (critic updates done) and ``policy_frozen`` (1 during the critic warm-up).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from . import gae
from .loss import kl_of_log_ratio
from .offload import Offload
from .optim import adam_state, apply_update, build_optimizer, build_scheduler
from .parallel import parallelize
from .replicas import Replicas
from .sharding import local

if TYPE_CHECKING:
    from ..config import Config

PREFIX = "critic/"


class ValueModel(torch.nn.Module):
    """The policy's transformer body (``model``: decoder layers at ``model.layers``, where the sharding finds
    them) and a value head; ``forward`` gives one float32 value per position, [B, L]."""

    def __init__(self, body: torch.nn.Module, hidden: int, dtype: torch.dtype, init_std: float, seed: int):
        super().__init__()
        self.model = body
        self.config = body.config
        self.value_head = torch.nn.Linear(hidden, 1, bias=True, dtype=dtype)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            w = torch.randn(self.value_head.weight.shape, generator=gen, dtype=torch.float64) * init_std
            self.value_head.weight.copy_(w)
            self.value_head.bias.zero_()

    @classmethod
    def from_policy(cls, policy: Any, init_std: float, seed: int) -> "ValueModel":
        body = copy.deepcopy(policy.base_model)
        dtype = next(body.parameters()).dtype
        return cls(body, int(policy.config.hidden_size), dtype, init_std, seed)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


class Critic:
    """The critic of one trainer rank (module docstring). ``policy`` is the policy model before it is laid out;
    ``group`` and ``shard_group`` are the trainer's replica and shard groups."""

    def __init__(self, policy: Any, cfg: "Config", device: torch.device, *, group: Any, shard_group: Any,
                 rank: int, timeout_s: float):
        c, a, tc = cfg.critic, cfg.algorithm, cfg.trainer
        self.cfg, self.device, self.rank = cfg, device, rank
        self.gamma, self.lam, self.eps = float(a.gae_gamma), float(a.gae_lambda), float(a.adv_eps)
        self.kl_coef = float(a.kl_coef) if a.kl_in_reward else 0.0
        self.kl_estimator = a.kl_estimator
        self.model = ValueModel.from_policy(policy, c.head_init_std, int(cfg.run.seed)).to(device)
        self.parallel = parallelize(self.model, shard_group, device=device, rank=rank, timeout_s=timeout_s,
                                    bucket_mb=tc.sync_bucket_mb)
        self._params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        opt_cfg = dataclasses.replace(tc, lr=c.lr or tc.lr, weight_decay=c.weight_decay,
                                      warmup_steps=c.lr_warmup_steps, schedule=c.schedule,
                                      min_lr_ratio=c.min_lr_ratio)
        self.optimizer = build_optimizer(self._params, opt_cfg)
        self.scheduler = build_scheduler(self.optimizer, opt_cfg)
        self.offload = Offload(self.optimizer, device)
        self.replicas = Replicas(group, self._params, device=device, rank=rank, timeout_s=timeout_s,
                                 bucket_mb=tc.allreduce_bucket_mb)
        self.replicas.start(self._params)
        self.step = 0
        self._sums = torch.zeros(len(gae.SUM_KEYS), dtype=torch.float64, device=device)

    @property
    def policy_frozen(self) -> bool:
        """The critic warm-up is under way: the policy is not run or updated this step."""
        return self.step < self.cfg.critic.warmup_steps

    def set_group(self, group: Any) -> None:
        self.replicas.set_group(group)

    def _allreduce_all(self, t: torch.Tensor, what: str, step: int) -> torch.Tensor:
        op = dist.ReduceOp.SUM
        return self.replicas.all_reduce(self.parallel.shard.all_reduce(t, op, what, step), op, what, step)

    # ------------------------------------------------------------------ the step

    def advantages(self, mbs: Sequence[Any], rounds: int, batch_loss_tokens: int, step: int,
                   ref_logp: Callable[[Any], torch.Tensor] | None) -> None:
        """Values, GAE and the value loss's backward for every micro-batch (``rounds`` of them, the shard group's
        most; empty rounds take part in FSDP's collectives), then whitening: each ``mb.advantages`` becomes the
        per-token advantage [B, S - 1]. ``ref_logp(mb)``: the reference policy's log-probs (KL in the reward)."""
        n_tokens = float(max(int(batch_loss_tokens), 1))
        clip = float(self.cfg.critic.value_clip)
        self._sums.zero_()
        adv_moments = torch.zeros(3, dtype=torch.float64, device=self.device)
        raw = []
        for i in range(rounds):
            if i >= len(mbs):
                ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
                (self.model(ids).sum() * 0.0).backward()
                continue
            mb = mbs[i]
            mask = mb.loss_mask.bool()
            values = self.model(mb.input_ids, mb.attention_mask, mb.position_ids)[:, :-1]
            old = values.detach()
            kl = None
            if self.kl_coef > 0 and ref_logp is not None:
                d = torch.where(mask, ref_logp(mb).double() - mb.behaviour_logp.double(),
                                torch.zeros(mask.shape, dtype=torch.float64, device=self.device))
                kl = kl_of_log_ratio(d, self.kl_estimator)
            rewards = gae.token_rewards(mask, mb.rewards, kl, self.kl_coef)
            adv, ret = gae.gae(old, rewards, mask, self.gamma, self.lam)
            per_token, clipped = gae.value_loss(values, old, ret, mask, clip)
            loss = per_token.sum() / n_tokens
            loss.backward()
            with torch.no_grad():
                f = mask.double()
                resid = (ret - old.double()) * f
                self._sums += torch.stack([
                    f.sum(), loss.detach(), (clipped.double() * f).sum(), (old.double() * f).sum(), ret.sum(),
                    (ret * ret).sum(), resid.sum(), (resid * resid).sum(),
                    (kl * f).sum() if kl is not None else f.sum() * 0, *gae.moments(adv, mask)[1:]])
                adv_moments += gae.moments(adv, mask)
            raw.append((mb, adv, mask))
        if self.cfg.critic.whiten_advantages:
            total = self._allreduce_all(adv_moments, "advantage moments", step)
            for mb, adv, mask in raw:
                mb.advantages = gae.whiten(adv, mask, total, self.eps)
        else:
            for mb, adv, _ in raw:
                mb.advantages = adv

    def update(self, step: int) -> dict[str, float]:
        """Sum the critic's gradients across replicas, clip, step (module docstring); the step's metrics."""
        self.replicas.sum_gradients(self._params, step)
        sums = dict(zip(gae.SUM_KEYS, self._allreduce_all(self._sums, "critic metrics sum", step).tolist()))
        lr = float(self.optimizer.param_groups[0]["lr"])
        frozen = self.policy_frozen
        norm = self.parallel.clip_grad_norm([p for _, p in self._params], self.cfg.critic.grad_clip, step)
        finite = math.isfinite(norm)
        apply_update(self.optimizer, self.scheduler, finite)
        self.step += 1
        n = sums["tokens"] or 1.0
        adv_mean = sums["adv"] / n
        return {
            "critic/value_loss": sums["value_loss"], "critic/explained_var": gae.explained_variance(sums),
            "critic/values_mean": sums["values"] / n, "critic/returns_mean": sums["returns"] / n,
            "critic/vf_clipfrac": sums["clipped"] / n, "critic/kl_reward": sums["kl_reward"] / n,
            "critic/advantages_raw_mean": adv_mean,
            "critic/advantages_raw_std": max(sums["adv_sq"] / n - adv_mean ** 2, 0.0) ** 0.5,
            "critic/grad_norm": norm, "critic/nonfinite_grad": 0.0 if finite else 1.0, "critic/lr": lr,
            "critic/step": float(self.step), "critic/policy_frozen": 1.0 if frozen else 0.0}

    # ------------------------------------------------------------------ state

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters and AdamW state (local shards), named ``critic/...``; as the policy's in the trainer."""
        out = []
        for name, p in self._params:
            st = adam_state(self.optimizer, p)
            out += [(PREFIX + name, local(p.data)), (f"{PREFIX}{name}.exp_avg", local(st["exp_avg"])),
                    (f"{PREFIX}{name}.exp_avg_sq", local(st["exp_avg_sq"])), (f"{PREFIX}{name}.step", st["step"])]
        return out

    def meta(self) -> dict[str, Any]:
        """The schedule point a joining replica needs besides the tensors (JSON)."""
        return {"step": self.step, "scheduler": self.scheduler.state_dict(),
                "lrs": [g["lr"] for g in self.optimizer.param_groups]}

    def load_meta(self, meta: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(meta["scheduler"])
        for g, lr in zip(self.optimizer.param_groups, meta["lrs"]):
            g["lr"] = lr
        self.step = int(meta["step"])
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any] | None:
        """Model, optimizer, schedule and step, full tensors on CPU (a collective over the shard group whose
        first member gets the result, the others None)."""
        full = self.parallel.full_state(self.model, self.optimizer, True)
        if full is None:
            return None
        model = {k: v.detach().cpu().clone() for k, v in full["model"].items()}
        return {"model": model, "optimizer": full["optimizer"], "scheduler": self.scheduler.state_dict(),
                "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.parallel.load_state(self.model, self.optimizer, state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.offload.reloaded()
