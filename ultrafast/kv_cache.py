"""The KV cache: one buffer per layer for keys and values, allocated once at the context size.

`tokens` records which tokens rows 0..len(tokens)-1 hold, so that a request whose prompt starts with
them reuses those rows (prefix caching: an agent re-sending its growing conversation prefills only what
is new). Reuse is exact: the packed kernels compute a row identically whatever rows come with it.
"""

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
        self.k_layers, self.v_layers = list(self.k.unbind(0)), list(self.v.unbind(0))  # views, made once
        self.max_len = max_len
        self.tokens: list[int] = []
        self.mirror = None  # `serve --tp`: rank 0 tells the other ranks of every change (tensor_parallel.Mirror)

    def copy_rows_from(self, src: "KVCache", start: int, stop: int) -> None:
        """Positions start..stop-1's rows of `src`, in every layer: a sibling candidate's prefilled prompt (start 0),
        or the rows a candidate with the same tokens so far computed for both in a batched pass."""
        if self.mirror is not None:
            self.mirror.copy_rows(self, src, start, stop)
        self.k[:, :, start:stop] = src.k[:, :, start:stop]
        self.v[:, :, start:stop] = src.v[:, :, start:stop]

    def reusable_prefix(self, prompt: list[int]) -> int:
        """How many leading prompt tokens already have their rows here (at least one is always recomputed)."""
        n = 0
        for a, b in zip(self.tokens, prompt[:-1]):
            if a != b:
                break
            n += 1
        return n

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
