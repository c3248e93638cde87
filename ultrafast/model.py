"""The transformer, in plain PyTorch: Llama-family decoder (Llama 2/3, SmolLM2, Qwen2 with QKV bias).

One sequence at a time: `forward(tokens [T], start_pos)` runs T new tokens at positions
start_pos..start_pos+T-1 against the KV cache and returns their logits. The model knows nothing of
quantization or devices; packed kernels are applied afterwards as transforms that swap modules
(`Linear` -> a packed linear, `AttentionCore`/`RMSNorm` -> batch-invariant kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .dequant import dequantize
from .kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class QuantEmbedding(nn.Module):
    """Token embedding kept in the file's own type; only the looked-up rows are dequantized."""

    def __init__(self, raw: torch.Tensor, qtype: int, dim: int):
        super().__init__()
        self.register_buffer("raw", raw, persistent=False)
        self.qtype, self.dim = qtype, dim

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return dequantize(self.raw[tokens], self.qtype, self.dim)


class AttentionCore(nn.Module):
    """softmax(q k^T * scale) v over the cache, causal, grouped-query. q: [T, H, D]; caches: [Hkv, S, D]."""

    def forward(self, q, k_cache, v_cache, start_pos: int, scale: float, tree=None) -> torch.Tensor:
        """tree: a token tree (`token_tree.TreeLayout`) whose nodes are the T rows: each sees its path only."""
        T, H, D = q.shape
        end = start_pos + T
        k = k_cache[:, :end].repeat_interleave(H // k_cache.shape[0], dim=0)
        v = v_cache[:, :end].repeat_interleave(H // v_cache.shape[0], dim=0)
        if tree is None and start_pos == 0:  # a sequence from its start: the plain causal mask, PyTorch's fused path
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=scale)
            return out.transpose(0, 1)
        if tree is not None:
            mask = tree.mask.to(q.device)
        else:
            mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(start_pos, end, device=q.device)[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        return out.transpose(0, 1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=c.qkv_bias)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.core = AttentionCore()
        self.scale = c.head_dim ** -0.5

    def forward(self, x, cos, sin, segments, tree=None):
        """segments: (start_pos, rows, k_cache, v_cache) per sequence whose rows x holds, in order; tree: the
        one sequence's rows are a token tree's nodes (`token_tree.TreeLayout`)."""
        T = x.shape[0]
        q = self.wq(x).view(T, self.n_heads, self.head_dim)
        k = self.wk(x).view(T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(T, self.n_kv_heads, self.head_dim)
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, D]: broadcast over heads
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        outs, row = [], 0
        for start, n, k_cache, v_cache in segments:
            k_cache[:, start:start + n] = k[row:row + n].transpose(0, 1)
            v_cache[:, start:start + n] = v[row:row + n].transpose(0, 1)
            outs.append(self.core(q[row:row + n], k_cache, v_cache, start, self.scale, tree))
            row += n
        return self.wo(torch.cat(outs).reshape(T, -1))


class FeedForward(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.feed_forward = FeedForward(c)

    def forward(self, x, cos, sin, segments, tree=None):
        h = x + self.attention(self.attention_norm(x), cos, sin, segments, tree)
        return h + self.feed_forward(self.ffn_norm(h))


ROPE_TABLE_START = 4096  # positions in the first RoPE table; it grows (doubling) as positions need


def rope_table(c: ModelConfig, n: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, head_dim] of RoPE (rotate-half layout) for positions 0..n-1, computed as transformers
    does. Each position's values are elementwise functions of it: the same whatever n."""
    exponents = torch.arange(0, c.head_dim, 2, dtype=torch.int64, device=device).float() / c.head_dim
    inv_freq = 1.0 / (c.rope_theta ** exponents)
    freqs = torch.arange(n, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig, embedding: QuantEmbedding):
        super().__init__()
        self.config = c
        self.kv_config = c  # what the KV cache holds (tensor parallelism: this rank's heads)
        self.tp = None  # tensor parallelism: this rank's place (tensor_parallel.apply_tp sets it)
        self.mirror = None  # `serve --tp`: rank 0 sends every pass to the other ranks first (tensor_parallel.py)
        # runs the layers of a pass in one call where it covers them (packed.FusedStack, set by apply_packed)
        self.layer_stack = None
        self.tok_embeddings = embedding
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        cos, sin = rope_table(c, min(c.context_length, ROPE_TABLE_START))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, cache: KVCache, all_logits: bool = False,
                layers: list[int] | None = None, hidden: bool = False, tree=None):
        """tokens: [T] int64 at positions start_pos.. -> logits [T, vocab] (all_logits) or [1, vocab] (last).
        layers: run only these decoder layers, in order, then the final norm and head (self-speculation's
        draft: the model with some layers skipped); their KV rows are written, the others' left alone.
        tree: the tokens are a token tree's nodes (`token_tree.TreeLayout`, root at start_pos): each at its
        depth's position, writing its slot, attending its path."""
        return self.forward_multi(tokens, [start_pos], [tokens.shape[0]], [cache], all_logits, layers, hidden, tree)

    def _rope_to(self, end: int) -> None:
        """Grow the RoPE table to cover positions below `end` (a model's context can be millions of positions;
        the table holds only what was used, doubled)."""
        have = self.rope_cos.shape[0]
        if end <= have:
            return
        if end > self.config.context_length:
            raise ValueError(f"position {end - 1} is past the model's context of {self.config.context_length}")
        n = min(self.config.context_length, max(end, 2 * have))
        self.rope_cos, self.rope_sin = rope_table(self.config, n, self.rope_cos.device)

    @torch.inference_mode()
    def forward_multi(self, tokens: torch.Tensor, starts: list[int], lens: list[int], caches: list[KVCache],
                      all_logits: bool = False, layers: list[int] | None = None, hidden: bool = False, tree=None,
                      share=None):
        """Several sequences in one pass (continuous batching): tokens holds lens[s] rows of sequence s at
        positions starts[s].., each with its own cache. Returns logits of every row (all_logits) or of each
        sequence's last row [n_sequences, vocab]. Rows never influence each other's values. hidden: also the
        last layer's output for every row, before the final norm (what a draft head reads): (logits, h [T, dim]);
        a tuple of layer indices instead of True appends those layers' outputs to each row (EAGLE-3's low and
        middle features): h [T, (1 + len(hidden)) * dim], the last layer's first. share: per sequence None or (j, m):
        sequence j's cache holds the same first m rows (best-of-n siblings' prompt), below both starts; the fused
        layers' attention then reads them from one cache for both (the same values, so the same bits)."""
        if self.mirror is not None:
            self.mirror.forward(tokens, starts, lens, caches, all_logits, layers, hidden, tree)
        # [T, D], once per pass for every layer; a table, so a position's values never depend on the batch
        self._rope_to(max(s + n for s, n in zip(starts, lens)))
        if tree is not None:
            if len(starts) != 1 or len(tree) != lens[0] or tree.start != starts[0]:
                raise ValueError("a token tree is one sequence whose rows are its nodes, the root first")
            positions = tree.positions()
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        elif len(starts) == 1:  # one sequence: a slice of the table (no gather)
            cos, sin = self.rope_cos[starts[0]:starts[0] + lens[0]], self.rope_sin[starts[0]:starts[0] + lens[0]]
        else:
            positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).to(tokens.device)
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.tok_embeddings(tokens)
        extra = tuple(hidden) if isinstance(hidden, (tuple, list)) else ()
        kept = {}
        ids = list(range(len(self.layers)) if layers is None else layers)
        if self.layer_stack is not None and self.layer_stack.covers(ids):
            at = [j for j, i in enumerate(ids) if i in extra]
            x, copies = self.layer_stack(x, cos, sin, starts, lens, caches, ids, at, tree, share)
            kept = {ids[j]: t for j, t in zip(at, copies)}
        else:
            for i in ids:
                layer = self.layers[i]
                segments = [(s, n, c.k_layers[i], c.v_layers[i]) for s, n, c in zip(starts, lens, caches)]
                x = layer(x, cos, sin, segments) if tree is None else layer(x, cos, sin, segments, tree)
                if i in extra:
                    kept[i] = x.clone()
        h = torch.cat([x] + [kept[i] for i in extra], dim=-1) if extra else x
        if not all_logits:
            x = x[-1:] if len(lens) == 1 else x[torch.tensor(lens, device=x.device).cumsum(0) - 1]
        logits = self.output(self.norm(x)).float()
        return (logits, h) if hidden else logits

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads (every linear once, one embedding row, the norms)."""
        total = 0
        for m in self.modules():
            if isinstance(m, nn.Linear):
                total += sum(t.numel() * t.element_size() for t in (m.weight, m.bias) if t is not None)
            elif hasattr(m, "nbytes_per_step"):
                total += m.nbytes_per_step()
            elif isinstance(m, RMSNorm):
                total += m.weight.numel() * m.weight.element_size()
        emb = self.tok_embeddings
        total += emb.raw.shape[1] if hasattr(emb, "raw") else 0
        return total

    def macs_per_token(self, head: bool = True) -> int:
        """Multiply-adds of the linears for one token (what the matmul kernels multiply; attention's grow with
        the context and are not counted). head=False leaves out the LM head, which a prefill applies to its
        last row only."""
        return sum(m.in_features * m.out_features for m in self.modules()
                   if hasattr(m, "in_features") and hasattr(m, "out_features") and (head or m is not self.output))

    def weight_bytes_held(self, in_file=None) -> int:
        """Bytes of the model's weights, each storage once; with `in_file` (a predicate: `LoadedModel.in_file`) only
        those in the process's own memory, not the views of the model file's mapping (page cache, read on demand)."""
        seen, total = set(), 0
        for t in list(self.parameters()) + list(self.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                if in_file is None or not in_file(t):
                    total += t.numel() * t.element_size()
        return total


def linear_weight_name(linear: str, c: ModelConfig) -> str:
    """The file tensor holding the weight of the linear module named `linear` (a tied LM head: the embedding)."""
    return "tok_embeddings.weight" if linear == "output" and c.tie_embeddings else f"{linear}.weight"


def swap_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` of `model` is (what transforms do to a model built on meta)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def build_model(loaded, device: str | torch.device = "cpu", transform=None) -> Transformer:
    """Build on the meta device, let `transform(model, loaded)` swap modules (e.g. packed kernels), then
    materialise whatever is still empty from the file: the reference build dequantizes to fp32 `nn.Linear`."""
    c, tensors = loaded.config, loaded.tensors
    emb = tensors["tok_embeddings.weight"]
    with torch.device("meta"):
        model = Transformer(c, QuantEmbedding(torch.empty(0, dtype=torch.uint8), emb.qtype, c.dim))
    model.tok_embeddings = QuantEmbedding(emb.raw, emb.qtype, c.dim)
    model.rope_cos, model.rope_sin = rope_table(c, min(c.context_length, ROPE_TABLE_START), "cpu")
    if transform is not None:
        transform(model, loaded)
    state = {}
    for name, p in list(model.named_parameters()):
        if p.is_meta:
            key = "tok_embeddings.weight" if name == "output.weight" and c.tie_embeddings else name
            if key not in tensors:
                raise ValueError(f"{loaded.path}: no weights for {name}")
            state[name] = tensors[key].dequantize()
    model.load_state_dict(state, strict=False, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(device).eval()
