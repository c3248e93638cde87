"""k tokens in one forward give bit-identical logits (and KV cache) to the same tokens fed one at a time.

This is the property the ultrafast tier stands on: verifying k drafted tokens in one pass must produce
exactly what the standard tier computes token by token.
"""

import pytest
import torch
from gguf import GGMLQuantizationType as T

import ultrafast.kernels as uk
from tests.builders import write_tiny_gguf
from ultrafast.engine import Engine

K_VALUES = (2, 4, 8, 16)


def check_invariance(engine, prefix: list[int], new: list[int]):
    n = len(prefix)
    engine.forward(prefix, 0)
    for k in K_VALUES:
        block = engine.forward(new[:k], n, all_logits=True)
        k_cache = engine.cache.k[:, :, n:n + k].clone()
        singles = torch.cat([engine.forward([t], n + i, all_logits=True) for i, t in enumerate(new[:k])])
        assert torch.equal(block, singles), f"k={k} at position {n}: max diff {(block - singles).abs().max()}"
        assert torch.equal(k_cache, engine.cache.k[:, :, n:n + k]), f"k={k}: KV cache differs"


@pytest.fixture(scope="module")
def qwen05_engine(qwen05_path):
    return Engine.from_path(qwen05_path, max_context=1024, device="cpu")


@pytest.mark.parametrize("prefix_len", [1, 37, 300])
def test_smollm2_k_invariant(smollm_engine, prefix_len):
    assert smollm_engine.kernels_in_use().startswith("packed, fused layers")
    g = torch.Generator().manual_seed(prefix_len)
    ids = torch.randint(0, smollm_engine.config.vocab_size, (prefix_len + 16,), generator=g).tolist()
    check_invariance(smollm_engine, ids[:prefix_len], ids[prefix_len:])


@pytest.mark.parametrize("prefix_len", [5, 130])
def test_qwen05_k_invariant(qwen05_engine, prefix_len):
    g = torch.Generator().manual_seed(prefix_len)
    ids = torch.randint(0, 150000, (prefix_len + 16,), generator=g).tolist()
    check_invariance(qwen05_engine, ids[:prefix_len], ids[prefix_len:])


@pytest.fixture(params=["vnni", "avx2"])
def int8_kernels(request):
    """Each path with integer kernels for 8-bit activations, as the path in use: the AVX512-VNNI ones, and the AVX2
    ones (forced where AVX-512 exists); auto again after."""
    if request.param == "vnni" and not uk.vnni_supported():
        pytest.skip("CPU without AVX512-VNNI")
    if request.param == "avx2" and not uk.load().avx2_supported():
        pytest.skip("CPU without AVX2")
    uk.set_kernels_path("auto" if request.param == "vnni" else "avx2")
    yield request.param
    uk.set_kernels_path("auto")


@pytest.mark.parametrize("prefix_len", [3, 130])
def test_int8_activations_k_invariant(qwen05_path, smollm_path, prefix_len, int8_kernels):
    """The same property with 8-bit activations (both tiers use them when the engine is built so), on both
    real models (SmolLM2: Q4_1 and Q8_0; the 0.5B: Q5_0, Q8_0, Q4_K, Q6_K); and the int8 logits are not the int16
    ones (the option changes the arithmetic)."""
    for path in (smollm_path, qwen05_path):
        engine = Engine.from_path(path, max_context=512, device="cpu", activation_bits=8)
        assert engine.kernels_in_use().endswith(f"{int8_kernels}-int8")
        g = torch.Generator().manual_seed(prefix_len)
        ids = torch.randint(0, 49000, (prefix_len + 16,), generator=g).tolist()
        check_invariance(engine, ids[:prefix_len], ids[prefix_len:])
        int16 = Engine.from_path(path, max_context=512, device="cpu")
        assert not torch.equal(engine.forward(ids[:prefix_len], 0), int16.forward(ids[:prefix_len], 0))


def test_int8_activations_need_integer_kernels(smollm_path):
    with pytest.raises(ValueError, match="activation_bits must be 16 or 8"):
        Engine.from_path(smollm_path, max_context=64, activation_bits=4)
    with pytest.raises(ValueError, match="8-bit activations need the packed CPU kernels"):
        Engine.from_path(smollm_path, max_context=64, packed=False, activation_bits=8)
    uk.set_kernels_path("scalar")  # no integer kernels on the portable path
    try:
        with pytest.raises(ValueError, match="int8 activations"):
            Engine.from_path(smollm_path, max_context=64, activation_bits=8)
    finally:
        uk.set_kernels_path("auto")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0], ids=lambda t: t.name)
def test_int8_activations_on_the_avx2_kernels(tmp_path, qtype):
    """On the AVX2 path (CPUs without AVX-512, or forced), 8-bit activations run every quantized type on the AVX2
    integer kernels: batch-invariant, close to the fp32 reference with each linear's input rounded as they round it
    (per 256 values for the K-quants, per 32 for the others)."""
    if not uk.load().avx2_supported():
        pytest.skip("CPU without AVX2")
    uk.set_kernels_path("avx2")
    try:
        path = tmp_path / "tiny.gguf"
        # untied: the K-quants' output Q6_K (a tied one would be Q8_0). An F32 embedding: a quantized one's rows hold
        # exact ratios that round to int8 at exact ties (x / s = 63.5), which the reference's norm, a few ulps off
        # the kernels', breaks the other way; the random weights then amplify one such flip far past the bound
        write_tiny_gguf(path, arch="qwen2", qtype=qtype, tied=False, embd_qtype=T.F32)
        engine = Engine.from_path(path, max_context=128, device="cpu", activation_bits=8)
        assert engine.kernels_in_use().endswith("avx2-int8")
        ids = list(range(3, 40))
        check_invariance(engine, ids[:21], ids[21:])
        # the fp32 reference path with every linear's input rounded as the kernels round it (int8 per 256 or 32
        # values): the same logits to fp32 summation error, token by token at position 0 (one forward a token, so
        # that a difference cannot spread along the sequence). A few tokens may differ by far more: an input that
        # the two paths, a few ulps apart, round to int8 on either side of a tie, which these random weights amplify
        # (by up to 28 on Q6_K); rounded per another block size (or not at all), none agree.
        from ultrafast.benchmarks.activation_precision import rounding_hook

        block = 256 if qtype in (T.Q4_K, T.Q6_K) else 32  # (the K-quant files' output is Q6_K)
        ref = Engine.from_path(path, max_context=128, device="cpu", packed=False)
        for m in ref.model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(rounding_hook(8, block=block))
        a = torch.cat([engine.forward([t], 0, all_logits=True) for t in ids])
        b = torch.cat([ref.forward([t], 0, all_logits=True) for t in ids])
        close = (a - b).abs().amax(-1) <= 1e-5 * b.abs().max() * b.shape[-1] ** 0.5
        assert close.sum() >= 0.75 * len(ids), f"{int(close.sum())} of {len(ids)} tokens agree"
        a = engine.forward(ids, 0, all_logits=True)
        assert not torch.equal(a, Engine.from_path(path, max_context=128, device="cpu").forward(ids, 0, all_logits=True))
    finally:
        uk.set_kernels_path("auto")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K],
                         ids=lambda t: t.name)
def test_tiny_models_k_invariant_for_every_packed_type(tmp_path, qtype, arch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch=arch, qtype=qtype, tied=qtype != T.Q4_0)
    engine = Engine.from_path(path, max_context=128, device="cpu", packed=True)
    ref = Engine.from_path(path, max_context=128, device="cpu", packed=False)
    ids = list(range(3, 40))
    check_invariance(engine, ids[:21], ids[21:])
    assert engine.batch_invariant and not ref.batch_invariant and engine.describe()["batch_invariant"]
    # the packed kernels agree with the fp32 reference path built from the same file (the bitwise checks
    # above are the same for every kernel path; only this closeness tolerance depends on the path: the
    # VNNI path rounds activations to int16 per block of 32, <= ~3e-5 of sum|x*w| per linear, and avx2-int16 (Q4_K,
    # Q6_K on AVX2) per 256; measured on these tiny models: <= 3e-4 for Q8_0/Q4_0/Q4_1/Q5_0 and <= 5e-3 for the
    # K-quants, whose random-byte test weights are large, up to ~2, and strongly biased per block)
    a, b = engine.forward(ids, 0, all_logits=True), ref.forward(ids, 0, all_logits=True)
    tol = 1e-4
    if "int16" in engine.kernels_in_use():
        tol = 2e-2 if qtype in (T.Q4_K, T.Q6_K) else 2e-3
    assert torch.allclose(a, b, atol=tol, rtol=tol), (a - b).abs().max()


def test_several_sequences_in_one_pass_equal_each_alone(smollm_engine):
    """Continuous batching: rows of different requests share the weight pass but never each other's values."""
    e = smollm_engine
    prompts = [list(range(10, 50)), list(range(300, 317)), list(range(1000, 1090))]
    caches = [e.new_cache() for _ in prompts]
    for p, c in zip(prompts, caches):
        e.forward(p, 0, cache=c)
    steps = [[7], [8, 9, 10], [11]]  # a decode step, a 3-token verify, a decode step
    batched = e.forward_batch([(s, len(p), c) for s, p, c in zip(steps, prompts, caches)])
    alone = torch.cat([e.forward(s, len(p), cache=c) for s, p, c in zip(steps, prompts, caches)])
    assert torch.equal(batched, alone)


def test_siblings_sharing_their_prompt_rows_get_the_bits_of_their_own(smollm_engine):
    """Best-of-n candidates of one prompt: a pass told that they hold the same prompt rows (`share`) reads those
    once, and gives each the logits of reading its own."""
    e = smollm_engine
    prompt = list(range(40, 90))
    caches = [e.new_cache() for _ in range(3)]
    e.forward(prompt, 0, cache=caches[0])
    for c in caches[1:]:
        c.copy_rows_from(caches[0], 0, len(prompt) - 1)
        e.forward(prompt[-1:], len(prompt) - 1, cache=c)
    for i, c in enumerate(caches):  # each its own continuation
        e.forward([200 + 7 * i + t for t in range(5 + i)], len(prompt), cache=c)
    seqs = [([300 + i], len(prompt) + 5 + i, c) for i, c in enumerate(caches)]
    alone = e.forward_batch(seqs)
    shared = e.forward_batch(seqs, share=[None, (0, len(prompt) - 1), (0, len(prompt) - 1)])
    assert torch.equal(shared, alone)
