"""Structured output and tool calls through the API, driven by the official `openai` client: JSON schemas
(`chat.completions.parse` with a pydantic model), json_object, vLLM's structured_outputs extras, forced tool
calls (whole and streamed), tool results fed back, and the 400s for what cannot be honoured. Real agent clients:
tests/server/test_agents.py."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    color: Literal["red", "green", "blue"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
PRICE = {"type": "function", "function": {
    "name": "get_price", "description": "The price of a fruit in dollars",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["fruit"],
                   "properties": {"fruit": {"type": "string", "maxLength": 20}}}}}


@pytest.fixture(scope="module")
def smol(server_factory):
    srv = server_factory()
    return openai.OpenAI(base_url=srv.base_url, api_key="local", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def qwen(qwen05_server):
    return openai.OpenAI(base_url=qwen05_server.base_url, api_key="local", max_retries=0, timeout=600)


def _ask(text):
    return [{"role": "user", "content": text}]


def test_parse_with_pydantic_model_both_tiers(smol):
    outs = []
    for tier in ("standard", "ultrafast"):
        r = smol.chat.completions.parse(model="smollm2-135m", messages=_ask("Describe a person."),
                                        response_format=Person, temperature=0, max_tokens=96,
                                        extra_body={"service_tier": tier})
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Person)
        outs.append(r.choices[0].message.content)
    assert outs[0] == outs[1]


def test_json_object_and_extras(smol):
    r = smol.chat.completions.create(model="smollm2-135m", messages=_ask("Give me a JSON object about a dog."),
                                     response_format={"type": "json_object"}, temperature=0, max_tokens=64)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = smol.chat.completions.create(model="smollm2-135m", messages=_ask("Is water wet?"), temperature=0,
                                     max_tokens=16, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = smol.completions.create(model="smollm2-135m", prompt="The year is", max_tokens=8, temperature=0,
                                extra_body={"guided_regex": r" [12][0-9]{3}\."})
    assert len(r.choices[0].text) == 6 and r.choices[0].text.endswith(".")


def test_streamed_json_schema_equals_whole(smol):
    schema = Person.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    whole = smol.chat.completions.create(model="smollm2-135m", messages=_ask("A person, please."), temperature=0,
                                         max_tokens=96, response_format=fmt)
    stream = smol.chat.completions.create(model="smollm2-135m", messages=_ask("A person, please."), temperature=0,
                                          max_tokens=96, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": "root ::= missing"}}, "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex"),
    ({"tools": [WEATHER]}, "tools"),  # SmolLM2's template has no tools
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
])
def test_refused_with_openai_error_shape(smol, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        smol.chat.completions.create(model="smollm2-135m", messages=_ask("hi"), max_tokens=4, **extra)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error"
    assert e.value.body["param"] == param, e.value.body


def test_tools_not_a_list_is_a_400(smol):
    with pytest.raises(openai.BadRequestError):
        smol.chat.completions.create(model="smollm2-135m", messages=_ask("hi"), max_tokens=4,
                                     tools={"type": "function"})


def test_required_tool_call_whole_streamed_and_answered(qwen):
    model = "qwen2.5-coder-0.5b"
    msgs = _ask("What is the weather in Paris, in celsius?")
    kw = dict(model=model, tools=[WEATHER, PRICE], tool_choice="required", temperature=0, max_tokens=96)
    tiers = {}
    for tier in ("standard", "ultrafast"):
        r = qwen.chat.completions.create(messages=msgs, extra_body={"service_tier": tier}, **kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls"
        assert len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0]
        schema = {"get_weather": WEATHER, "get_price": PRICE}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
        tiers[tier] = (call.function.name, call.function.arguments)
    assert tiers["standard"] == tiers["ultrafast"]

    stream = qwen.chat.completions.create(messages=msgs, stream=True, **kw)
    name, args, ids, finish = None, "", set(), None
    for c in stream:
        if not c.choices:
            continue
        for d in c.choices[0].delta.tool_calls or []:
            assert d.index == 0
            if d.id:
                ids.add(d.id)
            if d.function and d.function.name:
                name = d.function.name
            if d.function and d.function.arguments:
                args += d.function.arguments
        finish = c.choices[0].finish_reason or finish
    assert (name, args) == tiers["standard"] and len(ids) == 1 and finish == "tool_calls"

    # the call and its result go back through the template; the model answers in text
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}
    r = qwen.chat.completions.create(model=model, tools=[WEATHER, PRICE], temperature=0, max_tokens=48,
                                     messages=msgs + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                                      {"role": "tool", "tool_call_id": "call_1",
                                                       "content": json.dumps({"temperature": 21, "sky": "clear"})}])
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content


def test_named_tool_choice_and_unknown_name(qwen):
    model = "qwen2.5-coder-0.5b"
    r = qwen.chat.completions.create(model=model, messages=_ask("How much is an apple?"), tools=[WEATHER, PRICE],
                                     tool_choice={"type": "function", "function": {"name": "get_price"}},
                                     temperature=0, max_tokens=64)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_price"
    jsonschema.validate(json.loads(call.function.arguments), PRICE["function"]["parameters"])
    with pytest.raises(openai.BadRequestError) as e:
        qwen.chat.completions.create(model=model, messages=_ask("hi"), tools=[WEATHER], max_tokens=4,
                                     tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


def test_parallel_tool_calls(qwen):
    """tool_choice required with parallel calls allowed (the default) forces one call or more, so two cities get
    two calls; parallel_tool_calls false forces exactly one."""
    kw = dict(model="qwen2.5-coder-0.5b", messages=_ask("What is the weather in Paris and in London?"),
              tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=120)
    seen = {}
    for parallel in (None, False):
        for tier in ("standard", "ultrafast"):
            extra = {} if parallel is None else {"parallel_tool_calls": parallel}
            ch = qwen.chat.completions.create(extra_body={"service_tier": tier}, **kw, **extra).choices[0]
            assert ch.finish_reason == "tool_calls"
            seen[parallel, tier] = [(c.function.name, json.loads(c.function.arguments)["city"])
                                    for c in ch.message.tool_calls]
    assert seen[None, "standard"] == seen[None, "ultrafast"] and len(seen[None, "standard"]) == 2
    assert seen[False, "standard"] == seen[False, "ultrafast"] == seen[None, "standard"][:1]
