"""Constrained decoding: outputs match their grammar, the tiers stay token-identical under it (greedy, and
sampled with a seed, with drafters that propose tokens the grammar refuses), drafts the grammar refuses are cut,
forced tokens are drafted, and invalid grammars are refused."""

import json

import jsonschema
import pytest

from tests.builders import BadDrafter

from ultrafast.grammar import Grammar, GrammarError
from ultrafast.sampler import SamplingParams, SamplingError

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}}


def _prompt(engine, text="Describe a person as JSON."):
    return engine.chat_prompt([{"role": "user", "content": text}])


def test_json_schema_output_validates_and_tiers_agree(smollm_engine):
    engine = smollm_engine
    g = Grammar.json_schema(PERSON)
    for text in ("Describe a person as JSON.", "Give me a JSON record of a cat owner named Bob."):
        params = SamplingParams(max_tokens=96, grammar=g)
        std = engine.generate(_prompt(engine, text), params)
        assert std.finish_reason == "stop", std.text
        jsonschema.validate(json.loads(std.text), PERSON)
        fast = engine.generate(_prompt(engine, text), params, tier="ultrafast",
                               drafters=["grammar", "prompt_lookup", BadDrafter(engine.config.vocab_size)])
        assert fast.token_ids == std.token_ids
        assert fast.spec["drafters"]["grammar"]["accepted"] > 0  # keys and punctuation were free drafts


def test_unconstrained_output_differs(smollm_engine):
    """The mask does something: the same prompt without the grammar does not produce this JSON."""
    engine = smollm_engine
    params = SamplingParams(max_tokens=48)
    free = engine.generate(_prompt(engine), params)
    bound = engine.generate(_prompt(engine), SamplingParams(max_tokens=48, grammar=Grammar.json_schema(PERSON)))
    assert free.token_ids != bound.token_ids


def test_sampled_under_grammar_is_exact_across_tiers(smollm_engine):
    engine = smollm_engine
    g = Grammar.json_schema(PERSON)
    engine.fixed_draft_k = 4  # every pass drafts: grammar, lookup and random tokens in turn
    try:
        for seed in (1, 2, 3):
            params = SamplingParams(max_tokens=96, temperature=0.9, seed=seed, grammar=g)
            std = engine.generate(_prompt(engine), params)
            fast = engine.generate(_prompt(engine), params, tier="ultrafast",
                                   drafters=["grammar", BadDrafter(engine.config.vocab_size, seed), "prompt_lookup"])
            assert fast.token_ids == std.token_ids
            if std.finish_reason == "stop":
                jsonschema.validate(json.loads(std.text), PERSON)
    finally:
        engine.fixed_draft_k = None


@pytest.mark.parametrize("grammar,check", [
    (Grammar("json_object"), lambda t: isinstance(json.loads(t), (dict, list, str, int, float, bool, type(None)))),
    (Grammar("regex", r"(yes|no), because [a-z ]{1,20}\."), None),
    (Grammar("ebnf", 'root ::= "The answer is " [0-9]+ "."'), None),
], ids=["json_object", "regex", "ebnf"])
def test_other_grammar_kinds(smollm_engine, grammar, check):
    import re

    engine = smollm_engine
    out = engine.generate(_prompt(engine, "Is the sky blue? What is 6 times 7?"),
                          SamplingParams(max_tokens=64, grammar=grammar))
    if grammar.kind == "regex":
        assert re.fullmatch(grammar.source, out.text), out.text
    elif grammar.kind == "ebnf":
        assert re.fullmatch(r"The answer is [0-9]+\.", out.text), out.text
    elif out.finish_reason == "stop":
        assert check(out.text)


def test_cut_chain_and_tree(smollm_engine):
    engine = smollm_engine
    c = engine.grammars.constraint(Grammar("regex", r"ab(c|d)e"))
    tok = engine.tokenizer
    a, b, cc, d, e, x = (tok.encode(s, add_bos=False)[0] for s in "abcdex")
    assert c.cut([], [a, b, cc, e], None) == ([a, b, cc, e], None)
    assert c.cut([], [a, b, x, e], None) == ([a, b], None)
    assert c.cut([a], [x], None) == ([], None)
    # tree: root -> a -> b -> {c, x, d}; x's child e goes with it; the others stay, renumbered
    toks, parents = [a, b, cc, x, d, e, e], [0, 1, 2, 2, 2, 4, 5]
    assert c.cut([], toks, parents) == ([a, b, cc, d, e], [0, 1, 2, 2, 4])
    # forced drafts: after "a" the grammar forces "b"; after "ab" there are two ways on; after "abd", "e"
    assert tok.decode(c.forced([a], 8)) == "b"
    assert c.forced([a, b], 8) == []
    assert tok.decode(c.forced([a, b, d], 8)) == "e"
    long = engine.grammars.constraint(Grammar("regex", r"x(yes|no): the quick brown fox"))
    assert len(long.forced(tok.encode("xno", add_bos=False), 3)) == 3
    assert tok.decode(long.forced(tok.encode("xno", add_bos=False), 32)) == ": the quick brown fox"


def test_invalid_grammars_are_refused(smollm_engine):
    compiler = smollm_engine.grammars
    with pytest.raises(GrammarError):
        compiler.compile(Grammar("regex", "(unclosed"))
    with pytest.raises(GrammarError):
        compiler.compile(Grammar("ebnf", "root ::= undefined_rule"))
    with pytest.raises(GrammarError):
        compiler.compile(Grammar("json_schema", json.dumps({"type": "no-such-type"})))
    with pytest.raises(GrammarError):
        Grammar("json_schema", "")
    with pytest.raises(GrammarError):
        Grammar("xml", "x")
    with pytest.raises(SamplingError):
        SamplingParams(grammar="a regex as a bare string")


def test_special_tokens_are_never_admitted(smollm_engine):
    """Inside a JSON string the grammar admits any text, but never a control token such as <|im_end|>."""
    engine = smollm_engine
    c = engine.grammars.constraint(Grammar("json_object"))
    out = engine.tokenizer.encode('{"a": "b', add_bos=False)
    import torch

    masked = c.apply(torch.zeros(engine.config.vocab_size), out)
    allowed = torch.isfinite(masked)
    assert allowed.sum() > 1000
    for t in engine.tokenizer.eos_ids:
        assert not allowed[t]


def test_a_grammar_that_admits_nothing_ends_the_output(smollm_engine):
    engine = smollm_engine
    for temperature in (0.0, 0.8):
        out = engine.generate(engine.raw_prompt("x"), SamplingParams(max_tokens=5, temperature=temperature, seed=1,
                                                                     grammar=Grammar("ebnf", "root ::= root")))
        assert out.token_ids == [] and out.finish_reason == "stop"


def test_library_messages_lose_their_log_prefix(smollm_engine):
    with pytest.raises(GrammarError) as e:
        smollm_engine.grammars.compile(Grammar("regex", "\\"))
    assert str(e.value).startswith("invalid regex: Regex parsing error")


def test_one_or_several_forced_tool_calls(smollm_engine):
    """tool_choice required/named: `tool_call` is exactly one call, `tool_calls` (parallel calls allowed) one or
    more; a tool named `root` stays a name (only the grammar's rule is renamed)."""
    import xgrammar as xgr

    from ultrafast.tool_calls import call_schema

    tools = [{"type": "function", "function": {"name": "root", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    schema = json.dumps(call_schema(tools))
    call = '<tool_call>\n{"name": "root", "arguments": {"x": %d}}\n</tool_call>'

    def matches(kind, text):
        m = xgr.GrammarMatcher(smollm_engine.grammars.compile(Grammar(kind, schema)))
        return m.accept_string(text) and m.is_terminated() is False and m.accept_token(
            sorted(smollm_engine.tokenizer.eos_ids)[0])

    assert matches("tool_call", call % 1) and matches("tool_calls", call % 1)
    assert matches("tool_calls", call % 1 + "\n" + call % 2 + "\n" + call % 3)
    assert not matches("tool_call", call % 1 + "\n" + call % 2)
    assert not matches("tool_calls", call % 1 + "\n")  # a separator promises another call
    assert not matches("tool_calls", (call % 1).replace("root", "rooted", 1))
