"""The OpenAI-compatible request shapes, without any web framework: a request body becomes a
:class:`Ask` (or an :class:`ApiError` with the status OpenAI would answer). The replies' shapes
(JSON objects and stream chunks) are :mod:`muser_cli.service.replies`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from muser_cli.errors import MuserError
from muser_cli.service.schema import schema_problem

MAX_BODY = 8 << 20  # bytes of a request body (a prompt far past any context is refused before parsing)
MAX_STOPS = 4
MAX_DEPTH = 32  # nesting of a request body's arrays and objects (OpenAI's shapes need 5)
MAX_INT = (1 << 63) - 1  # the largest integer field value (a seed every engine's generator takes)
#: The message roles OpenAI defines that this server renders; any other is refused, so nothing a
#: client sends can put its own text where the chat template writes a role.
ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Ask:
    """One generation request, checked."""

    kind: str  # "chat" | "completion"
    model: str
    prompt: str | list[dict[str, Any]]  # the text, or the chat turns
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    prefill_deadline: float | None = None  # extension: seconds to wait for a producer
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, checked (chat only)
    tool_choice: str | dict[str, Any] = "auto"  # "auto" | "none" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True
    n: int = 1  # choices, each its own sequence (choice i seeded seed + i)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids checked by the worker
    top_k: int = 0  # extensions, as vLLM and llama.cpp take them (engines/base.py Sampling): 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    logprobs: int | None = None  # None: none; k: each token's logprob and the k most likely (chat: top_logprobs)
    user: str | None = None  # user / safety_identifier: written to the request's log line
    # structured output (chat): None (text), {"type": "json_object"}, or {"type": "json_schema", "schema", "strict"}
    response_format: dict[str, Any] | None = None

    @property
    def chat(self) -> bool:
        return self.kind == "chat"

    def filters(self, prompt: Sequence[int]) -> dict[str, Any]:
        """``top_k``, ``min_p`` and ``repetition_penalty`` as the engines' ``Sampling`` takes them; a
        repetition penalty counts the ``prompt``'s tokens as seen (transformers' and vLLM's rule)."""
        return {"top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                "seen": tuple(int(t) for t in prompt) if self.repetition_penalty != 1.0 else ()}


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body; every malformed body is a 400 in OpenAI's shape
    (too deep, an integer past Python's digit limit, a lone surrogate: not only bad syntax)."""
    if len(raw) > MAX_BODY:
        raise ApiError(413, f"the request body is over {MAX_BODY} bytes")
    depth = _depth(raw)
    if depth > MAX_DEPTH:
        raise ApiError(400, f"the request body nests {depth} levels deep; at most {MAX_DEPTH} are accepted")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, int digits
        detail = " ".join(str(exc).split())[:160]
        raise ApiError(400, f"the request body is not valid JSON: {detail}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_text(body, "")
    return body


def _depth(raw: bytes) -> int:
    """How deep the body's brackets nest, outside strings (counted before the parser recurses)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    return deepest
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _check_text(value: Any, where: str) -> None:
    """Every string of the body is valid Unicode: JSON's escapes can spell a lone surrogate
    (``"\\ud800"``), which no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"{where or 'the body'} holds a lone surrogate: not valid Unicode text",
                           param=where.split(".")[0].split("[")[0] or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where or "a key")
            _check_text(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{where}[{i}]")


def number_field(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo}, {hi}], got {value!r}", param=key)
    return float(value)


def int_field(body: dict, key: str, lo: int, hi: int = MAX_INT) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        shown = repr(value) if not isinstance(value, int) or abs(value) < 10 ** 30 else "a larger one"
        raise ApiError(400, f"{key} must be an integer in [{lo}, {hi}], got {shown}", param=key)
    return value


def _text_of(content: Any, i: int) -> str:
    if isinstance(content, list):  # content parts: only text ones
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}]: only text content parts are supported", param="messages")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or text parts", param="messages")
    return content


_TURN_KEYS = {"role", "content", "name"}


def _content(turn: Any, i: int) -> dict[str, Any]:
    if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a role", param="messages")
    role = turn["role"]
    if role not in ROLES + ("tool",):
        shown = repr(role) if len(role) <= 40 else repr(role[:40]) + "..."
        what = "function messages (the deprecated form of tool messages) are not supported" if role == "function" \
            else f"the role {shown} is not one of {', '.join(ROLES + ('tool',))}"
        raise ApiError(400, f"messages[{i}]: {what}", param="messages")
    allowed = _TURN_KEYS | ({"tool_calls", "refusal"} if role == "assistant" else set()) | \
        ({"tool_call_id"} if role == "tool" else set())
    extra = sorted(k for k, v in turn.items() if k not in allowed and not (v is None or v == [] or v == {}))
    if extra:
        raise ApiError(400, f"messages[{i}].{extra[0]} is not supported on a {role} message", param="messages")
    name = turn.get("name")
    if name is not None and (not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum()
                             or len(name) > 64):
        raise ApiError(400, f"messages[{i}].name must be up to 64 letters, digits, '_' or '-'", param="messages")
    out: dict[str, Any] = {"role": role, "content": _text_of(turn.get("content"), i)}
    if name is not None:
        out["name"] = name
    if role == "tool":
        cid = turn.get("tool_call_id")
        if not isinstance(cid, str) or not 0 < len(cid) <= 256:
            raise ApiError(400, f"messages[{i}].tool_call_id must be the id of the call it answers",
                           param="messages")
        out["tool_call_id"] = cid
    if role == "assistant" and turn.get("refusal") is not None:
        raise ApiError(400, f"messages[{i}].refusal is not supported", param="messages")
    if role == "assistant" and turn.get("tool_calls") is not None:
        calls = turn["tool_calls"]
        if not isinstance(calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list", param="messages")
        out["tool_calls"] = [_past_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]
        if not out["tool_calls"]:
            del out["tool_calls"]
    return out


def is_name(name: str) -> bool:
    """OpenAI's function and participant names: 1 to 64 letters, digits, '_' or '-'."""
    return 0 < len(name) <= 64 and name.isascii() and name.replace("_", "").replace("-", "").isalnum()


def _past_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant message's earlier call: ``{"id", "type": "function", "function": {"name",
    "arguments": a JSON object as a string}}``."""
    if not isinstance(call, dict) or call.get("type", "function") != "function" or \
            set(call) - {"id", "type", "function"}:
        raise ApiError(400, f"{where} must be {{\"id\", \"type\": \"function\", \"function\"}}", param="messages")
    fn = call.get("function")
    if not isinstance(call.get("id"), str) or not 0 < len(call["id"]) <= 256:
        raise ApiError(400, f"{where}.id must be a non-empty string", param="messages")
    if not isinstance(fn, dict) or set(fn) - {"name", "arguments"} or not isinstance(fn.get("name"), str) \
            or not is_name(fn["name"]):
        raise ApiError(400, f"{where}.function must have a name (up to 64 letters, digits, '_' or '-') and "
                            "arguments", param="messages")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        raise ApiError(400, f"{where}.function.arguments must be a JSON object written as a string",
                       param="messages")
    try:
        parsed = json.loads(args, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise ApiError(400, f"{where}.function.arguments is not a JSON object", param="messages")
    return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


MAX_TOOLS = 128
_SCHEMA_TYPES = ("object",)


def parse_tools(body: dict) -> list[dict[str, Any]] | None:
    """``tools``: OpenAI function tools, each ``{"type": "function", "function": {"name",
    "description"?, "parameters"?}}`` (parameters: a JSON schema of type object)."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools must be a list of up to {MAX_TOOLS} function tools", param="tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError(400, f"{where}.type must be 'function' (the only tools this server calls)", param="tools")
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise ApiError(400, f"{where}.{extra[0]} is not supported", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ApiError(400, f"{where}.function must be an object", param="tools")
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise ApiError(400, f"{where}.function.{extra[0]}: not supported", param="tools")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ApiError(400, f"{where}.function.strict must be true or false", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not is_name(name):
            raise ApiError(400, f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'", param="tools")
        if name in seen:
            raise ApiError(400, f"{where}.function.name {name!r} is given twice", param="tools")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ApiError(400, f"{where}.function.description must be a string", param="tools")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict) or params.get("type", "object") not in _SCHEMA_TYPES:
                raise ApiError(400, f"{where}.function.parameters must be a JSON schema of type 'object'",
                               param="tools")
            props = params.get("properties")
            if props is not None and (not isinstance(props, dict) or
                                      not all(isinstance(v, dict) for v in props.values())):
                raise ApiError(400, f"{where}.function.parameters.properties must map names to schemas",
                               param="tools")
            req = params.get("required")
            if req is not None and (not isinstance(req, list) or not all(isinstance(r, str) for r in req)):
                raise ApiError(400, f"{where}.function.parameters.required must be a list of names", param="tools")
        entry: dict[str, Any] = {"name": name}
        if desc is not None:
            entry["description"] = desc
        entry["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        if strict:  # honoured by checking each call's arguments against the schema (tools.py), so it must be one
            problem = schema_problem(entry["parameters"])  # whose every keyword is checked
            if problem:
                raise ApiError(400, f"{where}.function.parameters (strict): {problem}", param="tools")
            entry["strict"] = True  # not rendered: plan_tools gives the template the tools without it
        out.append({"type": "function", "function": entry})
    return out


def parse_tool_choice(body: dict, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if choice == "none":
        return choice
    if not tools:  # as OpenAI: a choice among no tools is refused, not ignored
        raise ApiError(400, f"tool_choice {str(choice)[:64]!r} without tools is not supported", param="tool_choice")
    if choice in ("auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "function"} \
            and isinstance(choice["function"], dict) and set(choice["function"]) == {"name"}:
        name = choice["function"]["name"]
        names = [t["function"]["name"] for t in tools or []]
        if name not in names:
            raise ApiError(400, f"tool_choice names {str(name)[:64]!r}, which is not one of the tools given",
                           param="tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise ApiError(400, "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}", param="tool_choice")


MAX_N = 8
MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}
MAX_LOGIT_BIAS = 300
#: Fields accepted only with the value that asks for nothing (OpenAI's default, or what this server does).
_ONLY = {"echo": (False,), "suffix": ("",), "functions": ([],), "function_call": ("none",), "prediction": (),
         "audio": (), "modalities": (["text"],), "store": (False,), "metadata": ({},), "service_tier": (),
         "reasoning_effort": (), "verbosity": (), "web_search_options": (), "moderation": (),
         "prompt_cache_key": (), "prompt_cache_options": (), "prompt_cache_retention": ()}
_CHAT_ONLY = ("messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs", "functions", "function_call",
              "prediction", "audio", "modalities", "store", "metadata", "service_tier", "reasoning_effort",
              "verbosity", "web_search_options", "moderation", "prompt_cache_key", "prompt_cache_options",
              "prompt_cache_retention")
_COMPLETION_ONLY = ("prompt", "echo", "suffix", "best_of")
#: Every field a route reads (honoured, or accepted only as :data:`_ONLY` says); any other is refused
#: naming it, never accepted and ignored. ``top_k``, ``min_p``, ``repetition_penalty`` and
#: ``muser_prefill_deadline`` are extensions (the first three as vLLM and llama.cpp's servers take them).
_BOTH = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
         "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "safety_identifier",
         "response_format", "top_k", "min_p", "repetition_penalty", "muser_prefill_deadline")
FIELDS = {"chat": frozenset(_BOTH + _CHAT_ONLY + ("max_completion_tokens",)),
          "completion": frozenset(_BOTH + _COMPLETION_ONLY)}
MAX_REPETITION_PENALTY = 2.0  # vLLM's bound


def sampling_extensions(body: dict) -> dict[str, Any]:
    """``top_k`` (an integer >= 0; 0 or -1: off), ``min_p`` (in [0, 1]; 0: off) and
    ``repetition_penalty`` (in (0, 2]; 1: off) as :class:`Ask`'s fields; a 400 naming a malformed one."""
    top_k = body.get("top_k")
    if top_k == -1 and not isinstance(top_k, bool):  # vLLM's "off"
        top_k = 0
    else:
        top_k = int_field(body, "top_k", 0) or 0
    penalty = body.get("repetition_penalty")
    if penalty is not None and (isinstance(penalty, bool) or not isinstance(penalty, (int, float))
                                or not math.isfinite(penalty) or not 0 < penalty <= MAX_REPETITION_PENALTY):
        raise ApiError(400, f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY}] (1: none), got "
                            f"{penalty!r}"[:160], param="repetition_penalty")
    return {"top_k": top_k, "min_p": number_field(body, "min_p", 0.0, 0.0, 1.0),
            "repetition_penalty": float(penalty) if penalty is not None else 1.0}


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: token ids (decimal strings) -> a number in [-100, 100] added to the logit."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias must map up to {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]",
                       param="logit_bias")
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12):
            raise ApiError(400, f"logit_bias: {str(key)[:40]!r} is not a token id", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias[{key}] must be a number in [-100, 100], got {value!r}"[:160],
                           param="logit_bias")
        if value:
            out.append((int(key), float(value)))
    return tuple(sorted(out))


def _logprobs(body: dict, kind: str) -> int | None:
    """Chat: ``logprobs`` true and ``top_logprobs`` 0..20; completions: ``logprobs`` 0..5."""
    top = MAX_TOP_LOGPROBS[kind]
    if kind != "chat":
        if isinstance(body.get("logprobs"), bool):
            raise ApiError(400, f"logprobs must be an integer in [0, {top}] on completions", param="logprobs")
        return int_field(body, "logprobs", 0, top)
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise ApiError(400, "logprobs must be true or false", param="logprobs")
    k = int_field(body, "top_logprobs", 0, top)
    if k is not None and not asked:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (k or 0) if asked else None


def _response_format(body: dict, kind: str) -> dict[str, Any] | None:
    """``response_format``: ``text`` (None), ``json_object``, or ``json_schema`` ({"name", "schema",
    "strict", "description"}): honoured by constrained decoding (docs/serve.md, Structured output).
    A strict schema with a keyword the grammar cannot enforce is refused naming it; a schema that
    is not strict is kept to as far as the grammar can (a keyword it cannot enforce is left out)."""
    fmt = body.get("response_format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    what = fmt.get("type") if isinstance(fmt, dict) else fmt
    if what not in ("json_object", "json_schema") or not isinstance(fmt, dict):
        raise ApiError(400, f"response_format {str(what)[:40]!r} is not supported by this server "
                            "(text, json_object, json_schema)", param="response_format")
    if kind != "chat":
        raise ApiError(400, "response_format json is not supported on /v1/completions (chat only)",
                       param="response_format")
    extra = sorted(set(fmt) - {"type", "json_schema"} if what == "json_schema" else set(fmt) - {"type"})
    if extra:
        raise ApiError(400, f"response_format.{str(extra[0])[:40]} is not supported", param="response_format")
    if what == "json_object":
        return {"type": "json_object"}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema must be an object with a name and a schema",
                       param="response_format")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise ApiError(400, f"response_format.json_schema.{str(extra[0])[:40]} is not supported",
                       param="response_format")
    name, schema, strict = spec.get("name"), spec.get("schema", {}), spec.get("strict")
    if not isinstance(name, str) or not is_name(name):
        raise ApiError(400, "response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'",
                       param="response_format")
    if not isinstance(schema, dict) or (strict is not None and not isinstance(strict, bool)) or \
            not isinstance(spec.get("description", ""), str):
        raise ApiError(400, "response_format.json_schema: schema must be an object, strict true or false, "
                            "description a string", param="response_format")
    from muser_cli.engines.constraint import schema_problem as grammar_problem  # lazy: llguidance, when asked

    try:
        problem = grammar_problem(schema, lenient=not strict)
    except MuserError as exc:  # llguidance missing
        raise ApiError(400, f"response_format json_schema is not supported here: {exc}",
                       param="response_format") from None
    if problem:
        raise ApiError(400, f"response_format.json_schema.schema is not supported: {problem}"[:400],
                       param="response_format")
    return {"type": "json_schema", "schema": schema, "strict": bool(strict)}


def parse_ask(body: dict[str, Any], kind: str, *, default_max_tokens: int) -> Ask:
    """The request ``body`` of ``/v1/chat/completions`` (kind chat) or ``/v1/completions``."""
    for key in (_COMPLETION_ONLY if kind == "chat" else _CHAT_ONLY):
        if body.get(key) is not None and not (kind != "chat" and key in ("tools",) and body[key] == []) \
                and not (kind != "chat" and key == "tool_choice" and body[key] == "none"):
            where = "/v1/completions" if kind == "chat" else "/v1/chat/completions"
            what = "a completions" if kind == "chat" else "a chat completions"
            raise ApiError(400, f"{key} is {what} field ({where})", param=key)
    for key, ok in _ONLY.items():
        if body.get(key) is not None and body[key] not in ok:
            shown = json.dumps(body[key])[:60]
            raise ApiError(400, f"{key} {shown} is not supported by this server", param=key)
    n = int_field(body, "n", 1, MAX_N) or 1
    best_of = int_field(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != n:
        raise ApiError(400, "best_of other than n is not supported (no choice is ranked here)", param="best_of")
    unknown = sorted(k for k in body if k not in FIELDS["chat"] | FIELDS["completion"])
    if unknown:
        shown = unknown[0] if len(unknown[0]) <= 64 else unknown[0][:64] + "..."
        raise ApiError(400, f"{shown} is not a field this server reads: it refuses what it would ignore "
                            "(docs/serve.md lists the fields it reads)", param=shown)
    options = body.get("stream_options") or {}
    if isinstance(options, dict):
        extra = sorted(k for k, v in options.items() if k not in ("include_usage",) and
                       not (k == "include_obfuscation" and v in (None, False)))
        if extra:
            raise ApiError(400, f"stream_options.{extra[0]} is not supported", param="stream_options")
        if options and not body.get("stream"):
            raise ApiError(400, "stream_options is only for stream: true", param="stream_options")
    user = None
    for key in ("user", "safety_identifier"):
        value = body.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > 256):
            raise ApiError(400, f"{key} must be a string of up to 256 characters", param=key)
        user = value if value is not None else user
    fmt = _response_format(body, kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    if kind == "chat":
        turns = body.get("messages")
        if not isinstance(turns, list) or not turns:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        prompt: str | list[dict[str, Any]] = [_content(t, i) for i, t in enumerate(turns)]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string", param="prompt")
    most = int_field(body, "max_completion_tokens", 1)
    most = most if most is not None else int_field(body, "max_tokens", 1)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop must be a string or up to {MAX_STOPS} non-empty strings", param="stop")
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise ApiError(400, "stream must be true or false and stream_options an object", param="stream")
    deadline = body.get("muser_prefill_deadline")
    if deadline is not None:
        deadline = number_field(body, "muser_prefill_deadline", 0.0, 0.0, 3600.0)
    tools = parse_tools(body) if kind == "chat" else None
    if fmt is not None and tools and body.get("tool_choice") != "none":
        raise ApiError(400, "response_format json with tools is not supported (tool_choice 'required' or a named "
                            "function constrains a call's arguments)", param="response_format")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if body.get("parallel_tool_calls") is not None and not tools:
        raise ApiError(400, "parallel_tool_calls without tools is not supported", param="parallel_tool_calls")
    return Ask(kind=kind, model=model or "", prompt=prompt, max_tokens=most or default_max_tokens,
               n=n, presence_penalty=number_field(body, "presence_penalty", 0.0, -2.0, 2.0),
               frequency_penalty=number_field(body, "frequency_penalty", 0.0, -2.0, 2.0), logit_bias=_logit_bias(body),
               logprobs=_logprobs(body, kind), user=user, **sampling_extensions(body),
               tools=tools, tool_choice=parse_tool_choice(body, tools) if kind == "chat" else "auto",
               parallel_tool_calls=parallel,
               temperature=number_field(body, "temperature", 1.0, 0.0, 2.0), top_p=number_field(body, "top_p", 1.0, 1e-9, 1.0),
               seed=int_field(body, "seed", 0), stop=stop, stream=stream, include_usage=bool(options.get("include_usage")),
               prefill_deadline=deadline, response_format=fmt)


class Piece(str):
    """A piece of an answer's text as the worker gives it out, with the choice it belongs to
    (``choice``: its index) and its tokens' logprob entries (``logprobs``; None: not asked for)."""

    choice: int
    logprobs: list[dict[str, Any]] | None

    def __new__(cls, text: str, choice: int = 0, logprobs: list[dict[str, Any]] | None = None) -> "Piece":
        obj = super().__new__(cls, text)
        obj.choice, obj.logprobs = choice, logprobs
        return obj
