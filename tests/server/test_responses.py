"""The Responses API (`ultrafast/server/responses.py`, stored responses in `conversations.py`): items to chat
messages, the output as items and stream events, and the endpoint driven by the official `openai` client's
`client.responses` (text, streamed, continued with previous_response_id, structured, tools, 400s)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from ultrafast.server import conversations
from ultrafast.server.db import Database
from ultrafast.server.errors import InvalidRequest
from ultrafast.server.protocol import ResponsesRequest
from ultrafast.server.responses import (ResponseOutput, input_items, responses_param, responses_params,
                                        to_chat_request, to_messages)
from ultrafast.server.structured import OutputPlan

SMOL = "smollm2-135m"
QWEN = "qwen2.5-coder-0.5b"
PRICE = {"type": "function", "name": "get_price", "description": "The price of a fruit in dollars",
         "parameters": {"type": "object", "additionalProperties": False, "required": ["fruit"],
                        "properties": {"fruit": {"type": "string", "maxLength": 20}}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 30}}}}


# ------------------------------------------------------------------------------------ translation


def test_items_become_chat_messages():
    items = [{"type": "message", "role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Price of "},
                                                              {"type": "input_text", "text": "a pear?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_price", "arguments": '{"fruit": "pear"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_price", "arguments": '{"fruit": "fig"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "2"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "?"}]},
             {"type": "function_call", "call_id": "c3", "name": "get_price", "arguments": "{}"}]
    msgs = to_messages("Answer in dollars.", items)
    assert msgs[0] == {"role": "system", "content": "Answer in dollars."}
    assert msgs[1] == {"role": "system", "content": "Be brief."}  # developer -> system, as in chat completions
    assert msgs[2] == {"role": "user", "content": "Price of a pear?"}
    assert msgs[3]["role"] == "assistant" and msgs[3]["content"] == "Let me look."  # calls join the turn
    assert [c["id"] for c in msgs[3]["tool_calls"]] == ["c1", "c2"]
    assert msgs[4] == {"role": "tool", "tool_call_id": "c1", "content": "2"}
    assert msgs[5] == {"role": "tool", "tool_call_id": "c2", "content": "?"}
    assert msgs[6] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c3", "type": "function", "function": {"name": "get_price", "arguments": "{}"}}]}
    assert to_messages(None, [])[:1] == []


def test_request_becomes_a_chat_request():
    body = ResponsesRequest.model_validate({
        "model": "m", "input": "hi", "tools": [PRICE], "tool_choice": {"type": "function", "name": "get_price"},
        "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}},
        "max_output_tokens": 9, "temperature": 0, "seed": 3, "top_k": 5, "cache_salt": "run-1", "unknown_field": 1})
    chat = to_chat_request(body, to_messages(body.instructions, input_items(body)))
    assert chat.messages[0].content == "hi" and chat.max_completion_tokens == 9 and chat.temperature == 0
    assert chat.tools[0].function.name == "get_price" and chat.tools[0].function.parameters == PRICE["parameters"]
    assert chat.tool_choice.function.name == "get_price"
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {"type": "object"}
    assert chat.seed == 3 and chat.top_k == 5 and chat.cache_salt == "run-1"  # extensions pass through; unknown
    # fields do not
    assert "unknown_field" not in (chat.model_extra or {})
    with pytest.raises(InvalidRequest) as e:
        to_chat_request(ResponsesRequest.model_validate({"model": "m", "input": "x", "top_k": -1}), [])
    assert e.value.param == "top_k"


@pytest.mark.parametrize("chat, responses", [
    ("messages", "input"), ("response_format", "text.format"), ("response_format.json_schema", "text.format.schema"),
    ("max_completion_tokens", "max_output_tokens"), ("tools.1.function", "tools.1"), ("tool_choice", "tool_choice"),
    (None, None)])
def test_errors_name_the_responses_parameters(chat, responses):
    assert responses_param(chat) == responses
    if chat:
        with pytest.raises(InvalidRequest) as e, responses_params():
            raise InvalidRequest(f"bad {chat}", param=chat)
        assert e.value.param == responses and e.value.message == f"bad {responses}"


# ------------------------------------------------------------------------------------ output items and events


def _output(tools=None, store=False):
    body = ResponsesRequest.model_validate({"model": "m", "input": "x", "store": store,
                                            **({"tools": tools} if tools else {})})
    req = SimpleNamespace(id="resp_1", created=1, model="m", tier="standard")
    plan = OutputPlan(tools=[{"type": "function", "function": {"name": t["name"]}} for t in tools or []] or None,
                      parse_tools=bool(tools))
    return ResponseOutput(None, None, req, body, plan, [], None)


def _feed(out, pieces, finish="stop"):
    events = []
    for p in pieces:
        events += out.absorb(("delta", 0, p, None))
    return events + out.absorb(("choice_done", 0, finish, None))


def test_text_and_calls_become_items_and_events():
    out = _output(tools=[PRICE])
    events = _feed(out, ["  Let me ", "check.\n<tool_", 'call>\n{"name": "get_price", "arguments": {"fruit": "fig"}}',
                         "\n</tool_call>\n", "<tool_call>{not json}</tool_call>"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    msg, call, tail = out.items
    assert msg["type"] == "message" and msg["status"] == "completed"
    # the text streams before the call is known: the message holds what was streamed
    assert msg["content"][0]["text"] == "  Let me check.\n"
    assert deltas == msg["content"][0]["text"] + tail["content"][0]["text"]
    assert call == {"id": call["id"], "type": "function_call", "status": "completed", "call_id": call["call_id"],
                    "name": "get_price", "arguments": '{"fruit": "fig"}'}
    args = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert [a["delta"] for a in args] == ['{"fruit": "fig"}'] and args[0]["item_id"] == call["id"]
    assert tail["type"] == "message" and tail["content"][0]["text"] == "<tool_call>{not json}</tool_call>"
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [d["item"]["id"] for d in done] == [msg["id"], call["id"], tail["id"]]
    final = out.full_response({"prompt_tokens": 5, "cached_tokens": 0, "completion_tokens": 7, "time_info": {}})
    assert final["status"] == "completed" and final["output"] == out.items
    assert final["usage"]["total_tokens"] == 12


def test_whitespace_and_length():
    out = _output()
    _feed(out, ["\n", " "])  # nothing but whitespace: one message holding it
    assert [i["content"][0]["text"] for i in out.items] == ["\n "]
    out = _output()
    _feed(out, ["\n", "Hi", " there"], finish="length")
    assert out.items[0]["content"][0]["text"] == "\nHi there" and out.items[0]["status"] == "incomplete"
    r = out.full_response({"prompt_tokens": 1, "cached_tokens": 0, "completion_tokens": 3, "time_info": {}})
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}


# ------------------------------------------------------------------------------------ the stored conversation


def test_stored_responses_belong_to_their_key(tmp_path):
    db = Database(tmp_path / "r.db").init()
    obj = {"id": "resp_a", "model": "m", "created_at": 1.0, "output": [{"type": "message", "content": []}]}
    conversations.save(db, obj, [{"type": "message", "role": "user", "content": "hi"}], "key1")
    assert conversations.load(db, "resp_a", "key1") == obj
    assert conversations.load(db, "resp_a", "key2") is None and conversations.load(db, "resp_a", None) is None
    assert conversations.conversation(db, "resp_a", "key1") == [
        {"type": "message", "role": "user", "content": "hi"}, {"type": "message", "content": []}]
    seen = []  # another thread (its own connection) sees the committed row
    t = threading.Thread(target=lambda: seen.append(conversations.load(db, "resp_a", "key1")))
    t.start(), t.join()
    assert seen == [obj]
    assert not conversations.delete(db, "resp_a", "key2")
    assert conversations.delete(db, "resp_a", "key1") and conversations.load(db, "resp_a", "key1") is None
    conversations.save(db, {**obj, "id": "resp_b"}, [], None)  # the local user (no key)
    assert conversations.load(db, "resp_b", None)["id"] == "resp_b"


# ------------------------------------------------------------------------------------ the endpoint


@pytest.fixture(scope="module")
def smol(server_factory):
    srv = server_factory(None, "--max-context", "1024")
    return openai.OpenAI(base_url=srv.base_url, api_key="local", max_retries=0, timeout=300)


def test_text_both_tiers_stream_and_continue(smol):
    kw = dict(model=SMOL, input="Name three colours.", instructions="Answer briefly.", temperature=0,
              max_output_tokens=24)
    std = smol.responses.create(**kw)
    fast = smol.responses.create(service_tier="ultrafast", **kw)
    assert std.status in ("completed", "incomplete") and std.output_text
    assert fast.output_text == std.output_text and fast.service_tier == "ultrafast"
    assert std.usage.output_tokens == fast.usage.output_tokens >= 1

    events = list(smol.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [events[0].type, events[1].type] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == std.output_text == events[-1].response.output_text

    # the stored conversation continues: the earlier question and answer are in the prompt
    more = smol.responses.create(model=SMOL, input="And two more.", previous_response_id=std.id, temperature=0,
                                 max_output_tokens=8)
    assert more.previous_response_id == std.id
    assert more.usage.input_tokens > std.usage.input_tokens + std.usage.output_tokens
    assert more.usage.input_tokens_details.cached_tokens > 0  # the prefix cache holds the earlier turn
    assert smol.responses.retrieve(std.id).output_text == std.output_text
    smol.responses.delete(std.id)
    with pytest.raises(openai.NotFoundError):
        smol.responses.retrieve(std.id)
    with pytest.raises(openai.BadRequestError) as e:
        smol.responses.create(model=SMOL, input="hi", previous_response_id=std.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = smol.responses.create(model=SMOL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        smol.responses.retrieve(unstored.id)


def test_incomplete_at_max_output_tokens(smol):
    r = smol.responses.create(model=SMOL, input="Write a long story.", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


class Colour(BaseModel):
    name: str = Field(max_length=12)
    hex: str = Field(pattern=r"^#[0-9a-f]{6}$")
    warm: bool
    kind: Literal["primary", "secondary", "other"]


def test_structured_output_parses_in_both_tiers(smol):
    outs = []
    for tier in ("standard", "ultrafast"):
        r = smol.responses.parse(model=SMOL, input="Describe the colour red.", text_format=Colour, temperature=0,
                                 max_output_tokens=96, service_tier=tier)
        assert isinstance(r.output_parsed, Colour)
        outs.append(r.output_text)
    assert outs[0] == outs[1]
    r = smol.responses.create(model=SMOL, input="A JSON object about cats.", text={"format": {"type": "json_object"}},
                              temperature=0, max_output_tokens=64)
    assert r.status == "incomplete" or isinstance(json.loads(r.output_text), dict)


@pytest.mark.parametrize("extra, param", [
    ({"input": []}, "input"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [PRICE]}, "tools"),  # SmolLM2's template has no tools
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
])
def test_refused_with_openai_error_shape(smol, extra, param):
    kw = {"model": SMOL, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as e:
        smol.responses.create(**kw)
    assert e.value.body["type"] == "invalid_request_error"
    assert (e.value.body["param"] or "").startswith(param), e.value.body


def test_a_tool_call_streamed_then_answered(qwen05_server):
    client = openai.OpenAI(base_url=qwen05_server.base_url, api_key="local", max_retries=0, timeout=600)
    kw = dict(model=QWEN, tools=[WEATHER, PRICE], tool_choice="required", temperature=0, max_output_tokens=96)
    whole = client.responses.create(input="How much is an apple?", **kw)
    (call,) = [o for o in whole.output if o.type == "function_call"]
    events = list(client.responses.create(input="How much is an apple?", stream=True, **kw))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response
    (streamed,) = [o for o in final.output if o.type == "function_call"]
    assert len(added) == 1 and added[0].name == streamed.name == call.name
    assert args == streamed.arguments == call.arguments  # the same call as the whole response's
    schema = {"get_weather": WEATHER, "get_price": PRICE}[call.name]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)

    # the tool's result continues the stored conversation; the model answers in text
    answer = client.responses.create(model=QWEN, previous_response_id=final.id, tools=[WEATHER, PRICE],
                                     temperature=0, max_output_tokens=48, input=[
                                         {"type": "function_call_output", "call_id": streamed.call_id,
                                          "output": json.dumps({"price_usd": 3})}])
    assert answer.status in ("completed", "incomplete") and answer.output_text
