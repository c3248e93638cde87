"""Tool calls parsed out of a model's output, whole and as it streams, and the messages templates read back."""

import json

import pytest

from ultrafast.tool_calls import (ToolCallParser, ToolFormatError, call_schema, check_template, parse_call,
                                  to_template_messages)

OUT = ('Let me look.\n<tool_call>\n{"name": "get_price", "arguments": {"item": "apple"}}\n</tool_call>\n'
       '<tool_call>\n{"name": "get_price", "arguments": {"item": "pear"}}\n</tool_call>')


def _stream(text: str, step: int, names=()):
    p = ToolCallParser(frozenset(names))
    content, calls = [], []
    for i in range(0, len(text), step):
        c, done = p.feed(text[i:i + step])
        content.append(c)
        calls += done
    c, done = p.finish()
    content.append(c)
    return p, "".join(content), calls + done


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_calls_parsed_whatever_the_chunking(step):
    p, content, calls = _stream(OUT, step)
    assert [c.name for c in calls] == ["get_price", "get_price"]
    assert [json.loads(c.arguments) for c in calls] == [{"item": "apple"}, {"item": "pear"}]
    assert content.strip() == "Let me look."
    assert p.message_content() == "Let me look."
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # JSON cut short
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "f", "arguments": {}}',  # never closed
])
def test_malformed_calls_come_back_as_text(text):
    for step in (1, 5, 1000):
        p, content, calls = _stream(text, step)
        assert calls == []
        assert content == text
        assert p.message_content() == text


def test_plain_text_passes_through_even_with_angle_brackets():
    text = "a < b and <tool is not a tag; x <tool_cal"
    p, content, calls = _stream(text, 2)
    assert calls == [] and content == text


def test_arguments_as_json_text_are_accepted():
    call = parse_call('{"name": "f", "arguments": "{\\"a\\": 2}"}')
    assert call.name == "f" and json.loads(call.arguments) == {"a": 2}


def test_template_check():
    with pytest.raises(ToolFormatError, match="does not support tools"):
        check_template("{{ messages }}", "smollm")
    with pytest.raises(ToolFormatError, match="cannot parse"):
        check_template("{% if tools %}{{ tools }}{% endif %}", "other")
    check_template("{% if tools %}<tool_call>{% endif %}", "qwen")


def test_call_schema_and_template_messages():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {}}}},
             {"type": "function", "function": {"name": "b"}}]
    s = call_schema(tools)
    assert [o["properties"]["name"]["const"] for o in s["anyOf"]] == ["a", "b"]
    msgs = to_template_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}]}])
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert msgs[0]["tool_calls"][0]["name"] == "a"


@pytest.mark.parametrize("text", [
    '```json\n{\n  "name": "get_price",\n  "arguments": {\n    "fruit": "apple"\n  }\n}\n```',
    '{{"name": "get_price", "arguments": {"fruit": "apple"}}}',
    '  {"name": "get_price", "arguments": {"fruit": "apple"}}',
])
def test_a_bare_call_to_an_offered_tool_is_a_call(text):
    """Qwen2.5-Coder-1.5B at greedy answers tool prompts so: the whole output one untagged call."""
    for step in (1, 4, 1000):
        p, content, calls = _stream(text, step, names=["get_price", "multiply"])
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_price", {"fruit": "apple"})]
        assert content == "" and p.message_content() is None


@pytest.mark.parametrize("text", [
    '```json\n{"name": "unknown_tool", "arguments": {}}\n```',  # not an offered tool
    '{"answer": 42}',  # JSON, but no call
    '```python\nprint(1)\n```',  # a fence, but code
    '{{"name": "get_price", "arguments": {"a": 3}}}}} and more',
])
def test_other_outputs_stay_text(text):
    for step in (1, 4, 1000):
        p, content, calls = _stream(text, step, names=["get_price"])
        assert calls == [] and content == text and p.message_content() == text


def test_bare_output_holding_a_tagged_call():
    text = '{"x": 1}\n<tool_call>\n{"name": "get_price", "arguments": {"fruit": "pear"}}\n</tool_call>'
    p, content, calls = _stream(text, 3, names=["get_price"])
    assert [c.name for c in calls] == ["get_price"] and content == '{"x": 1}'


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
           '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    p = ToolCallParser(frozenset("ab"), max_calls=1)
    text, calls = p.feed(two)
    assert [c.name for c in calls] == ["a"] and text == "" and p.finish() == ("", [])
    assert [c.name for c in p.calls] == ["a"]
    p = ToolCallParser(frozenset("ab"))
    assert [c.name for c in p.feed(two)[1]] == ["a", "b"]
