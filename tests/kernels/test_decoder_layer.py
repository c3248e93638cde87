"""decoder_block: one whole layer per call, one OpenMP parallel region with barriers between its stages, on
every kernel path (the `path` fixture: vnni, avx512 fp32, scalar; kernel_variant.h). Checked against the layer written out in PyTorch from the
dequantized weights, with several sequences in one call, mixed weight types, QKV bias, and the KV cache
writes; and for batch invariance: a multi-sequence call gives each sequence the bits of calling it alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from .test_qmatmul import dequant, path, random_weight  # noqa: F401  (path: the kernel-path fixture)

import ultrafast.kernels as uk  # noqa: E402

D, H, HKV, HD, F = 256, 4, 2, 64, 512
# wq, wk, wv, wo, w1 (gate), w3 (up), w2 (down): mixed types so the layer prepares its inputs per type
TYPES = [uk.Q4_K, uk.Q4_K, uk.Q6_K, uk.Q4_0, uk.Q4_1, uk.Q5_0, uk.Q8_0]
SHAPES = [(H * HD, D), (HKV * HD, D), (HKV * HD, D), (D, H * HD), (F, D), (F, D), (D, F)]
EPS, THETA = 1e-5, 10000.0


def layer_weights(seed=0, types=TYPES):
    raws = [random_weight(t, n, k, seed + i) for i, (t, (n, k)) in enumerate(zip(types, SHAPES))]
    # random block bytes give large weights; scale the residual branches down so values stay O(1)
    dense = [dequant(r, t, k) for r, t, (_, k) in zip(raws, types, SHAPES)]
    g = torch.Generator().manual_seed(seed)
    biases = [torch.randn(n, generator=g) * 0.1 for n, _ in SHAPES[:3]]
    norms = [torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5]
    return [torch.from_numpy(r) for r in raws], dense, biases, norms


def rope(max_len):
    inv = 1.0 / (THETA ** (torch.arange(0, HD, 2).float() / HD))
    f = torch.arange(max_len).float()[:, None] * inv[None, :]
    e = torch.cat((f, f), -1)
    return e.cos(), e.sin()


def ref_layer(x, start, kc, vc, dense, biases, norms, cos, sin):
    """The layer in float64 from the dequantized weights; writes the new rows into kc/vc (float64 copies)."""
    def rms(v, w):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * w

    def rot(v):
        return torch.cat((-v[..., HD // 2:], v[..., :HD // 2]), -1)

    wq, wk, wv, wo, w1, w3, w2 = (w.double() for w in dense)
    T = x.shape[0]
    x = x.double()
    h = rms(x, norms[0].double())
    q = (h @ wq.T + biases[0].double()).view(T, H, HD)
    k = (h @ wk.T + biases[1].double()).view(T, HKV, HD)
    v = (h @ wv.T + biases[2].double()).view(T, HKV, HD)
    c, s = cos[start:start + T].double()[:, None], sin[start:start + T].double()[:, None]
    q, k = q * c + rot(q) * s, k * c + rot(k) * s
    kc[:, start:start + T], vc[:, start:start + T] = k.transpose(0, 1), v.transpose(0, 1)
    att = torch.empty(T, H, HD, dtype=torch.float64)
    for i in range(T):
        n = start + i + 1
        for j in range(H):
            kv = j // (H // HKV)
            p = torch.softmax((kc[kv, :n] @ q[i, j]) / math.sqrt(HD), 0)
            att[i, j] = p @ vc[kv, :n]
    x = x + att.view(T, -1) @ wo.T
    h = rms(x, norms[1].double())
    a = h @ w1.T
    return x + (a * torch.sigmoid(a) * (h @ w3.T)) @ w2.T


def close(got, want, rel=2e-3):
    """Within rel of the largest reference value (int16 activations: ~1e-4 of sum|x*w| per linear)."""
    err = (got.double() - want).abs().max().item()
    return err <= rel * want.abs().max().item()


def run_layer(x, starts, lens, kcs, vcs, raws, biases, norms, cos, sin, types=TYPES):
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    return uk.decoder_block(x, starts, lens, norms[0], norms[1], EPS, raws, types, biases, kcs, vcs,
                            cos[rows].contiguous(), sin[rows].contiguous(), H, HKV, HD, 1.0 / math.sqrt(HD))


def fresh_cache(max_len, seed):
    g = torch.Generator().manual_seed(seed)
    # earlier positions hold (random) keys/values already
    return torch.randn(HKV, max_len, HD, generator=g), torch.randn(HKV, max_len, HD, generator=g)


def test_decoder_block_matches_the_layer_in_torch(path):  # noqa: F811
    raws, dense, biases, norms = layer_weights()
    cos, sin = rope(64)
    g = torch.Generator().manual_seed(1)
    starts, lens = [5, 0, 17], [1, 3, 2]
    x = torch.randn(sum(lens), D, generator=g)
    caches = [fresh_cache(64, 10 + i) for i in range(3)]
    refs = [(kc.double().clone(), vc.double().clone()) for kc, vc in caches]
    y = run_layer(x, starts, lens, [c[0] for c in caches], [c[1] for c in caches], raws, biases, norms, cos, sin)
    row = 0
    for i, (s, n, (kc, vc), (rk, rv)) in enumerate(zip(starts, lens, caches, refs)):
        want = ref_layer(x[row:row + n], s, rk, rv, dense, biases, norms, cos, sin)
        assert close(y[row:row + n], want), f"segment at {s}"
        assert close(kc[:, s:s + n], rk[:, s:s + n]) and close(vc[:, s:s + n], rv[:, s:s + n])
        # rows outside the segment are untouched
        assert torch.equal(kc[:, s + n:], fresh_cache(64, 10 + i)[0][:, s + n:])
        row += n


def test_decoder_block_sequences_do_not_interact(path):  # noqa: F811
    """Several sequences in one call give each one exactly the bits (output and cache rows) of its own call."""
    raws, _, biases, norms = layer_weights(seed=3)
    cos, sin = rope(64)
    g = torch.Generator().manual_seed(2)
    starts, lens = [9, 0, 30], [2, 4, 1]
    x = torch.randn(sum(lens), D, generator=g)
    together = [fresh_cache(64, 20 + i) for i in range(3)]
    y = run_layer(x, starts, lens, [c[0] for c in together], [c[1] for c in together], raws, biases, norms,
                  cos, sin)
    row = 0
    for i, (s, n) in enumerate(zip(starts, lens)):
        kc, vc = fresh_cache(64, 20 + i)
        alone = run_layer(x[row:row + n].clone(), [s], [n], [kc], [vc], raws, biases, norms, cos, sin)
        assert torch.equal(alone, y[row:row + n])
        assert torch.equal(kc, together[i][0]) and torch.equal(vc, together[i][1])
        row += n


@pytest.mark.parametrize("m", [16, 21])
def test_decoder_block_shared_rows_same_bits(path, m):  # noqa: F811
    """Sequences told that another's cache holds their first m rows (best-of-n siblings' prompt) get the bits of
    reading their own; on the vector paths those rows are then read from the source: the sharers' own copies can
    hold anything."""
    raws, _, biases, norms = layer_weights(seed=7)
    cos, sin = rope(64)
    starts, lens = [30, 25, 40], [1, 2, 1]
    x = torch.randn(sum(lens), D, generator=torch.Generator().manual_seed(4))

    def caches(poison: bool):
        cs = [fresh_cache(64, 60 + i) for i in range(3)]
        for kc, vc in cs[1:]:  # the same first m rows as sequence 0 (a copied prompt), other rows after them
            kc[:, :m], vc[:, :m] = cs[0][0][:, :m], cs[0][1][:, :m]
            if poison:
                kc[:, :m], vc[:, :m] = float("nan"), float("nan")
        return cs

    def run(cs, share=None):
        rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        return uk.decoder_block(x, starts, lens, norms[0], norms[1], EPS, raws, TYPES, biases, [c[0] for c in cs],
                                [c[1] for c in cs], cos[rows].contiguous(), sin[rows].contiguous(), H, HKV, HD,
                                1.0 / math.sqrt(HD), share=share)

    own, shared = caches(False), caches(False)
    want = run(own)
    assert torch.equal(run(shared, [None, (0, m), (0, m)]), want)
    for (k1, v1), (k2, v2) in zip(own, shared):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    if path != "scalar":  # (the scalar path reads each sequence's own rows)
        assert torch.equal(run(caches(True), [None, (0, m), (0, m)]), want)
        assert torch.isnan(run(caches(True))[1:]).all()


def test_decoder_block_rejects_bad_share():
    raws, _, biases, norms = layer_weights(seed=11)
    cos, sin = rope(16)
    x = torch.randn(2, D)
    (k0, v0), (k1, v1) = fresh_cache(16, 1), fresh_cache(16, 2)

    def run(share):
        return uk.decoder_block(x, [4, 6], [1, 1], norms[0], norms[1], EPS, raws, TYPES, biases, [k0, k1], [v0, v1],
                                cos[4:6].contiguous(), sin[4:6].contiguous(), H, HKV, HD, 1 / math.sqrt(HD),
                                share=share)
    with pytest.raises(ValueError, match="sequence 1 cannot share 5 rows with sequence 0"):
        run([None, (0, 5)])  # past sequence 0's start: this pass writes row 4 there
    with pytest.raises(ValueError, match="sequence 0 cannot share 2 rows with sequence 2"):
        run([(2, 2), None])
    with pytest.raises(ValueError, match="one entry per sequence"):
        run([None])


def test_decoder_block_no_bias_one_thread_same_bits(path):  # noqa: F811
    raws, _, _, norms = layer_weights(seed=5)
    cos, sin = rope(32)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(4))
    outs = []
    for threads in (2, 1):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            kc, vc = fresh_cache(32, 7)
            outs.append((run_layer(x, [4], [3], [kc], [vc], raws, [], norms, cos, sin), kc))
        finally:
            torch.set_num_threads(old)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert np.isfinite(outs[0][0].numpy()).all()


@pytest.mark.parametrize("starts,lens", [([40], [1]), ([40], [5]), ([9, 0, 30], [2, 4, 1])])
def test_attention_task_split_never_changes_bits(path, starts, lens):  # noqa: F811
    """How attention's work is cut into tasks (kv heads, runs of heads, rows; per thread count) changes what each
    thread reads, never a row's bits: 1, 2 and 3 threads give the same outputs and cache rows, for one row, several
    rows of one sequence and several sequences."""
    raws, _, biases, norms = layer_weights(seed=6)
    cos, sin = rope(64)
    x = torch.randn(sum(lens), D, generator=torch.Generator().manual_seed(8))
    outs = []
    for threads in (1, 2, 3):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            caches = [fresh_cache(64, 30 + i) for i in range(len(starts))]
            y = run_layer(x, starts, lens, [c[0] for c in caches], [c[1] for c in caches], raws, biases, norms,
                          cos, sin)
            outs.append((y, caches))
        finally:
            torch.set_num_threads(old)
    for y, caches in outs[1:]:
        assert torch.equal(y, outs[0][0])
        for (kc, vc), (k0, v0) in zip(caches, outs[0][1]):
            assert torch.equal(kc, k0) and torch.equal(vc, v0)


def test_decoder_block_float_linears_and_odd_head_dim(path):  # noqa: F811
    """The fused layer takes any mix of weight types (F16/F32 linears beside quantized ones) and a head_dim
    that is not a multiple of 16 (the attention op then is the portable one)."""
    types = [uk.F16, uk.Q8_0, uk.F32, uk.Q4_K, uk.BF16, uk.Q6_K, uk.Q4_0]
    raws, dense, biases, norms = layer_weights(seed=7, types=types)
    cos, sin = rope(64)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(8))
    kc, vc = fresh_cache(64, 9)
    rk, rv = kc.double().clone(), vc.double().clone()
    y = run_layer(x, [11], [3], [kc], [vc], raws, biases, norms, cos, sin, types=types)
    assert close(y, ref_layer(x, 11, rk, rv, dense, biases, norms, cos, sin))
    # head_dim 8 (not a multiple of 16): a layer of 4 heads of 8 on the same kind of weights
    hd, nh, d, f = 8, 4, 256, 256
    shapes = [(nh * hd, d), (nh * hd, d), (nh * hd, d), (d, nh * hd), (f, d), (f, d), (d, f)]
    types = [uk.Q8_0] * 7
    raws = [torch.from_numpy(random_weight(t, n, k, 30 + i)) for i, (t, (n, k)) in enumerate(zip(types, shapes))]
    inv = 1.0 / (THETA ** (torch.arange(0, hd, 2).float() / hd))
    e = torch.arange(4).float()[:, None] * inv[None, :]
    e = torch.cat((e, e), -1)
    kc, vc = torch.zeros(nh, 8, hd), torch.zeros(nh, 8, hd)
    x = torch.randn(4, d, generator=torch.Generator().manual_seed(9)) * 0.01
    one = uk.decoder_block(x, [0], [4], torch.ones(d), torch.ones(d), EPS, raws, types, [], [kc], [vc],
                           e.cos().contiguous(), e.sin().contiguous(), nh, nh, hd, hd ** -0.5)
    kc2, vc2 = torch.zeros(nh, 8, hd), torch.zeros(nh, 8, hd)
    rows = [uk.decoder_block(x[i:i + 1], [i], [1], torch.ones(d), torch.ones(d), EPS, raws, types, [], [kc2],
                             [vc2], e.cos()[i:i + 1].contiguous(), e.sin()[i:i + 1].contiguous(), nh, nh, hd,
                             hd ** -0.5) for i in range(4)]
    assert torch.equal(one, torch.cat(rows)) and torch.equal(kc, kc2)
    assert np.isfinite(one.numpy()).all()


def test_decoder_block_rejects_bad_input():
    raws, _, biases, norms = layer_weights(seed=11)
    cos, sin = rope(16)
    x = torch.randn(1, D)
    kc, vc = fresh_cache(16, 1)
    with pytest.raises(ValueError, match="caches must be fp32"):
        run_layer(x, [0], [1], [kc.double()], [vc.double()], raws, biases, norms, cos, sin)
    with pytest.raises(ValueError, match="linear 6 has shape"):
        run_layer(x, [0], [1], [kc], [vc], raws[:6] + [raws[5]], biases, norms, cos, sin)
    uk.set_kernels_path("scalar")
    try:
        with pytest.raises(ValueError, match="int8 activations need the AVX512-VNNI or the AVX2 integer kernels"):
            uk.decoder_block(x, [0], [1], norms[0], norms[1], EPS, raws, TYPES, biases, [kc], [vc],
                             cos[:1].contiguous(), sin[:1].contiguous(), H, HKV, HD, 1 / math.sqrt(HD), act_bits=8)
    finally:
        uk.set_kernels_path("auto")


def test_decoder_stack_gives_the_bits_of_one_call_per_layer(path):  # noqa: F811
    """decoder_stack: three layers (two sequences) in one call give the output, the kept copies and the cache rows
    of decoder_block called layer by layer."""
    layers = [layer_weights(seed=40 + 3 * i) for i in range(3)]
    cos, sin = rope(64)
    starts, lens = [6, 20], [2, 3]
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    c, s_ = cos[rows].contiguous(), sin[rows].contiguous()
    x = torch.randn(sum(lens), D, generator=torch.Generator().manual_seed(12))
    one = [[fresh_cache(64, 50 + 2 * li + q) for q in range(2)] for li in range(3)]  # [layer][sequence]
    y, kept = x, []
    for (raws, _, biases, norms), caches in zip(layers, one):
        y = uk.decoder_block(y, starts, lens, norms[0], norms[1], EPS, raws, TYPES, biases, [k for k, _ in caches],
                             [v for _, v in caches], c, s_, H, HKV, HD, 1.0 / math.sqrt(HD))
        kept.append(y)
    stack = [[fresh_cache(64, 50 + 2 * li + q) for q in range(2)] for li in range(3)]
    got, copies = uk.decoder_stack(
        x, starts, lens, [lw[3][0] for lw in layers], [lw[3][1] for lw in layers], EPS,
        [r for lw in layers for r in lw[0]], TYPES * 3, [b for lw in layers for b in lw[2]],
        [k for caches in stack for k, _ in caches], [v for caches in stack for _, v in caches], c, s_, H, HKV, HD,
        1.0 / math.sqrt(HD), keep=[0, 1])
    assert torch.equal(got, kept[2]) and len(copies) == 2
    assert torch.equal(copies[0], kept[0]) and torch.equal(copies[1], kept[1])
    for a, b in zip(one, stack):
        for (k1, v1), (k2, v2) in zip(a, b):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert not torch.equal(x, got)  # x itself is not written


def test_decoder_stack_rejects_bad_input():
    raws, _, biases, norms = layer_weights(seed=13)
    cos, sin = rope(16)
    x = torch.randn(1, D)
    kc, vc = fresh_cache(16, 1)
    args = (x, [0], [1], [norms[0]], [norms[1]], EPS, raws, TYPES, biases)
    rest = (cos[:1].contiguous(), sin[:1].contiguous(), H, HKV, HD, 1 / math.sqrt(HD))
    with pytest.raises(ValueError, match="per layer two norms, 7 linears"):
        uk.decoder_stack(*args, [kc, kc], [vc], *rest)
    with pytest.raises(ValueError, match="keep position 1 is not one of the 1 layers"):
        uk.decoder_stack(*args, [kc], [vc], *rest, keep=[1])
    with pytest.raises(ValueError, match="linear 6 has shape"):
        uk.decoder_stack(x, [0], [1], [norms[0]], [norms[1]], EPS, raws[:6] + [raws[5]], TYPES, biases, [kc], [vc],
                         *rest)
