"""The KV cache: one buffer per layer for keys and values, allocated once at the context size."""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, max_len: int, device="cpu", dtype=torch.float32):
        if max_len <= 0:
            raise ValueError(f"max context must be positive, got {max_len}")
        shape = (config.n_layers, config.n_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
