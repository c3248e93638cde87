"""The Responses API (POST /v1/responses) on top of chat completions.

A request becomes a chat request: the stored conversation (`previous_response_id`), then its `input` items,
become chat messages behind its `instructions` (a system message); its function tools, `tool_choice` and
`text.format` become the chat request's tools, tool choice and response format, so that templates, tool-call
parsing and constrained decoding are the ones chat completions use. Problems are 400s naming the Responses
parameter (`input`, `text.format`, `max_output_tokens`), not the chat one.

The output comes back as Responses items: a `message` with one `output_text` part for the text outside tool
calls, then one `function_call` item per call; streamed as Responses events (`response.created`,
`response.output_item.added`, `response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed`), each with its `sequence_number`. A stored response (`store`, default true) is written to
the database before the client sees it complete.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from contextlib import contextmanager

from pydantic import ValidationError

from . import conversations
from .errors import APIError, InvalidRequest
from .protocol import ChatCompletionRequest, ResponsesRequest

log = logging.getLogger("ultrafast.server")

# sampling extensions (and vLLM's cache_salt) a Responses request may carry (extra_body), passed to the chat request
# as they are
_SAMPLING_EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                    "logit_bias", "ignore_eos", "stop", "structured_outputs", "guided_json", "guided_regex",
                    "guided_grammar", "guided_choice", "cache_salt")
# chat parameters -> the Responses parameters they came from (for a 400's `param`)
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(body: ResponsesRequest) -> list[dict]:
    """The request's input as item dicts (text input: one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": body.input}]}]
    return [item.model_dump(exclude_none=True) for item in body.input]


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def to_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """Conversation items -> chat messages: a function_call joins the assistant turn before it (or opens one),
    a function_call_output is a `tool` message."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
    return messages


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def to_chat_request(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    chat = {"model": body.model, "messages": messages, "stream": bool(body.stream), "temperature": body.temperature,
            "top_p": body.top_p, "max_completion_tokens": body.max_output_tokens,
            "service_tier": body.service_tier, "user": body.user, "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": _response_format(body)}
    if body.tools is not None:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in body.tools]
    choice = body.tool_choice
    chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}} \
        if choice is not None and not isinstance(choice, str) else choice
    chat.update({k: v for k, v in (body.model_extra or {}).items() if k in _SAMPLING_EXTRAS})
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        param = responses_param(".".join(str(x) for x in err["loc"]))
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}", param=param) from None


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    if param.startswith("response_format.json_schema"):  # the Responses format holds the schema itself
        return "text.format" + param[len("response_format.json_schema"):].replace(".schema", "", 1) \
            if param != "response_format.json_schema" else "text.format.schema"
    head, dot, rest = param.partition(".")
    if head in _PARAMS:
        return _PARAMS[head] if head == "messages" else _PARAMS[head] + dot + rest
    if head == "tools" and rest.endswith(".function"):  # a chat tool's function is the Responses tool itself
        return "tools." + rest[:-len(".function")]
    return param


# the chat request's words in an error message -> the Responses request's
_WORDS = [("response_format of type json_schema needs json_schema.schema", "text.format of type json_schema needs "
           "a schema"), ("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
          ("the messages", "the input"), ("your messages", "your input")]


@contextmanager
def responses_params():
    """Errors raised inside name the Responses parameters."""
    try:
        yield
    except APIError as e:
        if e.param is not None:
            new = responses_param(e.param)
            message = e.message.replace(e.param, new)
            for chat, responses in _WORDS:
                message = message.replace(chat, responses)
            e.message, e.param = message, new
            e.args = (message,)
        raise


def _sse(event: dict) -> bytes:
    return (f"event: {event['type']}\ndata: ".encode()
            + json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n")


class ResponseOutput:
    """Builds a response and its stream events from the worker's messages, item by item: the text outside tool
    calls in a `message` item (whitespace before it held until text comes, and dropped around calls), then a
    `function_call` item per call. Whole and streamed responses are built the same way (the same item and call
    ids)."""

    def __init__(self, srv, worker, req, body: ResponsesRequest, plan, context: list[dict], key_id: str | None):
        self.srv, self.worker, self.req, self.body = srv, worker, req, body
        self.context, self.key_id = context, key_id
        self.parser = plan.call_parser() if plan.parse_tools else None
        self.items: list[dict] = []
        self.open_message: dict | None = None
        self.held = ""  # whitespace before the first text
        self.seq = 0
        self.finish: str | None = None
        self.closed = False

    # ---- the response object

    def response(self, status: str, summary: dict | None = None) -> dict:
        b = self.body
        tools = [t.model_dump(exclude_none=True) for t in b.tools] if b.tools else []
        choice = b.tool_choice if isinstance(b.tool_choice, str) or b.tool_choice is None \
            else b.tool_choice.model_dump()
        obj = {"id": self.req.id, "object": "response", "created_at": self.req.created, "status": status,
               "completed_at": None, "error": None, "incomplete_details": None, "model": self.req.model,
               "output": copy.deepcopy(self.items), "instructions": b.instructions,
               "previous_response_id": b.previous_response_id, "tools": tools, "tool_choice": choice or "auto",
               "parallel_tool_calls": b.parallel_tool_calls is not False,
               "text": {"format": b.text.format.model_dump(by_alias=True, exclude_none=True)
                        if b.text and b.text.format else {"type": "text"}},
               "temperature": b.temperature, "top_p": b.top_p, "max_output_tokens": b.max_output_tokens,
               "store": b.store is not False, "metadata": b.metadata or {}, "user": b.user,
               "truncation": "disabled", "reasoning": {"effort": None, "summary": None},
               "service_tier": self.req.tier, "usage": None}
        if summary is not None:
            obj["completed_at"] = time.time()
            obj["usage"] = {"input_tokens": summary["prompt_tokens"],
                            "input_tokens_details": {"cached_tokens": summary["cached_tokens"]},
                            "output_tokens": summary["completion_tokens"],
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": summary["prompt_tokens"] + summary["completion_tokens"]}
            obj["time_info"] = summary["time_info"]
            if status == "incomplete":
                obj["incomplete_details"] = {"reason": "max_output_tokens"}
        return obj

    def _event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    # ---- items, as the output arrives (each returns the stream events it makes)

    def _text(self, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if self.open_message is None:
            if not text.strip():
                self.held += text
                return []
            text, self.held = ("" if self.items else self.held) + text, ""
            events += self._open_message()
        part = self.open_message["content"][0]
        part["text"] += text
        events.append(self._event("response.output_text.delta", item_id=self.open_message["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=text, logprobs=[]))
        return events

    def _open_message(self) -> list[dict]:
        item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        self.items.append(item)
        self.open_message = item
        index = len(self.items) - 1
        part = {"type": "output_text", "text": "", "annotations": []}
        events = [self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item)),
                  self._event("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part=dict(part, annotations=[]))]
        item["content"].append(part)
        return events

    def _close_message(self) -> list[dict]:
        item = self.open_message
        if item is None:
            return []
        self.open_message = None
        item["status"] = "incomplete" if self.finish == "length" else "completed"
        index, part = self.items.index(item), item["content"][0]
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=copy.deepcopy(part)),
                self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _calls(self, calls) -> list[dict]:
        events = self._close_message() if calls else []
        for call in calls:
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                    "name": call.name, "arguments": ""}
            self.items.append(item)
            index = len(self.items) - 1
            events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
            item["arguments"] = call.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=call.arguments))
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=call.name, arguments=call.arguments))
            item["status"] = "completed"
            events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def absorb(self, msg) -> list[dict]:
        """One worker message -> the stream events it makes."""
        kind = msg[0]
        if kind == "delta":
            text = msg[2]
            if self.parser is None:
                return self._text(text)
            text, calls = self.parser.feed(text)
            return self._text(text) + self._calls(calls)
        if kind == "choice_done":
            self.finish = msg[2]
            events = []
            if self.parser is not None:
                rest, calls = self.parser.finish()
                events += self._text(rest) + self._calls(calls)
            if not self.items:  # no text and no call: an empty message (the whitespace, if any)
                text, self.held = self.held, ""
                events += self._open_message()
                self.open_message["content"][0]["text"] = text
            return events + self._close_message()
        return []

    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    # ---- whole and streamed

    def full_response(self, summary: dict) -> dict:
        return self.response(self.status(), summary)

    async def completed(self, obj: dict) -> None:
        """Store the response (before the client sees it complete)."""
        if self.body.store is not False:
            await asyncio.to_thread(conversations.save, self.srv.db, obj, self.context, self.key_id)

    async def stream(self, q: asyncio.Queue, include_usage: bool):
        done = False
        try:
            yield _sse(self._event("response.created", response=self.response("in_progress")))
            yield _sse(self._event("response.in_progress", response=self.response("in_progress")))
            while True:
                msg = await q.get()
                for event in self.absorb(msg):
                    yield _sse(event)
                if msg[0] != "done":
                    continue
                summary, fut = msg[1], msg[2]
                try:
                    await asyncio.wrap_future(fut)
                except Exception:
                    log.exception("ledger row for %s not written", self.req.id)
                done = True
                if summary["status"] != "finished":
                    obj = self.response("failed")
                    failed = summary["status"] == "failed"
                    obj["error"] = {"code": "server_error",
                                    "message": (summary["message"] or "generation failed") if failed
                                    else f"the request was cancelled: {summary['message']}"}
                    yield _sse(self._event("response.failed", response=obj))
                    return
                obj = self.full_response(summary)
                try:
                    await self.completed(obj)
                except Exception:
                    log.exception("response %s not stored", self.req.id)
                    obj["status"], obj["error"] = "failed", {"code": "server_error",
                                                             "message": "the response could not be stored"}
                    yield _sse(self._event("response.failed", response=obj))
                    return
                kind = "response.completed" if obj["status"] == "completed" else "response.incomplete"
                yield _sse(self._event(kind, response=obj))
                return
        finally:
            if not done:
                self.worker.cancel(self.req)
