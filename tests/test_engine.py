"""Generation on the real SmolLM2: streaming, stops, limits, seeds, raw prompts with special tokens."""

import pytest
import torch

from ultrafast.sampler import SamplingParams

CHAT = [{"role": "user", "content": "List the first ten prime numbers, separated by commas."}]


def collect(engine, ids, params):
    it, texts = engine.stream(ids, params), []
    while True:
        try:
            texts.append(next(it).text)
        except StopIteration as done:
            return "".join(texts), done.value


def test_streamed_text_equals_the_result(smollm_engine):
    ids = smollm_engine.chat_prompt(CHAT)
    streamed, res = collect(smollm_engine, ids, SamplingParams(max_tokens=40))
    assert streamed == res.text and res.text
    assert res.text == smollm_engine.tokenizer.decode(res.token_ids)
    assert res.prompt_tokens == len(ids) and res.completion_tokens >= len(res.token_ids)
    assert res.ttft_s > 0 and res.decode_tokens_per_s > 0 and res.achieved_gb_per_s > 0


def test_max_tokens_and_eos(smollm_engine):
    ids = smollm_engine.chat_prompt(CHAT)
    res = smollm_engine.generate(ids, SamplingParams(max_tokens=5))
    assert len(res.token_ids) == 5 and res.finish_reason == "length"
    short = smollm_engine.generate(smollm_engine.chat_prompt([{"role": "user", "content": "What is the capital of France?"}]),
                                   SamplingParams(max_tokens=64))
    assert short.finish_reason == "stop" and len(short.token_ids) < 64
    assert short.completion_tokens == len(short.token_ids) + 1  # the EOS counts as generated


def test_stop_string_cuts_the_text(smollm_engine):
    ids = smollm_engine.chat_prompt(CHAT)
    full = smollm_engine.generate(ids, SamplingParams(max_tokens=40))
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    cut = full.text[: full.text.index(stop)]
    streamed, res = collect(smollm_engine, ids, SamplingParams(max_tokens=40, stop=[stop, "never appears"]))
    assert res.text == cut == streamed and res.finish_reason == "stop"


def test_seeded_sampling_reproduces(smollm_engine):
    ids = smollm_engine.chat_prompt(CHAT)
    a = smollm_engine.generate(ids, SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24))
    b = smollm_engine.generate(ids, SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24))
    c = smollm_engine.generate(ids, SamplingParams(temperature=0.9, top_p=0.95, seed=8, max_tokens=24))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_raw_prompt_with_special_tokens_equals_the_chat_prompt(smollm_engine):
    tok = smollm_engine.tokenizer
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert "<|im_start|>" in text
    assert smollm_engine.raw_prompt(text) == smollm_engine.chat_prompt(CHAT)
    assert smollm_engine.raw_prompt("<|im_start|>")[-1] == tok.encode("<|im_start|>")[0]


def test_bad_prompts(smollm_engine):
    with pytest.raises(ValueError, match="empty"):
        smollm_engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        smollm_engine.generate([1, 10**7], SamplingParams())


def test_forward_returns_the_hidden_states_a_draft_head_reads(smollm_engine):
    """Engine.forward(hidden=True): the logits unchanged, and the last layer's output before the final norm for
    every row, from which the model's own norm and head give those logits back bit for bit."""
    e = smollm_engine
    ids = e.raw_prompt("The capital of France is")
    cache = e.new_cache()
    plain = e.forward(ids, 0, all_logits=True, cache=cache)
    logits, h = e.forward(ids, 0, all_logits=True, cache=e.new_cache(), hidden=True)
    assert torch.equal(logits, plain) and h.shape == (len(ids), e.config.dim)
    assert torch.equal(e.model.output(e.model.norm(h)).float(), logits)
    last, h_last = e.forward(ids, 0, cache=e.new_cache(), hidden=True)
    assert torch.equal(h_last, h) and torch.equal(last, plain[-1:])


def test_the_suffix_history_is_kept_per_scope(smollm_path):
    """The suffix drafter drafts from earlier requests of the request's own scope (a server's tenant) only: an
    ultrafast generation adds its text to its scope's history, never another's; the most recent SUFFIX_SCOPES
    scopes are kept."""
    from ultrafast.engine import SUFFIX_SCOPES, Engine

    engine = Engine.from_path(smollm_path, max_context=256)
    engine.r_table = [0.0, 1.0] + [1.0 + 0.1 * (k - 1) for k in range(2, 18)]  # (not measured: no timing here)
    a, b = engine.suffix_cache(("key-a", None)), engine.suffix_cache(("key-b", None))
    assert a is not b and engine.suffix_cache(("key-a", None)) is a and engine.suffix_cache(("key-a", "s")) is not a
    ids = engine.chat_prompt(CHAT)
    res = engine.generate(ids, SamplingParams(max_tokens=8), tier="ultrafast", scope=("key-a", None))
    assert a.index.tokens[:len(ids) + len(res.token_ids)] == ids + res.token_ids and not b.index.tokens
    for i in range(SUFFIX_SCOPES):
        engine.suffix_cache(("other", i))
    assert engine.suffix_cache(("key-a", None)) is not a  # dropped, least recently used
