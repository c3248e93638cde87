"""Tool calls: the model's own tool-call format, read from its chat template, and parsed out of its output.

The format this server reads is the one Qwen2.5/Qwen3 and Hermes templates teach their models: each call is a
JSON object {"name": ..., "arguments": {...}} between `<tool_call>` and `</tool_call>`. A template that renders
`tools` and mentions `<tool_call>` uses it; a template without tools (SmolLM2's) or with another format is
refused with a clear error rather than guessed at.

`ToolCallParser` reads the output as it streams: text outside calls goes out as content as soon as it cannot be
the start of a call; each call goes out when its closing tag arrives. A call that is not well-formed JSON with a
name and object arguments (or never closes) comes back as the text the model wrote. An output that is one bare
call to an offered tool (no tags; in a ```json fence or the template's doubled braces: what Qwen2.5-Coder-1.5B
writes at greedy) is a call too.

`call_schema` is what a forced call must match (tool_choice `required` or a named function): a JSON object whose
name is one of the tools and whose arguments follow that tool's parameter schema; the grammar (kind "tool_call")
puts the tags around it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolFormatError(ValueError):
    pass


def check_template(template: str | None, model: str) -> None:
    """Raise ToolFormatError unless the chat template renders tools in the format this module parses."""
    if not template or "tools" not in template:
        raise ToolFormatError(f"the chat template of {model} does not support tools")
    if OPEN not in template:
        raise ToolFormatError(f"the chat template of {model} uses a tool-call format this server cannot parse "
                              f"(it reads {OPEN}{{...}}{CLOSE} calls)")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI returns it

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_call(raw: str) -> ParsedCall | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass
class ToolCallParser:
    """Feed text as it is generated; get back (content to emit now, calls completed now).

    `names`: the tools offered. Some models (Qwen2.5-Coder-1.5B at greedy, for one) answer a tool prompt with the
    bare call instead of the tagged one: the whole output a JSON object {"name", "arguments"}, maybe inside a
    ```json fence or the template's own doubled braces. An output that starts like that is held to its end and
    taken as a call when the name is one of `names`; otherwise it goes out as the text it is. `max_calls` (OpenAI's
    parallel_tool_calls false: 1) keeps the first calls only."""
    names: frozenset = frozenset()
    max_calls: int | None = None  # parallel_tool_calls false: 1; the calls past it are dropped
    buf: str = ""
    in_call: bool = False
    calls: list[ParsedCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    bare: bool | None = None  # None: undecided (nothing but whitespace yet); True: holding a possible bare call

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buf += text
        if self.bare is None:
            head = self.buf.lstrip()
            if not self.names:
                self.bare = False
            elif not head or (FENCE.startswith(head) and len(head) < len(FENCE)):
                return "", []  # whitespace, or what may become a fence: undecided
            else:
                self.bare = head.startswith(("{", FENCE))
        if self.bare:
            return "", []
        out, done = [], []
        while True:
            if not self.in_call:
                i = self.buf.find(OPEN)
                if i >= 0:
                    out.append(self.buf[:i])
                    self.buf, self.in_call = self.buf[i + len(OPEN):], True
                    continue
                keep = _partial_suffix(self.buf, OPEN)
                out.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            j = self.buf.find(CLOSE)
            if j < 0:
                break
            raw, self.buf, self.in_call = self.buf[:j], self.buf[j + len(CLOSE):], False
            call = parse_call(raw.strip())
            if call is None:
                out.append(OPEN + raw + CLOSE)  # malformed: the model's own text
            else:
                done.append(call)
        text_out = "".join(out)
        if self.calls or done:  # whitespace between or around calls is not content
            text_out = text_out.strip()
        if self.max_calls is not None:
            done = done[:max(0, self.max_calls - len(self.calls))]
        self.calls.extend(done)
        self.content.append(text_out)
        return text_out, done

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The end of the output: (the content still held: a partial tag, an unclosed call, a held output that
        was no bare call; the calls found in what was held)."""
        if self.bare:
            held, self.buf, self.bare = self.buf, "", False
            call = parse_bare(held, self.names)
            if call is not None:
                self.calls.append(call)
                return "", [call]
            text, calls = self.feed(held)  # not a bare call: the text as it would have streamed (tags and all)
            rest, more = self.finish()
            return text + rest, calls + more
        rest = (OPEN + self.buf) if self.in_call else self.buf
        self.buf, self.in_call = "", False
        if self.calls:
            rest = rest.strip()
        self.content.append(rest)
        return rest, []

    def message_content(self) -> str | None:
        text = "".join(self.content)
        if self.calls:
            text = text.strip()
            return text or None
        return text


FENCE = "```"


def parse_bare(text: str, names) -> ParsedCall | None:
    """A whole output that is one call without the tags (see ToolCallParser), to one of `names`; else None."""
    t = text.strip()
    if t.startswith(FENCE):
        t = t[len(FENCE):]
        t = t[4:] if t.startswith("json") else t
        if not t.rstrip().endswith(FENCE):
            return None
        t = t.rstrip()[:-len(FENCE)].strip()
    if t.startswith("{{"):  # the template's example call, braces doubled
        try:
            _, end = json.JSONDecoder().raw_decode(t[1:])
        except ValueError:
            return None
        if t[1 + end:].strip().strip("}"):
            return None
        t = t[1:1 + end]
    call = parse_call(t)
    return call if call is not None and call.name in names else None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it may still become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def call_schema(tools: list[dict]) -> dict:
    """The JSON schema of one call to any of `tools` (OpenAI function tools)."""
    options = []
    for t in tools:
        f = t["function"]
        params = f.get("parameters") or {"type": "object", "properties": {}}
        options.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                        "properties": {"name": {"const": f["name"]}, "arguments": params}})
    return options[0] if len(options) == 1 else {"anyOf": options}


def to_template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages -> what chat templates expect: an assistant's tool calls with their arguments as objects
    (OpenAI sends JSON text), tool results as `tool` messages with their content."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                f = dict(c.get("function") or {})
                args = f.get("arguments")
                if isinstance(args, str):
                    try:
                        f["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass  # left as the text it is
                fixed.append({**c, "function": f, **f})  # templates read call.function.name or call.name
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
