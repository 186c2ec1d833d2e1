"""The slot KV cache of the embedded engine.

One K and one V tensor per layer, ``[slots, kv_heads, max_model_len, head_dim]``, allocated once.
A running request owns one slot (a row); its cached positions are ``0 .. length-1`` of that row
and anything beyond is stale and masked out by the attention. The engine keeps running requests in
rows ``0 .. n-1`` (it moves the last row into a freed one), so a decode step reads the contiguous
block ``[:n, :, :longest]`` and never gathers rows.
"""

from __future__ import annotations

import torch


def kv_bytes_per_token(hf_config, dtype: torch.dtype, tp: int = 1) -> int:
    """KV bytes of one token on one rank of an instance of ``tp`` ranks (the KV heads split over the ranks,
    replicated where there are fewer heads than ranks)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    heads = max(1, hf_config.num_key_value_heads // tp)
    return 2 * hf_config.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8


class SlotKVCache:
    def __init__(self, *, layers: int, slots: int, kv_heads: int, max_model_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.shape = (slots, kv_heads, max_model_len, head_dim)
        self.layers, self.dtype, self.device = layers, dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate()

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    def allocate(self) -> None:
        if not self.k:
            # zeros, not empty: stale positions must hold finite values (masked scores of NaN keys
            # would still poison the softmax of some attention kernels).
            self.k = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
            self.v = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]

    def release(self) -> None:
        self.k, self.v = [], []

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached positions of row ``src`` into row ``dst``."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]
