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
    if len(raw) > MAX_BODY:
        raise ApiError(413, f"the request body is over {MAX_BODY} bytes")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo}, {hi}], got {value!r}", param=key)
    return float(value)


def _int(body: dict, key: str, lo: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ApiError(400, f"{key} must be an integer >= {lo}, got {value!r}", param=key)
    return value


def _content(turn: Any, i: int) -> dict[str, str]:
    if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a role", param="messages")
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
    for key in ("echo", "logprobs", "top_logprobs", "tools", "suffix"):
        if body.get(key) not in (None, False, [], 0):
            raise ApiError(400, f"{key} is not supported by this server", param=key)
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
