"""Real agent clients from PyPI, unchanged, against `ultrafast serve --model qwen2.5-coder-1.5b` on loopback, in
both tiers: the OpenAI Agents SDK (`openai-agents`) over chat completions and over the Responses API (streamed),
and smolagents' ToolCallingAgent through its `OpenAIServerModel`. Each runs an agent with two function tools
(a price lookup and a multiplication) to completion on "What is the price of an apple?": the model's call
must reach the tool and the tool's answer must come back in the final answer."""

from __future__ import annotations

import asyncio

import pytest

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
