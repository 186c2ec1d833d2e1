"""How unused and replay samples mix in one batch: slot counts, loss weights, mixing weight α.

- Replay slots: a batch of b samples holds at most ``floor(b·σ)`` replay samples, so it consumes at
  least ``ceil(b·(1-σ)) = b - floor(b·σ)`` unused ones. ``b·σ`` is rounded to 9 decimals first so
  that binary floating point cannot move a whole sample (b = 10, σ = 0.3 gives 3 replay slots and
  7 unused samples, not 8).
- Loss weights: ``w_i = ω_i`` for an unused sample and ``τ·ω_i`` for a replay sample, normalised by
  ``Z = Σ_j w_j n_j / Σ_j n_j`` (n_j = loss tokens of sample j), so ``Σ w̃_i n_i / Σ n_i = 1``: the
  token-weighted mean weight is one and the loss scale does not depend on the replay fraction.
  That is the right mass when a sample's share of the loss grows with its tokens (aggregations
  ``token_mean``, ``seq_mean_token_sum``, ``seq_mean_token_sum_norm``). Under
  ``seq_mean_token_mean`` every sample has the same share, so ``per_sample`` normalises by
  ``Z = Σ_j w_j / m`` over the m samples instead: the plain mean weight is one.
- Mixing weight: with replay fraction ``λ = r/b``, the replayed part contributes
  ``α = τλ / (1 - λ + τλ)`` of the gradient in the equal-mass model; since λ ≤ σ,
  ``α ≤ τσ / (1 - σ + τσ)`` (σ = τ = 0.5 gives α ≤ 1/3).
"""

from __future__ import annotations

import math
from typing import Sequence


def max_replay_slots(batch_size: int, sigma: float) -> int:
    """floor(b·σ): the most replay samples one batch may hold."""
    return math.floor(round(batch_size * sigma, 9))


def min_unused(batch_size: int, sigma: float) -> int:
    """ceil(b·(1-σ)): the fewest unused samples one batch consumes."""
    return batch_size - max_replay_slots(batch_size, sigma)


def loss_weights(is_replay: Sequence[bool], loss_tokens: Sequence[int], tau: float,
                 base_weights: Sequence[float] | None = None, *, per_sample: bool = False) -> list[float]:
    """Normalised per-sample loss weights w̃_i (see the module docstring).

    When no sample carries loss tokens (or every weight is zero) there is nothing to normalise and
    the raw weights are returned.
    """
    if base_weights is None:
        w = [tau if r else 1.0 for r in is_replay]
    else:
        w = [b * tau if r else b for r, b in zip(is_replay, base_weights, strict=True)]
    if per_sample:
        total = math.fsum(w)
        if not w or total <= 0.0:
            return w
        inv = len(w) / total
        return [wi * inv for wi in w]
    total_tokens = sum(loss_tokens)
    mass = math.fsum(wi * n for wi, n in zip(w, loss_tokens, strict=True))
    if total_tokens <= 0 or mass <= 0.0:
        return w
    inv_z = total_tokens / mass
    return [wi * inv_z for wi in w]


def mixing_weight(replay_fraction: float, tau: float) -> float:
    """α = τλ / (1 - λ + τλ): the replayed share of the gradient in the equal-mass model."""
    lam = replay_fraction
    return tau * lam / (1.0 - lam + tau * lam)


def mixing_weight_bound(sigma: float, tau: float) -> float:
    """τσ / (1 - σ + τσ): the largest α any batch can have."""
    return mixing_weight(sigma, tau)
