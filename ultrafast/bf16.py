"""The bf16 transform: every linear holds a bf16 copy of its weights and multiplies bf16-rounded activations.

Applied to a model built on the meta device, like the packed transform (packed.py). On CPUs with AVX512-BF16
PyTorch's bf16 matmul (oneDNN) multiplies many rows at once at ~2x the packed int16 kernels' rate, so it serves
bulk forwards over long sequences where exactness is not the point: the features a draft head is trained on
(training/features.py). It is not the engine users are served by: the weights are rounded to bf16 (not the
file's exact values), activations are rounded to bf16 at each linear, and the rows of a pass are not
batch-invariant. Norms, RoPE, attention and the residual stream stay fp32 (the plain model's modules).

Where the CPU has no bf16 multiplier (AVX2 parts: PyTorch's bf16 matmul measured 7.9 G multiply-adds per second
on a Zen 2, its fp32 matmul 60), the same products run in fp32: the bf16 operands widened to fp32 (a product of
two bf16 values is exact in fp32), summed in fp32 as the bf16 matmul does. `apply_bf16` times both on the
model's own width and keeps the faster (`fp32_multiplies`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import linear_weight_name, swap_module

DEQUANT_ROWS = 4096  # rows dequantized at a time: the fp32 copy of a whole vocabulary never exists


class BF16Linear(nn.Module):
    """y = bf16(x) @ W.T (+ bias), W held in bf16; the products in bf16 (PyTorch's bf16 matmul) or, with
    `fp32_multiplies`, in fp32 on the operands widened (the same products, exact, summed in fp32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fp32_multiplies: bool = False):
        super().__init__()
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError("BF16Linear takes a 2-D bf16 weight")
        self.register_buffer("weight", weight.contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)
        self.out_features, self.in_features = weight.shape
        self.fp32_multiplies = bool(fp32_multiplies)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.fp32_multiplies:
            y = F.linear(xb.float(), self.weight.float())
        else:
            y = F.linear(xb, self.weight).float()
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bf16" + (", fp32 multiplies" if self.fp32_multiplies else "")


def bf16_matmul_pays(width: int, rows: int = 256, seconds: float = 0.2) -> bool:
    """Whether PyTorch's bf16 matmul beats widening to fp32 on this CPU, timed on [rows, width] x [width, width]
    (the best of repeated calls over about `seconds` each)."""
    import time

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g).to(torch.bfloat16)
    w = torch.randn(width, width, generator=g).to(torch.bfloat16)

    def best(f) -> float:
        f()
        out, t_end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t = time.perf_counter()
            f()
            out = min(out, time.perf_counter() - t)
        return out
    return best(lambda: F.linear(x, w)) < best(lambda: F.linear(x.float(), w.float()))


def bf16_weight(qt) -> torch.Tensor:
    """A file tensor (`loader.QTensor`, 2-D) dequantized to bf16, DEQUANT_ROWS rows at a time."""
    from .dequant import dequantize

    rows, cols = qt.shape[0], qt.shape[-1]
    raw = qt.raw.reshape(rows, -1)
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    for i in range(0, rows, DEQUANT_ROWS):
        out[i:i + DEQUANT_ROWS] = dequantize(raw[i:i + DEQUANT_ROWS], qt.qtype, cols)
    return out


def apply_bf16(model: nn.Module, loaded, fp32_multiplies: bool | None = None) -> nn.Module:
    """Replace every `nn.Linear` of `model` (built on meta) with a `BF16Linear` over the file's weights.
    fp32_multiplies: None times both on this CPU (`bf16_matmul_pays`) and keeps the faster."""
    tensors, c = loaded.tensors, loaded.config
    if fp32_multiplies is None:
        fp32_multiplies = not bf16_matmul_pays(c.dim)
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear):
            bias = tensors[f"{name}.bias"].dequantize() if f"{name}.bias" in tensors else None
            swap_module(model, name, BF16Linear(bf16_weight(tensors[linear_weight_name(name, c)]), bias,
                                                fp32_multiplies))
    return model
