"""The OpenAI Agents SDK (``openai-agents``) running a tool-using agent end to end against
``muser decode --serve`` on 127.0.0.1 (issue #38): ``OpenAIChatCompletionsModel`` on an
``AsyncOpenAI`` client pointed at the server, two ``@function_tool`` functions, and a tiny model
that calls them and then answers their results in text (tool_kit.make_tool_model with ``reply``,
its template HERMES_REPLY). The SDK sends its tools with ``strict: true`` (its default), which the
server honours by checking each call's arguments against the schema."""

from __future__ import annotations

import asyncio

import pytest

from serve_kit import DecodeServer  # first: the module skipped without the serve extra

agents = pytest.importorskip("agents")

from handoff_kit import HANG_S, wait_for  # noqa: E402
from tool_kit import HERMES_REPLY, REPLY, make_tool_model  # noqa: E402

QUESTION = "What are the weather and the time in Paris?"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    from muser_cli.model.resolve import resolve_model

    model = resolve_model(str(make_tool_model(tiny_llama, tmp_path_factory.mktemp("agent-model"), HERMES_REPLY,
                                              reply=REPLY)))
    s = DecodeServer(tmp_path_factory.mktemp("home"), "-m", str(model.path), "--threads", "1", "--dtype", "float32",
                     "--no-reuse", "-n", "32")
    try:
        yield s
    finally:
        s.stop()


def agent_with_tools(server, ran: list, *, strict: bool = True):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool(strict_mode=strict)
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        ran.append(("get_weather", {"city": city}))
        return f"sunny, 21 C in {city}"

    @function_tool(strict_mode=strict)
    def get_time(tz: str) -> str:
        """The time in a time zone."""
        ran.append(("get_time", {"tz": tz}))
        return "14:05"

    client = AsyncOpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=HANG_S)
    return Agent(name="assistant", instructions="Answer with the tools' help.", tools=[get_weather, get_time],
                 model=OpenAIChatCompletionsModel(model="default", openai_client=client),
                 model_settings=ModelSettings(temperature=0))


def test_an_agent_calls_its_tools_and_answers(server):
    from agents import Runner

    ran: list = []
    before = len(server.records())
    result = asyncio.run(Runner.run(agent_with_tools(server, ran), QUESTION, max_turns=4))
    assert ran == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]  # each ran, its arguments parsed
    assert result.final_output == "".join(REPLY)  # the model's text after the tools' results
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs == ["sunny, 21 C in Paris", "14:05"]
    assert wait_for(lambda: len(server.records()) >= before + 2, HANG_S)  # its stderr is read on a thread
    lines = server.records()[before:]
    assert [(r["status"], r["finish_reason"]) for r in lines] == [(200, "tool_calls"), (200, "stop")]
    assert lines[1]["prompt_tokens"] > lines[0]["prompt_tokens"]  # the second turn carried the calls and results


def test_a_streamed_run_does_the_same(server):
    from agents import Runner

    ran: list = []

    async def run():
        streamed = Runner.run_streamed(agent_with_tools(server, ran, strict=False), QUESTION, max_turns=4)
        kinds = [event.type async for event in streamed.stream_events()]
        return streamed, kinds

    streamed, kinds = asyncio.run(run())
    assert ran == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert streamed.final_output == "".join(REPLY) and "raw_response_event" in kinds
