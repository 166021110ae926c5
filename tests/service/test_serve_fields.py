"""The field walk (issues #38 and #49, item 3): every top-level field of OpenAI's chat-completions
and completions requests, taken from the installed ``openai`` package's own request types (a
field a new client release adds shows up here), and of Anthropic's Messages requests, taken
from the installed ``anthropic`` package's, is either honoured by ``decode --serve`` (an
assertion that it had its effect) or refused with 400 naming it (``param`` = the field on the
OpenAI routes; the message names it in Anthropic's shape). So are the extensions every route
takes (``top_k``, ``min_p``, ``repetition_penalty``: their exact rules are checked in
test_serve_sampling.py); and a field no route knows (an invented name, another server's
extension) is refused naming it. Nothing is accepted and ignored.

A real server on 127.0.0.1 (torch, a tiny model, float32), the real ``openai`` client; every
field is sent in the request body as the client would send it (``extra_body``, so the walk does
not depend on the client's own keyword arguments). ``CHECKS`` is the table: field -> how it is
checked. The tool-call fields may be either: refused naming them, or accepted and read (a
malformed value refused naming them; on this tiny model a good value is read and rendered into
a prompt past its 256-token context, a 400 context_length_exceeded; their behaviour is tested in
test_serve_tools.py and test_generic_tools.py);
``response_format`` is honoured (the json modes: test_serve_structured.py).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import pytest

from serve_kit import DecodeServer  # first: the module skipped without Starlette or prometheus_client

openai = pytest.importorskip("openai")

from muser_cli.model.tokens import decode_text, encode_prompt  # noqa: E402

PROMPT = "The committee met on a grey Tuesday to decide where the new bridge would go, and"
CHAT = [{"role": "user", "content": "Where should the new bridge go, and why?"}]


def chat_fields() -> list[str]:
    from openai.types.chat.completion_create_params import CompletionCreateParamsBase

    return sorted(CompletionCreateParamsBase.__annotations__)


def completion_fields() -> list[str]:
    from openai.types.completion_create_params import CompletionCreateParamsBase

    return sorted(CompletionCreateParamsBase.__annotations__)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    srv = DecodeServer(tmp_path_factory.mktemp("home"), "-m", str(tiny_llama.path), "--dtype", "float32",
                       "--threads", "1", "--no-reuse", "--max-batch", "4")
    yield srv
    srv.stop()


class Walk:
    """One route of the live server: ``ask(**fields)`` sends a request of that route (the base
    request plus ``fields`` in the body) and gives the parsed answer."""

    def __init__(self, server: DecodeServer, route: str, info: Any) -> None:
        self.server, self.route, self.info = server, route, info
        self.client = server.client()
        texts = [decode_text(info, [t], skip_special_tokens=False) for t in range(info.vocab_size)]
        # a token the checks push with logit_bias: one whose text no other token has
        self.x = next(t for t in range(100, info.vocab_size) if texts[t].strip().isalpha() and texts.count(texts[t]) == 1)
        self.unique = {t for t in texts if texts.count(t) == 1}  # texts that name one token

    @property
    def chat(self) -> bool:
        return self.route == "chat"

    def ask(self, *, stream: bool = False, base: bool = True, **fields: Any) -> Any:
        body = {"max_tokens": 6, "temperature": 0} if base else {}
        body.update(fields)
        if self.chat:
            return self.client.chat.completions.create(model="default", messages=body.pop("messages", CHAT),
                                                       stream=stream, extra_body=body)
        return self.client.completions.create(model="default", prompt=body.pop("prompt", PROMPT), stream=stream,
                                              extra_body=body)

    def text(self, r: Any, i: int = 0) -> str:
        c = sorted(r.choices, key=lambda c: c.index)[i]
        return c.message.content if self.chat else c.text

    def tokens(self, r: Any) -> list[str]:
        lp = r.choices[0].logprobs
        return [c.token for c in lp.content] if self.chat else list(lp.tokens)

    def logprobs(self, k: int = 0) -> dict[str, Any]:
        return {"logprobs": True, "top_logprobs": k} if self.chat else {"logprobs": min(k, 5)}

    def refused(self, field: str, value: Any, **more: Any) -> None:
        with pytest.raises(openai.BadRequestError) as err:
            self.ask(**{field: value}, **more)
        assert err.value.status_code == 400 and err.value.body["param"] == field, err.value.body

    def refused_or_read(self, field: str, good: Any, bad: Any, **more: Any) -> None:
        """Refused naming it; or accepted, and then read: a malformed value is refused naming it."""
        try:
            self.ask(**{field: good}, **more)
        except openai.BadRequestError as err:  # this field, or the tools (a template that cannot take them)
            if err.body["code"] != "context_length_exceeded":  # (read, rendered: tools told in the generic format
                assert err.body["param"] in (field, "tools"), err.body  # take more than this tiny model's 256)
                if err.body["param"] == field:
                    return
        self.refused(field, bad, **more)

    def token_text(self, token: int) -> str:
        return decode_text(self.info, [token], skip_special_tokens=False)


# ----------------------------------------------------------------------------- the checks, one a field
def _refused(value: Any, **more: Any) -> Callable[[Walk, str], None]:
    return lambda w, field: w.refused(field, value, **more)


def _max_tokens(w: Walk, field: str) -> None:  # the end token biased away: exactly this many tokens
    r = w.ask(**{field: 3}, logit_bias={str(t): -100 for t in w.info.eos_token_ids})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    w.refused(field, 0)


def _messages_or_prompt(w: Walk, field: str) -> None:
    other = [{"role": "user", "content": "A much longer question about the river, the bridge and the town."}] \
        if w.chat else PROMPT + " the town council argued about it for a long time"
    for value in (CHAT if w.chat else PROMPT, other):
        r = w.ask(**{field: value})
        assert r.usage.prompt_tokens == len(encode_prompt(w.info, value, chat=w.chat))
    w.refused(field, [] if w.chat else "")


def _model(w: Walk, field: str) -> None:
    assert w.ask(model="default").choices
    with pytest.raises(openai.NotFoundError) as err:
        w.ask(model="another-model")
    assert err.value.body["param"] == "model"


def _n(w: Walk, field: str) -> None:
    r = w.ask(n=3, temperature=0.8, seed=4)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({w.text(r, i) for i in range(3)}) > 1
    w.refused(field, 9)


def _seed(w: Walk, field: str) -> None:
    a = w.text(w.ask(seed=21, temperature=1.0, max_tokens=8))
    assert w.text(w.ask(seed=21, temperature=1.0, max_tokens=8)) == a
    assert w.text(w.ask(seed=22, temperature=1.0, max_tokens=8)) != a
    w.refused(field, -1)


def _temperature(w: Walk, field: str) -> None:
    greedy = w.text(w.ask(temperature=0, max_tokens=8))
    assert w.text(w.ask(temperature=0, max_tokens=8, seed=3)) == greedy
    hot = {w.text(w.ask(temperature=1.5, max_tokens=8, seed=s)) for s in range(3)}
    assert hot - {greedy}
    w.refused(field, 2.5)


def _top_p(w: Walk, field: str) -> None:
    greedy = w.text(w.ask(temperature=0, max_tokens=8))
    assert all(w.text(w.ask(temperature=1.5, top_p=1e-9, max_tokens=8, seed=s)) == greedy for s in range(3))
    assert any(w.text(w.ask(temperature=1.5, top_p=1.0, max_tokens=8, seed=s)) != greedy for s in range(3))
    w.refused(field, 0)


def _stop(w: Walk, field: str) -> None:
    whole = w.text(w.ask(max_tokens=12))
    cut = next(i for i in range(len(whole) // 2, len(whole)) if whole[i:i + 2].strip() and whole.find(whole[i:i + 2]) == i)
    r = w.ask(max_tokens=12, stop=[whole[cut:cut + 2]])
    assert w.text(r) == whole[:cut] and r.choices[0].finish_reason == "stop"
    w.refused(field, [""])


def _stream_options(w: Walk, field: str) -> None:
    chunks = list(w.ask(stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in list(w.ask(stream=True))[-1:])
    w.refused(field, {"include_usage": True, "something": 1}, stream=True)


def _logit_bias(w: Walk, field: str) -> None:
    assert w.text(w.ask(logit_bias={str(w.x): 100})) == w.token_text(w.x) * 6
    w.refused(field, {"100000": 1})
    w.refused(field, {str(w.x): 101})


def _frequency_penalty(w: Walk, field: str) -> None:
    """A bias of 10 makes x the greedy pick every step; a frequency penalty of 2 takes 2 off it each
    time it was picked, so it stops coming once the bias is spent (at most 5 or 6 times)."""
    ask = {"max_tokens": 12, "logit_bias": {str(w.x): 10}, **w.logprobs()}
    x = w.token_text(w.x)
    assert w.tokens(w.ask(**ask)).count(x) == 12
    assert 1 <= w.tokens(w.ask(**ask, frequency_penalty=2.0)).count(x) <= 6
    w.refused(field, 2.5)


def _presence_penalty(w: Walk, field: str) -> None:
    """Each greedy pick with a presence penalty P is the largest logit after P is taken off every
    token already generated: checked on the model's own logprobs the answer carries (a top entry
    whose text several tokens share is bounded, not known, to have been generated); a penalty of
    2 or -2 changes the plain output."""
    ask = {"max_tokens": 10, **w.logprobs(20)}
    plain = w.tokens(w.ask(**ask))
    changed = False
    for penalty in (2.0, -2.0):
        r = w.ask(**ask, presence_penalty=penalty)
        got = w.tokens(r)
        changed |= got != plain
        lp = r.choices[0].logprobs
        if w.chat:
            tops = [[(t.token, t.logprob) for t in c.top_logprobs] for c in lp.content]
            own = [c.logprob for c in lp.content]
        else:
            tops, own = [list(t.items()) for t in lp.top_logprobs], list(lp.token_logprobs)
        checked = 0
        for i, token in enumerate(got):
            seen = set(got[:i])
            if token not in w.unique:
                continue
            mine = own[i] - (penalty if token in seen else 0.0)
            for text, raw in tops[i]:
                least = raw - (penalty if text in seen else 0.0) if text in w.unique else raw - max(penalty, 0.0)
                assert mine >= least - 1e-4, (penalty, i, token, text, raw, seen)
            checked += 1
        assert checked >= 3, (penalty, checked)
    assert changed, "neither penalty changed the output"
    w.refused(field, -2.5)


def _logprobs(w: Walk, field: str) -> None:
    r = w.ask(**w.logprobs(2))
    if w.chat:
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
        w.refused(field, "yes")
    else:
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == r.usage.completion_tokens and all(len(t) <= 2 for t in lp.top_logprobs)
        w.refused(field, 6)
    assert r.choices[0].logprobs is not None
    assert w.ask().choices[0].logprobs is None


def _top_logprobs(w: Walk, field: str) -> None:
    r = w.ask(logprobs=True, top_logprobs=3)
    assert all(len(c.top_logprobs) == 3 for c in r.choices[0].logprobs.content)
    w.refused(field, 3)  # without logprobs: true
    w.refused(field, 21, logprobs=True)


def _identifier(w: Walk, field: str) -> None:
    """Written to the request's log line (an operator traces a user's requests by it)."""
    name = f"walk-{w.route}-{field}"
    w.ask(**{field: name})
    deadline = time.monotonic() + 10  # the line comes through the server's stderr
    while not any(r.get("user") == name for r in w.server.records()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(r.get("user") == name for r in w.server.records()), name
    w.refused(field, 12)


def _store(w: Walk, field: str) -> None:
    assert w.ask(store=False).choices  # nothing is stored: what false asks
    w.refused(field, True)


def _modalities(w: Walk, field: str) -> None:
    assert w.text(w.ask(modalities=["text"]))
    w.refused(field, ["text", "audio"])


def _best_of(w: Walk, field: str) -> None:
    r = w.ask(best_of=2, n=2, temperature=0.9, seed=1)  # best_of = n: every candidate is returned
    assert len(r.choices) == 2
    w.refused(field, 3)


def _response_format(w: Walk, field: str) -> None:
    """Honoured by constrained decoding (test_serve_structured.py): a strict json_schema answer
    parses and validates; a json_object answer is an object from its first token (whole: it
    parses); a malformed value is refused naming it."""
    import jsonschema

    assert w.ask(response_format={"type": "text"}).choices
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = w.ask(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}},
              max_tokens=64)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(w.text(r)), schema)
    r = w.ask(response_format={"type": "json_object"}, max_tokens=16)
    assert w.text(r).startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(w.text(r)), dict)
    w.refused(field, {"type": "json_schema"})


TOOLS = [{"type": "function", "function": {"name": "where", "parameters": {"type": "object", "properties": {}}}}]
CHECKS: dict[str, dict[str, Callable[[Walk, str], None]]] = {
    "chat": {
        "audio": _refused({"voice": "alloy", "format": "wav"}),
        "frequency_penalty": _frequency_penalty,
        "function_call": _refused("auto"),
        "functions": _refused([{"name": "f", "parameters": {"type": "object"}}]),
        "logit_bias": _logit_bias,
        "logprobs": _logprobs,
        "max_completion_tokens": _max_tokens,
        "max_tokens": _max_tokens,
        "messages": _messages_or_prompt,
        "metadata": _refused({"k": "v"}),
        "modalities": _modalities,
        "model": _model,
        "moderation": _refused({"type": "auto"}),
        "n": _n,
        "parallel_tool_calls": lambda w, f: w.refused_or_read(f, False, "no", tools=TOOLS),
        "prediction": _refused({"type": "content", "content": "x"}),
        "presence_penalty": _presence_penalty,
        "prompt_cache_key": _refused("k"),
        "prompt_cache_options": _refused({"ttl": "1h"}),
        "prompt_cache_retention": _refused("24h"),
        "reasoning_effort": _refused("low"),
        "response_format": _response_format,
        "safety_identifier": _identifier,
        "seed": _seed,
        "service_tier": _refused("flex"),
        "stop": _stop,
        "store": _store,
        "stream_options": _stream_options,
        "temperature": _temperature,
        "tool_choice": lambda w, f: w.refused_or_read(f, "auto", "sometimes", tools=TOOLS),
        "tools": lambda w, f: w.refused_or_read(f, TOOLS, [{"type": "retrieval"}]),
        "top_logprobs": _top_logprobs,
        "top_p": _top_p,
        "user": _identifier,
        "verbosity": _refused("low"),
        "web_search_options": _refused({}),
    },
    "completion": {
        "best_of": _best_of,
        "echo": _refused(True),
        "frequency_penalty": _frequency_penalty,
        "logit_bias": _logit_bias,
        "logprobs": _logprobs,
        "max_tokens": _max_tokens,
        "model": _model,
        "n": _n,
        "presence_penalty": _presence_penalty,
        "prompt": _messages_or_prompt,
        "seed": _seed,
        "stop": _stop,
        "stream_options": _stream_options,
        "suffix": _refused(" and so on."),
        "temperature": _temperature,
        "top_p": _top_p,
        "user": _identifier,
    },
}


# ----------------------------------------------------------------------------- beyond the clients' fields
def _top_k(w: Any, field: str) -> None:
    """1: the most likely token only, so a hot sample is the greedy answer; 0 (and -1): off."""
    greedy = w.text(w.ask(temperature=0, max_tokens=8))
    assert all(w.text(w.ask(temperature=1.0, top_k=1, max_tokens=8, seed=s)) == greedy for s in range(3))
    assert any(w.text(w.ask(temperature=1.0, top_k=0, max_tokens=8, seed=s)) != greedy for s in range(3))
    if w.route != "messages":  # (the Messages API has no seed)
        assert w.text(w.ask(temperature=1.0, top_k=-1, max_tokens=8, seed=0)) == \
            w.text(w.ask(temperature=1.0, max_tokens=8, seed=0))
    w.refused(field, -2)
    w.refused(field, 1.5)


def _min_p(w: Any, field: str) -> None:
    """1: only tokens as likely as the most likely one stay, so a hot sample is the greedy answer."""
    greedy = w.text(w.ask(temperature=0, max_tokens=8))
    assert all(w.text(w.ask(temperature=1.0, min_p=1.0, max_tokens=8, seed=s)) == greedy for s in range(3))
    assert any(w.text(w.ask(temperature=1.0, min_p=0.0, max_tokens=8, seed=s)) != greedy for s in range(3))
    w.refused(field, 1.5)


def _repetition_penalty(w: Any, field: str) -> None:
    """2 changes the greedy answer (the prompt's tokens and the answer's own made less likely); 1 is none."""
    plain = w.text(w.ask(max_tokens=8))
    assert w.text(w.ask(max_tokens=8, repetition_penalty=2.0)) != plain
    assert w.text(w.ask(max_tokens=8, repetition_penalty=1.0)) == plain
    w.refused(field, 0)
    w.refused(field, 2.5)


EXTENSIONS: dict[str, Callable[[Any, str], None]] = {"top_k": _top_k, "min_p": _min_p,
                                                     "repetition_penalty": _repetition_penalty}
#: Fields no route of this server knows: invented, and other servers' extensions (vLLM's, TGI's).
INVENTED = ["foo_bar", "max_new_tokens", "ignore_eos", "top_a", "chat_template_kwargs"]


class MessagesWalk:
    """``/v1/messages`` of the live server through the real ``anthropic`` client: ``ask(**fields)``
    sends the base request (greedy, 6 tokens) with ``fields`` in the body."""

    route = "messages"

    def __init__(self, server: DecodeServer) -> None:
        self.server = server
        self.client = anthropic().Anthropic(base_url=f"http://{server.address}", api_key="unused", max_retries=0,
                                            timeout=60)

    def ask(self, *, stream: bool = False, **fields: Any) -> Any:
        fields.pop("seed", None)  # the Messages API has none: the checks' samples are unseeded here
        body = {"model": "default", "max_tokens": 6, "messages": CHAT, "temperature": 0, **fields}
        return self.client.messages.create(model=body.pop("model"), max_tokens=body.pop("max_tokens"),
                                           messages=body.pop("messages"), stream=stream, extra_body=body)

    def text(self, m: Any) -> str:
        return "".join(b.text for b in m.content if b.type == "text")

    def refused(self, field: str, value: Any, *, also: tuple[str, ...] = ()) -> None:
        with pytest.raises(anthropic().BadRequestError) as err:
            self.ask(**{field: value})
        body = err.value.body
        assert err.value.status_code == 400 and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error", body
        assert any(name in body["error"]["message"] for name in (field, *also)), body


def anthropic() -> Any:
    return pytest.importorskip("anthropic")


def messages_fields() -> list[str]:
    anthropic()
    from anthropic.types.message_create_params import MessageCreateParamsNonStreaming, MessageCreateParamsStreaming

    return sorted(set(MessageCreateParamsNonStreaming.__annotations__) |
                  set(MessageCreateParamsStreaming.__annotations__))


def _m_max_tokens(w: MessagesWalk, field: str) -> None:
    m = w.ask(max_tokens=3)
    assert m.usage.output_tokens <= 3 and (m.usage.output_tokens == 3) == (m.stop_reason == "max_tokens")
    w.refused(field, 0)


def _m_messages(w: MessagesWalk, field: str) -> None:
    short = w.ask().usage.input_tokens
    longer = w.ask(messages=[{"role": "user", "content": CHAT[0]["content"] + " And what would it cost the town?"}])
    assert longer.usage.input_tokens > short
    w.refused(field, [])


def _m_system(w: MessagesWalk, field: str) -> None:
    assert w.ask(system="Answer briefly.").usage.input_tokens > w.ask().usage.input_tokens
    w.refused(field, 5)


def _m_model(w: MessagesWalk, field: str) -> None:
    assert w.ask(model="default").content is not None
    with pytest.raises(anthropic().NotFoundError):
        w.ask(model="another-model")


def _m_stop_sequences(w: MessagesWalk, field: str) -> None:
    whole = w.text(w.ask(max_tokens=12))
    cut = next(i for i in range(len(whole) // 2, len(whole)) if whole[i:i + 2].strip() and whole.find(whole[i:i + 2]) == i)
    m = w.ask(max_tokens=12, stop_sequences=[whole[cut:cut + 2]])
    assert w.text(m) == whole[:cut] and m.stop_reason == "stop_sequence" and m.stop_sequence == whole[cut:cut + 2]
    w.refused(field, [""])


def _m_stream(w: MessagesWalk, field: str) -> None:
    whole = w.text(w.ask())
    events = list(w.ask(stream=True))
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta") \
        == whole and events[-1].type == "message_stop"
    w.refused(field, "yes")


def _m_metadata(w: MessagesWalk, field: str) -> None:
    assert w.text(w.ask(metadata={"user_id": "u1"})) == w.text(w.ask())  # accepted: it changes nothing
    w.refused(field, {"user_id": "u1", "other": 1})


A_TOOLS = [{"name": "where", "input_schema": {"type": "object", "properties": {}}}]


def _m_tools_or_choice(good: dict[str, Any], bad: dict[str, Any]) -> Callable[[MessagesWalk, str], None]:
    """Refused naming it (or the tools); or read (on this tiny model: rendered past its context), a
    malformed value refused naming it (their behaviour: test_serve_messages.py)."""
    def check(w: MessagesWalk, field: str) -> None:
        try:
            w.ask(**good)
        except anthropic().BadRequestError as err:
            message = err.body["error"]["message"]
            if "longer than the model's context" not in message:  # read and rendered (the generic format's
                assert field in message or "tools" in message, err.body  # tools take more than 256 tokens)
                return
        with pytest.raises(anthropic().BadRequestError) as err:
            w.ask(**bad)
        assert field in err.value.body["error"]["message"], err.value.body
    return check


def _m_refused(value: Any) -> Callable[[MessagesWalk, str], None]:
    return lambda w, field: w.refused(field, value)


MESSAGES_CHECKS: dict[str, Callable[[MessagesWalk, str], None]] = {
    "cache_control": _m_refused({"type": "ephemeral"}),
    "container": _m_refused("container_1"),
    "diagnostics": _m_refused({}),
    "inference_geo": _m_refused("us"),
    "max_tokens": _m_max_tokens,
    "messages": _m_messages,
    "metadata": _m_metadata,
    "model": _m_model,
    "output_config": _m_refused({"effort": "low"}),
    "service_tier": _m_refused("auto"),
    "speed": _m_refused("fast"),
    "stop_sequences": _m_stop_sequences,
    "stream": _m_stream,
    "system": _m_system,
    "thinking": _m_refused({"type": "enabled", "budget_tokens": 1024}),
    "tool_choice": _m_tools_or_choice({"tools": A_TOOLS, "tool_choice": {"type": "auto"}},
                                      {"tools": A_TOOLS, "tool_choice": {"type": "sometimes"}}),
    "tools": _m_tools_or_choice({"tools": A_TOOLS}, {"tools": [{"name": "x", "input_schema": {"type": "array"}}]}),
    "user_profile_id": _m_refused("p1"),
    "workspace_id": _m_refused("w1"),
}


def test_the_table_covers_the_clients_fields():
    """Every field of the installed client's request types has its check (a new one: decide it)."""
    assert sorted(CHECKS["chat"]) == chat_fields()
    assert sorted(CHECKS["completion"]) == completion_fields()
    assert sorted(MESSAGES_CHECKS) == messages_fields()


@pytest.mark.parametrize("route, field", [("chat", f) for f in chat_fields()] +
                         [("completion", f) for f in completion_fields()])
def test_each_field_is_honoured_or_refused(server, tiny_llama, route, field):
    check = CHECKS[route].get(field)
    assert check is not None, f"{route} field {field!r} (new in this openai release?) has no check: decide it"
    check(Walk(server, route, tiny_llama), field)


@pytest.mark.parametrize("field", messages_fields() if __import__("importlib").util.find_spec("anthropic") else [])
def test_each_messages_field_is_honoured_or_refused(server, field):
    check = MESSAGES_CHECKS.get(field)
    assert check is not None, f"messages field {field!r} (new in this anthropic release?) has no check: decide it"
    check(MessagesWalk(server), field)


@pytest.mark.parametrize("route, field", [(r, f) for r in ("chat", "completion", "messages") for f in EXTENSIONS])
def test_each_extension_is_honoured_on_every_route(server, tiny_llama, route, field):
    w = MessagesWalk(server) if route == "messages" else Walk(server, route, tiny_llama)
    EXTENSIONS[field](w, field)


@pytest.mark.parametrize("route", ["chat", "completion", "messages"])
def test_a_field_no_route_knows_is_refused_naming_it(server, tiny_llama, route):
    w = MessagesWalk(server) if route == "messages" else Walk(server, route, tiny_llama)
    for name in INVENTED:
        w.refused(name, 1)
    w.refused("foo_bar", None)  # even null: a key the route does not read
