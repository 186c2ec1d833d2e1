"""The GRPO policy loss with PPO clipping against the behaviour log-probs, and its metrics.

Rules (DESIGN §2, §7):

- Each sample i carries a group-normalised advantage ``A_i`` (computed once, when its group
  completed) and a loss weight ``w̃_i`` already normalised over the whole batch by the coordinator
  (1 for an unused sample, τ for a replayed one, divided by ``Z`` so that the token-weighted mean
  weight is 1).
- Token t of sample i is in the loss when the policy generated it (``mask``, i.e. ``versions >= 0``);
  prompt, tool-observation and padding tokens contribute nothing.
- Importance ratio against the policy that generated the token: ``r_t = exp(logp_t - logp^b_t)``.
  Per-token policy-gradient loss, clipped on both sides (PPO):
  ``pg_t = -min(r_t A_i, clip(r_t, 1 - clip_low, 1 + clip_high) A_i)``.
- Optional KL to a frozen reference policy with the k3 estimator
  ``k3_t = exp(q_t - logp_t) - (q_t - logp_t) - 1`` (``q`` = reference log-prob), weight ``kl_coef``.
- Aggregate: ``loss = Σ_i w̃_i Σ_t mask_it (pg_it + kl_coef·k3_it) / N_batch`` where ``N_batch`` is the
  number of loss tokens of the *whole* batch (every micro-batch on every trainer replica). Each
  micro-batch's loss is therefore a slice of one global sum: summing gradients over micro-batches
  and replicas gives exactly the gradient of the full batch on one replica.

Metrics (names are API): ``loss``, ``pg_loss`` (the policy-gradient part of ``loss``), ``kl`` (mean
k3 to the reference per loss token; 0 without one), ``entropy`` (mean policy entropy per loss token;
not in the loss), ``clip_fraction`` (loss tokens whose clipped term is binding, i.e. get no
gradient), ``ratio/mean``, ``ratio/max``, ``approx_kl`` (mean k3 estimate of KL(behaviour ‖ current)
per loss token), ``advantages/mean`` and ``weights/mean`` (per sample).

Everything here is a pure function of tensors. Statistics leave as two small float64 vectors
(sums and maxima, see :data:`SUM_KEYS` / :data:`MAX_KEYS`) so that a trainer can add them over
micro-batches and all-reduce them across replicas in one collective each, then call
:func:`loss_metrics`.
"""

from __future__ import annotations

import torch

SUM_KEYS = ("samples", "loss_tokens", "loss", "pg_loss", "kl", "entropy", "clipped", "ratio", "approx_kl",
            "advantage", "weight")
MAX_KEYS = ("ratio_max",)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy of the distribution) under ``log_softmax(logits / T)``.

    ``logits`` [B, S, V] predict ``targets`` [B, S]. They are upcast to float32 first, like the
    rollout engine does, so that bf16 models compare against behaviour log-probs at full precision.
    The entropy is a metric only and carries no gradient. float64 logits stay float64.
    """
    if temperature <= 0:
        raise ValueError(f"temperature = {temperature}: must be > 0 (rollout.temperature)")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor,
                advantages: torch.Tensor, weights: torch.Tensor, *, clip_low: float, clip_high: float,
                batch_loss_tokens: int, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, sums, maxima) of one micro-batch; see the module docstring for the formula.

    Shapes: ``logp``, ``behaviour_logp``, ``mask``, ``ref_logp``, ``entropy`` are [B, S] (token s
    of row b); ``advantages`` and ``weights`` are [B]. ``batch_loss_tokens`` is N_batch, the loss
    tokens of the whole batch over all micro-batches and replicas (0 is treated as 1: no token
    carries loss). ``sums`` and ``maxima`` are float64 vectors ordered as :data:`SUM_KEYS` and
    :data:`MAX_KEYS`.
    """
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("algorithm.kl_coef > 0 needs the reference policy's log-probs (ref_logp)")
    mask = mask.bool()
    fmask = mask.to(logp.dtype)
    n_batch = float(max(int(batch_loss_tokens), 1))
    adv = advantages.to(logp.dtype)[:, None]
    w = weights.to(logp.dtype)[:, None]

    # Masked positions get log-ratio 0 before exp: padding must not overflow into NaN gradients.
    log_ratio = torch.where(mask, logp - behaviour_logp.to(logp.dtype), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    pg_loss = (w * fmask * pg).sum() / n_batch
    per_token = pg
    if ref_logp is not None and kl_coef > 0:
        d = torch.where(mask, ref_logp.to(logp.dtype) - logp, torch.zeros_like(logp))
        k3 = torch.exp(d) - d - 1.0
        per_token = pg + kl_coef * k3
    else:
        k3 = None
    loss = (w * fmask * per_token).sum() / n_batch

    with torch.no_grad():
        f64 = fmask.double()
        r = ratio.double()
        n_tok = f64.sum()
        stats = {
            "samples": torch.tensor(float(logp.shape[0]), dtype=torch.float64, device=logp.device),
            "loss_tokens": n_tok,
            "loss": loss.detach().double(),
            "pg_loss": pg_loss.detach().double(),
            "kl": (f64 * k3.double()).sum() if k3 is not None else n_tok * 0,
            "entropy": (f64 * entropy.double()).sum() if entropy is not None else n_tok * 0,
            "clipped": (f64 * (clipped > unclipped).double()).sum(),
            "ratio": (f64 * r).sum(),
            "approx_kl": (f64 * (r - 1.0 - log_ratio.double())).sum(),
            "advantage": advantages.double().sum(),
            "weight": weights.double().sum(),
        }
        sums = torch.stack([stats[k] for k in SUM_KEYS])
        ratio_max = torch.where(mask, r, torch.zeros_like(r)).max() if r.numel() else n_tok * 0
        maxima = torch.stack([ratio_max])
    return loss, sums, maxima


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
    }
