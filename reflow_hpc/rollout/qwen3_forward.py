"""The Qwen3 forward pass of the embedded engine, over the weights of a ``transformers`` model.

The engine does not call the Hugging Face module: like vLLM it runs its own forward pass over the
module's weights, so that one decode step serves many requests at different positions with
explicit per-row masks over the slot KV cache. The math follows ``modeling_qwen3.py`` of the
installed ``transformers`` term by term: RMSNorm (upcast to float32, normalise, cast back, scale),
q/k/v projections (with bias when ``attention_bias``), per-head RMSNorm of q and k, rotary embedding
with the table of the model's own rotary module (theta, scaling type and attention factor from the
config), grouped-query attention with scale ``head_dim ** -0.5``, o projection, SiLU-gated MLP,
final norm and ``lm_head`` (tied or not: whatever tensor ``lm_head.weight`` is). Logits are cast to
float32 at the end, as a trainer does before ``log_softmax``.

Rope types whose frequencies depend on the sequence length (``dynamic``, ``longrope``) and sliding-
window layers are refused: a per-position table cannot reproduce them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_supported(config) -> None:
    """Raise a one-line ValueError when the model config is outside what the forward pass runs."""
    model_type = getattr(config, "model_type", None)
    if model_type != "qwen3":
        raise ValueError(f"model config model_type = {model_type!r}: the torch engine runs Qwen3 causal LMs (qwen3)")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"model config hidden_act = {act!r}: the torch engine supports silu only")
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    if any(t != "full_attention" for t in layer_types):
        raise ValueError("model config layer_types contains sliding_attention: the torch engine supports "
                         "full attention only (set use_sliding_window = false)")
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"model config rope_parameters.rope_type = {rope_type!r}: frequencies that depend on "
                         f"the sequence length are not supported by the torch engine")


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    mlp_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class Qwen3Weights:
    """Detached views of a ``Qwen3ForCausalLM``'s parameters plus the shapes the forward needs.

    Views share storage with the module's parameters, so in-place weight loads are seen at once;
    after the module moves to another device the views must be taken again (:meth:`of`).
    """
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float

    @classmethod
    def of(cls, model) -> "Qwen3Weights":
        config = model.config
        check_supported(config)

        def d(t):
            return None if t is None else t.detach()

        layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            layers.append(LayerWeights(
                attn_norm=d(layer.input_layernorm.weight),
                q=d(a.q_proj.weight), k=d(a.k_proj.weight), v=d(a.v_proj.weight), o=d(a.o_proj.weight),
                q_bias=d(a.q_proj.bias), k_bias=d(a.k_proj.bias), v_bias=d(a.v_proj.bias), o_bias=d(a.o_proj.bias),
                q_norm=d(a.q_norm.weight), k_norm=d(a.k_norm.weight),
                mlp_norm=d(layer.post_attention_layernorm.weight),
                gate=d(m.gate_proj.weight), up=d(m.up_proj.weight), down=d(m.down_proj.weight)))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(embed=d(model.model.embed_tokens.weight), layers=layers, norm=d(model.model.norm.weight),
                   lm_head=d(model.lm_head.weight), num_heads=config.num_attention_heads,
                   num_kv_heads=config.num_key_value_heads, head_dim=head_dim, eps=config.rms_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


@dataclass
class RopeTable:
    """cos/sin of every position up to ``max_model_len`` [M, head_dim], in the model dtype."""
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor     # arange(M), int64, reused for masks

    @classmethod
    def of(cls, model, max_model_len: int, device: torch.device, dtype: torch.dtype) -> "RopeTable":
        # The model's own rotary module computes the table, so theta, the scaling type and the
        # attention factor are exactly the model's.
        positions = torch.arange(max_model_len, device=device)
        rotary = model.model.rotary_emb
        probe = torch.empty(1, dtype=dtype, device=device)
        cos, sin = rotary(probe, positions[None])
        return cls(cos=cos[0].to(dtype).contiguous(), sin=sin[0].to(dtype).contiguous(), positions=positions)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Lower precision: HF normalises in float32, casts back, then scales in the model dtype.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _mlp(x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, lw.gate)) * F.linear(x, lw.up), lw.down)


def decode(w: Qwen3Weights, rope: RopeTable, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
           tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, attn_len: int) -> torch.Tensor:
    """One token for each of rows ``0..B-1``: token ``tokens[i]`` at position ``positions[i]``.

    Writes the new K/V at ``positions`` of each row, attends over the first ``attn_len`` cached
    positions of rows ``0..B-1`` with a per-row mask (key position ≤ query position), and returns
    float32 logits [B, V]. ``rows`` is ``arange(B)``.
    """
    b, heads, kv_heads, dim = tokens.shape[0], w.num_heads, w.num_kv_heads, w.head_dim
    group = heads // kv_heads
    x = F.embedding(tokens, w.embed)                                   # [B, hidden]
    cos, sin = rope.cos[positions][:, None], rope.sin[positions][:, None]   # [B, 1, D]
    mask = (rope.positions[:attn_len][None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, L]
    scale = dim ** -0.5
    for lw, k_all, v_all in zip(w.layers, k_cache, v_cache):
        h = _rms_norm(x, lw.attn_norm, w.eps)
        q = _rms_norm(F.linear(h, lw.q, lw.q_bias).view(b, heads, dim), lw.q_norm, w.eps)
        k = _rms_norm(F.linear(h, lw.k, lw.k_bias).view(b, kv_heads, dim), lw.k_norm, w.eps)
        v = F.linear(h, lw.v, lw.v_bias).view(b, kv_heads, dim)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k_all[rows, :, positions] = k
        v_all[rows, :, positions] = v
        # One query token: the `group` query heads that share a KV head become that head's query
        # rows, so no KV is repeated.
        a = F.scaled_dot_product_attention(q.view(b, kv_heads, group, dim), k_all[:b, :, :attn_len],
                                           v_all[:b, :, :attn_len], attn_mask=mask, scale=scale)
        x = x + F.linear(a.reshape(b, heads * dim), lw.o, lw.o_bias)
        x = x + _mlp(_rms_norm(x, lw.mlp_norm, w.eps), lw)
    return F.linear(_rms_norm(x, w.norm, w.eps), w.lm_head).float()


def prefill(w: Qwen3Weights, rope: RopeTable, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
            tokens: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> None:
    """Fill the KV cache of rows ``rows`` [N] with positions ``0..lengths[i]-1`` of ``tokens`` [N, T].

    Sequences are right-padded to T; padded positions get finite, unused K/V. Nothing is sampled:
    the engine feeds each sequence's last context token through :func:`decode`. Every length must
    be ≥ 1 (a row with no valid key would make its softmax undefined).
    """
    n, t = tokens.shape
    heads, kv_heads, dim = w.num_heads, w.num_kv_heads, w.head_dim
    x = F.embedding(tokens, w.embed)                                   # [N, T, hidden]
    cos, sin = rope.cos[:t], rope.sin[:t]                              # [T, D]
    pos = rope.positions[:t]
    causal = pos[None, :] <= pos[:, None]                              # [T(query), T(key)]
    mask = (causal[None] & (pos[None, :] < lengths[:, None])[:, None, :])[:, None]   # [N, 1, T, T]
    scale = dim ** -0.5
    last = len(w.layers) - 1
    for i, (lw, k_all, v_all) in enumerate(zip(w.layers, k_cache, v_cache)):
        h = _rms_norm(x, lw.attn_norm, w.eps)
        k = _rms_norm(F.linear(h, lw.k, lw.k_bias).view(n, t, kv_heads, dim), lw.k_norm, w.eps).transpose(1, 2)
        v = F.linear(h, lw.v, lw.v_bias).view(n, t, kv_heads, dim).transpose(1, 2)
        k = _rope(k, cos, sin)
        k_all[rows, :, :t] = k
        v_all[rows, :, :t] = v
        if i == last:
            break   # the cache is all a prefill produces; the last attention output is never read
        q = _rms_norm(F.linear(h, lw.q, lw.q_bias).view(n, t, heads, dim), lw.q_norm, w.eps).transpose(1, 2)
        q = _rope(q, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
        x = x + F.linear(a.transpose(1, 2).reshape(n, t, heads * dim), lw.o, lw.o_bias)
        x = x + _mlp(_rms_norm(x, lw.mlp_norm, w.eps), lw)
