"""What a request asks of its output's shape: a grammar (response_format, vLLM's structured_outputs / guided_*
extras, a forced tool call) and the tools the model may call (rendered by the chat template, parsed out of the
output). Each problem is a 400 naming the parameter at fault."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..grammar import Grammar, GrammarError
from ..tool_calls import ToolCallParser, ToolFormatError, call_schema, check_template
from .errors import InvalidRequest


@dataclass
class OutputPlan:
    grammar: Grammar | None = None
    grammar_param: str | None = None  # the request field the grammar came from (for a compile error's 400)
    tools: list[dict] | None = None  # for the chat template
    parse_tools: bool = False  # read tool calls out of the output
    max_calls: int | None = None  # parallel_tool_calls false: 1 (the calls after the first are dropped)

    def call_parser(self) -> ToolCallParser:
        """A parser of one output's tool calls (to the tools offered)."""
        return ToolCallParser(frozenset(t["function"]["name"] for t in self.tools or []), self.max_calls)


def _extras(body) -> list[tuple[str, Grammar]]:
    """vLLM's structured_outputs (json, regex, grammar, choice) and its guided_* spellings."""
    found = []
    so = body.structured_outputs
    pairs = [("structured_outputs.json", so.json_ if so else None), ("guided_json", body.guided_json),
             ("structured_outputs.regex", so.regex if so else None), ("guided_regex", body.guided_regex),
             ("structured_outputs.grammar", so.grammar if so else None), ("guided_grammar", body.guided_grammar),
             ("structured_outputs.choice", so.choice if so else None), ("guided_choice", body.guided_choice)]
    for param, value in pairs:
        if value is None:
            continue
        try:
            if param.endswith("json"):
                if isinstance(value, str):
                    try:
                        value = json.loads(value)
                    except ValueError as e:
                        raise InvalidRequest(f"{param}: not a JSON schema: {e}", param=param) from None
                g = Grammar.json_schema(value)
            elif param.endswith("regex"):
                g = Grammar("regex", value)
            elif param.endswith("grammar"):
                g = Grammar("ebnf", value)
            else:
                g = Grammar("ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
        except GrammarError as e:
            raise InvalidRequest(f"{param}: {e}", param=param) from None
        found.append((param, g))
    return found


def _response_format(body) -> tuple[str, Grammar] | None:
    rf = getattr(body, "response_format", None)
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return "response_format", Grammar("json_object")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise InvalidRequest("response_format of type json_schema needs json_schema.schema",
                             param="response_format.json_schema")
    try:
        return "response_format", Grammar.json_schema(rf.json_schema.schema_)
    except GrammarError as e:
        raise InvalidRequest(f"response_format: {e}", param="response_format") from None


def _at_most_one(found: list[tuple[str, Grammar]], plan: OutputPlan) -> OutputPlan:
    """The plan with the one grammar the request asked for, if any (two or more: a 400 naming the second)."""
    if len(found) > 1:
        raise InvalidRequest(f"one output constraint at a time, got {', '.join(p for p, _ in found)}",
                             param=found[1][0])
    if found:
        plan.grammar_param, plan.grammar = found[0]
    return plan


def plan_completion(body) -> OutputPlan:
    return _at_most_one(_extras(body), OutputPlan())


def plan_chat(body, template: str | None, model: str) -> OutputPlan:
    found = _extras(body)
    rf = _response_format(body)
    if rf:
        found.insert(0, rf)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if tools is None:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        plan = OutputPlan()
    else:
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise InvalidRequest("tools: function names must be unique", param="tools")
        if choice == "none":
            plan = OutputPlan()  # as OpenAI: the model will not call a tool (nor see the list)
        else:
            try:
                check_template(template, model)
            except ToolFormatError as e:
                raise InvalidRequest(str(e), param="tools") from None
            single = body.parallel_tool_calls is False
            plan = OutputPlan(tools=tools, parse_tools=True, max_calls=1 if single else None)
            forced = None
            if choice == "required":
                forced = tools
            elif choice not in (None, "auto"):
                forced = [t for t in tools if t["function"]["name"] == choice.function.name]
                if not forced:
                    raise InvalidRequest(f"tool_choice names the function {choice.function.name!r}, which is not "
                                         f"among the tools", param="tool_choice")
            if forced is not None:
                kind = "tool_call" if single else "tool_calls"  # one call, or one or more
                found.insert(0, ("tool_choice", Grammar(kind, json.dumps(call_schema(forced)))))
    return _at_most_one(found, plan)
