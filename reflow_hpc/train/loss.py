"""The policy loss around an objective (``algorithm.name``), and its metrics.

Rules (DESIGN §2, §7):

- Each sample i carries an advantage ``A_i`` (computed once, when its group completed, by the
  objective's estimator) and a loss weight ``w̃_i`` already normalised over the whole batch by the
  coordinator (1 for an unused sample, τ for a replayed one, divided by ``Z`` so that the mean weight
  is 1 — token-weighted, or per sample under ``seq_mean_token_mean``).
- Token t of sample i is in the loss when the policy generated it (``mask``, i.e. ``versions >= 0``);
  prompt, tool-observation and padding tokens contribute nothing.
- The objective gives the policy-gradient term ``pg_t`` of each token
  (:mod:`reflow_hpc.train.objectives`); GRPO's is PPO's clip against the policy that generated the
  token: ``r_t = exp(logp_t - logp^b_t)``, ``pg_t = -min(r_t A_i, clip(r_t, 1 - clip_low, 1 + clip_high) A_i)``.
- Off-policy correction (``is_cap > 0``; AReaL's decoupled PPO, verl's rollout correction): the ratio
  and its clip are taken against the proximal policy — the trainer's log-probs at the start of the
  step; the trainer takes one optimizer step per batch, so that is the current policy, detached — and
  ``pg_t`` is multiplied by ``ω_t = π_prox/π_behav`` (per token, or per sample as the product over its
  tokens), truncated at ``is_cap`` (``truncate``) or set to 0 above it, and below ``is_low`` when that
  is set (``mask``). With ``is_cap = 0``
  nothing changes: the ratio is against the behaviour log-probs, as in GRPO above.
- Optional KL to a frozen reference policy (weight ``kl_coef``, estimator ``kl_estimator``, see
  :func:`kl_estimate`) and an entropy bonus (``-entropy_coef · H_t``) are added per token.
- Aggregate ``ℓ_it = pg_it + kl_coef·kl_it - entropy_coef·H_it`` with the weights over the *whole* batch
  (every micro-batch on every trainer replica; N = loss tokens, B = samples, L = rollout.max_new_tokens):

      token_mean               Σ_i w̃_i Σ_t ℓ_it / N
      seq_mean_token_sum       Σ_i w̃_i Σ_t ℓ_it / B
      seq_mean_token_mean      Σ_i w̃_i (Σ_t ℓ_it / n_i) / B
      seq_mean_token_sum_norm  Σ_i w̃_i Σ_t ℓ_it / (B · L)

  Each micro-batch's loss is therefore a slice of one global sum: summing gradients over micro-batches
  and replicas gives exactly the gradient of the full batch on one replica.

Metrics (names are API): ``loss``, ``pg_loss`` (the policy-gradient part of ``loss``), ``kl`` (mean
KL estimate to the reference per loss token; 0 without one), ``entropy`` (mean policy entropy per
loss token), ``clip_fraction`` (loss tokens whose clip is binding, i.e. get no gradient; cispo: whose
weight is capped, they keep their gradient),
``ratio/mean``, ``ratio/max`` (the objective's ratio: per token, or per sample for gspo),
``approx_kl`` (mean k3 estimate of KL(behaviour ‖ current) per loss token), ``advantages/mean`` and
``weights/mean`` (per sample), ``rollout_is/mean``, ``rollout_is/max`` (π_prox/π_behav per loss token
before the cap; per sample at ``is_level = sequence``) and ``rollout_is/capped_fraction`` (loss
tokens whose weight was above ``is_cap``; 0 when the correction is off).

Everything here is a pure function of tensors. Statistics leave as two small float64 vectors
(sums and maxima, see :data:`SUM_KEYS` / :data:`MAX_KEYS`) so that a trainer can add them over
micro-batches and all-reduce them across replicas in one collective each, then call
:func:`loss_metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .objectives import make_objective
from .objectives.base import Objective

SUM_KEYS = ("samples", "loss_tokens", "loss", "pg_loss", "kl", "entropy", "clipped", "ratio", "approx_kl",
            "advantage", "weight", "is_weight", "is_capped")
MAX_KEYS = ("ratio_max", "is_max")
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


@dataclass(frozen=True)
class LossSettings:
    """Everything of ``[algorithm]`` the loss reads, with the objective it selects."""
    objective: Objective
    loss_agg: str = "token_mean"
    max_response_len: int = 0          # L of seq_mean_token_sum_norm: rollout.max_new_tokens
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    is_cap: float = 0.0                # 0 = no off-policy correction
    is_level: str = "token"
    is_mode: str = "truncate"
    is_low: float = 0.0                # mask: weights below it are zeroed too (0 = no lower bound)

    def __post_init__(self) -> None:
        if self.loss_agg not in AGGREGATIONS:
            raise ValueError(f"algorithm.loss_agg = {self.loss_agg!r}: allowed: " + ", ".join(AGGREGATIONS))
        if self.loss_agg == "seq_mean_token_sum_norm" and self.max_response_len < 1:
            raise ValueError("seq_mean_token_sum_norm needs max_response_len ≥ 1 (rollout.max_new_tokens)")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"algorithm.kl_estimator = {self.kl_estimator!r}: allowed: " + ", ".join(KL_ESTIMATORS))
        if self.is_level not in ("token", "sequence") or self.is_mode not in ("truncate", "mask"):
            raise ValueError(f"algorithm.is_level = {self.is_level!r}, is_mode = {self.is_mode!r}: allowed: "
                             f"token|sequence, truncate|mask")

    @property
    def needs_samples(self) -> bool:
        """Whether the aggregation divides by the batch's sample count B."""
        return self.loss_agg != "token_mean"

    @classmethod
    def from_config(cls, cfg: Any) -> "LossSettings":
        """From a whole config: ``[algorithm]`` and ``rollout.max_new_tokens``."""
        from ..config import objective_traits
        a = cfg.algorithm
        # KL in the reward (ppo): the critic's rewards carry it, the loss adds none.
        return cls(objective=make_objective(a), loss_agg=objective_traits(cfg)[1],
                   max_response_len=int(cfg.rollout.max_new_tokens),
                   kl_coef=0.0 if getattr(a, "kl_in_reward", False) else a.kl_coef,
                   kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef, is_cap=a.is_cap,
                   is_level=a.is_level, is_mode=a.is_mode, is_low=a.is_low)


class _Clip:
    """The [algorithm] fields GRPO reads, for callers that give only the clip range."""
    def __init__(self, clip_low: float, clip_high: float):
        self.clip_low, self.clip_high, self.clip_ratio_c = clip_low, clip_high, 0.0


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π (Schulman 2020, Approximating KL Divergence),
    with ``d = log π_ref - log π``: k1 = -d (unbiased, high variance, can be negative), k2 = d²/2
    (biased, low variance), k3 = exp(d) - d - 1 (unbiased, ≥ 0), low_var_kl = k3 with d clamped to
    [-20, 20] and the result to [-10, 10] (verl's kl_penalty = "low_var_kl")."""
    return kl_of_log_ratio(ref_logp - logp, kind)


def kl_of_log_ratio(d: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """:func:`kl_estimate` from ``d = log π_ref - log π``."""
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(d) - d - 1.0
    if kind == "low_var_kl":
        d = torch.clamp(d, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"kl estimator {kind!r}: allowed: " + ", ".join(KL_ESTIMATORS))


def rollout_is_weights(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, *,
                       cap: float, level: str = "token", mode: str = "truncate", low: float = 0.0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(applied weight, raw weight, capped) of each token, [B, S], no gradient: the importance weight
    ``π_prox/π_behav`` per token (``token``) or per sample as the product over its loss tokens
    (``sequence``), then truncated at ``cap`` (TIS) or zeroed above it, and below ``low`` when that is
    > 0 (``mask``, MIS); ``capped`` marks the loss tokens whose weight was changed. ``cap = 0``
    applies nothing (weight 1) but still gives the raw weights for the metrics."""
    with torch.no_grad():
        log_w = torch.where(mask, prox_logp - behaviour_logp, torch.zeros_like(prox_logp))
        if level == "sequence":
            log_w = log_w.sum(-1, keepdim=True).expand_as(prox_logp)
        raw = torch.exp(log_w)
        if cap <= 0:
            return torch.ones_like(raw), raw, torch.zeros_like(mask)
        capped = mask & (raw > cap)
        if mode == "mask":
            if low > 0:
                capped = capped | (mask & (raw < low))
            applied = torch.where(capped, torch.zeros_like(raw), raw)
        else:
            applied = torch.clamp(raw, max=cap)
        return applied, raw, capped


def aggregate(x: torch.Tensor, fmask: torch.Tensor, w: torch.Tensor, agg: str, *, n_tokens: float,
              n_samples: float, max_len: float) -> torch.Tensor:
    """One micro-batch's slice of the batch loss: per-token ``x`` [B, S] (or [B, 1]), ``fmask`` [B, S],
    weights ``w`` [B, 1]; ``n_tokens`` and ``n_samples`` count the whole batch (module docstring)."""
    if agg == "token_mean":
        return (w * fmask * x).sum() / n_tokens
    if agg == "seq_mean_token_sum":
        return (w * fmask * x).sum() / n_samples
    if agg == "seq_mean_token_sum_norm":
        return (w * fmask * x).sum() / (n_samples * max_len)
    if agg == "seq_mean_token_mean":
        per_sample = (fmask * x).sum(-1, keepdim=True) / fmask.sum(-1, keepdim=True).clamp(min=1.0)
        return (w * per_sample).sum() / n_samples
    raise ValueError(f"algorithm.loss_agg = {agg!r}: allowed: " + ", ".join(AGGREGATIONS))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy of the distribution) under ``log_softmax(logits / T)``.

    ``logits`` [B, S, V] predict ``targets`` [B, S]. They are upcast to float32 first, like the
    rollout engine does, so that bf16 models compare against behaviour log-probs at full precision.
    The entropy carries no gradient unless ``entropy_grad`` (an entropy bonus in the loss).
    float64 logits stay float64.
    """
    if temperature <= 0:
        raise ValueError(f"temperature = {temperature}: must be > 0 (rollout.temperature)")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor,
                advantages: torch.Tensor, weights: torch.Tensor, *, batch_loss_tokens: int,
                clip_low: float = 0.2, clip_high: float = 0.2, ref_logp: torch.Tensor | None = None,
                kl_coef: float | None = None, entropy: torch.Tensor | None = None,
                settings: LossSettings | None = None, batch_samples: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, sums, maxima) of one micro-batch; see the module docstring for the formula.

    Shapes: ``logp``, ``behaviour_logp``, ``mask``, ``ref_logp``, ``entropy`` are [B, S] (token s
    of row b); ``weights`` are [B], ``advantages`` [B] (one per sample) or [B, S] (per token: ppo's, from
    its critic; the metric ``advantages/mean`` then takes each sample's mean over its loss tokens).
    ``batch_loss_tokens`` is N, the loss tokens of the whole batch over all micro-batches and replicas
    (0 is treated as 1: no token carries loss);
    ``batch_samples`` is B, its samples (read by the seq_mean aggregations; 0 is treated as 1).
    ``settings`` selects the objective and everything around it; without it, GRPO with ``clip_low``,
    ``clip_high`` and ``kl_coef`` (k3). ``entropy`` enters the loss only when
    ``settings.entropy_coef > 0`` (then it must carry its gradient). ``sums`` and ``maxima`` are
    float64 vectors ordered as :data:`SUM_KEYS` and :data:`MAX_KEYS`.
    """
    if settings is None:
        settings = LossSettings(objective=make_objective_grpo(clip_low, clip_high), kl_coef=kl_coef or 0.0)
    elif kl_coef is not None and kl_coef != settings.kl_coef:
        raise ValueError(f"kl_coef = {kl_coef} disagrees with settings.kl_coef = {settings.kl_coef}")
    st = settings
    if st.kl_coef > 0 and ref_logp is None:
        raise ValueError("algorithm.kl_coef > 0 needs the reference policy's log-probs (ref_logp)")
    if st.entropy_coef > 0 and entropy is None:
        raise ValueError("algorithm.entropy_coef > 0 needs the policy's entropy (with its gradient)")
    mask = mask.bool()
    fmask = mask.to(logp.dtype)
    n_batch = float(max(int(batch_loss_tokens), 1))
    n_samples = float(max(int(batch_samples), 1))
    adv = advantages.to(logp.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv
    w = weights.to(logp.dtype)[:, None]
    behaviour = behaviour_logp.to(logp.dtype)

    # Decoupled correction: one optimizer step per batch, so the proximal policy is the current one, detached.
    prox = logp.detach()
    is_w, is_raw, is_capped = rollout_is_weights(prox, behaviour, mask, cap=st.is_cap, level=st.is_level,
                                                 mode=st.is_mode, low=st.is_low)
    anchor = prox if st.is_cap > 0 else behaviour
    terms = st.objective.per_token_loss(logp, anchor, mask, adv)
    pg = terms.loss.expand_as(logp) if terms.loss.shape != logp.shape else terms.loss
    if st.is_cap > 0:
        pg = pg * is_w
    agg = dict(n_tokens=n_batch, n_samples=n_samples, max_len=float(max(st.max_response_len, 1)))
    pg_loss = aggregate(pg, fmask, w, st.loss_agg, **agg)
    per_token = pg
    kl = None
    if ref_logp is not None and st.kl_coef > 0:
        d = torch.where(mask, ref_logp.to(logp.dtype) - logp, torch.zeros_like(logp))
        kl = kl_of_log_ratio(d, st.kl_estimator)
        per_token = per_token + st.kl_coef * kl
    if st.entropy_coef > 0:
        per_token = per_token - st.entropy_coef * entropy
    loss = aggregate(per_token, fmask, w, st.loss_agg, **agg)

    with torch.no_grad():
        f64 = fmask.double()
        r = terms.ratio.expand_as(logp).double()
        clipped = terms.clipped.expand_as(logp)
        lr_b = torch.where(mask, prox - behaviour, torch.zeros_like(prox))
        r_b, lr_b = torch.exp(lr_b).double(), lr_b.double()
        n_tok = f64.sum()
        raw = is_raw.double()
        stats = {
            "samples": torch.tensor(float(logp.shape[0]), dtype=torch.float64, device=logp.device),
            "loss_tokens": n_tok,
            "loss": loss.detach().double(),
            "pg_loss": pg_loss.detach().double(),
            "kl": (f64 * kl.detach().double()).sum() if kl is not None else n_tok * 0,
            "entropy": (f64 * entropy.detach().double()).sum() if entropy is not None else n_tok * 0,
            "clipped": (f64 * clipped.double()).sum(),
            "ratio": (f64 * r).sum(),
            "approx_kl": (f64 * (r_b - 1.0 - lr_b)).sum(),
            "advantage": (advantages.double().sum() if advantages.dim() == 1 else
                          ((f64 * advantages.double()).sum(-1) / f64.sum(-1).clamp(min=1.0)).sum()),
            "weight": weights.double().sum(),
            "is_weight": (f64 * raw).sum(),
            "is_capped": (f64 * is_capped.double()).sum(),
        }
        sums = torch.stack([stats[k] for k in SUM_KEYS])
        if r.numel():
            maxima = torch.stack([torch.where(mask, r, torch.zeros_like(r)).max(),
                                  torch.where(mask, raw, torch.zeros_like(raw)).max()])
        else:
            maxima = torch.stack([n_tok * 0, n_tok * 0])
    return loss, sums, maxima


def make_objective_grpo(clip_low: float, clip_high: float) -> Objective:
    """GRPO with this clip range and no dual clip."""
    from .objectives.grpo import GRPO
    return GRPO(_Clip(clip_low, clip_high))


def empty_stats(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Zero sums and maxima, the neutral start of an accumulation."""
    return (torch.zeros(len(SUM_KEYS), dtype=torch.float64, device=device),
            torch.zeros(len(MAX_KEYS), dtype=torch.float64, device=device))


def loss_metrics(sums: torch.Tensor, maxima: torch.Tensor) -> dict[str, float]:
    """The metrics of the module docstring from accumulated (and all-reduced) sums and maxima."""
    s = dict(zip(SUM_KEYS, sums.detach().cpu().tolist()))
    m = dict(zip(MAX_KEYS, maxima.detach().cpu().tolist()))
    tokens = s["loss_tokens"] or 1.0
    samples = s["samples"] or 1.0
    return {
        "loss": s["loss"],
        "pg_loss": s["pg_loss"],
        "kl": s["kl"] / tokens,
        "entropy": s["entropy"] / tokens,
        "clip_fraction": s["clipped"] / tokens,
        "ratio/mean": s["ratio"] / tokens if s["loss_tokens"] else 1.0,
        "ratio/max": m["ratio_max"] if s["loss_tokens"] else 1.0,
        "approx_kl": s["approx_kl"] / tokens,
        "advantages/mean": s["advantage"] / samples,
        "weights/mean": s["weight"] / samples,
        "rollout_is/mean": s["is_weight"] / tokens if s["loss_tokens"] else 1.0,
        "rollout_is/max": m["is_max"] if s["loss_tokens"] else 1.0,
        "rollout_is/capped_fraction": s["is_capped"] / tokens,
    }
