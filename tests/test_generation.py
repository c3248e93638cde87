"""Driving several generations with shared passes (continuous batching) gives each its solo output."""

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
