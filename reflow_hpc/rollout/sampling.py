"""Batched, seeded token sampling for the embedded engine.

Rules:

- **Behaviour log-prob.** The log-prob recorded for a sampled token is
  ``log_softmax(logits / temperature)`` at that token, taken *before* top-p truncation; with
  temperature 0 (greedy) it is ``log_softmax(logits)``. This is exactly what a trainer recomputes
  from one forward pass over prompt + response, so the importance ratio is 1 for on-policy tokens.
- **Top-p.** The nucleus is the smallest set of most likely tokens whose mass reaches ``top_p``
  (the most likely token is always in it); the sample is drawn from the renormalised nucleus.
- **Seeding without per-request generators.** Each draw uses one uniform number computed by a
  counter-based hash (splitmix64) of the request's stream key and the position of the token in its
  context. A token therefore depends only on (stream key, position, logits): not on which other
  requests share the batch, not on preemption and re-prefill, and not on the engine's step count.
  The draw is an inverse-CDF lookup, so one uniform per row suffices and the whole batch is sampled
  with a handful of tensor ops.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """An unsigned 64-bit integer as the int64 that has the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, request_id: int | None = None) -> int:
    """The int64 key of a request's random stream: splitmix64 of the seed, then of the request id.

    ``request_id=None`` gives a stream that depends on the seed alone (a request that carries its
    own seed, as in vLLM).
    """
    z = _mix((seed * _GOLDEN + 1) & _MASK64)
    if request_id is not None:
        z = _mix((z + (request_id + 1) * _GOLDEN) & _MASK64)
    return _signed(z)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic on negative values)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform float32 in [0, 1) per row: splitmix64(key + (counter + 1)·φ), top 24 bits.

    int64 products wrap modulo 2**64, which is the unsigned arithmetic splitmix64 needs.
    """
    z = keys + (counters + 1) * _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    z = z ^ _shr(z, 31)
    return _shr(z, 40).to(torch.float32) * (1.0 / (1 << 24))


def uniform_reference(key: int, counter: int) -> float:
    """Plain-Python twin of :func:`uniforms` for one row (used by tests)."""
    z = _mix((key + (counter + 1) * _GOLDEN) & _MASK64)
    return (z >> 40) / float(1 << 24)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, *,
           any_top_p: bool, any_greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V] (float32).

    ``temperature`` and ``top_p`` are per-row [B]; ``u`` holds one uniform per row. ``any_top_p``
    and ``any_greedy`` say whether some row has top_p < 1 or temperature 0, so that the common
    case skips the sort and the argmax. Returns (tokens int64 [B], behaviour log-probs float32 [B]).
    """
    t = temperature[:, None]
    if any_greedy:
        t = torch.where(t > 0, t, torch.ones_like(t))
    logp = torch.log_softmax(logits / t, dim=-1)
    probs = logp.exp()
    if any_top_p:
        probs, order = probs.sort(dim=-1, descending=True)
        mass_before = probs.cumsum(-1) - probs
        probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    idx = torch.searchsorted(cdf, u[:, None] * total, right=True)
    # Rounding can put u·total at the very end of the CDF; the first index where the CDF reaches
    # its total is the last token that still adds mass, so it is the right clamp.
    idx = torch.minimum(idx, (cdf < total).sum(-1, keepdim=True))
    tokens = order.gather(-1, idx) if any_top_p else idx
    if any_greedy:
        tokens = torch.where(temperature[:, None] > 0, tokens, logits.argmax(-1, keepdim=True))
    return tokens[:, 0], logp.gather(-1, tokens)[:, 0]
