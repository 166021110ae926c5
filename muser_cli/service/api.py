"""The OpenAI-compatible request and response shapes, without any web framework: a request
body becomes a :class:`Ask` (or an :class:`ApiError` with the status OpenAI would answer);
results become the JSON objects and stream chunks OpenAI clients parse."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

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
    prompt: str | list[dict[str, str]]  # the text, or the chat turns
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    prefill_deadline: float | None = None  # extension: seconds to wait for a producer

    @property
    def chat(self) -> bool:
        return self.kind == "chat"


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


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo}, {hi}], got {value!r}", param=key)
    return float(value)


def _int(body: dict, key: str, lo: int, hi: int = MAX_INT) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        shown = repr(value) if not isinstance(value, int) or abs(value) < 10 ** 30 else "a larger one"
        raise ApiError(400, f"{key} must be an integer in [{lo}, {hi}], got {shown}", param=key)
    return value


def _content(turn: Any, i: int) -> dict[str, str]:
    if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a role", param="messages")
    role = turn["role"]
    if role not in ROLES:
        shown = repr(role) if len(role) <= 40 else repr(role[:40]) + "..."
        what = "tool messages are not supported by this server" if role in ("tool", "function") else \
            f"the role {shown} is not one of {', '.join(ROLES)}"
        raise ApiError(400, f"messages[{i}]: {what}", param="messages")
    name = turn.get("name")
    if name is not None and (not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum()
                             or len(name) > 64):
        raise ApiError(400, f"messages[{i}].name must be up to 64 letters, digits, '_' or '-'", param="messages")
    content = turn.get("content")
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
    return {"role": turn["role"], "content": content}


def parse_ask(body: dict[str, Any], kind: str, *, default_max_tokens: int) -> Ask:
    """The request ``body`` of ``/v1/chat/completions`` (kind chat) or ``/v1/completions``."""
    for key, ok in (("n", 1), ("best_of", 1)):
        if body.get(key) not in (None, ok):
            raise ApiError(400, f"{key} other than {ok} is not supported", param=key)
    for key in ("echo", "logprobs", "top_logprobs", "tools", "suffix", "functions", "function_call", "tool_choice",
                "parallel_tool_calls", "logit_bias", "prediction", "audio", "modalities"):
        if body.get(key) not in (None, False, [], 0, {}) and not (key == "tool_choice" and body[key] == "none"):
            raise ApiError(400, f"{key} is not supported by this server", param=key)
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty"):  # accepted only where they do nothing
        if body.get(key) not in (None, 0, 0.0) or isinstance(body.get(key), bool):
            raise ApiError(400, f"{key} other than 0 is not supported by this server", param=key)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise ApiError(400, f"response_format {kind!r} is not supported by this server (only 'text')",
                       param="response_format")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    if kind == "chat":
        turns = body.get("messages")
        if not isinstance(turns, list) or not turns:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        prompt: str | list[dict[str, str]] = [_content(t, i) for i, t in enumerate(turns)]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string", param="prompt")
    n = _int(body, "max_completion_tokens", 1)
    n = n if n is not None else _int(body, "max_tokens", 1)
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
        deadline = _number(body, "muser_prefill_deadline", 0.0, 0.0, 3600.0)
    return Ask(kind=kind, model=model or "", prompt=prompt, max_tokens=n or default_max_tokens,
               temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
               seed=_int(body, "seed", 0), stop=stop, stream=stream, include_usage=bool(options.get("include_usage")),
               prefill_deadline=deadline)


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def response(ask: Ask, rid: str, model: str, text: str, finish: str, use: dict, muser: dict) -> dict[str, Any]:
    """The whole (non-streamed) answer."""
    created = int(time.time())
    if ask.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": use,
            "muser": muser}


def chunk(ask: Ask, rid: str, model: str, text: str | None, finish: str | None, *, first: bool = False,
          use: dict | None = None, muser: dict | None = None) -> dict[str, Any]:
    """One streamed chunk; ``use`` alone (no choice): the usage chunk of include_usage."""
    created = int(time.time())
    if ask.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        obj = "chat.completion.chunk"
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
        obj = "text_completion"
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if use is not None:
        out["choices"], out["usage"] = [], use
    if muser is not None:
        out["muser"] = muser
    return out


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
