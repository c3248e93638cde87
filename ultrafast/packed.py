"""The packed transform: swap the plain model's modules for batch-invariant kernels over packed weights.

Applied to a model built on the meta device, before any weight is materialised, as gpt-fast applies its
quantization and tensor-parallel transforms:
- every `nn.Linear` becomes a `PackedLinear` that keeps the file's raw GGUF bytes and multiplies by them
  with the fused dequantize-and-multiply kernel (no fp32 copy of the weights exists);
- `RMSNorm` and `AttentionCore` become kernel versions with a fixed reduction order per row.

Activations are fp32 between operations; inside a quantized linear they are rounded per block of 32 to int16
(`act_bits=16`, the default) or to int8 (`act_bits=8`, as llama.cpp rounds them to int8, at twice the multiply rate: see
the README on the decode path). Every row's arithmetic is the same whatever the number of rows in the call, so the
logits of k tokens verified in one forward are bit-identical to feeding them one at a time; this is what
lets the ultrafast tier promise exactly the standard tier's tokens. (PyTorch's own fp32 `F.linear` is not
batch-invariant on this CPU; its bf16 and int4/int8 packed matmuls are, but their scales are not the file's
exact values: see shared/notes/measurements.md.)
"""

from __future__ import annotations

import torch
from torch import nn

from . import kernels
from .hugepages import empty_on_hugepages
from .model import AttentionCore, RMSNorm, linear_weight_name, swap_module


def vnni_path() -> bool:
    """Whether the quantized linears run on the VNNI kernels now (the path is process-wide and may change)."""
    return kernels.path_in_use().startswith("vnni")


class PackedLinear(nn.Module):
    def __init__(self, raw: torch.Tensor, qtype: int, in_features: int, out_features: int, bias=None,
                 act_bits: int = 16):
        super().__init__()
        if act_bits not in (16, 8):
            raise ValueError(f"act_bits must be 16 or 8, got {act_bits!r}")
        if raw.dtype != torch.uint8 or raw.shape[0] != out_features or raw.shape[1] != kernels.row_bytes(qtype, in_features):
            raise ValueError(f"packed weight of shape {list(raw.shape)} does not hold {out_features}x{in_features} "
                             f"values of type {qtype}")
        self.register_buffer("raw", raw.contiguous(), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.qtype, self.in_features, self.out_features = int(qtype), in_features, out_features
        self.act_bits = act_bits
        self.register_buffer("raw_layout", None, persistent=False)  # the kernels' own layout of raw, once made
        self._layout_of: torch.Tensor | None = None  # the raw that raw_layout was made from

    def weights(self, layouts: bool | None = None) -> tuple[torch.Tensor, int]:
        """The bytes and type id the kernels read: the file's, except where the kernels in force read a layout made
        once from `raw` (`kernels.layout_in_use`: every quantized type on the VNNI kernels, `kernels.repack_vnni`:
        Q4_0, Q4_1, Q5_0, Q8_0 and Q4_K with one fp32 step per 512 values, Q6_K without weight permutes; the AVX2
        integer kernels, at 8 and 16 bits, Q4_K's and Q6_K's). `raw` keeps the file's bytes for every other
        reader and path. layouts: True / False ask for the type's layout / the file's bytes whatever the path."""
        if layouts is None:
            layout = kernels.layout_in_use(self.qtype, self.act_bits)
        else:
            layout = kernels.vnni_layout(self.qtype) if layouts else None
        if layout is None:
            return self.raw, self.qtype
        if self.raw_layout is None or self._layout_of is not self.raw:
            self.raw_layout, self._layout_of = kernels.repack_vnni(self.raw, self.qtype, self.in_features), self.raw
        return self.raw_layout, layout

    def kernel_path(self) -> str:
        """The kernels this linear runs on now (`kernels.linear_path` of the bytes `weights` gives them)."""
        return kernels.linear_path(kernels.layout_in_use(self.qtype, self.act_bits) or self.qtype, self.act_bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, qtype = self.weights()
        y = kernels.qmatmul(x.contiguous(), w, qtype, self.in_features, self.act_bits)
        return y if self.bias is None else y + self.bias

    def nbytes_per_step(self) -> int:
        return self.raw.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, qtype={self.qtype}, act_bits={self.act_bits}"


def layout_copy_bytes(model: nn.Module) -> int:
    """Bytes of the kernels' own layouts (`PackedLinear.weights`), made at load from the file's bytes: part of what the
    model holds in memory; the file's bytes of those linears stay in the file's mapping."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, PackedLinear) and m.raw_layout is not None and m.raw_layout.data_ptr() not in seen:
            seen.add(m.raw_layout.data_ptr())
            total += m.raw_layout.numel()
    return total


class KernelRMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight.float().contiguous(), persistent=False)
        self.eps = eps

    def forward(self, x):
        return kernels.rmsnorm(x.contiguous(), self.weight, self.eps)

    def nbytes_per_step(self) -> int:
        return self.weight.numel() * 4


class KernelAttentionCore(nn.Module):
    def forward(self, q, k_cache, v_cache, start_pos: int, scale: float, tree=None):
        return kernels.attention(q.contiguous(), k_cache, v_cache, start_pos, scale,
                                 None if tree is None else tree.kernel_args)


class FusedBlock(nn.Module):
    """A whole decoder layer as one kernel call, built from a `Block` whose linears are all packed."""

    LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
               "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")

    def __init__(self, block: nn.Module, tp=None):
        super().__init__()
        self.block = block  # keeps the packed modules (and their bytes) registered
        self.tp = tp  # tensor parallelism (tensor_parallel.py): the layer runs as two halves, all-reduced
        lin = [block.get_submodule(n) for n in self.LINEARS]
        self._lin = lin
        self._weights_seen = None  # (path, the linears' raw tensors, weights()): see weights()
        self.act_bits = lin[0].act_bits
        self.biases = [m.bias for m in lin[:3]] if lin[0].bias is not None else []
        # the norms' weights and eps, read per pass (plain attributes: a module attribute lookup costs ~1 us)
        self.norms = (block.attention_norm.weight, block.ffn_norm.weight, block.attention_norm.eps)
        att = block.attention
        self.n_heads, self.n_kv_heads, self.head_dim, self.scale = att.n_heads, att.n_kv_heads, att.head_dim, att.scale

    def weights(self, path: str | None = None) -> tuple[list[torch.Tensor], list[int]]:
        """The linears' bytes and type ids for the path in use (`PackedLinear.weights`; path: `kernels.path_in_use()`,
        asked if not given: with the linears' types and activation width it decides which layouts are read). Kept
        from the last call while the path and every linear's `raw` are the same objects (a decode step asks once per
        layer), so that rebinding their bytes or changing the path is seen."""
        path = kernels.path_in_use() if path is None else path
        # (the buffers' dict: `m.raw` goes through nn.Module.__getattr__, ~0.7 us, and a pass asks for 196 of them)
        raws = [m._buffers["raw"] for m in self._lin]
        seen = self._weights_seen
        if seen is not None and seen[0] == path and all(a is b for a, b in zip(seen[1], raws)):
            return seen[2]
        w = [m.weights() for m in self._lin]
        out = [b for b, _ in w], [q for _, q in w]
        self._weights_seen = (path, raws, out)
        return out

    @staticmethod
    def fusable(block: nn.Module) -> bool:
        lin = [block.get_submodule(n) for n in FusedBlock.LINEARS]
        return all(isinstance(m, PackedLinear) for m in lin) and len({m.act_bits for m in lin}) == 1 and \
            isinstance(block.attention_norm, KernelRMSNorm) and isinstance(block.ffn_norm, KernelRMSNorm)

    def forward(self, x, cos, sin, segments, tree=None):
        starts, lens, kcs, vcs = (list(t) for t in zip(*segments))
        raws, qtypes = self.weights()
        attn_norm, ffn_norm, eps = self.norms

        def run(x, part):
            return kernels.decoder_block(x, starts, lens, attn_norm, ffn_norm, eps, raws, qtypes, self.biases, kcs,
                                         vcs, cos, sin, self.n_heads, self.n_kv_heads, self.head_dim, self.scale,
                                         self.act_bits, None if tree is None else tree.kernel_args, part)
        if self.tp is None:
            return run(x, 0)
        h = x + self.tp.all_reduce(run(x, 1))  # the attention half's partial sums, then the residual
        return h + self.tp.all_reduce(run(h, 2))


class FusedStack:
    """A model's fused layers run as one kernel call per pass (`kernels.decoder_stack`: the layers' `decoder_block`
    calls, in order, without a Python->C++ crossing per layer), for the passes whose layers it covers: all fused,
    none split for tensor parallelism, all of one shape (biases on all or none, the same heads, eps and activation
    precision). `Transformer.forward_multi` asks it first."""

    def __init__(self, layers: nn.ModuleList):
        self.layers = layers

    def covers(self, ids) -> bool:
        layers = list(self.layers)  # (indexing a ModuleList costs ~1 us a layer; listing it, a fraction)
        blocks = [layers[i] for i in ids]
        if not blocks or not all(isinstance(b, FusedBlock) and b.tp is None for b in blocks):
            return False
        return len({(bool(b.biases), b.act_bits, b.norms[2], b.n_heads, b.n_kv_heads, b.head_dim, b.scale)
                    for b in blocks}) == 1

    def __call__(self, x, cos, sin, starts, lens, caches, ids, keep, tree=None, share=None):
        """x through layers `ids` (in order) for the sequences' rows (starts, lens, caches as in forward_multi);
        keep: positions in ids after which x is also returned; share: rows the sequences' caches hold alike
        (`kernels.decoder_block`). Returns (x, kept)."""
        path = kernels.path_in_use()
        layers = list(self.layers)
        blocks = [layers[i] for i in ids]
        an, fn, ws, qts, bs, kcs, vcs = [], [], [], [], [], [], []
        for i, b in zip(ids, blocks):
            raws, qtypes = b.weights(path)
            an.append(b.norms[0])
            fn.append(b.norms[1])
            ws += raws
            qts += qtypes
            bs += b.biases
            kcs += [c.k_layers[i] for c in caches]
            vcs += [c.v_layers[i] for c in caches]
        b0 = blocks[0]
        return kernels.decoder_stack(x, starts, lens, an, fn, b0.norms[2], ws, qts, bs, kcs, vcs,
                                     cos, sin, b0.n_heads, b0.n_kv_heads, b0.head_dim, b0.scale, b0.act_bits,
                                     None if tree is None else tree.kernel_args, keep, share)


def _place_on_hugepages(lins: list[PackedLinear], release=None) -> None:
    """What the kernels stream every step, in one mapping on huge pages (`hugepages.py`: a decode step reads all of it),
    made now, at load: where the kernels in force read a layout of their own (`PackedLinear.weights`), that layout,
    made from the file's bytes, which stay where they are (`raw`: the file's mapping, for the rare readers); elsewhere
    a copy of the file's bytes, which becomes `raw`. Either way one copy of each linear in memory (a layout has the
    file's bytes per row). release(t): called with each linear's file bytes once they are placed
    (`LoadedModel.release_file_pages`), so that the file's pages leave the process a linear at a time rather than all
    after the last."""
    homes = empty_on_hugepages([m.raw for m in lins])
    for m, home in zip(lins, homes):
        if kernels.layout_in_use(m.qtype, m.act_bits) is not None:
            kernels.repack_vnni(m.raw, m.qtype, m.in_features, out=home)
            m.raw_layout, m._layout_of = home, m.raw
            placed = m.raw
        else:
            home.copy_(m.raw)
            placed, m.raw = m.raw, home
        if release is not None:
            release(placed)


def apply_packed(model: nn.Module, loaded, fuse: bool = True, act_bits: int = 16) -> nn.Module:
    """Replace linears, norms and attention cores of `model` (built on meta) with packed kernel modules,
    then (fuse) each decoder layer with a single-call fused layer over the same packed weights. act_bits: the
    precision of the quantized linears' activations (16, or 8: llama.cpp's)."""
    tensors, c = loaded.tensors, loaded.config
    lins = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear):
            qt = tensors[linear_weight_name(name, c)]
            bias = tensors[f"{name}.bias"].dequantize() if f"{name}.bias" in tensors else None
            if qt.qtype not in kernels.SUPPORTED_TYPES:
                continue  # stays a plain linear, filled in by the reference build
            if act_bits == 8 and not kernels.linear_path(qt.qtype, 8):
                raise ValueError(f"8-bit activations: the kernels of this CPU ({kernels.path_in_use()}) do not multiply "
                                 f"{name}'s weights (GGML type {qt.qtype}) with int8 activations; they need the "
                                 "AVX512-VNNI or the AVX2 integer kernels")
            lin = PackedLinear(qt.raw, qt.qtype, mod.in_features, mod.out_features, bias, act_bits)
            lins.append(lin)
            swap_module(model, name, lin)
        elif isinstance(mod, RMSNorm):
            swap_module(model, name, KernelRMSNorm(tensors[f"{name}.weight"].dequantize(), mod.eps))
        elif isinstance(mod, AttentionCore):
            swap_module(model, name, KernelAttentionCore())
    _place_on_hugepages(lins, loaded.release_file_pages)
    loaded.release_file_pages()  # the rest (read once for the copies above); not streamed from here on
    if fuse:
        for i, block in enumerate(model.layers):
            if FusedBlock.fusable(block):
                model.layers[i] = FusedBlock(block)
        model.layer_stack = FusedStack(model.layers)
    return model


def batch_invariant(model: nn.Module) -> bool:
    """Whether every row of a forward is computed the same whatever rows come with it: true when no plain
    PyTorch linear, norm or attention is left (all are the packed kernels). The ultrafast tier's promise of
    the standard tier's very tokens rests on it; PyTorch's own ops (the reference path, CUDA for now) may
    round a k-row pass differently from a 1-row one."""
    return not any(isinstance(m, (nn.Linear, RMSNorm, AttentionCore)) for m in model.modules())
