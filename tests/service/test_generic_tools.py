"""Tool calls on a chat model whose template writes none (issue #49, item 1): muser's ``generic``
format (service/tools.py, docs/serve.md "Tool calls on any chat model"): the tools described in
a system turn, the whole answer constrained by the grammar to ``{"tool_calls": [...]}`` or
``{"response": "..."}``, read back as calls or text, whole and streamed.

The reader and the renderer on their own first (no model); then the embedded SmolLM2-135M-Instruct
(the model ``make`` installs, its own template: no tool format) behind ``decode --serve``, with
the real ``openai`` and ``anthropic`` clients and the OpenAI Agents SDK. A model this small may
choose poorly (it calls a tool where it could answer, and calls again after the result); what is
asserted is what the format guarantees: every call names an offered tool with arguments its
schema accepts, the streamed answer is the whole one, the answer and the log name the format."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_kit import DecodeServer  # first: the module skipped without the serve extra

from muser_cli.service.api import parse_ask  # noqa: E402
from muser_cli.service.schema import instance_problem  # noqa: E402
from muser_cli.service.structured import generic_schema  # noqa: E402
from muser_cli.service.tools import GENERIC, GenericStream, generic_turns, plan_tools  # noqa: E402

openai = pytest.importorskip("openai")

from handoff_kit import HANG_S, wait_for  # noqa: E402
from tool_kit import TOOLS, WEATHER  # noqa: E402

NAMES = ("get_weather", "get_time")
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def read(pieces: list[str], **kw) -> tuple[GenericStream, list]:
    stream = GenericStream(GENERIC, NAMES, **kw)
    events = []
    for piece in pieces:
        events += stream.feed(piece)
    return stream, events + stream.finish()


# ----------------------------------------------------------------------------- the reader
def test_a_text_answer_streams_its_string_with_escapes_split_across_pieces():
    stream, events = read(['{"resp', 'onse": "Hel', 'lo \\', 'u00e9 \\ud83d', '\\ude00 a\\"b\\n', 'c"}'])
    assert "".join(e[1] for e in events if e[0] == "text") == 'Hello \u00e9 \U0001F600 a"b\nc'
    assert stream.content == 'Hello \u00e9 \U0001F600 a"b\nc' and not stream.calls and stream.error is None
    assert len([e for e in events if e[0] == "text"]) >= 4  # given out as it came, not at the end
    # a lone surrogate half (JSON allows it, UTF-8 cannot carry it) is U+FFFD; what follows is kept
    for raw, text in (('a\\ud83d\\nb', "a\ufffd\nb"), ('\\ud83d\\ud83d\\ude00', "\ufffd\U0001F600"),
                      ('\\udc00x', "\ufffdx")):
        assert read(['{"response": "' + raw + '"}'])[0].content == text, raw


def test_calls_are_given_out_as_each_is_whole_and_a_repeat_or_a_cut_ends_the_list():
    one = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    two = '{"name": "get_time", "arguments": {"tz": "CET"}}'
    stream, events = read(['{"tool_calls": [' + one[:20], one[20:] + ", ", two + "]}"])
    assert [(c["name"], json.loads(c["arguments"])) for c in stream.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert [e[0] for e in events] == ["call", "call"] and stream.content is None and stream.done
    looped, _ = read(['{"tool_calls": [' + one + ", " + one + ", " + one[:10]])  # a small model's loop
    assert len(looped.calls) == 1 and looped.done and looped.error is None
    cut, _ = read(['{"tool_calls": [' + one + ", " + two[:15]])  # max_tokens inside the second
    assert [c["name"] for c in cut.calls] == ["get_weather"] and cut.error is None
    stray, _ = read(['{"tool_calls": [{"name": "rm_rf", "arguments": {}}]}'])  # no offered tool: no call
    assert not stray.calls and stray.content.startswith('{"tool_calls"')


def test_a_required_call_never_passes_off_text_or_a_broken_call():
    for pieces in (["Sure, here it is"], ['{"response": "no"}'], ['{"tool_calls": [{"name": "get_wea']):
        stream, _ = read(pieces, required=True)
        assert stream.error is not None and stream.error.code == "tool_call_failed", pieces
        assert not stream.calls
    strict, _ = read(['{"tool_calls": [{"name": "get_weather", "arguments": {"town": "Paris"}}]}'],
                     strict={"get_weather": {**WEATHER["function"]["parameters"], "additionalProperties": False}})
    assert strict.error is not None and "strict" in strict.error.message


# ----------------------------------------------------------------------------- the plan
def test_the_conversation_is_rendered_for_a_template_that_knows_no_tools():
    ask = parse_ask({"messages": [
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        {"role": "assistant", "content": "Sunny at noon."}, {"role": "user", "content": "Thanks."}],
        "tools": TOOLS}, "chat", default_max_tokens=8)
    plan = plan_tools(ask, "{{ messages }}")  # a template with no call format of its own
    assert plan.fmt is GENERIC and plan.template_tools is None and plan.tools is not None
    roles = [t["role"] for t in plan.turns]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"], roles  # tool results: a user turn
    system = plan.turns[0]["content"]
    assert system.startswith("Be brief.\n\n") and '"name": "get_time"' in system and '{"response"' in system
    assert json.loads(plan.turns[2]["content"]) == {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]}
    results = [json.loads(line) for line in plan.turns[3]["content"].split("\n")]
    assert results == [{"tool_response": {"name": "get_weather", "content": "sunny"}},
                       {"tool_response": {"name": "get_time", "content": "noon"}}]
    assert plan.turns[4]["content"] == "Sunny at noon."  # a text answer as it was read out
    # the same conversation after tool_choice none: rendered (no tool turns left for the template), no tools told
    none = plan_tools(parse_ask({"messages": ask.prompt, "tools": TOOLS, "tool_choice": "none"}, "chat",
                                default_max_tokens=8), "{{ messages }}")
    assert none.tools is None and [t["role"] for t in none.turns] == roles and "get_time" not in str(none.turns[0])
    assert generic_turns(ASK, None) == ASK
    # text beside calls kept; two assistant turns in a row joined (templates that want roles to alternate)
    both = generic_turns([*ASK, {"role": "assistant", "content": "Checking."},
                          {"role": "assistant", "content": "Let me look.", "tool_calls": [
                              {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                                           "arguments": '{"city": "Paris"}'}}]}], None)
    assert [t["role"] for t in both] == ["user", "assistant"]
    assert both[1]["content"] == ('Checking.\nLet me look.\n{"tool_calls": [{"name": "get_weather", "arguments": '
                                  '{"city": "Paris"}}]}')


def test_a_tools_local_references_resolve_and_the_grammar_compiles(tiny_llama):
    """A tool's ``$defs`` (what pydantic writes for a nested model) move to the answer's root under
    the tool's name, its references with them; objects closed, an ``allOf`` left open."""
    from muser_cli.engines.constraint import json_constraint

    nested = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
              "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"]}}}
    mixed = {"type": "object", "properties": {"a": {"type": "integer"}},
             "allOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    schema = generic_schema({"find": nested, "mix": mixed}, required=True, named=None, parallel=True)
    assert instance_problem({"tool_calls": [{"name": "find", "arguments": {"where": {"city": "Paris"}}}]}, schema) is None
    assert instance_problem({"tool_calls": [{"name": "find", "arguments": {"where": {"city": "Paris", "x": 1}}}]},
                            schema) is not None  # closed: the declared keys only
    assert instance_problem({"tool_calls": [{"name": "mix", "arguments": {"a": 1, "b": 2}}]}, schema) is None
    assert json_constraint(tiny_llama, schema, lenient=True).matcher() is not None  # llguidance takes it


def test_the_schema_allows_only_what_tool_choice_allows():
    auto = generic_schema(SCHEMAS, required=False, named=None, parallel=True)
    two = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                          {"name": "get_time", "arguments": {"tz": "CET"}}]}
    assert instance_problem({"response": "hi"}, auto) is None and instance_problem(two, auto) is None
    assert instance_problem({"tool_calls": [{"name": "rm", "arguments": {}}]}, auto) is not None
    assert instance_problem({"tool_calls": []}, auto) is not None
    required = generic_schema(SCHEMAS, required=True, named=None, parallel=False)
    assert instance_problem({"response": "hi"}, required) is not None and instance_problem(two, required) is not None
    assert instance_problem({"tool_calls": two["tool_calls"][1:]}, required) is None
    named = generic_schema(SCHEMAS, required=True, named="get_weather", parallel=True)
    assert instance_problem({"tool_calls": two["tool_calls"][1:]}, named) is not None


# ----------------------------------------------------------------------------- the embedded model
@pytest.fixture(scope="module")
def server(real_model, tmp_path_factory):
    s = DecodeServer(tmp_path_factory.mktemp("home"), "-m", "default", "--threads", "1", "--no-reuse", "-n", "64")
    try:
        yield s
    finally:
        s.stop()


def valid(name: str, arguments: str, names=NAMES) -> bool:
    args = json.loads(arguments)
    return name in names and isinstance(args, dict) and instance_problem(args, SCHEMAS[name]) is None


def streamed(client, **kw) -> tuple[list, str, str | None, dict]:
    calls: dict[int, dict] = {}
    content, finish, muser = "", None, {}
    for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        muser = (ch.model_extra or {}).get("muser") or muser
        if not ch.choices:
            continue
        choice = ch.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], content, finish, muser


def test_the_embedded_model_calls_tools_whole_and_streamed(server):
    client = server.client()
    before = len(server.records())
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}, "auto"):
        kw = dict(model="default", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=64)
        whole = client.chat.completions.create(**kw)
        message = whole.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert whole.model_extra["muser"]["tool_format"] == "generic", whole.model_extra["muser"]
        if choice != "auto":
            assert calls and whole.choices[0].finish_reason == "tool_calls", message
        names = ("get_time",) if isinstance(choice, dict) else NAMES
        assert all(valid(name, args, names) for name, args in calls), calls
        if not calls:  # auto may answer in text: the text, not JSON
            assert message.content and not message.content.startswith("{"), message
        assert streamed(client, **kw)[:3] == (calls, message.content or "", whole.choices[0].finish_reason), choice
    assert wait_for(lambda: len(server.records()) >= before + 6, HANG_S)  # its stderr is read on a thread
    lines = server.records()[before:]
    assert len(lines) == 6 and all(r["tool_format"] == "generic" and r["status"] == 200 for r in lines), lines


def test_the_results_go_back_and_the_next_answer_is_a_valid_call_or_text(server):
    client = server.client()
    first = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=64)
    calls = first.choices[0].message.tool_calls
    turns = ASK + [first.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls]
    nxt = client.chat.completions.create(model="default", messages=turns, tools=TOOLS, temperature=0, max_tokens=64)
    message = nxt.choices[0].message
    assert nxt.usage.prompt_tokens > first.usage.prompt_tokens + 10  # the calls and the results were rendered
    assert message.tool_calls or message.content, message
    assert all(valid(c.function.name, c.function.arguments) for c in message.tool_calls or [])


def test_the_anthropic_client_gets_tool_use_blocks_whole_and_streamed(server):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=f"http://{server.address}", api_key="unused", max_retries=0,
                                 timeout=HANG_S)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    kw = dict(model="default", max_tokens=64, messages=ASK, tools=tools, tool_choice={"type": "any"},
              extra_body={"temperature": 0})
    whole = client.messages.create(**kw)
    uses = [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and uses, whole
    assert all(valid(name, json.dumps(args)) for name, args in uses), uses
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == uses


def test_the_agents_sdk_runs_its_tools_on_the_embedded_model(server):
    """docs/serve.md's Agents SDK example against the embedded model, whole and streamed: the SDK's
    strict tools, the model's calls parsed and run with their arguments; the run stops at the first
    tool's output (``tool_use_behavior="stop_on_first_tool"``, the docs' setting for a model this
    small)."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    ran: list = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        ran.append(("get_weather", city))
        return f"sunny, 21 C in {city}"

    @agents.function_tool
    def get_time(tz: str) -> str:
        """The time in a time zone."""
        ran.append(("get_time", tz))
        return "14:05"

    def agent():  # a client of its own for each event loop (asyncio.run closes its loop)
        client = AsyncOpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=HANG_S)
        return agents.Agent(name="assistant", instructions="Use the tools.", tools=[get_weather, get_time],
                            model=agents.OpenAIChatCompletionsModel(model="default", openai_client=client),
                            model_settings=agents.ModelSettings(temperature=0, tool_choice="required"),
                            tool_use_behavior="stop_on_first_tool")

    async def streamed():
        run = agents.Runner.run_streamed(agent(), "Weather in Paris?", max_turns=3)
        async for _ in run.stream_events():
            pass
        return run

    for how in ("whole", "streamed"):
        ran.clear()
        before = len(server.records())
        result = asyncio.run(agents.Runner.run(agent(), "Weather in Paris?", max_turns=3) if how == "whole"
                             else streamed())
        assert ran and all(isinstance(arg, str) and arg for _, arg in ran), (how, ran)
        outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
        assert result.final_output == outputs[0], (how, result.final_output, outputs)
        assert wait_for(lambda: len(server.records()) > before, HANG_S)  # its stderr is read on a thread
        line = server.records()[before]
        assert line["tool_format"] == "generic" and line["finish_reason"] == "tool_calls", (how, line)
