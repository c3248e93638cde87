"""A real agent client from PyPI, unchanged, against `ultrafast serve --model qwen2.5-coder-1.5b` on loopback:
the OpenAI Agents SDK (`openai-agents`, over chat completions) runs an agent with two function tools to
completion, the tool's result coming back through the chat template, in both tiers."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.conftest import ServerProcess

agents = pytest.importorskip("agents")


@pytest.fixture(scope="module")
def qwen15_url(tmp_path_factory):
    from ultrafast.pull import pull

    tmp = tmp_path_factory.mktemp("agents")
    srv = ServerProcess(pull("qwen2.5-coder-1.5b"), str(tmp / "ledger.db"), tmp / "server.log").start()
    yield srv.base_url
    srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["standard", "ultrafast"])
def test_openai_agents_sdk_runs_a_tool_agent_to_completion(qwen15_url, tier):
    from openai import AsyncOpenAI

    calls = []

    @agents.function_tool
    def get_price(fruit: str) -> int:
        """The price of one fruit in dollars."""
        calls.append(("get_price", fruit))
        return {"apple": 3, "pear": 2}.get(fruit.lower().rstrip("s"), 0)

    @agents.function_tool
    def multiply(a: int, b: int) -> int:
        """a times b."""
        calls.append(("multiply", a, b))
        return a * b

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=qwen15_url, api_key="local", max_retries=0)
    agent = agents.Agent(
        name="shop", instructions="Use the tools to answer. Answer with the total price only.",
        tools=[get_price, multiply],
        model=agents.OpenAIChatCompletionsModel(model="qwen2.5-coder-1.5b", openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, extra_body={"service_tier": tier}))
    result = asyncio.run(agents.Runner.run(agent, "What is the price of an apple?", max_turns=6))
    assert ("get_price", "apple") in calls  # the model's call reached the tool
    assert "3" in str(result.final_output)  # and the tool's answer came back to it
