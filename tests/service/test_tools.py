"""Tool calls (issue #38), without a server: the request fields checked, the call format read from
a chat template's own text, tools rendered by the template (and a template that ignores them
refused), and the calls parsed out of answers written by the templates themselves (Hermes/Qwen,
Llama 3, Mistral), whole and piece by piece."""

from __future__ import annotations

import json
import random

import pytest

from tool_kit import DEAF, HERMES, LLAMA3, MISTRAL, TIME, TOOLS, WEATHER

from muser_cli.service.api import ApiError, parse_ask
from muser_cli.service.tools import ToolStream, plan_tools, template_turns, tool_format

NAMES = ("get_weather", "get_time")
CALLS = [{"id": "call_a1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_b2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]


def chat(**fields):
    body = {"messages": [{"role": "user", "content": "Weather and time in Paris?"}], **fields}
    return parse_ask(body, "chat", default_max_tokens=8)


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama.path))


def answer_as_written(tok, template: str, calls: list[dict], content: str = "") -> str:
    """The assistant's answer holding ``calls`` as ``template`` writes it: the conversation with
    that answer, less the conversation up to the assistant prompt, less the turn's end."""
    tok.chat_template = template
    fmt = tool_format(template)
    turns = [{"role": "user", "content": "Weather and time in Paris?"}]
    said = template_turns(fmt, turns + [{"role": "assistant", "content": content, "tool_calls": calls}])
    whole = tok.apply_chat_template(said, tokenize=False)
    before = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert whole.startswith(before)
    text = whole[len(before):]
    for end in ("<|im_end|>\n", "<|eom_id|>", "</s>"):
        text = text.removesuffix(end)
    return text


def read(fmt, text: str, *, pieces: bool = False, **kw) -> ToolStream:
    ts = ToolStream(fmt, NAMES, **kw)
    events = []
    if pieces:  # a random split: every boundary a token could make
        rng, at = random.Random(len(text)), 0
        while at < len(text):
            n = rng.randint(1, 4)
            events += ts.feed(text[at:at + n])
            at += n
    else:
        events += ts.feed(text)
    events += ts.finish()
    ts.events = events
    return ts


def shown(ts: ToolStream) -> list:
    return [(c["name"], json.loads(c["arguments"])) for c in ts.calls]


@pytest.mark.parametrize("template", [HERMES, LLAMA3, MISTRAL], ids=["hermes", "llama3", "mistral"])
@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
def test_calls_written_by_the_template_parse_back(tok, template, pieces):
    fmt = tool_format(template)
    text = answer_as_written(tok, template, CALLS)
    ts = read(fmt, text, pieces=pieces)
    assert shown(ts) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})], text
    assert ts.content is None and ts.error is None
    assert [e[0] for e in ts.events] == ["call", "call"]  # nothing of the markup leaks as content
    assert all(c["id"].startswith("call_") and len(c["id"]) > 10 for c in ts.calls)
    assert len({c["id"] for c in ts.calls}) == 2


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
def test_hermes_text_around_calls_is_content(tok, pieces):
    text = answer_as_written(tok, HERMES, CALLS[:1], content="Let me look that up.") + "\nDone."
    ts = read(tool_format(HERMES), text, pieces=pieces)
    assert shown(ts) == [("get_weather", {"city": "Paris"})]
    assert ts.content == "Let me look that up.Done."
    texts = "".join(p for k, p in ts.events if k == "text")
    assert "<" not in texts and texts == ts.content


def test_a_marker_split_over_pieces_never_leaks():
    fmt = tool_format(HERMES)
    ts = ToolStream(fmt, NAMES)
    got = ts.feed("Sure <tool")
    assert got == [("text", "Sure")]  # "<tool" may open a call: held, and the space before it too
    got += ts.feed('_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>')
    assert [k for k, _ in got] == ["text", "call"]
    assert ts.feed(" <tool") == []  # "<tool" held until it cannot be the opening...
    assert ts.feed("s are great!") == [("text", "<tools are great!")]  # ... then it is text
    assert ts.finish() == [] and ts.content == "Sure<tools are great!"


def test_plain_answers_stay_text_in_every_format():
    for template in (HERMES, LLAMA3, MISTRAL):
        for text in ("Paris is sunny.", "  {not a call", "[TOOL_CALL", "<tool_call>{oops</tool_call> after"):
            ts = read(tool_format(template), text, pieces=True)
            assert ts.calls == [] and ts.content == text and ts.error is None, (template[:20], text)


def test_llama3_json_after_the_python_tag_and_semicolons():
    ts = read(tool_format(LLAMA3), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                   '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}', pieces=True)
    assert shown(ts) == [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})]


def test_mistral_name_args_form():
    ts = read(tool_format(MISTRAL), 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', pieces=True)
    assert shown(ts) == [("get_weather", {"city": "Rome"})] and ts.content == "Checking."


def test_calls_that_do_not_parse_are_content_or_an_error():
    fmt = tool_format(HERMES)
    for bad in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # a function not offered
                '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',  # arguments not an object
                '<tool_call>{"name": "get_time", "arguments": {"tz": NaN}}</tool_call>',  # not JSON
                '<tool_call>{"name": "get_time", "arguments": {"tz": "C'):  # cut (max_tokens)
        auto = read(fmt, bad, pieces=True)
        assert auto.calls == [] and auto.content == bad and auto.error is None
        forced = read(fmt, bad, required=True)
        assert forced.calls == [] and forced.error is not None and forced.error.status == 500
        assert forced.error.code == "tool_call_failed"
    named = read(fmt, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', required=True,
                 named="get_weather")
    assert named.error is not None and "not 'get_weather'" in named.error.message
    nothing = read(fmt, "I would rather not.", required=True)
    assert nothing.error is not None and nothing.calls == []


def test_single_stops_after_the_first_call():
    fmt = tool_format(HERMES)
    ts = ToolStream(fmt, NAMES, single=True)
    ts.feed('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>')
    assert ts.done and len(ts.calls) == 1 and ts.calls[0]["arguments"] == "{}"


def test_forced_openings_continue_as_the_template_writes():
    for template, want in ((HERMES, '<tool_call>\n{"name": "get_time", "arguments": '),
                           (LLAMA3, '{"name": "get_time", "parameters": '),
                           (MISTRAL, '[TOOL_CALLS] [{"name": "get_time", "arguments": ')):
        plan = plan_tools(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
                          template)
        assert plan.prefix == want and plan.required and plan.named == "get_time"
        ts = plan.stream()
        ts.feed('{"tz": "UTC"}' + ("}]" if template is MISTRAL else "}"))
        ts.finish()
        assert shown(ts) == [("get_time", {"tz": "UTC"})], template[:20]
    plan = plan_tools(chat(tools=TOOLS, tool_choice="required"), HERMES)
    assert plan.prefix == '<tool_call>\n{"name": "' and plan.named is None and plan.stream().single is False
    assert plan_tools(chat(tools=TOOLS, parallel_tool_calls=False), HERMES).stream().single
    none = plan_tools(chat(tools=TOOLS, tool_choice="none"), HERMES)
    assert none.tools is None and none.stream() is None  # not rendered, not parsed


def test_templates_that_write_no_tools_take_the_generic_format_and_deaf_ones_are_refused(tiny_llama, real_model,
                                                                                          tmp_path):
    from muser_cli.errors import ConfigError
    from muser_cli.model.tokens import chat_template_text, encode_prompt, render_chat

    ask = chat(tools=TOOLS)
    plan = plan_tools(ask, chat_template_text(real_model))  # SmolLM2's own template writes no tools: muser's format
    assert plan.fmt.name == "generic" and plan.template_tools is None and plan.prefix == ""
    assert plan.turns[0]["role"] == "system" and '"name": "get_weather"' in plan.turns[0]["content"]
    assert encode_prompt(real_model, plan.turns, chat=True, tools=plan.template_tools)
    with pytest.raises(ApiError, match="no chat template"):
        plan_tools(ask, None)
    # one that names <tool_call> but writes nothing of the tools: found out by rendering
    import shutil

    from muser_cli.model.resolve import resolve_model

    deaf = tmp_path / "deaf"
    shutil.copytree(tiny_llama.path, deaf)
    config = json.loads((deaf / "tokenizer_config.json").read_text())
    config["chat_template"] = DEAF
    (deaf / "tokenizer_config.json").write_text(json.dumps(config))
    (deaf / "chat_template.jinja").unlink(missing_ok=True)
    info = resolve_model(str(deaf))
    plan = plan_tools(ask, chat_template_text(info))
    with pytest.raises(ConfigError, match="does not render tools"):
        render_chat(info, plan.turns, tools=plan.tools)
    assert encode_prompt(info, plan.turns, chat=True)  # without tools it renders as before


def test_mistral_ids_are_nine_characters_the_same_every_turn(tok):
    tok.chat_template = MISTRAL
    fmt = tool_format(MISTRAL)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": CALLS},
             {"role": "tool", "tool_call_id": "call_a1", "content": "sunny"},
             {"role": "tool", "tool_call_id": "call_b2", "content": "noon"}]
    parsed = parse_ask({"messages": turns, "tools": TOOLS}, "chat", default_max_tokens=4).prompt
    mapped = template_turns(fmt, parsed)
    assert mapped == template_turns(fmt, parsed)
    ids = [c["id"] for c in mapped[1]["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids)
    assert [mapped[2]["tool_call_id"], mapped[3]["tool_call_id"]] == ids
    assert mapped[2]["name"] == "get_weather"
    assert mapped[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = tok.apply_chat_template(mapped, tools=TOOLS, tokenize=False)  # the template's own id check passes
    assert '"call_id": "%s"' % ids[1] in text


def test_request_fields_are_checked():
    a = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
             parallel_tool_calls=False)
    assert a.tools == TOOLS and a.tool_choice["function"]["name"] == "get_time" and not a.parallel_tool_calls
    assert chat().tools is None and chat().tool_choice == "auto"
    assert chat(tools=[{"type": "function", "function": {"name": "ping"}}]).tools[0]["function"]["parameters"] == \
        {"type": "object", "properties": {}}
    turns = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": None, "tool_calls": CALLS, "refusal": None},
             {"role": "tool", "tool_call_id": "call_a1", "content": [{"type": "text", "text": "sunny"}]}]
    got = parse_ask({"messages": turns, "tools": TOOLS}, "chat", default_max_tokens=4).prompt
    assert got[1] == {"role": "assistant", "content": "", "tool_calls": CALLS}
    assert got[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_a1"}


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": {"x": 1}}, "tools", "list of up to"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]}, "tools",
     "properties"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "not": {}}}}]}, "tools", "does not check the keyword 'not'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools", "strict must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]}, "tools", "examples"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "given twice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", "without tools is not supported"),
    ({"tool_choice": "auto"}, "tool_choice", "without tools is not supported"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "without tools is not supported"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"functions": [WEATHER["function"]]}, "functions", "not supported"),
    ({"function_call": "auto"}, "function_call", "not supported"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages", "function messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": CALLS}]}, "messages", "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages", "not a JSON object"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages", "written as a string"),
])
def test_malformed_tool_fields_are_400_naming_the_field(fields, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ApiError) as exc:
        parse_ask(body, "chat", default_max_tokens=4)
    assert exc.value.status == 400 and exc.value.param == param and words in exc.value.message, exc.value.message


def test_completions_take_no_tools():
    with pytest.raises(ApiError, match="chat completions field") as exc:
        parse_ask({"prompt": "hi", "tools": [TIME]}, "completion", default_max_tokens=4)
    assert exc.value.param == "tools"


def test_an_opening_that_is_a_special_token_is_seen_where_decoding_drops_it(tiny_llama, tmp_path):
    """Mistral's [TOOL_CALLS] is a special token: the text of the answer loses it, so the worker
    hands its text to the parser by id (skipped_tokens); an ordinary token is not listed."""
    from transformers import AutoTokenizer

    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tokens import decode_text, skipped_tokens

    tok = AutoTokenizer.from_pretrained(str(tiny_llama.path))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tok.chat_template = MISTRAL
    folder = tmp_path / "special"
    import shutil

    shutil.copytree(tiny_llama.path, folder)
    tok.save_pretrained(str(folder))
    info = resolve_model(str(folder))
    (marker,) = tok.convert_tokens_to_ids(["[TOOL_CALLS]"])
    assert skipped_tokens(info, ["[TOOL_CALLS]", "<tool_call>", "<|python_tag|>"]) == {marker: "[TOOL_CALLS]"}
    assert decode_text(info, [marker]) == ""
