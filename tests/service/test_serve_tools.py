"""Tool calls through ``muser decode --serve`` and the real ``openai`` client (issue #38): a tiny
model that calls tools (tool_kit.make_tool_model: a bigram model whose table writes two
``<tool_call>`` blocks after the assistant prompt, and continues a forced opening as it would),
its tokenizer carrying a Hermes-style template. Every call here is what the model generated,
parsed by the server: the whole answer and its streamed deltas, a named ``tool_choice``,
``required`` with and without parallel calls, the tools' answers sent back, ``none``, an answer
cut by ``max_tokens``, and a required call that does not parse."""

from __future__ import annotations

import json

import pytest

from serve_kit import DecodeServer, engine_worker  # first: the module skipped without the serve extra

from tool_kit import TIME, TOOLS, WEATHER, make_tool_model  # noqa: E402

ASK = [{"role": "user", "content": "What are the weather and the time in Paris?"}]
BOTH = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


@pytest.fixture(scope="module")
def tool_model(tiny_llama, tmp_path_factory):
    from muser_cli.model.resolve import resolve_model

    return resolve_model(str(make_tool_model(tiny_llama, tmp_path_factory.mktemp("tool-model"))))


@pytest.fixture(scope="module")
def server(tool_model, tmp_path_factory):
    s = DecodeServer(tmp_path_factory.mktemp("home"), "-m", str(tool_model.path), "--threads", "1",
                     "--dtype", "float32", "--no-reuse", "-n", "32")
    try:
        yield s
    finally:
        s.stop()


def calls_of(message) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed(client, **kw) -> tuple[dict[int, dict], str, list[str], list]:
    """The tool calls a stream's deltas add up to (by index), its content, its finish reasons."""
    calls: dict[int, dict] = {}
    content, finishes, chunks = "", [], []
    for ch in client.chat.completions.create(stream=True, **kw):
        chunks.append(ch)
        if not ch.choices:
            continue
        choice = ch.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
            assert d.type in (None, "function")
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    return calls, content, finishes, chunks


def test_the_models_calls_come_back_parsed(server):
    client = server.client()
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == BOTH
    assert choice.message.content is None  # the text was all calls: nothing of the markup is content
    ids = [c.id for c in choice.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert all(c.type == "function" for c in choice.message.tool_calls)
    log = server.records()[-1]
    assert log["tool_calls"] == 2 and log["finish_reason"] == "tool_calls" and "text" not in log


def test_streamed_deltas_add_up_to_the_same_calls(server):
    calls, content, finishes, chunks = streamed(server.client(), model="default", messages=ASK, tools=TOOLS,
                                                temperature=0)
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == BOTH
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert content == "" and finishes == ["tool_calls"]
    first = [ch for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]
    assert first[0].choices[0].delta.tool_calls[0].function.name == "get_weather"  # the name comes first ...
    assert first[0].choices[0].delta.tool_calls[0].function.arguments == ""  # ... then the arguments


def test_a_named_tool_choice_gets_exactly_that_call(server):
    client = server.client()
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice=named,
                                       temperature=0)
    # the answer was made to start with get_time's opening and its arguments decoded under get_time's
    # schema (docs/serve.md, Structured output): unconstrained, this model writes {"city": "Paris"} there
    assert calls_of(r.choices[0].message) == [("get_time", {"tz": "CET"})]
    assert r.choices[0].finish_reason == "tool_calls"
    calls, content, finishes, _ = streamed(client, model="default", messages=ASK, tools=TOOLS, tool_choice=named,
                                           temperature=0)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {"tz": "CET"})]
    assert finishes == ["tool_calls"] and content == ""


def test_required_with_and_without_parallel_calls(server):
    client = server.client()
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=0)
    assert calls_of(r.choices[0].message) == BOTH
    one = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, temperature=0)
    assert calls_of(one.choices[0].message) == BOTH[:1]  # generation stopped after the first call
    assert one.usage.completion_tokens < r.usage.completion_tokens
    auto_one = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                              parallel_tool_calls=False, temperature=0)
    assert calls_of(auto_one.choices[0].message) == BOTH[:1]


def test_the_tools_answers_go_back_and_the_chat_goes_on(server, tool_model):
    from muser_cli.model.tokens import chat_template_text, encode_prompt, render_chat
    from muser_cli.service.api import parse_ask
    from muser_cli.service.tools import plan_tools

    client = server.client()
    first = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, temperature=0)
    said = first.choices[0].message
    messages = ASK + [said]  # the client's own message object, as agent loops pass it back
    messages += [{"role": "tool", "tool_call_id": said.tool_calls[0].id, "content": "sunny, 21 C"},
                 {"role": "tool", "tool_call_id": said.tool_calls[1].id, "content": "14:05"}]
    second = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, temperature=0)
    assert second.choices[0].finish_reason == "tool_calls"  # this model always calls: it answers so again
    body = {"messages": [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages],
            "tools": TOOLS}
    plan = plan_tools(parse_ask(body, "chat", default_max_tokens=4), chat_template_text(tool_model))
    text = render_chat(tool_model, plan.turns, tools=plan.tools)
    assert '"arguments": {"city": "Paris"}}\n</tool_call>' in text and "<tool_response>\n14:05\n" in text
    assert second.usage.prompt_tokens == len(encode_prompt(tool_model, plan.turns, chat=True, tools=plan.tools))
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_tool_choice_none_renders_no_tools_and_parses_nothing(server):
    client = server.client()
    with_tools = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, temperature=0,
                                                max_tokens=2)
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="none",
                                       temperature=0)
    assert r.usage.prompt_tokens < with_tools.usage.prompt_tokens  # the tools were not rendered
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content.startswith("<tool_call>")  # the model's text, as it wrote it


def test_an_answer_cut_inside_a_call_is_text_not_a_call(server):
    r = server.client().chat.completions.create(model="default", messages=ASK, tools=TOOLS, temperature=0,
                                                max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'


def test_a_required_call_is_steered_to_an_offered_tool_or_fails(server):
    import openai

    client = server.client()
    # only get_time offered: unconstrained the model writes get_weather, no call of this request;
    # decoded under the grammar of the offered calls it writes get_time with get_time's arguments
    r = client.chat.completions.create(model="default", messages=ASK, tools=[TIME], tool_choice="required",
                                       temperature=0)
    assert calls_of(r.choices[0].message) == [("get_time", {"tz": "CET"})]
    # a required call cut by max_tokens does not parse: the request fails, never text passed off as a call
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model="default", messages=ASK, tools=[TIME], tool_choice="required",
                                       temperature=0, max_tokens=1)
    assert exc.value.body["code"] == "tool_call_failed" and "does not parse" in exc.value.body["message"]
    with pytest.raises(openai.APIError, match="tool_call_failed|does not parse"):
        streamed(client, model="default", messages=ASK, tools=[TIME], tool_choice="required", temperature=0,
                 max_tokens=1)
    auto = client.chat.completions.create(model="default", messages=ASK, tools=[TIME], temperature=0)
    # auto: the block that is no call stays text, as the model wrote it; the one that is, is a call
    assert calls_of(auto.choices[0].message) == BOTH[1:]
    assert auto.choices[0].message.content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' \
                                              '\n</tool_call>'


def test_a_model_whose_template_takes_no_tools_gets_the_generic_format(tmp_path):
    """The tiny model's ChatML template writes no tools: muser's generic format (the tools in a
    system turn, the answer constrained to a call's JSON), so even a random model's required
    call is one of the offered tools with arguments by its schema; ``none`` renders no tools."""
    from starlette.testclient import TestClient

    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tiny import make_tiny_long_llama
    from muser_cli.service.app import ServeOptions, Service
    from muser_cli.service.schema import instance_problem

    model = resolve_model(str(make_tiny_long_llama(tmp_path / "tiny-long")))  # the tools' text: past 256 tokens
    with engine_worker(model, max_queue=1) as worker:
        service = Service(worker, worker.metrics, ServeOptions(model_id="tiny"), log=lambda r: None)
        with TestClient(service.app()) as c:
            # a random model's string runs to max_tokens: an enum bounds it (the grammar holds it to the schema)
            tool = {"type": "function", "function": {**WEATHER["function"], "parameters": {
                "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
            r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": [tool], "tool_choice": "required",
                                                     "max_tokens": 64, "temperature": 0})
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["muser"]["tool_format"] == "generic" and got["choices"][0]["finish_reason"] == "tool_calls"
            call = got["choices"][0]["message"]["tool_calls"][0]["function"]
            assert call["name"] == "get_weather"
            assert instance_problem(json.loads(call["arguments"]), tool["function"]["parameters"]) is None
            r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none",
                                                     "max_tokens": 2})
            assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]
            assert r.json()["muser"]["tool_format"] is None