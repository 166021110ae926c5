"""Structured output on ``muser decode --serve`` (issue #38 item 2, docs/serve.md): ``response_format``
``json_schema`` and ``json_object`` and a named ``tool_choice``, by constrained decoding. A real
server on 127.0.0.1, the real ``openai`` client, tiny random models (torch and MLX): whatever
such a model would write, the answer parses and validates (``jsonschema``)."""

from __future__ import annotations

import json

import pytest
from serve_kit import DecodeServer  # first: the module skipped without the serve extra
from tool_kit import TOOLS, make_tool_model

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

ENGINES = ["torch", pytest.param("mlx", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("mlx_lm"), reason="mlx-lm not installed"))]
ASK = [{"role": "user", "content": "Describe one animal of the committee's bridge as a record."}]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    "wild": {"type": "boolean"},
    "kind": {"enum": ["cat", "dog", "bird"]},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["name", "legs", "wild", "kind", "tags"], "additionalProperties": False}


def fmt(schema: dict, strict: bool | None = True) -> dict:
    spec = {"name": "record", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


@pytest.fixture(scope="module", params=ENGINES)
def server(request, tmp_path_factory, tiny_llama):
    srv = DecodeServer(tmp_path_factory.mktemp("home"), "-m", str(tiny_llama.path), "--dtype", "float32",
                       "--threads", "1", "--no-reuse", "--max-batch", "4", "--engine", request.param, "-n", "160")
    yield srv
    srv.stop()


def test_json_schema_strict_answer_parses_and_validates(server):
    client = server.client()
    r = client.chat.completions.create(model="default", messages=ASK, response_format=fmt(SCHEMA), temperature=0)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    # streamed: the pieces add up to the same answer
    text, finishes = "", []
    for ch in client.chat.completions.create(model="default", messages=ASK, response_format=fmt(SCHEMA),
                                             temperature=0, stream=True):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finishes += [ch.choices[0].finish_reason] if ch.choices[0].finish_reason else []
    assert text == r.choices[0].message.content and finishes == ["stop"]


def test_sampled_choices_each_validate(server):
    """n choices sampled (each its own sequence and matcher, stepped together): each validates."""
    r = server.client().chat.completions.create(model="default", messages=ASK, response_format=fmt(SCHEMA),
                                                temperature=1.3, seed=7, n=3)
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_starts_an_object(server):
    """A random model's JSON object has strings of random length (see test_json_object_parses for
    a model that closes them): whole or cut by max_tokens, it is an object from its first token."""
    r = server.client().chat.completions.create(model="default", messages=ASK,
                                                response_format={"type": "json_object"}, temperature=0, max_tokens=8)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_schema_that_is_not_strict_keeps_what_it_can(server):
    """``not`` is a keyword the grammar cannot enforce: strict, refused naming it; not strict, the
    rest of the schema is still kept to."""
    loose = {**SCHEMA, "not": {"required": ["extra"]}}
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(model="default", messages=ASK, response_format=fmt(loose))
    assert err.value.body["param"] == "response_format" and "not" in err.value.body["message"]
    r = server.client().chat.completions.create(model="default", messages=ASK, response_format=fmt(loose, None),
                                                temperature=0)
    jsonschema.validate(json.loads(r.choices[0].message.content), loose)


def test_max_tokens_cuts_the_json_with_finish_length(server):
    r = server.client().chat.completions.create(model="default", messages=ASK, response_format=fmt(SCHEMA),
                                                temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert '{"name": "'.startswith(r.choices[0].message.content) or \
        r.choices[0].message.content.startswith('{"name": "')


@pytest.mark.parametrize("body, why", [
    ({"response_format": {"type": "json_schema"}}, "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}, "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}},
     "not supported"),
    ({"response_format": {"type": "xml"}}, "not supported"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS}, "with tools"),
    ({"response_format": fmt({"type": "object", "if": {}, "then": {}})}, "not supported"),
])
def test_malformed_response_formats_are_400(server, body, why):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(model="default", messages=ASK, extra_body=body)
    assert err.value.body["param"] == "response_format" and why in err.value.body["message"], err.value.body


def test_completions_take_no_json_mode(server):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().completions.create(model="default", prompt="a record:", extra_body={
            "response_format": {"type": "json_object"}})
    assert err.value.body["param"] == "response_format"


# ------------------------------------------------------------------ a named tool_choice
CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer",
        "minimum": 1, "maximum": 3}}, "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": CITY, "strict": True}}


@pytest.fixture(scope="module")
def tool_server(tiny_llama, tmp_path_factory):
    from muser_cli.model.resolve import resolve_model

    model = resolve_model(str(make_tool_model(tiny_llama, tmp_path_factory.mktemp("tool-model"))))
    s = DecodeServer(tmp_path_factory.mktemp("home"), "-m", str(model.path), "--threads", "1",
                     "--dtype", "float32", "--no-reuse", "-n", "64")
    yield s
    s.stop()


def test_a_named_tool_choice_gives_arguments_that_validate(tool_server):
    """The tool model writes {"city": "Paris"} for get_weather; its schema here admits only Oslo or
    Lima and needs days: the arguments are decoded under it, so the strict call is returned."""
    client = tool_server.client()
    ask = [{"role": "user", "content": "What are the weather and the time in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        r = client.chat.completions.create(model="default", messages=ask, tools=[WEATHER, TOOLS[1]],
                                           tool_choice=choice, temperature=0, parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        if choice is named or call.function.name == "get_weather":
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), CITY)


@pytest.mark.slow
def test_json_object_parses(real_model, tmp_path_factory):
    """The embedded model (SmolLM2-135M-Instruct) in JSON mode: its answer is one object that parses."""
    srv = DecodeServer(tmp_path_factory.mktemp("home"), "-m", str(real_model.path), "--threads", "2",
                       "--no-reuse", "-n", "100")
    try:
        r = srv.client().chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Give a JSON object with the name and age of "
                                                                   "a famous scientist."}],
            response_format={"type": "json_object"}, temperature=0)
    finally:
        srv.stop()
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
