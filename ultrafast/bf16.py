"""The bf16 transform: every linear holds a bf16 copy of its weights and multiplies with PyTorch's bf16 matmul.

Applied to a model built on the meta device, like the packed transform (packed.py). On CPUs with AVX512-BF16
PyTorch's bf16 matmul (oneDNN) multiplies many rows at once at ~2x the packed int16 kernels' rate, so it serves
bulk forwards over long sequences where exactness is not the point: the features a draft head is trained on
(training/features.py). It is not the engine users are served by: the weights are rounded to bf16 (not the
file's exact values), activations are rounded to bf16 at each linear, and the rows of a pass are not
batch-invariant. Norms, RoPE, attention and the residual stream stay fp32 (the plain model's modules).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import linear_weight_name, swap_module

DEQUANT_ROWS = 4096  # rows dequantized at a time: the fp32 copy of a whole vocabulary never exists


class BF16Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError("BF16Linear takes a 2-D bf16 weight")
        self.register_buffer("weight", weight.contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight).float()
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bf16"


def bf16_weight(qt) -> torch.Tensor:
    """A file tensor (`loader.QTensor`, 2-D) dequantized to bf16, DEQUANT_ROWS rows at a time."""
    from .dequant import dequantize

    rows, cols = qt.shape[0], qt.shape[-1]
    raw = qt.raw.reshape(rows, -1)
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    for i in range(0, rows, DEQUANT_ROWS):
        out[i:i + DEQUANT_ROWS] = dequantize(raw[i:i + DEQUANT_ROWS], qt.qtype, cols)
    return out


def apply_bf16(model: nn.Module, loaded) -> nn.Module:
    """Replace every `nn.Linear` of `model` (built on meta) with a `BF16Linear` over the file's weights."""
    tensors, c = loaded.tensors, loaded.config
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear):
            bias = tensors[f"{name}.bias"].dequantize() if f"{name}.bias" in tensors else None
            swap_module(model, name, BF16Linear(bf16_weight(tensors[linear_weight_name(name, c)]), bias))
    return model
