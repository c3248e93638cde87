"""Driving several generations with shared passes (continuous batching) gives each its solo output."""

import torch

from ultrafast.sampler import SamplingParams


def test_batched_generations_equal_solo_runs(smollm_engine):
    e = smollm_engine
    asks = ["Name three fruits.", "What is 2+2?", "Write a haiku about rain."]
    params = [SamplingParams(max_tokens=24), SamplingParams(max_tokens=10),
              SamplingParams(max_tokens=30, temperature=0.8, seed=5)]
    prompts = [e.chat_prompt([{"role": "user", "content": a}]) for a in asks]
    solo = [e.generate(p, q, cache=e.new_cache()) for p, q in zip(prompts, params)]
    gens = [e.start(p, q, cache=e.new_cache()) for p, q in zip(prompts, params)]
    for g in gens:
        g.prefill()
    while not all(g.done for g in gens):
        live = [g for g in gens if not g.done]
        logits = e.forward_batch([g.plain_input() for g in live])
        for g, row in zip(live, logits):
            g.advance(row)
    for g, s in zip(gens, solo):
        assert g.result.token_ids == s.token_ids and g.result.text == s.text
        assert "".join(ev.text for ev in g.take_events()) == s.text  # the streamed pieces add up
        assert g.take_events() == []


def test_prefill_from_a_siblings_logits(smollm_engine):
    """A best-of-n sibling whose cache holds the whole prompt's rows (copied from the candidate that prefilled it)
    takes its first token from that candidate's last-row logits, with no forward, and generates the very tokens
    of its own full run; where the cache lacks the prompt's rows the logits are ignored and it prefills itself."""
    e = smollm_engine
    prompt = e.chat_prompt([{"role": "user", "content": "Name a colour and say why you like it."}])
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=11)
    solo = e.generate(prompt, params, cache=e.new_cache())
    first = e.start(prompt, SamplingParams(max_tokens=4), cache=e.new_cache())
    row = first.prefill()
    assert row.shape == (e.config.vocab_size,)

    cache = e.new_cache()
    cache.copy_rows_from(first.cache, 0, len(prompt))
    cache.tokens = list(prompt)
    calls = []
    forward = e.forward
    e.forward = lambda *a, **kw: (calls.append(a[1]), forward(*a, **kw))[1]
    try:
        g = e.start(prompt, params, cache=cache)
        g.prefill(row.clone())
        assert calls == []  # no forward for the prompt
        while not g.done:
            g.advance()
        assert g.result.token_ids == solo.token_ids and g.result.text == solo.text

        calls.clear()
        bare = e.start(prompt, params, cache=e.new_cache())  # no rows: the logits are not used
        bare.prefill(torch.full_like(row, float("nan")))
        assert calls == [0]
        while not bare.done:
            bare.advance()
        assert bare.result.token_ids == solo.token_ids
    finally:
        e.forward = forward
