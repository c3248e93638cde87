"""Real agent clients from PyPI, unchanged, against `ultrafast serve --model qwen2.5-coder-1.5b` on loopback, in
both tiers: the OpenAI Agents SDK (`openai-agents`) over chat completions and over the Responses API (streamed),
and smolagents' ToolCallingAgent through its `OpenAIServerModel`. Each runs an agent with two function tools
(a price lookup and a multiplication) to completion on "What is the price of an apple?": the model's call
must reach the tool and the tool's answer must come back in the final answer. And the official client's
`chat.completions.parse` with a pydantic model and `responses.create` with a tool, streamed."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "qwen2.5-coder-1.5b"
QUESTION = "What is the price of an apple?"
PRICES = {"apple": 3, "pear": 2}

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("tier", ["standard", "ultrafast"])]


def _price(fruit: str) -> int:
    return PRICES.get(fruit.lower().rstrip("s"), 0)


def _openai_agent(agents, base_url: str, tier: str, responses: bool, calls: list):
    from openai import AsyncOpenAI

    @agents.function_tool
    def get_price(fruit: str) -> int:
        """The price of one fruit in dollars."""
        calls.append(("get_price", fruit))
        return _price(fruit)

    @agents.function_tool
    def multiply(a: int, b: int) -> int:
        """a times b."""
        calls.append(("multiply", a, b))
        return a * b

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="local", max_retries=0)
    model = (agents.OpenAIResponsesModel if responses else agents.OpenAIChatCompletionsModel)(
        model=MODEL, openai_client=client)
    return agents.Agent(name="shop", instructions="Use the tools to answer. Answer with the total price only.",
                        tools=[get_price, multiply], model=model,
                        model_settings=agents.ModelSettings(temperature=0, extra_body={"service_tier": tier}))


def test_openai_agents_sdk_over_chat_completions(qwen15_server, tier):
    agents = pytest.importorskip("agents")
    calls = []
    agent = _openai_agent(agents, qwen15_server.base_url, tier, responses=False, calls=calls)
    result = asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=6))
    assert ("get_price", "apple") in calls  # the model's call reached the tool
    assert "3" in str(result.final_output)  # and the tool's answer came back to it


def test_openai_agents_sdk_over_the_responses_api_streamed(qwen15_server, tier):
    agents = pytest.importorskip("agents")
    calls = []
    agent = _openai_agent(agents, qwen15_server.base_url, tier, responses=True, calls=calls)

    async def run():
        result = agents.Runner.run_streamed(agent, QUESTION, max_turns=6)
        kinds = [event.type async for event in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert "raw_response_event" in kinds  # streamed from the server's Responses events
    assert ("get_price", "apple") in calls
    assert "3" in str(result.final_output)


def test_smolagents_tool_calling_agent(qwen15_server, tier):
    smolagents = pytest.importorskip("smolagents")
    tool = smolagents.tool
    calls = []

    @tool
    def get_price(fruit: str) -> int:
        """The price of one fruit in dollars.

        Args:
            fruit: the fruit's name, e.g. pear
        """
        calls.append(("get_price", fruit))
        return _price(fruit)

    @tool
    def multiply(a: int, b: int) -> int:
        """a times b.

        Args:
            a: a number
            b: another number
        """
        calls.append(("multiply", a, b))
        return a * b

    model = smolagents.OpenAIServerModel(model_id=MODEL, api_base=qwen15_server.base_url, api_key="local",
                                         temperature=0, extra_body={"service_tier": tier})
    agent = smolagents.ToolCallingAgent(tools=[get_price, multiply], model=model, max_steps=6, verbosity_level=0)
    answer = agent.run(QUESTION)
    assert ("get_price", "apple") in calls
    assert "3" in str(answer)


class Fruit(BaseModel):
    name: str = Field(max_length=20)
    price_usd: float = Field(ge=0, le=100)
    colour: Literal["red", "green", "yellow", "orange"]


def test_chat_completions_parse_with_a_pydantic_model(qwen15_server, tier):
    client = openai.OpenAI(base_url=qwen15_server.base_url, api_key="local", max_retries=0, timeout=600)
    r = client.chat.completions.parse(model=MODEL, response_format=Fruit, temperature=0, max_tokens=96,
                                      messages=[{"role": "user", "content": "Describe an apple that costs $3."}],
                                      extra_body={"service_tier": tier})
    fruit = r.choices[0].message.parsed
    assert isinstance(fruit, Fruit) and r.service_tier == tier


def test_responses_create_with_a_tool_streamed(qwen15_server, tier):
    client = openai.OpenAI(base_url=qwen15_server.base_url, api_key="local", max_retries=0, timeout=600)
    tool = {"type": "function", "name": "get_price", "description": "The price of one fruit in dollars.",
            "parameters": {"type": "object", "properties": {"fruit": {"type": "string"}}, "required": ["fruit"]}}
    events = list(client.responses.create(model=MODEL, input=QUESTION, tools=[tool], temperature=0, stream=True,
                                          extra_body={"service_tier": tier}))
    done = events[-1]
    assert done.type == "response.completed" and done.response.service_tier == tier
    (call,) = [o for o in done.response.output if o.type == "function_call"]
    assert call.name == "get_price" and json.loads(call.arguments)["fruit"].lower() == "apple"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    answer = client.responses.create(model=MODEL, previous_response_id=done.response.id, tools=[tool], temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": str(_price("apple"))}], extra_body={"service_tier": tier})
    assert answer.status == "completed"
