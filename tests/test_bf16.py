"""The bf16 transform (bf16.py): the reference model with bf16 weights and PyTorch's bf16 matmul."""

import pytest
import torch

from ultrafast.bf16 import BF16Linear, bf16_weight
from ultrafast.engine import Engine


@pytest.fixture(scope="module")
def engines(smollm_engine):
    ref = Engine.from_loaded(smollm_engine.loaded, max_context=256, device="cpu", packed=False)
    bf16 = Engine.from_loaded(smollm_engine.loaded, max_context=256, device="cpu", bf16=True)
    return ref, bf16


def test_every_linear_is_bf16_and_the_logits_stay_near_the_fp32_models(engines, smollm_engine):
    ref, bf16 = engines
    assert bf16.kernels_in_use().startswith("reference, bf16") and not bf16.batch_invariant
    lin = [m for m in bf16.model.modules() if isinstance(m, BF16Linear)]
    assert len(lin) == 7 * bf16.config.n_layers + 1 and all(m.weight.dtype == torch.bfloat16 for m in lin)
    ids = smollm_engine.raw_prompt("The quick brown fox jumps over the lazy dog because it wanted to")
    a = ref.forward(ids, 0, all_logits=True, cache=ref.new_cache())
    b = bf16.forward(ids, 0, all_logits=True, cache=bf16.new_cache())
    assert not torch.equal(a, b)
    rel = (a - b).norm(dim=-1) / a.norm(dim=-1)
    # bf16 weights and activations move SmolLM2's logits by a few percent, more at some positions, and flip near-ties.
    # Measured: under 0.05 everywhere on the Zen machines; on an Intel machine with AMX (oneDNN's bf16 path there)
    # 0.003-0.061 by position (mean 0.018), the argmax equal at 11 of 13 positions. A wrong weight moves them by ~1.
    assert rel.max() < 0.1 and rel.mean() < 0.03 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


def test_weights_are_the_files_values_rounded_to_bf16(smollm_engine):
    qt = smollm_engine.loaded.tensors["layers.0.feed_forward.w2.weight"]
    w = bf16_weight(qt)
    assert w.dtype == torch.bfloat16 and torch.equal(w, qt.dequantize().to(torch.bfloat16))
    big = smollm_engine.loaded.tensors["tok_embeddings.weight"]  # more rows than one dequantized chunk
    assert big.shape[0] > 4096 and torch.equal(bf16_weight(big)[4090:4100], big.dequantize()[4090:4100].to(torch.bfloat16))


def test_bf16_is_refused_beside_the_packed_kernels(smollm_engine):
    for bad in ({"packed": True}, {"activation_bits": 8}):
        with pytest.raises(ValueError, match="bf16"):
            Engine.from_loaded(smollm_engine.loaded, bf16=True, device="cpu", **bad)
    with pytest.raises(ValueError, match="2-D bf16"):
        BF16Linear(torch.zeros(4, 4), None)


def test_fp32_multiplies_are_the_same_products_summed_in_fp32():
    """Where the CPU has no bf16 multiplier the products run in fp32 on the widened operands: the bf16
    matmul's own products (exact in fp32), so the two modes agree to the rounding of the sums."""
    from ultrafast.bf16 import bf16_matmul_pays

    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 320, generator=g).to(torch.bfloat16)
    bias = torch.randn(48, generator=g)
    x = torch.randn(5, 320, generator=g)
    wide, native = BF16Linear(w, bias, fp32_multiplies=True), BF16Linear(w, bias)
    assert "fp32 multiplies" in repr(wide) and "fp32 multiplies" not in repr(native)
    want = x.to(torch.bfloat16).double() @ w.double().T + bias.double()
    for lin in (wide, native):
        got = lin(x)
        assert got.dtype == torch.float32
        scale = x.to(torch.bfloat16).double().abs() @ w.double().abs().T
        assert ((got.double() - want).abs() <= 1e-2 * scale + 1e-5).all()
    # the exact fp32 products: the widened mode is fp32 arithmetic on the rounded operands
    assert torch.allclose(wide(x), torch.nn.functional.linear(x.to(torch.bfloat16).float(), w.float()) + bias)
    assert isinstance(bf16_matmul_pays(64, rows=8, seconds=0.01), bool)


def test_the_engine_names_the_multiplies_it_chose(engines):
    _, bf16 = engines
    flags = {m.fp32_multiplies for m in bf16.model.modules() if isinstance(m, BF16Linear)}
    assert len(flags) == 1  # one choice for the model, timed once
    assert ("fp32 multiplies" in bf16.kernels_in_use()) == flags.pop()
