"""The field walk (issue #38, item 3): every top-level field of OpenAI's chat-completions and
completions requests, taken from the installed ``openai`` package's own request types (a field a
new client release adds shows up here), is either honoured by ``decode --serve`` (an assertion
that it had its effect) or refused with 400 naming it (``param`` = the field). Nothing is
accepted and ignored.

A real server on 127.0.0.1 (torch, a tiny model, float32), the real ``openai`` client; every
field is sent in the request body as the client would send it (``extra_body``, so the walk does
not depend on the client's own keyword arguments). ``CHECKS`` is the table: field -> how it is
checked. The tool-call fields may be either: refused naming them, or accepted and read (a
malformed value refused naming them; their behaviour is tested in test_serve_tools.py);
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
            assert err.body["param"] in (field, "tools"), err.body
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


def test_the_table_covers_the_clients_fields():
    """Every field of the installed client's request types has its check (a new one: decide it)."""
    assert sorted(CHECKS["chat"]) == chat_fields()
    assert sorted(CHECKS["completion"]) == completion_fields()


@pytest.mark.parametrize("route, field", [("chat", f) for f in chat_fields()] +
                         [("completion", f) for f in completion_fields()])
def test_each_field_is_honoured_or_refused(server, tiny_llama, route, field):
    check = CHECKS[route].get(field)
    assert check is not None, f"{route} field {field!r} (new in this openai release?) has no check: decide it"
    check(Walk(server, route, tiny_llama), field)
