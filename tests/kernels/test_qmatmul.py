"""Tests for ultrafast.kernels: packed-weight matmul, RMSNorm and attention.

Every GGUF block layout is checked against gguf.quants.dequantize (the reference for the weights' values),
and every kernel is checked for batch invariance: a k-row call must be bit-identical to k one-row calls,
and to itself under a different thread count. Both the AVX-512 path (when the CPU has it) and the portable
scalar path are exercised.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import numpy as np
import pytest
import torch
from torch.utils.cpp_extension import is_ninja_available

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

import ultrafast.kernels as uk  # noqa: E402

if shutil.which(os.environ.get("CXX", "c++")) is None or not is_ninja_available():  # pragma: no cover
    pytest.skip("no C++ compiler / ninja to build the ultrafast kernels", allow_module_level=True)
uk.load()  # a build error in the kernels fails loudly here instead of skipping

ALL_TYPES = [uk.F32, uk.F16, uk.BF16, uk.Q4_0, uk.Q4_1, uk.Q5_0, uk.Q8_0, uk.Q4_K, uk.Q6_K]
NAMES = {uk.F32: "F32", uk.F16: "F16", uk.BF16: "BF16", uk.Q4_0: "Q4_0", uk.Q4_1: "Q4_1", uk.Q5_0: "Q5_0",
         uk.Q8_0: "Q8_0", uk.Q4_K: "Q4_K", uk.Q6_K: "Q6_K"}
# K values per type: several kernel blocks, partial kernel blocks (Q4_0/Q4_1 group 4 GGUF blocks; the float
# types handle any K) and, for the larger ones, several K panels.
K_VALUES = {
    uk.F32: [16, 40, 576, 1100], uk.F16: [8, 40, 576, 1100], uk.BF16: [24, 40, 576, 1100],
    uk.Q4_0: [32, 96, 544, 576, 608, 4224], uk.Q4_1: [32, 96, 544, 576, 608, 4224],
    uk.Q5_0: [32, 96, 576, 1088], uk.Q8_0: [32, 96, 576, 1088],
    uk.Q4_K: [256, 1536, 4608], uk.Q6_K: [256, 1536, 4608],
}
# Agreement with x @ dequant(W).T, relative to sum_i |x_i| * |w_i| per output (fp32 sums in another order).
RTOL = 1e-5
# The VNNI path rounds activations to int16 per block of 32 (s = max|x|/32639): worst case ~1/65278 per
# value of max|x| in its block, measured <= 2.7e-5 of sum|x*w| on these tests; weights are exact.
RTOL_VNNI = 1e-4
QUANT_TYPES = {uk.Q4_0, uk.Q4_1, uk.Q5_0, uk.Q8_0, uk.Q4_K, uk.Q6_K}
_active = {"path": "avx512"}


def _f16_bytes(rng, shape, lo, hi):
    return rng.uniform(lo, hi, size=shape).astype(np.float16).view(np.uint8).reshape(shape + (2,))


def random_weight(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes [n, row_bytes] of a random weight: random block bytes with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    if qtype == uk.F32:
        return rng.standard_normal((n, k)).astype(np.float32).view(np.uint8)
    if qtype == uk.F16:
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    if qtype == uk.BF16:
        f = rng.standard_normal((n, k)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blk, nbytes = uk.block_info(qtype)
    nb = k // blk
    raw = rng.integers(0, 256, size=(n, nb, nbytes), dtype=np.uint8)
    s = (n, nb)
    if qtype in (uk.Q4_0, uk.Q5_0, uk.Q8_0):
        raw[..., 0:2] = _f16_bytes(rng, s, -0.05, 0.05)
    elif qtype == uk.Q4_1:
        raw[..., 0:2] = _f16_bytes(rng, s, 0.0, 0.05)
        raw[..., 2:4] = _f16_bytes(rng, s, -0.4, 0.0)
    elif qtype == uk.Q4_K:
        raw[..., 0:2] = _f16_bytes(rng, s, -0.003, 0.003)
        raw[..., 2:4] = _f16_bytes(rng, s, 0.0, 0.003)
    elif qtype == uk.Q6_K:
        raw[..., 208:210] = _f16_bytes(rng, s, -0.003, 0.003)
    return raw.reshape(n, nb * nbytes)


def dequant(raw: np.ndarray, qtype: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, qtype), dtype=np.float32).reshape(raw.shape[0], k))


@contextlib.contextmanager
def num_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


PATHS = ["vnni", "avx512", "avx2", "scalar"]  # avx512 = the AVX-512 fp32 path, avx2 = the AVX2 fp32 path
_REQUEST = {"vnni": "auto", "avx512": "fp32", "avx2": "avx2-fp32", "scalar": "scalar"}
_NAME = {"vnni": "vnni-int16", "avx512": "avx512-fp32", "avx2": "avx2-fp32", "scalar": "scalar"}


@pytest.fixture(params=PATHS)
def path(request):
    if request.param in ("vnni", "avx512") and not uk.load().avx512_supported():
        pytest.skip("CPU without AVX-512")
    if request.param == "vnni" and not uk.load().vnni_supported():
        pytest.skip("CPU without AVX512-VNNI")
    if request.param == "avx2" and not uk.load().avx2_supported():
        pytest.skip("CPU without AVX2")
    uk.set_kernels_path(_REQUEST[request.param])
    assert uk.avx512_active() == (request.param in ("vnni", "avx512"))
    assert uk.path_in_use() == _NAME[request.param]
    _active["path"] = request.param
    yield request.param
    _active["path"] = "avx512"
    uk.set_kernels_path("auto")


def _check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rtol: float | None = None,
                 qtype: int | None = None) -> None:
    if rtol is None:
        rtol = RTOL_VNNI if _active["path"] == "vnni" and qtype in QUANT_TYPES else RTOL
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    err = (y.double() - ref).abs()
    bad = err > rtol * scale + 1e-30
    assert not bad.any(), f"max rel err {(err / scale.clamp_min(1e-30)).max().item():.3g}"
    # and the plain fp32 reference, as the engine would compute it
    ref32 = x @ w.T
    assert ((y - ref32).abs().double() <= 2 * rtol * scale + 1e-30).all()


# ---------------------------------------------------------------------------------------------------------
# qmatmul

@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: NAMES[t])
def test_block_layouts_match_gguf(path, qtype):
    n = 37  # not a multiple of the kernel's row group
    ks = K_VALUES[qtype] if path != "scalar" else K_VALUES[qtype][:3]
    for i, k in enumerate(ks):
        raw = random_weight(qtype, n, k, seed=i)
        w = dequant(raw, qtype, k)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(i))
        y = uk.qmatmul(x, torch.from_numpy(raw), qtype, k)
        assert y.shape == (5, n) and y.dtype == torch.float32
        _check_close(y, x, w, qtype=qtype)


@pytest.mark.parametrize("qtype", [uk.Q4_0, uk.Q4_1, uk.Q5_0, uk.Q8_0], ids=lambda t: NAMES[t])
def test_gguf_quantized_weights(path, qtype):
    # weights produced by gguf's own quantizer (realistic scales) for the types it supports
    k, n = 576, 24
    wf = np.random.default_rng(3).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = np.ascontiguousarray(quantize(wf, qtype))
    assert raw.shape == (n, uk.row_bytes(qtype, k))
    w = dequant(raw, qtype, k)
    x = torch.randn(3, k)
    _check_close(uk.qmatmul(x, torch.from_numpy(raw), qtype, k), x, w, qtype=qtype)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: NAMES[t])
def test_qmatmul_batch_invariant(path, qtype):
    k_in = K_VALUES[qtype][-1] if path != "scalar" else K_VALUES[qtype][1]
    n = 35 if path != "scalar" else 19
    raw = torch.from_numpy(random_weight(qtype, n, k_in, seed=7))
    x = torch.randn(16, k_in, generator=torch.Generator().manual_seed(1))
    singles = torch.cat([uk.qmatmul(x[i:i + 1], raw, qtype, k_in) for i in range(16)])
    for k in (1, 2, 3, 4, 5, 8, 16):
        yk = uk.qmatmul(x[:k], raw, qtype, k_in)
        assert torch.equal(yk, singles[:k]), f"k={k}"
    # a row's result does not depend on its position in the block or on its neighbours
    yk = uk.qmatmul(x[5:12], raw, qtype, k_in)
    assert torch.equal(yk, singles[5:12])
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(2))
    assert torch.equal(uk.qmatmul(x[perm], raw, qtype, k_in), singles[perm])
    # nor a weight row's on the weight rows tiled with it (an odd count leaves a one-row tile at the end;
    # dropping the first row pairs every row with another neighbour)
    for k in (1, 4, 8):
        assert torch.equal(uk.qmatmul(x[:k], raw[1:], qtype, k_in), singles[:k, 1:]), f"k={k}"
    # and not on the thread count
    for k in (1, 16):
        with num_threads(1):
            y1 = uk.qmatmul(x[:k], raw, qtype, k_in)
        with num_threads(2):
            y2 = uk.qmatmul(x[:k], raw, qtype, k_in)
        assert torch.equal(y1, y2) and torch.equal(y1, singles[:k])


@pytest.mark.parametrize("qtype", [uk.Q4_K, uk.Q6_K, uk.Q4_1, uk.Q8_0], ids=lambda t: NAMES[t])
def test_qmatmul_long_blocks(path, qtype):
    # more rows than one register tile and one row chunk (k=37), K over several panels
    k_in = {uk.Q4_K: 2560, uk.Q6_K: 2560, uk.Q4_1: 1120, uk.Q8_0: 1120}[qtype]
    raw = torch.from_numpy(random_weight(qtype, 21, k_in, seed=3))
    x = torch.randn(37, k_in, generator=torch.Generator().manual_seed(4))
    y = uk.qmatmul(x, raw, qtype, k_in)
    singles = torch.cat([uk.qmatmul(x[i:i + 1], raw, qtype, k_in) for i in range(37)])
    assert torch.equal(y, singles)
    _check_close(y, x, dequant(raw.numpy(), qtype, k_in), qtype=qtype)


@pytest.mark.parametrize("qtype", [uk.Q4_K, uk.Q6_K, uk.Q5_0], ids=lambda t: NAMES[t])
def test_qmatmul_prefill_schedule(path, qtype):
    # enough rows that their prepared x outgrows L2 (the weight-tiled prefill schedule on the VNNI path): every
    # row's result still equals the one-row call's (the decode schedule), bit for bit
    k_in, k = 2560, 100
    raw = torch.from_numpy(random_weight(qtype, 19, k_in, seed=5))
    x = torch.randn(k, k_in, generator=torch.Generator().manual_seed(6))
    y = uk.qmatmul(x, raw, qtype, k_in)
    singles = torch.cat([uk.qmatmul(x[i:i + 1], raw, qtype, k_in) for i in range(k)])
    assert torch.equal(y, singles)
    _check_close(y, x, dequant(raw.numpy(), qtype, k_in), qtype=qtype)


def test_multiply_peak():
    if not uk.load().vnni_supported():  # the CPU's, whatever path the tests chose
        assert uk.multiply_peak(1, iters=1000, reps=1) is None
        return
    p = uk.multiply_peak(1, iters=200_000, reps=2)
    assert p.threads == 1 and p.vpdpbusd_per_s > 1e8  # any VNNI core sustains far more than this
    assert p.int8_macs_per_s == 64 * p.vpdpbusd_per_s and p.macs_per_s(16) == 32 * p.vpdpbusd_per_s
    # the kernels' arithmetic: 128 multiply-adds per product, for both activation widths (two timings on a shared
    # machine: how they order against the bare multiplies is printed by `ultrafast bench`, not asserted here)
    assert set(p.products_per_s) == {16, 8}
    for bits in (16, 8):
        assert p.products_per_s[bits] > 1e6
        assert p.arithmetic_macs_per_s(bits) == pytest.approx(128 * p.products_per_s[bits], rel=1e-12)
    # the paired layouts' 512-value products: all the multiply-adds there gives their rate, a share of them the time of
    # each part at its rate
    assert set(p.paired_products_per_s) == {16, 8}
    for bits in (16, 8):
        kq, pa = 128 * p.products_per_s[bits], 512 * p.paired_products_per_s[bits]
        assert p.paired_products_per_s[bits] > 1e5 and p.arithmetic_macs_per_s(bits, 1.0) == pytest.approx(pa)
        assert p.arithmetic_macs_per_s(bits, 0.7) == pytest.approx(1 / (0.3 / kq + 0.7 / pa))
    with pytest.raises(ValueError, match="paired_share"):
        p.arithmetic_macs_per_s(8, 1.5)
    # what an fp32 FMA costs beside vpdpbusd, in their slots: ~1 on Zen 4, ~0 where the pipes differ; never more than
    # the 12 / 6 = 2 that would mean the FMAs alone took longer than the vpdpbusd loop they ride beside, plus noise
    assert 0.0 <= p.fma_cost < 3.0
    # a load beside vpdpbusd, the same way: 0.35-0.48 on the Intel Xeon, ~0 where loads do not bind; 12 loads cannot
    # take longer than 12 vpdpbusd slots each (the loop then memory-bound, which an L1-resident buffer is not), plus noise
    assert 0.0 <= p.load_cost < 2.0
    with pytest.raises(ValueError, match="act_bits"):
        p.arithmetic_macs_per_s(4)
    with pytest.raises(ValueError, match="act_bits"):
        p.macs_per_s(4)
    with pytest.raises(ValueError, match="threads"):
        uk.multiply_peak(0)


def test_fma_peak():
    if not uk.load().avx2_supported():
        assert uk.fma_peak(1, iters=1000, reps=1) is None
        return
    rate = uk.fma_peak(1, iters=200_000, reps=2)
    assert rate > 8e8  # multiply-adds per second: any AVX2 core sustains far more than 1e8 FMA instructions
    with pytest.raises(ValueError, match="threads"):
        uk.fma_peak(0)


def test_int8_madd_peak():
    if not uk.load().avx2_supported():
        assert uk.int8_madd_peak(1, iters=1000, reps=1) is None
        return
    rate = uk.int8_madd_peak(1, iters=200_000, reps=2)
    assert rate > 3.2e9  # multiply-adds per second: 32 a step, and any AVX2 core runs far more than 1e8 steps
    with pytest.raises(ValueError, match="threads"):
        uk.int8_madd_peak(0)


def test_qmatmul_many_rows_thread_split(path):
    # enough rows that both threads get work, with a row count that is not a multiple of any tile size
    qtype, k_in, n = uk.Q4_K, 512, 16 * 45 + 5
    raw = torch.from_numpy(random_weight(qtype, n, k_in, seed=11))
    x = torch.randn(3, k_in)
    with num_threads(1):
        y1 = uk.qmatmul(x, raw, qtype, k_in)
    with num_threads(2):
        y2 = uk.qmatmul(x, raw, qtype, k_in)
    assert torch.equal(y1, y2)
    _check_close(y2, x, dequant(raw.numpy(), qtype, k_in), qtype=qtype)


def test_qmatmul_concurrent_callers():
    # calls release the GIL and keep per-thread scratch: concurrent callers get the same bits
    import threading

    raw = torch.from_numpy(random_weight(uk.Q4_K, 64, 1536, seed=8))
    xs = [torch.randn(3, 1536, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    ref = [uk.qmatmul(x, raw, uk.Q4_K, 1536) for x in xs]
    bad = []

    def work():
        for _ in range(10):
            for x, r in zip(xs, ref):
                if not torch.equal(uk.qmatmul(x, raw, uk.Q4_K, 1536), r):
                    bad.append(1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_qmatmul_1d_and_strided_inputs():
    qtype, k_in, n = uk.Q8_0, 64, 9
    raw = torch.from_numpy(random_weight(qtype, n, k_in))
    x = torch.randn(4, 2 * k_in)[:, ::2]  # non-contiguous x is copied
    y = uk.qmatmul(x, raw, qtype, k_in)
    assert torch.equal(y, uk.qmatmul(x.contiguous(), raw, qtype, k_in))
    y1 = uk.qmatmul(x[0].contiguous(), raw, qtype, k_in)
    assert y1.shape == (n,) and torch.equal(y1, y[0])
    y3 = uk.qmatmul(x.reshape(2, 2, k_in), raw, qtype, k_in)  # leading dims are rows
    assert y3.shape == (2, 2, n) and torch.equal(y3.reshape(4, n), y)
    # rows of w may be a row slice of a bigger buffer (e.g. a fused QKV tensor)
    big = torch.from_numpy(random_weight(qtype, 3 * n, k_in, seed=5))
    part = big[n:2 * n]
    assert torch.equal(uk.qmatmul(x, part, qtype, k_in), uk.qmatmul(x, part.clone(), qtype, k_in))


def test_qmatmul_zero_rows():
    raw = torch.from_numpy(random_weight(uk.Q8_0, 4, 64))
    assert uk.qmatmul(torch.empty(0, 64), raw, uk.Q8_0, 64).shape == (0, 4)


def test_qmatmul_input_errors():
    raw = torch.from_numpy(random_weight(uk.Q4_K, 8, 256))
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="float32"):
        uk.qmatmul(x.double(), raw, uk.Q4_K, 256)
    with pytest.raises(ValueError, match="uint8"):
        uk.qmatmul(x, raw.to(torch.int8), uk.Q4_K, 256)
    with pytest.raises(ValueError, match="features"):
        uk.qmatmul(torch.randn(2, 255), raw, uk.Q4_K, 256)
    with pytest.raises(ValueError, match="multiple of the block size"):
        uk.qmatmul(torch.randn(2, 250), raw, uk.Q4_K, 250)
    with pytest.raises(ValueError, match="bytes per row"):
        uk.qmatmul(torch.randn(2, 512), raw, uk.Q4_K, 512)
    with pytest.raises(ValueError, match="unsupported GGML type"):
        uk.qmatmul(x, raw, 7, 256)  # Q5_1
    with pytest.raises(ValueError, match="2-D"):
        uk.qmatmul(x, raw[None], uk.Q4_K, 256)
    with pytest.raises(ValueError, match="torch.Tensor"):
        uk.qmatmul(x.numpy(), raw, uk.Q4_K, 256)
    with pytest.raises(ValueError, match="bytes per row"):
        uk.qmatmul(x, raw[:, :100].contiguous(), uk.Q4_K, 256)
    with pytest.raises(ValueError, match="float32"):
        uk.qmatmul(x.half(), raw, uk.Q4_K, 256)
    with pytest.raises(ValueError, match="in_features must be positive"):
        uk.qmatmul(torch.empty(2, 0), raw, uk.Q4_K, 0)


def test_block_info_and_row_bytes():
    for t in ALL_TYPES:
        blk, nbytes = uk.block_info(t)
        assert (blk, nbytes) == uk.load().block_info(t)
        if blk > 1:
            assert (blk, nbytes) == tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)])
    assert uk.row_bytes(uk.Q4_K, 1536) == 6 * 144
    assert uk.available()


# ---------------------------------------------------------------------------------------------------------
# rmsnorm

def test_rmsnorm(path):
    d, eps = 1536, 1e-6
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, d, generator=g) * 3
    w = torch.randn(d, generator=g)
    y = uk.rmsnorm(x, w, eps)
    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps) * w.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    singles = torch.cat([uk.rmsnorm(x[i:i + 1], w, eps) for i in range(16)])
    for k in (1, 2, 3, 4, 8, 16):
        assert torch.equal(uk.rmsnorm(x[:k], w, eps), singles[:k])
    with num_threads(1):
        y1 = uk.rmsnorm(x, w, eps)
    assert torch.equal(y1, y)
    assert torch.equal(uk.rmsnorm(x[3], w, eps), singles[3])
    assert torch.equal(uk.rmsnorm(x.view(4, 4, d), w, eps).view(16, d), y)
    # odd width (not a multiple of the 16 lanes)
    x2, w2 = torch.randn(3, 577), torch.randn(577)
    ref2 = x2.double() * torch.rsqrt(x2.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w2.double()
    torch.testing.assert_close(uk.rmsnorm(x2, w2, 1e-5).double(), ref2, rtol=1e-5, atol=1e-6)


def test_rmsnorm_errors():
    with pytest.raises(ValueError, match="float32"):
        uk.rmsnorm(torch.randn(2, 8).double(), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        uk.rmsnorm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="weight must be 1-D"):
        uk.rmsnorm(torch.randn(2, 8), torch.randn(2, 8), 1e-6)
    with pytest.raises(ValueError, match="torch.Tensor"):
        uk.rmsnorm([1.0, 2.0], torch.randn(2), 1e-6)


# ---------------------------------------------------------------------------------------------------------
# attention

def ref_attention(q, kc, vc, start_pos, scale):
    k, h, hd = q.shape
    group = h // kc.shape[0]
    out = torch.empty(k, h, hd, dtype=torch.float64)
    for i in range(k):
        n = start_pos + i + 1
        for j in range(h):
            kv = j // group
            s = (kc[kv, :n].double() @ q[i, j].double()) * scale
            out[i, j] = torch.softmax(s, 0) @ vc[kv, :n].double()
    return out


@pytest.mark.parametrize("hd,heads,kv_heads", [(64, 9, 3), (128, 12, 2), (48, 4, 4), (256, 14, 2), (40, 6, 2)])
def test_attention(path, hd, heads, kv_heads):
    g = torch.Generator().manual_seed(hd)
    max_len, start = 96, 37
    kc = torch.randn(kv_heads, max_len, hd, generator=g)
    vc = torch.randn(kv_heads, max_len, hd, generator=g)
    q = torch.randn(16, heads, hd, generator=g) * 2
    scale = hd ** -0.5
    out = uk.attention(q, kc, vc, start, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_attention(q, kc, vc, start, scale), rtol=1e-5, atol=2e-6)
    # query i alone at position start+i gives the same bits as inside any block
    singles = torch.cat([uk.attention(q[i:i + 1], kc, vc, start + i, scale) for i in range(16)])
    assert torch.equal(out, singles)
    for k in (1, 2, 3, 4, 8):
        for s0 in (0, 5):
            blk = uk.attention(q[s0:s0 + k], kc, vc, start + s0, scale)
            assert torch.equal(blk, singles[s0:s0 + k]), (k, s0)
    with num_threads(1):
        assert torch.equal(uk.attention(q, kc, vc, start, scale), out)
    # from position 0 (a single key) and a long context (several 16-key chunks + tail)
    out0 = uk.attention(q[:3], kc, vc, 0, scale)
    torch.testing.assert_close(out0.double(), ref_attention(q[:3], kc, vc, 0, scale), rtol=1e-5, atol=2e-6)


def test_attention_cache_view():
    # caches may be views of a bigger [n_layers, n_kv, max_len, hd] buffer
    buf_k = torch.randn(3, 2, 64, 32)
    buf_v = torch.randn(3, 2, 64, 32)
    q = torch.randn(4, 4, 32)
    out = uk.attention(q, buf_k[1], buf_v[1], 10, 0.2)
    torch.testing.assert_close(out.double(), ref_attention(q, buf_k[1], buf_v[1], 10, 0.2), rtol=1e-5, atol=2e-6)


def test_attention_errors():
    kc = torch.randn(2, 16, 32)
    with pytest.raises(ValueError, match="exceed the cache length"):
        uk.attention(torch.randn(4, 4, 32), kc, kc, 14, 0.1)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        uk.attention(torch.randn(1, 3, 32), kc, kc, 0, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        uk.attention(torch.randn(1, 4, 16), kc, kc, 0, 0.1)
    with pytest.raises(ValueError, match="float32"):
        uk.attention(torch.randn(1, 4, 32).double(), kc, kc, 0, 0.1)
    with pytest.raises(ValueError, match="3-D"):
        uk.attention(torch.randn(4, 32), kc, kc, 0, 0.1)
    with pytest.raises(ValueError, match="shapes differ"):
        uk.attention(torch.randn(1, 4, 32), kc, kc[:, :8], 0, 0.1)


# ---------------------------------------------------------------------------------------------------------
# build

def test_build_failure_is_a_clear_runtime_error(tmp_path, monkeypatch):
    # a compiler error (here an unknown flag) must surface as available() == False and a RuntimeError
    monkeypatch.setenv("ULTRAFAST_HOME", str(tmp_path))
    monkeypatch.setattr(uk, "_ext", None)
    monkeypatch.setattr(uk, "_err", None)
    monkeypatch.setattr(uk, "_err_msg", "")
    monkeypatch.setattr(uk, "_CFLAGS", uk._CFLAGS + ["-fno-such-flag-for-ultrafast-test"])
    assert uk.available() is False
    with pytest.raises(RuntimeError, match="failed to build the C\\+\\+ kernels"):
        uk.qmatmul(torch.randn(1, 32), torch.zeros(1, 34, dtype=torch.uint8), uk.Q8_0, 32)
    with pytest.raises(uk.KernelBuildError):
        uk.load()


def test_build_is_cached():
    # the extension lives under $ULTRAFAST_HOME/torch_extensions/<content hash>/ and is reused
    name = uk._build_name()
    so = uk._home() / "torch_extensions" / name / f"{name}.so"
    assert so.exists()
    assert uk.load().__file__ == str(so)


def check_non_finite_inputs_propagate(qtype, act_bits=16):
    # a NaN or inf in an activation row makes that row's outputs NaN/inf, never silently finite
    k_in = 512
    raw = torch.from_numpy(random_weight(qtype, 7, k_in, seed=2))
    x = torch.randn(3, k_in, generator=torch.Generator().manual_seed(5))
    x[1, 100] = float("nan")
    x[2, 300] = float("inf")
    y = uk.qmatmul(x, raw, qtype, k_in, act_bits=act_bits)
    assert torch.isfinite(y[0]).all()
    assert not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).any()
    assert torch.equal(y[0], uk.qmatmul(x[:1], raw, qtype, k_in, act_bits=act_bits)[0])


@pytest.mark.parametrize("qtype", [uk.Q4_0, uk.Q4_1, uk.Q5_0, uk.Q8_0, uk.Q4_K, uk.Q6_K], ids=lambda t: NAMES[t])
def test_qmatmul_non_finite_inputs_propagate(path, qtype):
    check_non_finite_inputs_propagate(qtype)


# ---------------------------------------------------------------------------------------------------------
# int8 activations (act_bits=8: llama.cpp's precision, VNNI path only)

def _round_int8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x rounded per block (the VNNI kernels: 32 values) as the kernels do: s = max|x| / 127 in fp32, q = rint(x / s)."""
    xb = x.reshape(-1, block)
    s = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(s > 0, torch.round(xb / torch.where(s > 0, s, torch.ones_like(s))), torch.zeros_like(xb))
    return (q.double() * s.double()).reshape(x.shape)


@pytest.mark.parametrize("qtype", sorted(QUANT_TYPES), ids=lambda t: NAMES[t])
def test_int8_activations_are_exact_products_of_the_rounded_x(vnni, qtype):
    """With act_bits=8 the only approximation is x rounded to int8 per block of 32: the output equals
    rounded-x @ dequant(W).T to fp32 summation error (and differs from the int16 result by far more)."""
    for i, k in enumerate(K_VALUES[qtype]):
        raw = random_weight(qtype, 29, k, seed=20 + i)
        w = dequant(raw, qtype, k).double()
        x = torch.randn(6, k, generator=torch.Generator().manual_seed(i))
        y8 = uk.qmatmul(x, torch.from_numpy(raw), qtype, k, act_bits=8)
        ref = _round_int8(x) @ w.T
        scale = x.double().abs() @ w.abs().T
        assert ((y8.double() - ref).abs() <= 2e-6 * scale + 1e-30).all(), f"K={k}"
        y16 = uk.qmatmul(x, torch.from_numpy(raw), qtype, k)
        assert (y8 - y16).abs().max() > 10 * (y8.double() - ref).abs().max()


@pytest.mark.parametrize("qtype", sorted(QUANT_TYPES), ids=lambda t: NAMES[t])
def test_int8_activations_batch_invariant(vnni, qtype):
    k_in = K_VALUES[qtype][-1]
    raw = torch.from_numpy(random_weight(qtype, 35, k_in, seed=7))
    x = torch.randn(37, k_in, generator=torch.Generator().manual_seed(1))
    singles = torch.cat([uk.qmatmul(x[i:i + 1], raw, qtype, k_in, act_bits=8) for i in range(37)])
    for k in (2, 3, 8, 9, 16, 37):  # whole-row chunks and (37) the tiled schedule
        assert torch.equal(uk.qmatmul(x[:k], raw, qtype, k_in, act_bits=8), singles[:k]), f"k={k}"
    with num_threads(1):
        assert torch.equal(uk.qmatmul(x[:16], raw, qtype, k_in, act_bits=8), singles[:16])


# int8 activations on the AVX2 integer kernels (avx2-int8: every quantized type, x rounded per super-block of 256 for
# Q4_K and Q6_K, per block of 32 for the others)
AVX2_INT8_BLOCK = {uk.Q4_0: 32, uk.Q4_1: 32, uk.Q5_0: 32, uk.Q8_0: 32, uk.Q4_K: 256, uk.Q6_K: 256}


@pytest.fixture
def avx2_int8():
    """The AVX2 kernels as the path in use (int8 activations then take the avx2-int8 ops), auto again after."""
    if not uk.load().avx2_supported():
        pytest.skip("CPU without AVX2")
    uk.set_kernels_path("avx2")
    yield
    uk.set_kernels_path("auto")


@pytest.mark.parametrize("qtype", sorted(QUANT_TYPES), ids=lambda t: NAMES[t])
def test_avx2_int8_activations_are_exact_products_of_the_rounded_x(avx2_int8, qtype):
    """On the AVX2 path act_bits=8 rounds x to int8 (per super-block of 256 for the K-quants, llama.cpp's Q8_K; per
    block of 32 for the others, its Q8_0) and multiplies it with the file's integers exactly: the output equals
    rounded-x @ dequant(W).T to fp32 summation error."""
    assert uk.linear_path(qtype, 8) == "avx2-int8"
    assert uk.linear_path(qtype, 16) == ("avx2-fp32" if qtype == uk.Q6_K else "avx2-int16")
    block = AVX2_INT8_BLOCK[qtype]
    for i, k in enumerate(K_VALUES[qtype]):
        raw = random_weight(qtype, 29, k, seed=20 + i)
        if qtype == uk.Q8_0:
            raw.reshape(29, -1, 34)[3, 0, 2:] = 0x80  # the byte -128 (|w| = 128, the largest vpsignb leaves)
        w = dequant(raw, qtype, k).double()
        x = torch.randn(6, k, generator=torch.Generator().manual_seed(i))
        x[1, :block] = 0.0  # an all-zero block
        x[2, -block:] *= 1e-3  # a block far smaller than the others
        y8 = uk.qmatmul(x, torch.from_numpy(raw), qtype, k, act_bits=8)
        ref = _round_int8(x, block) @ w.T
        scale = x.double().abs() @ w.abs().T
        assert ((y8.double() - ref).abs() <= 2e-6 * scale + 1e-30).all(), f"K={k}"
        y16 = uk.qmatmul(x, torch.from_numpy(raw), qtype, k)
        assert (y8 - y16).abs().max() > 10 * (y8.double() - ref).abs().max()


@pytest.mark.parametrize("qtype", sorted(QUANT_TYPES), ids=lambda t: NAMES[t])
def test_avx2_int8_non_finite_inputs_propagate(avx2_int8, qtype):
    check_non_finite_inputs_propagate(qtype, act_bits=8)


@pytest.mark.parametrize("qtype", sorted(QUANT_TYPES), ids=lambda t: NAMES[t])
def test_avx2_int8_activations_batch_invariant(avx2_int8, qtype):
    k_in = K_VALUES[qtype][-1]
    raw = torch.from_numpy(random_weight(qtype, 35, k_in, seed=7))
    x = torch.randn(37, k_in, generator=torch.Generator().manual_seed(1))
    singles = torch.cat([uk.qmatmul(x[i:i + 1], raw, qtype, k_in, act_bits=8) for i in range(37)])
    for k in (2, 3, 5, 8, 9, 16, 37):  # tiles of up to 8 rows (the K-quants) or 16, and (37) the weight-tiled schedule
        assert torch.equal(uk.qmatmul(x[:k], raw, qtype, k_in, act_bits=8), singles[:k]), f"k={k}"
    with num_threads(1):
        assert torch.equal(uk.qmatmul(x[:16], raw, qtype, k_in, act_bits=8), singles[:16])


@pytest.mark.parametrize("qtype,layout", [(uk.Q4_K, uk.Q4_K_R2), (uk.Q6_K, uk.Q6_K_R16)], ids=["Q4_K", "Q6_K"])
def test_avx2_int8_reads_the_k_quants_in_lanes(avx2_int8, qtype, layout):
    """At int8 the AVX2 integer kernels read Q4_K and Q6_K in the VNNI kernels' layouts made at load (Q4_K's pairs of
    super-blocks: a sub-block per int32 lane; Q6_K a scale group per lane): the exact product of the rounded x again
    (Q4_K: an odd last super-block in the file's layout), batch-invariant; at 16 bits the file's bytes."""
    assert uk.layout_in_use(qtype, 8) == layout and uk.linear_path(layout, 8) == "avx2-int8"
    assert uk.layout_in_use(uk.Q8_0, 8) is None
    # Q4_K: one super-block (no pair), a pair, two and one, 9 pairs, 17 and one (the 1.5B's down projection)
    for i, k in enumerate((256, 512, 1280, 4608, 8960)):
        raw = random_weight(qtype, 29, k, seed=40 + i)
        w = dequant(raw, qtype, k).double()
        lanes = uk.repack_vnni(torch.from_numpy(raw), qtype, k)
        x = torch.randn(37, k, generator=torch.Generator().manual_seed(i))
        x[1, :256] = 0.0
        x[2, -256:] *= 1e-3
        y = uk.qmatmul(x, lanes, layout, k, act_bits=8)
        ref = _round_int8(x, 256) @ w.T
        scale = x.double().abs() @ w.abs().T
        assert ((y.double() - ref).abs() <= 2e-6 * scale + 1e-30).all(), f"K={k}"
        singles = torch.cat([uk.qmatmul(x[j:j + 1], lanes, layout, k, act_bits=8) for j in range(37)])
        for rows in (2, 5, 6, 7, 9, 10, 16, 20, 21, 37):  # tiles of up to 10 rows; from 21 the weight-tiled schedule
            assert torch.equal(uk.qmatmul(x[:rows], lanes, layout, k, act_bits=8), singles[:rows]), (k, rows)
    x = torch.randn(3, 512)
    x[0, 7] = float("nan")
    x[1, 300] = float("inf")
    lanes = uk.repack_vnni(torch.from_numpy(random_weight(qtype, 4, 512, seed=1)), qtype, 512)
    y = uk.qmatmul(x, lanes, layout, 512, act_bits=8)
    assert not y[:2].isfinite().any() and y[2].isfinite().all()


# 16-bit activations on the AVX2 integer kernels (avx2-int16: Q4_K and the two lane layouts; x rounded to int16 per
# super-block of 256 and multiplied as two signed byte planes)

def _round_int16(x: torch.Tensor, block: int = 256, qmax: float = 32639.0) -> torch.Tensor:
    """x rounded per block as avx2-int16 does: s = max|x| / qmax in fp32 (the K-quants: 256 values, 32639; the blocks
    of 32: 32385), q = rint(x / s) in fp32."""
    xb = x.reshape(-1, block)
    s = xb.abs().amax(-1, keepdim=True) / qmax
    q = torch.where(s > 0, torch.round(xb / torch.where(s > 0, s, torch.ones_like(s))), torch.zeros_like(xb))
    return (q.double() * s.double()).reshape(x.shape)


def test_avx2_int16_is_the_16_bit_path_for_the_quantized_types(avx2_int8):
    """On the AVX2 path, 16-bit activations take the integer kernels for every quantized type but Q6_K's file layout:
    Q4_K and Q6_K in their lanes (the layouts made at load), the blocks of 32 in the file's layout; the fp32 kernels for
    Q6_K's file layout and the float types; `avx2-fp32` and `fp32` keep them all on the fp32 kernels; int8 is
    unchanged."""
    assert uk.linear_path(uk.Q4_K, 16) == "avx2-int16" and uk.linear_path(uk.Q4_K_R2, 16) == "avx2-int16"
    assert uk.linear_path(uk.Q6_K_R16, 16) == "avx2-int16" and uk.linear_path(uk.Q6_K, 16) == "avx2-fp32"
    assert uk.layout_in_use(uk.Q4_K, 16) == uk.Q4_K_R2 and uk.layout_in_use(uk.Q6_K, 16) == uk.Q6_K_R16
    for t in (uk.Q4_0, uk.Q4_1, uk.Q5_0, uk.Q8_0):
        assert uk.linear_path(t, 16) == "avx2-int16" and uk.layout_in_use(t, 16) is None
    assert uk.linear_path(uk.F32, 16) == "avx2-fp32" and uk.layout_in_use(uk.F32, 16) is None
    try:
        for request in ("avx2-fp32", "fp32"):
            uk.set_kernels_path(request)
            if request == "fp32" and uk.load().avx512_supported():
                continue  # the AVX-512 fp32 kernels there
            for t in (uk.Q4_K, uk.Q4_0, uk.Q8_0):
                assert uk.linear_path(t, 16) == "avx2-fp32" and uk.layout_in_use(t, 16) is None
                assert uk.linear_path(t, 8) == "avx2-int8"
    finally:
        uk.set_kernels_path("avx2")


@pytest.mark.parametrize("qtype,layout", [(uk.Q4_K, uk.Q4_K), (uk.Q4_K, uk.Q4_K_R2), (uk.Q6_K, uk.Q6_K_R16)],
                         ids=["Q4_K", "Q4_K_R2", "Q6_K_R16"])
def test_avx2_int16_activations_are_exact_products_of_the_rounded_x(avx2_int8, qtype, layout):
    """avx2-int16 rounds x to int16 per super-block of 256 (s = max|x| / 32639) and multiplies it with the file's
    integers exactly (two byte planes, the high one weighted by 256 in the integer sums): the output equals rounded-x
    @ dequant(W).T to fp32 summation error, is within the int16 rounding of the fp32 product, and is batch-invariant
    at any tile (up to 4 rows) and schedule. Q4_K: one super-block, a pair, two and one, 9 pairs, 17 and one (the
    1.5B's down projection), its odd last one in the file's layout."""
    for i, k in enumerate((256, 512, 1280, 4608, 8960)):
        raw = random_weight(qtype, 29, k, seed=60 + i)
        if qtype == uk.Q6_K:  # the extremes of the integer sums: scale -128 and every weight 0 (w - 32 = -32)
            blocks = raw.reshape(29, -1, 210)
            blocks[5, :, 192:208] = 0x80
            blocks[5, :, :192] = 0
        w = dequant(raw, qtype, k).double()
        bytes_ = torch.from_numpy(raw) if layout == qtype else uk.repack_vnni(torch.from_numpy(raw), qtype, k)
        x = torch.randn(23, k, generator=torch.Generator().manual_seed(i))
        x[1, :256] = 0.0  # an all-zero super-block
        x[2, -256:] *= 1e-3  # a super-block far smaller than the others
        x[3, :] = -torch.linspace(1.0, 2.0, k)  # x at -32639 (and every other q negative): the largest |sum|
        y = uk.qmatmul(x, bytes_, layout, k)
        ref = _round_int16(x) @ w.T
        scale = x.double().abs() @ w.abs().T
        assert ((y.double() - ref).abs() <= 2e-6 * scale + 1e-30).all(), f"K={k}"
        assert ((y.double() - x.double() @ w.T).abs() <= RTOL_VNNI * scale + 1e-30).all(), f"K={k}"
        singles = torch.cat([uk.qmatmul(x[j:j + 1], bytes_, layout, k) for j in range(23)])
        for rows in (2, 3, 4, 5, 7, 8, 9, 16, 23):  # tiles of up to 4 rows; above 8 the weight-tiled schedule
            assert torch.equal(uk.qmatmul(x[:rows], bytes_, layout, k), singles[:rows]), (k, rows)
        with num_threads(1):
            assert torch.equal(uk.qmatmul(x[:9], bytes_, layout, k), singles[:9])
        y8 = uk.qmatmul(x, bytes_, layout, k, act_bits=8)
        assert (y8 - y).abs().max() > 10 * (y.double() - ref).abs().max()  # not the int8 path's result


@pytest.mark.parametrize("qtype", [uk.Q4_0, uk.Q4_1, uk.Q5_0, uk.Q8_0], ids=lambda t: NAMES[t])
def test_avx2_int16_blocks_are_exact_products_of_the_rounded_x(avx2_int8, qtype):
    """The blocks of 32 at 16 bits: x rounded to int16 per block (s = max|x| / 32385, so that both byte planes of
    q = 255 * hi + lo stay in -127..127, which Q8_0's vpsignb needs) and multiplied with the file's integers exactly:
    rounded-x @ dequant(W).T to fp32 summation error, within the int16 rounding of the fp32 product, batch-invariant
    at any tile and schedule, and not the int8 result. K: the type's values in these tests (one block; groups of 8
    with blocks left over, which go one at a time)."""
    for i, k in enumerate(K_VALUES[qtype]):
        raw = random_weight(qtype, 29, k, seed=80 + i)
        if qtype == uk.Q8_0:
            raw.reshape(29, -1, 34)[3, 0, 2:] = 0x80  # the byte -128
        w = dequant(raw, qtype, k).double()
        x = torch.randn(19, k, generator=torch.Generator().manual_seed(i))
        x[1, :32] = 0.0  # an all-zero block
        x[2, -32:] *= 1e-3  # a block far smaller than the others
        x[3, :] = -torch.linspace(1.0, 2.0, k)  # every q negative, one at -32385 in each block
        x[4, :] = torch.linspace(1.0, 2.0, k)  # and positive
        y = uk.qmatmul(x, torch.from_numpy(raw), qtype, k)
        ref = _round_int16(x, 32, 32385.0) @ w.T
        scale = x.double().abs() @ w.abs().T
        assert ((y.double() - ref).abs() <= 2e-6 * scale + 1e-30).all(), f"K={k}"
        assert ((y.double() - x.double() @ w.T).abs() <= RTOL_VNNI * scale + 1e-30).all(), f"K={k}"
        singles = torch.cat([uk.qmatmul(x[j:j + 1], torch.from_numpy(raw), qtype, k) for j in range(19)])
        for rows in (2, 3, 5, 8, 9, 16, 19):
            assert torch.equal(uk.qmatmul(x[:rows], torch.from_numpy(raw), qtype, k), singles[:rows]), (k, rows)
        with num_threads(1):
            assert torch.equal(uk.qmatmul(x[:9], torch.from_numpy(raw), qtype, k), singles[:9])
        y8 = uk.qmatmul(x, torch.from_numpy(raw), qtype, k, act_bits=8)
        assert (y8 - y).abs().max() > 10 * (y.double() - ref).abs().max()  # not the int8 path's result


@pytest.mark.parametrize("qtype", [uk.Q4_0, uk.Q4_1, uk.Q5_0, uk.Q8_0], ids=lambda t: NAMES[t])
def test_avx2_int16_blocks_non_finite_inputs_propagate(avx2_int8, qtype):
    check_non_finite_inputs_propagate(qtype)


@pytest.mark.parametrize("layout", [uk.Q4_K_R2, uk.Q6_K_R16], ids=["Q4_K_R2", "Q6_K_R16"])
def test_avx2_int16_non_finite_inputs_propagate(avx2_int8, layout):
    qtype = uk.Q4_K if layout == uk.Q4_K_R2 else uk.Q6_K
    x = torch.randn(3, 512)
    x[0, 7] = float("nan")
    x[1, 300] = float("inf")
    lanes = uk.repack_vnni(torch.from_numpy(random_weight(qtype, 4, 512, seed=1)), qtype, 512)
    y = uk.qmatmul(x, lanes, layout, 512)
    assert not y[:2].isfinite().any() and y[2].isfinite().all()
    assert torch.equal(y[2], uk.qmatmul(x[2:], lanes, layout, 512)[0])


def test_act_bits_errors():
    raw = torch.from_numpy(random_weight(uk.Q8_0, 4, 64, seed=0))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="act_bits must be 16 or 8"):
        uk.qmatmul(x, raw, uk.Q8_0, 64, act_bits=4)
    if uk.load().avx512_supported() or uk.load().avx2_supported():
        uk.set_kernels_path("scalar")  # no integer kernels there
        try:
            with pytest.raises(ValueError, match="int8 activations need the AVX512-VNNI"):
                uk.qmatmul(x, raw, uk.Q8_0, 64, act_bits=8)
            # float weights have no integer products: act_bits does not apply to them
            wf = torch.randn(4, 64)
            assert torch.equal(uk.qmatmul(x, wf.view(torch.uint8), uk.F32, 64, act_bits=8),
                               uk.qmatmul(x, wf.view(torch.uint8), uk.F32, 64))
        finally:
            uk.set_kernels_path("auto")


# ---------------------------------------------------------------------------------------------------------
# The VNNI kernels' own layouts (`repack_vnni`): Q4_K in pairs of super-blocks, the 32-value-block types 16 blocks a
# group, one block per int32 lane (a row's last group holding the rest)

# per type: K with and without values past the last group of 512, which stay in the file's layout (Q4_K: an odd last
# super-block, 256 no group at all; the others: 32, 64, 96 no group, 544 / 576 / 896 / 4864 groups and then 1 / 2 /
# 12 / 8 blocks: the 0.5B's and SmolLM2's widths and their FFN's)
REPACK_KS = {uk.Q4_K: [256, 512, 768, 1536, 2304], uk.Q4_0: [32, 512, 576, 1536], uk.Q4_1: [64, 512, 576, 1536],
             uk.Q5_0: [32, 544, 896, 4864], uk.Q8_0: [96, 512, 576, 1024], uk.Q6_K: [256, 512, 1536, 8960]}


def test_repack_into_out():
    """`out` takes the layout in place of a new tensor (what the loader does, straight into the huge-page region):
    the same bytes; a wrong shape, dtype or an out overlapping w is a ValueError."""
    raw = torch.from_numpy(random_weight(uk.Q4_K, 16, 1024, seed=3))
    want = uk.repack_vnni(raw, uk.Q4_K, 1024)
    out = torch.full_like(raw, 7)
    uk.repack_vnni(raw, uk.Q4_K, 1024, out=out)
    assert torch.equal(out, want)
    for bad in (torch.empty(15, raw.shape[1], dtype=torch.uint8), torch.empty(raw.shape, dtype=torch.int8), raw,
                torch.empty(raw.shape[1], raw.shape[0], dtype=torch.uint8).T):
        with pytest.raises(ValueError):
            uk.repack_vnni(raw, uk.Q4_K, 1024, out=bad)
    with pytest.raises(ValueError):
        uk.repack_vnni(raw, uk.Q4_K, 1024, out="not a tensor")


@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("qtype", sorted(REPACK_KS))
def test_repacked_same_values(vnni, qtype, act_bits):
    """The repacked rows hold the file's values: the product agrees with the reference like the file's layout does
    (and with its result to fp32 summation order)."""
    layout = uk.vnni_layout(qtype)
    for i, k in enumerate(REPACK_KS[qtype]):
        raw = random_weight(qtype, 29, k, seed=40 + i)
        r2 = uk.repack_vnni(torch.from_numpy(raw), qtype, k)
        assert r2.shape == raw.shape and r2.dtype == torch.uint8
        # no whole group: all in the file's layout (Q6_K: a group is a super-block)
        assert torch.equal(r2, torch.from_numpy(raw)) == (k < 512 and qtype != uk.Q6_K)
        x = torch.randn(6, k, generator=torch.Generator().manual_seed(i))
        y2 = uk.qmatmul(x, r2, layout, k, act_bits=act_bits)
        y1 = uk.qmatmul(x, torch.from_numpy(raw), qtype, k, act_bits=act_bits)
        w = dequant(raw, qtype, k).double()
        scale = x.double().abs() @ w.abs().T
        assert ((y2.double() - y1.double()).abs() <= 2e-6 * scale + 1e-30).all(), f"K={k}"
        xr = _round_int8(x) if act_bits == 8 else x.double()
        assert ((y2.double() - xr @ w.T).abs() <= (2e-6 if act_bits == 8 else RTOL_VNNI) * scale + 1e-30).all()


@pytest.mark.parametrize("act_bits", [16, 8])
# the rows' x within L1 less 4 KB (tiles of one weight row x up to 16 rows) or not (2 x 4); Q6_K's tiles 2 x 8, with
# int8 x 2 x 12;
# 4864: Q4_K's 19 super-blocks, the last in the file's layout, Q5_0's 152 blocks, a last group of 8; 576: Q4_1's 18
# blocks, a last group of 2
@pytest.mark.parametrize("qtype,k_in", [(uk.Q4_K, 1536), (uk.Q4_K, 4864), (uk.Q4_1, 576), (uk.Q5_0, 4864),
                                        (uk.Q8_0, 1536), (uk.Q4_0, 8192), (uk.Q6_K, 1536), (uk.Q6_K, 8960)])
def test_repacked_batch_invariant(vnni, act_bits, qtype, k_in):
    layout = uk.vnni_layout(qtype)
    raw = uk.repack_vnni(torch.from_numpy(random_weight(qtype, 35, k_in, seed=7)), qtype, k_in)
    x = torch.randn(80, k_in, generator=torch.Generator().manual_seed(1))
    singles = torch.cat([uk.qmatmul(x[i:i + 1], raw, layout, k_in, act_bits=act_bits) for i in range(80)])
    for k in (2, 3, 5, 8, 9, 12, 15, 16, 37, 80):  # one chunk of rows, several, and (37 or 80) the weight-tiled schedule
        assert torch.equal(uk.qmatmul(x[:k], raw, layout, k_in, act_bits=act_bits), singles[:k]), f"k={k}"
    assert torch.equal(uk.qmatmul(x[:4], raw[1:], layout, k_in, act_bits=act_bits), singles[:4, 1:])
    with num_threads(1):
        assert torch.equal(uk.qmatmul(x[:16], raw, layout, k_in, act_bits=act_bits), singles[:16])


def test_repacked_nonfinite_x_gives_nan(vnni):
    """A block of x holding an infinity makes its outputs NaN, as the file's layout does, in a full group and in a
    row's partial last one; the other rows stay finite."""
    raw = uk.repack_vnni(torch.from_numpy(random_weight(uk.Q4_1, 3, 576, seed=2)), uk.Q4_1, 576)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    x[0, 40] = float("inf")
    x[1, 560] = float("inf")  # in the last group of two blocks
    y = uk.qmatmul(x, raw, uk.Q4_1_R16, 576)
    assert y[:2].isnan().all() and y[2].isfinite().all()


def test_repacked_errors(vnni):
    raw = torch.from_numpy(random_weight(uk.Q4_K, 4, 512, seed=0))
    with pytest.raises(ValueError, match="512 Q4_K values take 288"):
        uk.repack_vnni(raw[:, :200], uk.Q4_K, 512)
    with pytest.raises(ValueError, match="must be uint8"):
        uk.repack_vnni(raw.float(), uk.Q4_K, 512)
    with pytest.raises(ValueError, match="no layout of the VNNI kernels"):
        uk.repack_vnni(torch.from_numpy(random_weight(uk.F16, 4, 512, seed=0)), uk.F16, 512)
    with pytest.raises(ValueError, match="in_features a multiple of 32"):
        uk.repack_vnni(torch.zeros(2, 22, dtype=torch.uint8), uk.Q5_0, 33)
    assert uk.vnni_layout(uk.F32) is None and uk.vnni_layout(uk.Q8_0) == uk.Q8_0_R16
    # the ops name their activation width
    assert uk.linear_path(uk.Q4_K, 8) == uk.linear_path(uk.Q4_K_R2, 8) == "vnni-int8"
    assert uk.linear_path(uk.Q4_K, 16) == "vnni-int16"
    r2 = uk.repack_vnni(raw, uk.Q4_K, 512)
    uk.set_kernels_path("fp32")  # only the VNNI kernels read the layouts
    try:
        with pytest.raises(ValueError, match=r"own layouts \(Q4_K_R2, \*_R16\) are read by the VNNI kernels"):
            uk.qmatmul(torch.randn(2, 512), r2, uk.Q4_K_R2, 512)
    finally:
        uk.set_kernels_path("auto")
