"""Self-speculation: the target with some layers skipped drafts in the target's own KV cache."""

import pytest
import torch

from ultrafast.drafters.self_spec import SelfSpecDrafter, default_layers, parse_layers
from ultrafast.sampler import SamplingParams


def test_default_layers_skip_the_middle_third():
    assert default_layers(28) == list(range(0, 9)) + list(range(18, 28))
    assert default_layers(2) == [1]


def test_parse_layers():
    assert parse_layers("0-3,6,8-9", 10) == [0, 1, 2, 3, 6, 8, 9]
    for bad in ("", "a-b", "3-1", "0,0", "0-10", "-1", "5,2"):
        with pytest.raises(ValueError, match="self-speculation layers"):
            parse_layers(bad, 10)
    with pytest.raises(ValueError, match="the target itself"):
        parse_layers("0-9", 10)


def test_all_layers_is_the_full_forward(smollm_engine):
    e = smollm_engine
    ids = e.raw_prompt("The capital of France is")
    a = e.forward(ids, 0, all_logits=True, cache=e.new_cache())
    b = e.forward(ids, 0, all_logits=True, cache=e.new_cache(), layers=list(range(e.config.n_layers)))
    assert torch.equal(a, b)
    c = e.forward(ids, 0, all_logits=True, cache=e.new_cache(), layers=e.self_spec_layers)
    assert not torch.equal(a, c)


def test_drafts_leave_the_accepted_rows_alone(smollm_engine):
    """The drafter writes only at and past the drafting position, only in its layers; its drafts are the
    argmax of the skipped-layer model, one forward each."""
    e = smollm_engine
    ids = e.raw_prompt("def add(a, b):\n    return")
    cache = e.new_cache()
    e.forward(ids[:-1], 0, cache=cache)
    n = len(ids) - 1
    before_k, before_v = cache.k.clone(), cache.v.clone()
    drafter = SelfSpecDrafter(e, cache, e.self_spec_layers, 0.5)
    drafts = drafter.propose(ids, 3)
    assert len(drafts) == 3
    assert torch.equal(cache.k[:, :, :n], before_k[:, :, :n]) and torch.equal(cache.v[:, :, :n], before_v[:, :, :n])
    skipped = [i for i in range(e.config.n_layers) if i not in e.self_spec_layers]
    assert torch.equal(cache.k[skipped], before_k[skipped])
    assert not torch.equal(cache.k[e.self_spec_layers, :, n:n + 3], before_k[e.self_spec_layers, :, n:n + 3])
    # the same drafts, one by one, in a fresh copy of the prompt's rows
    ref, ctx = [], list(ids)
    for _ in range(3):
        logits = e.forward([ctx[-1]], len(ctx) - 1, cache=cache, layers=e.self_spec_layers)[-1]
        ctx.append(int(logits.argmax()))
        ref.append(ctx[-1])
    assert drafts == ref
    assert drafter.propose(ids, 0) == [] and drafter.propose(list(range(cache.max_len)), 2) == []


def test_ultrafast_with_self_spec_equals_standard(smollm_engine):
    """The rows the drafts wrote are rewritten by the verify pass: the output stays the standard tier's.
    (Sampled: tests/test_verifier.py checks the distribution.)"""
    e = smollm_engine
    saved, e.self_spec_cost = e.self_spec_cost, 0.05  # pretend it is cheap, so that the policy keeps asking
    drafted = accepted = 0
    try:
        for text in ("List five fruits, one per line.", "Write a haiku about the sea.",
                     "Count from 1 to 20, separated by commas."):
            ids = e.chat_prompt([{"role": "user", "content": text}])
            std = e.generate(ids, SamplingParams(max_tokens=64))
            fast = e.generate(ids, SamplingParams(max_tokens=64), tier="ultrafast", drafters=["self_spec"])
            assert fast.token_ids == std.token_ids
            st = fast.spec["drafters"]["self_spec"]
            drafted, accepted = drafted + st["drafted"], accepted + st["accepted"]
    finally:
        e.self_spec_cost = saved
    assert 0 < accepted < drafted  # drafts were verified, some kept and some rolled back


def test_unknown_drafter_names_the_known_ones(smollm_engine):
    with pytest.raises(ValueError, match="self_spec"):
        smollm_engine.stepper("ultrafast", ["nope"])
