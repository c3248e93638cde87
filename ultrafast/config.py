"""Model hyper-parameters, read from the file's metadata (never hard-coded per model)."""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("n_layers", "dim", "ffn_dim", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "context_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model config: {self.n_heads} heads is not a multiple of {self.n_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    def kv_bytes_per_token(self, bytes_per_value: int = 4) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_value
