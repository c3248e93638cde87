"""The packed transform's linears (`ultrafast/packed.py`): which bytes the kernels read on each path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultrafast import kernels
from ultrafast.dequant import dequantize
from ultrafast.packed import PackedLinear, vnni_path

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the packed linears run the C++ kernels")


def _q4k(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random Q4_K rows (gguf cannot quantize to Q4_K): random nibbles and 6-bit scales, small fp16 d and dmin."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    raw[:, :, 0:4] = np.frombuffer(np.array([0.01, 0.002], dtype=np.float16).tobytes(), dtype=np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1).copy())


def test_q4k_read_repacked_on_the_vnni_path_only(vnni):
    lin = PackedLinear(_q4k(24, 1536), kernels.Q4_K, 1536, 24)
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(0))
    assert vnni_path()
    w, qt = lin.weights(True)
    assert qt == kernels.Q4_K_R2 and w.shape == lin.raw.shape and not torch.equal(w, lin.raw)
    assert lin.weights(True)[0] is w  # made once
    y_vnni = lin(x)
    assert torch.equal(y_vnni, kernels.qmatmul(x, w, kernels.Q4_K_R2, 1536))
    # the file's bytes stay in `raw`, for every other reader and path
    ref = x.double() @ dequantize(lin.raw, kernels.Q4_K, 1536).double().T
    scale = x.double().abs() @ dequantize(lin.raw, kernels.Q4_K, 1536).double().abs().T
    assert ((y_vnni.double() - ref).abs() <= 1e-4 * scale).all()
    kernels.set_kernels_path("fp32")
    assert not vnni_path()
    assert lin.weights(False) == (lin.raw, kernels.Q4_K)
    assert ((lin(x).double() - ref).abs() <= 1e-5 * scale).all()


def test_rebound_bytes_are_repacked_again(vnni):
    lin = PackedLinear(_q4k(8, 512, seed=1), kernels.Q4_K, 512, 8)
    first = lin.weights(True)[0]
    lin.raw = _q4k(8, 512, seed=2)
    second = lin.weights(True)[0]
    assert second is not first and torch.equal(second, kernels.repack_vnni(lin.raw, kernels.Q4_K, 512))


def test_which_types_are_repacked(vnni):
    wide = PackedLinear(_q4k(4, 8960), kernels.Q4_K, 8960, 4)  # an odd number of super-blocks: repacked too
    assert wide.weights(True)[1] == kernels.Q4_K_R2
    # the 32-value-block types in groups of 16 blocks, a partial last group included (576 = 18 blocks)
    rng = np.random.default_rng(3)
    for qt, layout in ((kernels.Q4_0, kernels.Q4_0_R16), (kernels.Q4_1, kernels.Q4_1_R16),
                       (kernels.Q5_0, kernels.Q5_0_R16), (kernels.Q8_0, kernels.Q8_0_R16)):
        raw = torch.from_numpy(rng.integers(0, 256, size=(4, kernels.row_bytes(qt, 576)), dtype=np.uint8))
        raw.view(4, -1, kernels.block_info(qt)[1])[:, :, :2] = 0  # d = 0: finite values
        lin = PackedLinear(raw, qt, 576, 4)
        w, got = lin.weights(True)
        assert got == layout and not torch.equal(w, lin.raw) and lin.weights(False) == (lin.raw, qt)
    q6 = PackedLinear(torch.zeros(4, kernels.row_bytes(kernels.Q6_K, 512), dtype=torch.uint8), kernels.Q6_K, 512, 4)
    assert q6.weights(True)[1] == kernels.Q6_K_R16 and q6.weights(False) == (q6.raw, kernels.Q6_K)
    # float weights keep the file's layout on every path
    f32 = PackedLinear(torch.zeros(4, 512 * 4, dtype=torch.uint8), kernels.F32, 512, 4)
    assert f32.weights(True) == (f32.raw, kernels.F32)


def test_the_layer_stack_gives_the_bits_of_a_call_per_layer(smollm_engine):
    """`FusedStack` (every fused layer of a pass in one kernel call) against the per-layer calls: the same logits,
    hidden features, layer subsets, token-tree passes, several sequences in a pass, and cache rows."""
    from ultrafast.token_tree import TreeLayout

    e = smollm_engine
    m = e.model
    stack = m.layer_stack
    assert stack is not None and stack.covers(range(len(m.layers)))
    ids = e.tokenizer.encode("def add(a, b):\n    return a + b\n")

    def passes():
        c, c2 = e.new_cache(), e.new_cache()
        out = [e.forward(ids, 0, all_logits=True, cache=c),
               *m.forward(torch.tensor([5, 6]), len(ids), c, all_logits=True, hidden=(2, 15)),
               m.forward(torch.tensor([7]), len(ids) + 2, c, layers=[0, 1, 2, 5, len(m.layers) - 1]),
               m.forward(torch.tensor([8, 9, 10, 11]), len(ids) + 3, c, all_logits=True,
                         tree=TreeLayout([-1, 0, 0, 1], len(ids) + 3)),
               m.forward_multi(torch.tensor(ids[:3] + ids[:2]), [len(ids) + 3, 0], [3, 2], [c, c2], all_logits=True)]
        return out + [c.k_layers[3][:, :len(ids) + 7].clone(), c2.v_layers[20][:, :2].clone()]

    try:
        together = passes()
        m.layer_stack = None
        alone = passes()
    finally:
        m.layer_stack = stack
    assert len(together) == len(alone) == 8
    for a, b in zip(together, alone):
        assert torch.equal(a, b)


def test_a_fused_layer_sees_rebound_bytes(smollm_engine, vnni):
    """`FusedBlock.weights` keeps its answer only while every linear's bytes are the same tensors: rebinding one
    is seen on the next call (repacked where the VNNI kernels read their own layout)."""
    block = smollm_engine.model.layers[0]
    first = block.weights()
    assert block.weights() is first  # nothing changed: the kept answer
    lin = block._lin[3]
    old = lin.raw
    try:
        lin.raw = old.clone()
        again = block.weights()
        assert again is not first and again[0][3] is lin.weights()[0]
        assert torch.equal(again[0][3], first[0][3]) and again[1] == first[1]
    finally:
        lin.raw = old
    assert block.weights()[0][3] is lin.weights()[0]
