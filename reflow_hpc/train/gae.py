"""The arithmetic of ppo's critic (:mod:`reflow_hpc.train.objectives.ppo` has the formulas and sources): per-token
rewards, GAE over the loss tokens, whitening moments, the clipped value loss and explained variance.

Pure functions of tensors, shaped like the trainer's micro-batches: ``[B, S]`` with position t the prediction
of token t + 1 (the loss mask's alignment). Only loss tokens — tokens the policy generated — are steps of the
episode: prompt, tool-observation and padding positions are skipped, so the reward and the bootstrap flow
from one loss token straight to the previous loss token, across a tool observation, and get advantage and
return 0 themselves. Advantages and returns are float64 whatever the model's dtype.
"""

from __future__ import annotations

import torch

# Order of the critic's per-step sums (added over micro-batches, then over every trainer rank).
SUM_KEYS = ("tokens", "value_loss", "clipped", "values", "returns", "returns_sq", "residual", "residual_sq",
            "kl_reward", "adv", "adv_sq")


def last_loss_token(mask: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: the last loss token of each row (none in a row without loss tokens)."""
    pos = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, pos, torch.full_like(pos, -1)).max(dim=-1, keepdim=True).values
    return mask & (pos == last)


def token_rewards(mask: torch.Tensor, reward: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """[B, S] float64 rewards: each sample's ``reward`` [B] on its last loss token, plus ``-kl_coef · kl`` on every
    loss token when ``kl`` [B, S] is given (KL in the reward); 0 elsewhere."""
    r = torch.where(last_loss_token(mask), reward.double()[:, None], torch.zeros(mask.shape, dtype=torch.float64,
                                                                               device=mask.device))
    if kl is not None:
        r = r - kl_coef * torch.where(mask, kl.double(), torch.zeros_like(r))
    return r


def gae(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, S] float64 by generalised advantage estimation over each row's loss tokens:
    ``δ_k = r_k + γ V_{k+1} - V_k``, ``A_k = δ_k + γλ A_{k+1}``, ``R_k = A_k + V_k``, with k running over the loss
    tokens only (V and A after the last one are 0); 0 at every other position."""
    v, r = values.detach().double(), rewards.double()
    zero = torch.zeros(v.shape[0], dtype=torch.float64, device=v.device)
    next_v, running = zero, zero
    adv = torch.zeros_like(v)
    for t in range(v.shape[1] - 1, -1, -1):
        m = mask[:, t]
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * running
        adv[:, t] = torch.where(m, a, zero)
        # A position off the loss mask is no step: what follows it passes through unchanged.
        running = torch.where(m, a, running)
        next_v = torch.where(m, v[:, t], next_v)
    return adv, torch.where(mask, adv + v, torch.zeros_like(v))


def moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[count, Σx, Σx²] over the loss tokens, float64: summed over micro-batches and ranks, they give the
    batch's mean and std (:func:`whiten`)."""
    f = mask.double()
    xd = x.double() * f
    return torch.stack([f.sum(), xd.sum(), (xd * xd).sum()])


def whiten(x: torch.Tensor, mask: torch.Tensor, total: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` on loss tokens, 0 elsewhere; mean and (population) std from ``total``, the
    batch's :func:`moments`."""
    n = max(float(total[0]), 1.0)
    mean = float(total[1]) / n
    var = max(float(total[2]) / n - mean * mean, 0.0)
    out = (x.double() - mean) / (var ** 0.5 + eps)
    return torch.where(mask, out, torch.zeros_like(out))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, clipped) per token [B, S]: PPO's clipped value loss ``½·max((V - R)², (clip(V, V_old ± ε) - R)²)``
    (``clip = 0``: ``½(V - R)²``) on loss tokens, 0 elsewhere; ``clipped`` marks tokens where the clipped term is
    the larger one (it carries the gradient there: none, when V left the range)."""
    v = values.double()
    vo, ret = old_values.detach().double(), returns.detach().double()
    plain = (v - ret) ** 2
    if clip > 0:
        far = (vo + torch.clamp(v - vo, -clip, clip) - ret) ** 2
        loss, clipped = torch.maximum(plain, far), mask & (far > plain)
    else:
        loss, clipped = plain, torch.zeros_like(mask)
    return 0.5 * torch.where(mask, loss, torch.zeros_like(loss)), clipped


def explained_variance(sums: dict[str, float]) -> float:
    """``1 - Var(R - V) / Var(R)`` over the batch's loss tokens from the sums of :data:`SUM_KEYS` (NaN when the
    returns do not vary)."""
    n = sums["tokens"]
    if n <= 0:
        return float("nan")
    var_r = sums["returns_sq"] / n - (sums["returns"] / n) ** 2
    var_e = sums["residual_sq"] / n - (sums["residual"] / n) ** 2
    return 1.0 - var_e / var_r if var_r > 1e-12 else float("nan")
