"""silu_mul: the fused decoder layer's gated activation silu(gate) * up (kernels/activation_simd.h on the
vector paths, libm's exp on the scalar one), on every kernel path (the `path` fixture of test_qmatmul)."""

from __future__ import annotations

import pytest
import torch

from .test_qmatmul import path  # noqa: F401  (path: the kernel-path fixture)

import ultrafast.kernels as uk  # noqa: E402


def ref(g, u):
    g, u = g.double(), u.double()
    return g * torch.sigmoid(g) * u


def test_silu_mul_is_within_a_few_ulp_of_float64(path):
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(7, 1531, generator=gen) * 6  # a row length no vector width divides: every tail
    g[0, :9] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 80.0, -80.0, 86.0])
    u = torch.randn(7, 1531, generator=gen)
    y = uk.silu_mul(g, u)
    assert y.dtype == torch.float32 and y.shape == g.shape
    r = ref(g, u)
    err = (y.double() - r).abs()
    assert (err <= 4e-7 * r.abs() + 1e-37).all(), err.max()
    assert y[0, 1] == 0


def test_silu_mul_far_below_the_exp_range_is_zero_to_float_resolution(path):
    g = torch.tensor([-87.5, -100.0, -1e4, -3e38, 88.5, 100.0, 1e4, 3e38, float("nan")])
    u = torch.ones(9)
    y = uk.silu_mul(g, u)
    assert torch.isfinite(y[:8]).all() and torch.isnan(y[8])
    assert (y[:4].abs() <= 1e-35).all(), y[:4]  # silu(z) < 1e-36 in magnitude there
    assert torch.equal(y[4:8], g[4:8])  # sigmoid rounds to 1


def test_silu_mul_gives_an_element_the_same_bits_wherever_it_sits(path):
    """Batch invariance: an element's result depends only on its own gate and up, not on the length of the
    range it is in or its position in the vector (the lanes and the masked tail run the same operations)."""
    gen = torch.Generator().manual_seed(1)
    g, u = torch.randn(300, generator=gen) * 5, torch.randn(300, generator=gen)
    whole = uk.silu_mul(g, u)
    for start, n in ((0, 1), (3, 5), (7, 16), (1, 17), (33, 40), (250, 50)):
        part = uk.silu_mul(g[start:start + n], u[start:start + n])
        assert torch.equal(part, whole[start:start + n]), (start, n)


def test_silu_mul_rejects_bad_input():
    with pytest.raises(ValueError, match="differ in shape"):
        uk.silu_mul(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="float32"):
        uk.silu_mul(torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError):
        uk.silu_mul([1.0], torch.zeros(1))
