"""kernels.sample_row (sampling.cpp): the sampler's rule in one call, against sampler.py's PyTorch reference
(`sample_from(probabilities(logits, p), u)`): the same token for every u but those within rounding of a boundary
between two tokens, the same counts over a grid of u, and the edges (NaN, -inf, overflow, ties, errors)."""

import math

import pytest
import torch

from ultrafast import kernels
from ultrafast.sampler import SamplingParams, probabilities, sample_from, sample_token

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels unavailable")


def reference(x, p, u):
    return sample_from(probabilities(x, p), u)


def fused(x, p, u):
    return kernels.sample_row(x, p.temperature, p.top_k, p.top_p, p.min_p, u)


def near_boundary(probs, u, tol=1e-5):
    """Whether u lies within tol of the cumulative mass at the end of some kept token (vocabulary order)."""
    cum = torch.cumsum(probs.double(), 0)
    cum = cum / cum[-1]
    return bool((cum[probs > 0] - u).abs().min() < tol)


CASES = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=5),
         dict(temperature=0.5, min_p=0.05), dict(temperature=1.0, top_p=0.5, top_k=40, min_p=0.01),
         dict(temperature=0.05, top_p=0.99), dict(temperature=2.0, top_p=0.999)]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_same_token_as_the_reference(case):
    g = torch.Generator().manual_seed(case)
    p = SamplingParams(**CASES[case])
    differ = 0
    for trial in range(40):
        V = int(torch.randint(2, 5000, (1,), generator=g))
        x = torch.randn(V, generator=g) * float(0.1 + 8 * torch.rand(1, generator=g))
        probs = probabilities(x, p)
        for u in torch.rand(25, generator=g, dtype=torch.float64).tolist():
            a, b = reference(x, p, u), fused(x, p, u)
            if a != b:
                differ += 1
                assert near_boundary(probs, u), (V, u, a, b)
                assert probs[b] > 0
    assert differ <= 2


def test_counts_over_a_grid_of_u_on_a_vocabulary_of_152k():
    """A model-sized row: over 5,000 evenly spaced u each token is drawn as often as by the reference, give or
    take the u that fall on a boundary."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(151936, generator=g) * 2.5
    x[:20] += 9.0  # a peaked head over a long tail, as a model's logits are
    us = ((torch.arange(5000, dtype=torch.float64) + 0.5) / 5000).tolist()
    for p in (SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.8, top_k=50, min_p=0.02)):
        probs = probabilities(x, p)
        cum = torch.cumsum(probs, -1)  # sample_from for all u at once (no u lands on a dropped token here)
        want = torch.searchsorted(cum, torch.tensor(us, dtype=cum.dtype) * cum[-1], right=True)
        assert bool((probs[want] > 0).all())
        want = torch.bincount(want, minlength=x.numel())
        got = torch.bincount(torch.tensor([fused(x, p, u) for u in us]), minlength=x.numel())
        assert int((want - got).abs().max()) <= 1, p
        # a token the reference drops is drawn only at the edge of the kept set, where the sums' rounding decides
        # (here the nucleus's: its mass reaches 0.95 within ~3e-6 of the 2764th token): the next in rank
        n_kept = int((probs > 0).sum())
        drawn_outside = ((got > 0) & (probs == 0)).nonzero().flatten().tolist()
        order = torch.argsort(torch.softmax(x / p.temperature, -1), descending=True)
        assert set(drawn_outside) <= set(order[:n_kept + 1].tolist()), p


def test_a_flat_row_whose_nucleus_is_most_of_the_vocabulary():
    """top_p = 0.95 over nearly equal logits keeps ~95% of 50k tokens: the search for the nucleus must widen to
    them (and gives the reference's set)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50000, generator=g) * 0.05
    p = SamplingParams(temperature=1.0, top_p=0.95)
    probs = probabilities(x, p)
    kept = probs > 0
    seen = torch.zeros_like(kept)
    for u in torch.rand(3000, generator=g, dtype=torch.float64).tolist():
        t = fused(x, p, u)
        seen[t] = True
        assert t == sample_from(probs, u) or near_boundary(probs, u)
    assert bool(kept[seen].all())
    assert 0.9 * x.numel() < int(kept.sum()) < x.numel()


def test_nan_and_masked_logits_are_never_drawn():
    x = torch.tensor([float("nan"), 1.0, float("-inf"), 0.5, float("nan"), float("-inf")])
    p = SamplingParams(temperature=1.0)
    drawn = {fused(x, p, u) for u in (i / 1000 for i in range(1000))}
    assert drawn == {1, 3}
    with pytest.raises(ValueError, match="finite"):
        fused(torch.full((8,), float("-inf")), p, 0.5)
    with pytest.raises(ValueError, match="finite"):
        fused(torch.full((8,), float("nan")), p, 0.5)


def test_overflowing_temperature_and_ties():
    """A temperature so small that x / T overflows: the limit, the top logit(s), ties shared (as the reference);
    top-k and top-p keep every token tied at their edge."""
    x = torch.tensor([2.0, 5.0, 5.0, -1.0])
    p = SamplingParams(temperature=1e-40)
    assert {fused(x, p, u) for u in (0.1, 0.4, 0.6, 0.9)} == {1, 2}
    x = torch.tensor([3.0, 1.0, 3.0, 1.0, 0.0])
    assert {fused(x, SamplingParams(temperature=1.0, top_k=1), u / 50) for u in range(50)} == {0, 2}
    tie = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1]))
    assert {fused(tie, SamplingParams(temperature=1.0, top_p=0.5), u / 50) for u in range(50)} == {0, 1, 2}
    assert {fused(tie, SamplingParams(temperature=1.0, top_p=1e-9), u / 50) for u in range(50)} == {0}
    assert {fused(tie, SamplingParams(temperature=1.0, min_p=0.45), u / 50) for u in range(50)} == {0, 1, 2}
    assert {fused(tie, SamplingParams(temperature=1.0, min_p=0.55), u / 50) for u in range(50)} == {0}


def test_the_top_token_at_u_zero_and_the_last_kept_near_one():
    x = torch.tensor([0.0, 2.0, 1.0, -3.0])
    p = SamplingParams(temperature=1.0, top_p=0.9)
    kept = (probabilities(x, p) > 0).nonzero().flatten().tolist()
    assert fused(x, p, 0.0) == kept[0]
    assert fused(x, p, math.nextafter(1.0, 0.0)) == kept[-1]


@pytest.mark.parametrize("bad", [
    dict(logits=torch.zeros(4, dtype=torch.float64)), dict(logits=torch.zeros(2, 3)), dict(logits=torch.zeros(0)),
    dict(logits=torch.zeros(8)[::2]), dict(temperature=0.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
    dict(min_p=1.5), dict(u=1.0), dict(u=-0.1)])
def test_errors(bad):
    args = dict(logits=torch.zeros(4), temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, u=0.5) | bad
    with pytest.raises(ValueError):
        kernels.sample_row(**args)
    with pytest.raises(ValueError):
        kernels.sample_row([0.0, 1.0], 1.0, 0, 1.0, 0.0, 0.5)


def test_sample_token_uses_the_reference_without_the_kernels(monkeypatch):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 3
    p = SamplingParams(temperature=0.9, top_p=0.9)
    us = [i / 97 for i in range(97)]
    fast = [sample_token(x, p, u) for u in us]
    monkeypatch.setattr(kernels, "available", lambda: False)
    slow = [sample_token(x, p, u) for u in us]
    probs = probabilities(x, p)
    assert slow == [sample_from(probs, u) for u in us]
    assert all(a == b or near_boundary(probs, u) for a, b, u in zip(fast, slow, us))
