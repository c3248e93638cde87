"""Dequantization of GGUF tensor types in PyTorch: the reference for what each packed weight means.

Every function takes the raw bytes of a tensor as uint8 `[rows, row_bytes]` and returns float32
`[rows, cols]`, computing exactly what GGML computes (fp16 scales widened to fp32, then one multiply
and one add per weight), so the values are the file's own. The packed kernels are checked against these.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

QK_K = 256

SUPPORTED = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 2] (little-endian fp16) -> float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high nibbles (GGML's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q8_0(b):
    d, qs = _f16(b[:, :2]), b[:, 2:].view(torch.int8)
    return d[:, None] * qs.float()


def _q4_0(b):
    d, q = _f16(b[:, :2]), _nibbles(b[:, 2:]).to(torch.int8) - 8
    return d[:, None] * q.float()


def _q4_1(b):
    d, m, q = _f16(b[:, :2]), _f16(b[:, 2:4]), _nibbles(b[:, 4:])
    return d[:, None] * q.float() + m[:, None]


def _q5_0(b):
    d = _f16(b[:, :2])
    qh = b[:, 2:6].contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [n, 1]
    high = ((qh >> torch.arange(32)) & 1).to(torch.uint8)  # bit j is element j's fifth bit
    q = (_nibbles(b[:, 6:]) | (high << 4)).to(torch.int8) - 16
    return d[:, None] * q.float()


def _k_scales(s: torch.Tensor):
    """Q4_K's 12 bytes of packed 6-bit scales and mins -> (scales [n, 8], mins [n, 8]) as uint8."""
    s = s.long()
    sc_lo, m_lo = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc_hi = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    m_hi = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([sc_lo, sc_hi], 1), torch.cat([m_lo, m_hi], 1)


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    d_sub = (d[:, None] * sc.float())[:, :, None]  # [n, 8, 1]
    m_sub = (dmin[:, None] * m.float())[:, :, None]
    # 4 chunks of 32 bytes; each chunk's low nibbles are sub-block 2j, its high nibbles sub-block 2j+1
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (d_sub * q - m_sub).reshape(n, QK_K)


def _q6_k(b):
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64).long()
    qh = b[:, 128:192].reshape(n, 2, 1, 32).long()
    sc = b[:, 192:208].view(torch.int8).float().reshape(n, 16, 1)
    d = _f16(b[:, 208:210])[:, None, None]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 2, 4, 32)  # per 128-half: l, l+32, l+64, l+96
    high = (qh >> torch.tensor([0, 2, 4, 6]).reshape(1, 1, 4, 1)) & 3
    q = ((low | (high << 4)) - 32).reshape(n, 16, 16).float()
    return (d * sc * q).reshape(n, QK_K)


_BLOCK_FNS = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q4_K: _q4_k, T.Q6_K: _q6_k}


def row_bytes(qtype: int, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[T(qtype)]
    if cols % block:
        raise ValueError(f"{T(qtype).name} rows need a multiple of {block} values, got {cols}")
    return cols // block * size


def dequantize(raw: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """Raw bytes uint8 [rows, row_bytes] of GGML type `qtype` -> float32 [rows, cols]."""
    qtype = T(qtype)
    if qtype not in SUPPORTED:
        raise ValueError(f"unsupported tensor type {qtype.name}")
    rows = raw.shape[0]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(qtype, cols):
        raise ValueError(f"{qtype.name}: expected uint8 [rows, {row_bytes(qtype, cols)}], got {raw.dtype} {list(raw.shape)}")
    raw = raw.contiguous()
    if qtype == T.F32:
        return raw.view(torch.float32).clone()
    if qtype == T.F16:
        return raw.view(torch.float16).float()
    if qtype == T.BF16:
        return raw.view(torch.bfloat16).float()
    block, size = GGML_QUANT_SIZES[qtype]
    return _BLOCK_FNS[qtype](raw.reshape(-1, size)).reshape(rows, cols)
