"""Sampling: the filters, the seeded inverse-CDF draw, parameter validation."""

import pytest
import torch

from ultrafast.sampler import (Sampler, SamplingError, SamplingParams, apply_repetition_penalty, probabilities,
                               sample_from)


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert Sampler(SamplingParams(), [0]).sample(logits) == 1


def test_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]))  # 0.5 + 0.3 reaches 0.8
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert (p > 0).sum() == 3
    p = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.5))  # keep p >= 0.25
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]))
    p = probabilities(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(50)
    history = torch.tensor([3, 7, 7, 20])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(history[None], logits[None].clone())[0]
    assert torch.allclose(apply_repetition_penalty(logits, history, 1.3), ref)


def test_presence_frequency_penalties_and_logit_bias():
    """OpenAI's penalties count the output only (history past the prompt), as vLLM applies them; the bias adds
    to the named token ids' logits."""
    logits = torch.zeros(10)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={9: 3.0, 0: -1.0})
    s = Sampler(p, [1, 1, 2])  # the prompt's tokens are not penalised
    s.history += [2, 5, 5]
    want = torch.zeros(10)
    want[2] -= 0.5 + 0.25
    want[5] -= 0.5 + 2 * 0.25
    want[9] += 3.0
    want[0] -= 1.0
    assert torch.equal(s.adjusted(logits), want)
    assert s.sample(logits) == 9  # greedy follows the adjusted logits
    # a drafter's history (the context plus its drafts) is adjusted the same way
    assert torch.equal(s.adjusted(logits, [1, 1, 2, 2, 5, 5]), want)


def test_inverse_cdf_draw_follows_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    us = (torch.arange(10000, dtype=torch.float64) + 0.5) / 10000
    counts = torch.bincount(torch.tensor([sample_from(probs, float(u)) for u in us]), minlength=4)
    assert counts.tolist() == [1000, 0, 6000, 3000]
    assert sample_from(probs, 0.999999999) == 3


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(1000)

    def run(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed), [1, 2])
        return [s.sample(logits) for _ in range(20)]
    assert run(5) == run(5)
    assert run(5) != run(6)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                                    dict(top_k=-1), dict(max_tokens=0), dict(repetition_penalty=0),
                                    dict(repetition_penalty=1e-320), dict(repetition_penalty=1e300),
                                    dict(seed=2**64), dict(seed=-(2**63) - 1), dict(seed=1.5), dict(stop=[""]),
                                    dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                    dict(logit_bias={-1: 1.0}), dict(logit_bias={3: 101.0}), dict(logprobs=21)])
def test_invalid_params_are_rejected(kwargs):
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)


def test_seed_range_ends_are_accepted():
    for seed in (-(2**63), 2**64 - 1):
        SamplingParams(temperature=1.0, seed=seed).generator()


def test_tiny_sampling_values_are_their_limits_not_nan():
    """temperature -> 0 is the argmax; a top_p below float32's range keeps the top token (issue: temperature
    1e-40 or top_p 1e-320 gave a NaN distribution and garbage text)."""
    logits = torch.tensor([1.0, 3.0, 2.5, -4.0, 3.0 - 1e-3])
    for params in (SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-30),
                   SamplingParams(temperature=0.7, top_p=1e-320), SamplingParams(temperature=1e-40, top_p=1e-320)):
        p = probabilities(logits, params)
        assert torch.isfinite(p).all() and p.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0], params
        s = Sampler(SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=3), [])
        assert [s.sample(logits) for _ in range(5)] == [1] * 5
    # a tie at the top in the limit: the two share the mass
    p = probabilities(torch.tensor([2.0, 5.0, 5.0]), SamplingParams(temperature=1e-40))
    assert p.tolist() == [0.0, 0.5, 0.5]
    # ordinary temperatures are untouched by the limit's path
    assert torch.equal(probabilities(logits, SamplingParams(temperature=0.5)), torch.softmax(logits / 0.5, dim=-1))


def test_nucleus_is_the_sorted_prefix_reaching_top_p():
    """Top-p found among the top tokens (not a full sort of the vocabulary) keeps the smallest most-likely
    prefix whose mass reaches top_p, as a full sort does; a tie at its edge keeps every token of that
    probability."""
    from ultrafast.sampler import nucleus

    g = torch.Generator().manual_seed(0)
    for scale in (0.5, 2.0, 6.0):
        probs = torch.softmax(torch.randn(151_936, generator=g) * scale, dim=-1)
        for top_p in (0.05, 0.5, 0.9, 0.95):
            sorted_p, _ = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_p, dim=-1) - sorted_p
            edge = sorted_p[int((before < top_p).sum()) - 1]  # the last token of the prefix
            assert torch.equal(nucleus(probs, top_p), probs.masked_fill(probs < edge, 0.0)), (scale, top_p)
    tie = torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1])
    assert (nucleus(tie, 0.5) > 0).tolist() == [True, True, True, False, False]  # both 0.2s: a tie at the edge
    assert (nucleus(tie, 1e-9) > 0).tolist() == [True, False, False, False, False]  # always the top token
    assert torch.equal(nucleus(tie, 1.0), tie)
