"""Anthropic's Messages API (``POST /v1/messages``) on ``muser decode --serve``, through the real
``anthropic`` client on 127.0.0.1 (issue #38): a tiny model that calls tools and answers the
tools' results in text (tool_kit.make_tool_model with ``reply``, its template HERMES_REPLY). A plain
answer equals the OpenAI route's tokens; a streamed one is Anthropic's event sequence adding up to
it; stop sequences; the model's calls as ``tool_use`` blocks (whole, and streamed as
``input_json_delta``), the results sent back as ``tool_result`` and the conversation continued;
refusals in Anthropic's error shape; the ``x-api-key`` header."""

from __future__ import annotations

import json
import time

import pytest

from serve_kit import DecodeServer  # first: the module skipped without the serve extra

anthropic = pytest.importorskip("anthropic")
import httpx  # noqa: E402

from handoff_kit import HANG_S  # noqa: E402
from tool_kit import HERMES_REPLY, REPLY, TOOLS, make_tool_model  # noqa: E402

KEY = "s3cret-key"
QUESTION = "What are the weather and the time in Paris?"
ASK = [{"role": "user", "content": QUESTION}]
SYSTEM = "You answer briefly."
#: The tool kit's tools as Anthropic's custom tools.
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
BOTH = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
#: Greedy. This anthropic client (2.17) has no sampling parameters of its own (Anthropic's newer
#: models take none), so temperature rides in the body, as any field a client does not know.
T0 = {"temperature": 0}


@pytest.fixture(scope="module")
def tool_model(tiny_llama, tmp_path_factory):
    from muser_cli.model.resolve import resolve_model

    folder = make_tool_model(tiny_llama, tmp_path_factory.mktemp("reply-model"), HERMES_REPLY, reply=REPLY)
    return resolve_model(str(folder))


@pytest.fixture(scope="module")
def server(tool_model, tmp_path_factory):
    s = DecodeServer(tmp_path_factory.mktemp("home"), "-m", str(tool_model.path), "--threads", "1",
                     "--dtype", "float32", "--no-reuse", "-n", "32", "--api-key", KEY)
    try:
        yield s
    finally:
        s.stop()


def claude(server, key: str = KEY):
    return anthropic.Anthropic(base_url=f"http://{server.address}", api_key=key, max_retries=0, timeout=HANG_S)


def gpt(server):
    import openai

    return openai.OpenAI(base_url=server.base, api_key=KEY, max_retries=0, timeout=HANG_S)


def logged(server, before: int) -> dict:
    """The first request line logged after the first ``before`` (its stderr is read on a thread)."""
    deadline = time.monotonic() + HANG_S
    while len(server.records()) <= before and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.records()[before]


def uses(message) -> list:
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_plain_answer_is_the_openai_routes_tokens(server):
    """No tools: the model's text (its calls' markup, as text) through both routes, the same tokens."""
    raw = claude(server).messages.with_raw_response.create(model="default", max_tokens=64, messages=ASK,
                                                           system=SYSTEM, extra_body=T0)
    msg = raw.parse()
    same = gpt(server).chat.completions.create(model="default", max_tokens=64, extra_body=T0,
                                               messages=[{"role": "system", "content": SYSTEM}] + ASK)
    assert text_of(msg) == same.choices[0].message.content and text_of(msg).startswith("<tool_call>")
    assert [b.type for b in msg.content] == ["text"] and msg.role == "assistant" and msg.type == "message"
    assert msg.id.startswith("msg_") and msg.model == "default"
    assert msg.stop_reason == "end_turn" and same.choices[0].finish_reason == "stop" and msg.stop_sequence is None
    assert msg.usage.output_tokens == same.usage.completion_tokens
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == same.usage.prompt_tokens
    assert raw.headers["x-muser-source"] and float(raw.headers["x-muser-ttft-ms"]) > 0
    body = json.loads(raw.http_response.text)  # muser's own field, as the OpenAI answers carry it
    assert body["muser"]["source"] == raw.headers["x-muser-source"] and body["muser"]["ttft_ms"] > 0
    cut = claude(server).messages.create(model="default", max_tokens=3, messages=ASK, system=SYSTEM, extra_body=T0)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    assert text_of(msg).startswith(text_of(cut))


def test_a_stop_sequence_ends_the_answer_and_is_named(server):
    full = text_of(claude(server).messages.create(model="default", max_tokens=64, messages=ASK, extra_body=T0))
    msg = claude(server).messages.create(model="default", max_tokens=64, messages=ASK, extra_body=T0,
                                         stop_sequences=["never here", "Paris"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "Paris"
    assert text_of(msg) == full[: full.index("Paris")]


def test_a_stream_is_anthropics_events_adding_up_to_the_answer(server):
    client = claude(server)
    whole = client.messages.create(model="default", max_tokens=64, messages=ASK, extra_body=T0)
    events = list(client.messages.create(model="default", max_tokens=64, messages=ASK, extra_body=T0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start" and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"} and len(kinds) > 6  # the text in several deltas
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens and events[0].message.content == []
    assert events[1].content_block.type == "text" and events[1].index == 0
    assert all(e.delta.type == "text_delta" and e.index == 0 for e in events[2:-3])
    assert "".join(e.delta.text for e in events[2:-3]) == text_of(whole)
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == whole.usage.output_tokens
    # the SDK's own accumulator reads the same message out of the events
    with client.messages.stream(model="default", max_tokens=64, messages=ASK, extra_body=T0) as stream:
        final = stream.get_final_message()
    assert text_of(final) == text_of(whole) and final.stop_reason == "end_turn"
    # on the wire: each event named by its `event:` line, then its data
    with httpx.stream("POST", f"http://{server.address}/v1/messages", headers={"x-api-key": KEY}, timeout=HANG_S,
                      json={"model": "default", "max_tokens": 4, "messages": ASK, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas] and len(lines) == 2 * len(names)
    assert datas[-2]["muser"]["source"] == r.headers["x-muser-source"]  # the muser field rides on message_delta


def test_the_models_calls_are_tool_use_blocks(server):
    client = claude(server)
    before = len(server.records())
    msg = client.messages.create(model="default", max_tokens=64, messages=ASK, tools=A_TOOLS, extra_body=T0)
    assert uses(msg) == BOTH and [b.type for b in msg.content] == ["tool_use", "tool_use"]
    assert msg.stop_reason == "tool_use"
    ids = [b.id for b in msg.content]
    assert all(i.startswith("toolu_") for i in ids) and len(set(ids)) == 2
    assert logged(server, before)["tool_calls"] == 2
    events = list(client.messages.create(model="default", max_tokens=64, messages=ASK, tools=A_TOOLS,
                                         extra_body=T0, stream=True))
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type, e.content_block.name, e.content_block.input) for e in starts] == [
        (0, "tool_use", "get_weather", {}), (1, "tool_use", "get_time", {})]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert all(e.delta.type == "input_json_delta" for e in deltas)
    got = {}
    for e in deltas:
        got[e.index] = got.get(e.index, "") + e.delta.partial_json
    assert [json.loads(got[i]) for i in (0, 1)] == [args for _, args in BOTH]
    assert [e.type for e in events].count("content_block_stop") == 2
    assert events[-2].delta.stop_reason == "tool_use"
    with client.messages.stream(model="default", max_tokens=64, messages=ASK, tools=A_TOOLS,
                                extra_body=T0) as stream:
        assert uses(stream.get_final_message()) == BOTH


def test_tool_choice_named_and_any_without_parallel_calls(server):
    client = claude(server)
    named = client.messages.create(model="default", max_tokens=64, messages=ASK, tools=A_TOOLS, extra_body=T0,
                                   tool_choice={"type": "tool", "name": "get_time"})
    # forced opening, the arguments decoded under get_time's schema (unconstrained: {"city": "Paris"})
    assert uses(named) == [("get_time", {"tz": "CET"})]
    one = client.messages.create(model="default", max_tokens=64, messages=ASK, tools=A_TOOLS, extra_body=T0,
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert uses(one) == BOTH[:1] and one.stop_reason == "tool_use"
    none = client.messages.create(model="default", max_tokens=64, messages=ASK, tools=A_TOOLS, extra_body=T0,
                                  tool_choice={"type": "none"})
    assert uses(none) == [] and text_of(none).startswith("<tool_call>")  # tools not rendered, nothing parsed


def test_the_tool_results_go_back_and_the_model_answers(server):
    client = claude(server)
    first = client.messages.create(model="default", max_tokens=64, messages=ASK, tools=A_TOOLS, extra_body=T0)
    results = [{"type": "tool_result", "tool_use_id": first.content[0].id, "content": "sunny, 21 C"},
               {"type": "tool_result", "tool_use_id": first.content[1].id,
                "content": [{"type": "text", "text": "14:05"}]}]
    turns = ASK + [{"role": "assistant", "content": first.content}, {"role": "user", "content": results}]
    second = client.messages.create(model="default", max_tokens=64, messages=turns, tools=A_TOOLS, extra_body=T0)
    assert text_of(second) == "".join(REPLY) and second.stop_reason == "end_turn" and uses(second) == []
    # the same conversation through the OpenAI route renders the same prompt and the same answer
    said = {"role": "assistant", "content": None, "tool_calls": [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
        for b in first.content]}
    same = gpt(server).chat.completions.create(
        model="default", max_tokens=64, extra_body=T0, tools=TOOLS,
        messages=ASK + [said, {"role": "tool", "tool_call_id": first.content[0].id, "content": "sunny, 21 C"},
                        {"role": "tool", "tool_call_id": first.content[1].id, "content": "14:05"}])
    assert same.choices[0].message.content == text_of(second)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == same.usage.prompt_tokens
    assert second.usage.input_tokens > first.usage.input_tokens
    with client.messages.stream(model="default", max_tokens=64, messages=turns, tools=A_TOOLS,
                                extra_body=T0) as stream:
        assert "".join(stream.text_stream) == "".join(REPLY)


def _refused(server, body: dict, *, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"http://{server.address}/v1/messages", json=body, timeout=HANG_S,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01", **(headers or {})})


def test_refusals_are_400_in_anthropics_shape(server):
    client = claude(server)
    r = _refused(server, {"model": "default", "messages": ASK})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: a field required by the Messages API"}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="default", max_tokens=8, messages=ASK, extra_body={"frobnicate": 1})
    assert exc.value.status_code == 400 and exc.value.body["type"] == "error"
    assert exc.value.body["error"]["type"] == "invalid_request_error" and "frobnicate" in exc.value.body["error"][
        "message"]
    with pytest.raises(anthropic.BadRequestError, match="top_k must be an integer"):  # read (honoured: test_serve_fields)
        client.messages.create(model="default", max_tokens=8, messages=ASK, extra_body={"top_k": -5})
    for body, words in [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "type 'image'"),
        ({"messages": [{"role": "system", "content": "x"}]}, "'user' or 'assistant'"),
        ({"messages": ASK + [{"role": "assistant", "content": "Sure"}]}, "prefilled answer"),
        ({"messages": ASK, "tools": [{"name": "x", "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
        ({"messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only custom tools"),
        ({"messages": ASK, "tool_choice": {"type": "any"}}, "without tools"),
        ({"messages": ASK, "tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "not one of"),
        ({"messages": ASK, "temperature": 1.5}, "temperature"),
        ({"messages": ASK, "metadata": {"user_id": "u1", "other": 1}}, "metadata.other"),
        ({"messages": ASK, "system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]},
         "system[0].cache_control"),
    ]:
        r = _refused(server, {"model": "default", "max_tokens": 8, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["type"] == "error" and words in r.json()["error"]["message"], (body, r.text)
    r = _refused(server, {"model": "another", "max_tokens": 8, "messages": ASK})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    ok = client.messages.create(model="default", max_tokens=2, messages=ASK, metadata={"user_id": "u1"})
    assert ok.usage.output_tokens == 2  # metadata accepted: it changes nothing
    log = [rec for rec in server.records() if rec.get("endpoint") == "messages"]
    assert log and all(rec["status"] in (400, 404) for rec in log) and "top_k" in " ".join(r["reason"] for r in log)


def test_the_api_key_goes_in_x_api_key_or_bearer(server):
    with pytest.raises(anthropic.AuthenticationError) as exc:
        claude(server, key="wrong").messages.create(model="default", max_tokens=2, messages=ASK)
    assert exc.value.status_code == 401 and exc.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"http://{server.address}/v1/messages", timeout=HANG_S,
                   json={"model": "default", "max_tokens": 2, "messages": ASK})
    assert r.status_code == 401 and r.json()["type"] == "error"
    r = httpx.post(f"http://{server.address}/v1/messages", timeout=HANG_S, headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "default", "max_tokens": 2, "messages": ASK})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2
    metrics = httpx.get(f"http://{server.address}/metrics", headers={"x-api-key": KEY}, timeout=HANG_S).text
    assert 'muser_requests_total{endpoint="messages",status="401"}' in metrics
    assert 'muser_requests_total{endpoint="messages",status="200"}' in metrics


def test_a_strict_tools_call_must_match_its_schema(server):
    """``strict: true`` is honoured: a call the model makes on its own is checked, and one whose
    arguments the schema refuses is an error (500, never returned as a call); a named call is
    decoded under the schema, so it matches. The same on both routes."""
    strict = [{**t, "strict": True, "input_schema": {**t["input_schema"], "additionalProperties": False}}
              for t in A_TOOLS]
    ok = claude(server).messages.create(model="default", max_tokens=64, messages=ASK, tools=strict, extra_body=T0)
    assert uses(ok) == BOTH
    # named get_time: unconstrained the model writes {"city": ...}; steered by the schema it writes a tz
    named = claude(server).messages.create(model="default", max_tokens=64, messages=ASK, tools=strict, extra_body=T0,
                                           tool_choice={"type": "tool", "name": "get_time"})
    assert uses(named) == [("get_time", {"tz": "CET"})]
    oslo = {"type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"],
            "additionalProperties": False}
    refusing = [{**strict[0], "input_schema": oslo}, strict[1]]
    with pytest.raises(anthropic.InternalServerError) as exc:  # auto: the model's own call, Paris, is refused
        claude(server).messages.create(model="default", max_tokens=64, messages=ASK, tools=refusing, extra_body=T0)
    assert exc.value.body["error"]["type"] == "api_error" and "schema refuses" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.APIStatusError, match="schema refuses"):  # streamed: an error event
        list(claude(server).messages.create(model="default", max_tokens=64, messages=ASK, tools=refusing,
                                            extra_body=T0, stream=True))
    import openai

    with pytest.raises(openai.InternalServerError) as exc:
        gpt(server).chat.completions.create(model="default", max_tokens=64, messages=ASK, extra_body=T0, tools=[
            {"type": "function", "function": {**TOOLS[0]["function"], "parameters": oslo, "strict": True}}])
    assert exc.value.body["code"] == "tool_call_failed" and "schema refuses" in exc.value.body["message"]
    r = _refused(server, {"model": "default", "max_tokens": 8, "messages": ASK, "tools": [
        {**A_TOOLS[0], "strict": True, "input_schema": {"type": "object", "properties": {}, "patternProperties": {}}}]})
    assert r.status_code == 400 and "does not check the keyword 'patternProperties'" in r.json()["error"]["message"]
