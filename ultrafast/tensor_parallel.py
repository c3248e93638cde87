"""Tensor parallelism over `torch.distributed` (gloo on the CPU, NCCL on CUDA), applied as a transform on the
plain model as gpt-fast's `apply_tp` does, after the packed transform.

Launched with `torchrun --nproc-per-node N ... generate --tp N` (or `serve --tp N`): every rank loads the model,
keeps its share of each layer and runs the same forward passes on the same tokens.

- Attention is split by key-value head groups (a rank keeps some KV heads and the query heads that read them):
  wq, wk, wv (and their biases) keep the rank's output rows; wo keeps the matching input columns.
- The feed-forward is split along its intermediate dimension: w1 and w3 keep rows, w2 the matching columns.
- Packed weights are sliced at load without dequantizing: a row split takes whole GGUF rows; a column split cuts
  every row at a quantization block boundary (so the split points are multiples of the block: 32 values, 256 for
  K-quants), which is why shares can be uneven.
- wo's and w2's outputs are this rank's partial sums: one all-reduce after each, then the residual add. The fused
  layer runs as its two halves with the all-reduce between them (`kernels.decoder_block(part=1|2)`).
- The embedding, the norms and the LM head are kept whole on every rank: every rank computes the same logits
  and so picks the same tokens, with no broadcast.

The reduction order is fixed (the all-reduce's, the same every call), and every kernel is batch-invariant, so
within one degree the ultrafast tier still emits exactly the standard tier's tokens. Against degree 1 the
partial sums are added in another order: the logits agree up to rounding (`tp-check` measures it).
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from . import kernels


@dataclass
class TensorParallel:
    """This process's place in the group, and what its all-reduces have cost so far."""

    rank: int
    world: int
    reduces: int = 0
    reduce_s: float = 0.0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def agree(self, obj):
        """Rank 0's value of `obj` on every rank (a measurement that steers what the ranks run)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (the same order every call); timed."""
        t = time.perf_counter()
        dist.all_reduce(x)
        self.reduce_s += time.perf_counter() - t
        self.reduces += 1
        return x


def init(tp: int, device: str = "cpu") -> TensorParallel | None:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment): None for
    tp = 1. ValueError when the launch does not match `tp`."""
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp == 1:
        if world != 1:
            raise ValueError(f"launched with {world} processes (WORLD_SIZE) but --tp 1")
        return None
    if world != tp:
        raise ValueError(f"--tp {tp} needs {tp} processes: launch with `torchrun --nproc-per-node {tp} "
                         f"$(which ultrafast) ...` (WORLD_SIZE is {world})")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return TensorParallel(dist.get_rank(), dist.get_world_size())


def _shares(n_units: int, world: int) -> list[tuple[int, int]]:
    """[start, end) per rank of n_units, as even as whole units allow (the first ranks take the extra)."""
    if n_units < world:
        raise ValueError(f"cannot split {n_units} units over {world} ranks")
    base, extra = divmod(n_units, world)
    out, at = [], 0
    for r in range(world):
        n = base + (r < extra)
        out.append((at, at + n))
        at += n
    return out


def _block(m: nn.Module) -> int:
    return kernels.block_info(m.qtype)[0] if hasattr(m, "qtype") else 1


def _rows(m: nn.Module, a: int, b: int) -> None:
    """Keep output rows [a, b) of a packed linear (whole GGUF rows)."""
    m.raw = m.raw[a:b].contiguous()
    if m.bias is not None:
        m.bias = m.bias[a:b].contiguous()
    m.out_features = b - a


def _cols(m: nn.Module, a: int, b: int) -> None:
    """Keep input columns [a, b) of a packed linear: every row cut at quantization block boundaries."""
    per, nbytes = kernels.block_info(m.qtype)
    if a % per or b % per:
        raise ValueError(f"column split [{a}, {b}) is not on {per}-value blocks")
    m.raw = m.raw[:, a // per * nbytes:b // per * nbytes].contiguous()
    m.in_features = b - a


def apply_tp(model: nn.Module, tp: TensorParallel) -> nn.Module:
    """Keep this rank's share of every decoder layer of a packed model (built by `apply_packed`)."""
    from .packed import FusedBlock, PackedLinear

    c = model.config
    group = c.n_heads // c.n_kv_heads
    kv = _shares(c.n_kv_heads, tp.world)[tp.rank]
    heads = (kv[0] * group, kv[1] * group)
    for i, layer in enumerate(model.layers):
        fused = isinstance(layer, FusedBlock)
        block = layer.block if fused else layer
        att, ffn = block.attention, block.feed_forward
        lins = [att.wq, att.wk, att.wv, att.wo, ffn.w1, ffn.w3, ffn.w2]
        if not all(isinstance(m, PackedLinear) for m in lins):
            raise ValueError("tensor parallelism slices packed weights: this model's types "
                             f"({sorted({getattr(m, 'qtype', 'fp32') for m in lins}, key=str)}) are not all packed")
        if heads[0] * c.head_dim % _block(att.wo) or heads[1] * c.head_dim % _block(att.wo):
            raise ValueError(f"the attention heads cannot be split over {tp.world} ranks at the blocks of wo")
        unit = _block(ffn.w2)  # the intermediate dimension splits at w2's blocks
        f0, f1 = (x * unit for x in _shares(c.ffn_dim // unit, tp.world)[tp.rank])
        _rows(att.wq, heads[0] * c.head_dim, heads[1] * c.head_dim)
        _rows(att.wk, kv[0] * c.head_dim, kv[1] * c.head_dim)
        _rows(att.wv, kv[0] * c.head_dim, kv[1] * c.head_dim)
        _cols(att.wo, heads[0] * c.head_dim, heads[1] * c.head_dim)
        _rows(ffn.w1, f0, f1)
        _rows(ffn.w3, f0, f1)
        _cols(ffn.w2, f0, f1)
        att.n_heads, att.n_kv_heads = heads[1] - heads[0], kv[1] - kv[0]
        if fused:
            model.layers[i] = FusedBlock(block, tp)
        else:
            att.wo, ffn.w2 = RowParallel(att.wo, tp), RowParallel(ffn.w2, tp)
    # the model's own config stays whole (its draft head, prompts and logits are the whole model's); the KV cache
    # holds this rank's heads only
    model.kv_config = replace(c, n_heads=heads[1] - heads[0], n_kv_heads=kv[1] - kv[0], ffn_dim=f1 - f0)
    model.tp = tp
    return model


class RowParallel(nn.Module):
    """A row-parallel linear (wo, w2): this rank's partial product, all-reduced. (Its bytes and multiplies are
    the inner linear's, counted there.)"""

    def __init__(self, inner: nn.Module, tp: TensorParallel):
        super().__init__()
        self.inner, self.tp = inner, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.inner(x))


# ---------------------------------------------------------------------------------------------- serve --tp
# Under `serve --tp N` only rank 0 runs the server: the scheduler, the sampler and the drafters. The model's
# passes and the KV-cache changes made outside them (a sibling's prompt rows copied, a token tree's accepted path
# kept) are what every rank must do together: rank 0 sends each one to the others before doing it (`Mirror`),
# and they do it too (`follow`), with caches of their own that they number as rank 0 numbers its caches.


class Mirror:
    """Rank 0's side: each pass and each cache change, broadcast to the other ranks before it runs. A cache rank 0
    lets go of (a measurement's scratch cache) is dropped by the other ranks too, with the next operation."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp
        self._ids: dict[int, int] = {}  # id(cache) -> the number the other ranks know it by
        self._next = 0
        self._gone: list[int] = []  # numbers of caches collected on rank 0, not yet told

    def _cache(self, cache) -> int:
        key = id(cache)
        if key not in self._ids:
            self._ids[key] = self._next
            self._next += 1
            weakref.finalize(cache, self._forget, key)
        return self._ids[key]

    def _forget(self, key: int) -> None:  # (a finalizer: it only notes; the next _send tells the others)
        self._gone.append(self._ids.pop(key))

    def _send(self, op: tuple) -> None:
        if self._gone:
            gone, self._gone = self._gone, []
            op = ("drop", gone, op)
        dist.broadcast_object_list([op], src=0)

    def forward(self, tokens, starts, lens, caches, all_logits, layers, hidden, tree) -> None:
        self._send(("forward", tokens.tolist(), list(starts), list(lens), [self._cache(c) for c in caches],
                    all_logits, layers, hidden, tree))

    def copy_rows(self, dst, src, start: int, stop: int) -> None:
        self._send(("copy_rows", self._cache(dst), self._cache(src), start, stop))

    def keep_path(self, cache, start: int, path: list[int]) -> None:
        self._send(("keep_path", self._cache(cache), start, list(path)))

    def stop(self) -> None:
        self._send(("stop",))


def follow(engine, tp: TensorParallel) -> None:
    """The other ranks' side: run what rank 0 sends until it says stop."""
    from .token_tree import keep_path

    caches: dict[int, object] = {}

    def cache(i: int):
        if i not in caches:
            caches[i] = engine.new_cache()
        return caches[i]
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        op = box[0]
        if op[0] == "drop":  # caches rank 0 no longer holds, then the operation itself
            for i in op[1]:
                caches.pop(i, None)
            op = op[2]
        if op[0] == "stop":
            return
        if op[0] == "forward":
            _, tokens, starts, lens, ids, all_logits, layers, hidden, tree = op
            engine.model.forward_multi(torch.tensor(tokens, dtype=torch.long), starts, lens, [cache(i) for i in ids],
                                       all_logits, layers, hidden, tree)
        elif op[0] == "copy_rows":
            cache(op[1]).copy_rows_from(cache(op[2]), op[3], op[4])
        elif op[0] == "keep_path":
            keep_path(cache(op[1]), op[2], op[3])
        else:
            raise RuntimeError(f"tensor parallelism: unknown operation {op[0]!r} from rank 0")
