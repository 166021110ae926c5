"""The OpenAI-compatible reply shapes, without any web framework: a worker's results become the
JSON objects (:func:`response`) and the stream chunks (:func:`chunk`, :func:`sse`) OpenAI clients
parse. The requests' side is :mod:`muser_cli.service.api`."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from muser_cli.service.api import Ask


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))


def logprobs_json(ask: Ask, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A choice's ``logprobs`` in OpenAI's shape from the worker's entries: chat's ``content``
    list (``token``, ``logprob``, ``bytes``, ``top_logprobs``), or completions' ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (one {token: logprob} a token) and ``text_offset``."""
    if entries is None:
        return None
    if ask.chat:
        return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": _bytes(e["token"]),
                             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": _bytes(t["token"])}
                                              for t in e["top"]]} for e in entries], "refusal": None}
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in entries],
            "text_offset": [e["offset"] for e in entries]}


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def response(ask: Ask, rid: str, model: str, text: str | None, finish: str, use: dict, muser: dict, *,
             calls: list[dict[str, Any]] = (), choices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The whole (non-streamed) answer; ``calls``: its tool calls (``{"id", "name", "arguments"}``);
    ``choices``: the worker's choices (``{"index", "text", "finish_reason", "logprobs"}``) where
    there are several or logprobs were asked for."""
    if choices is not None:
        out = response(ask, rid, model, text, finish, use, muser, calls=calls)
        out["choices"] = [{**response(ask, rid, model, c["text"], c["finish_reason"], use, muser)["choices"][0],
                           "index": c["index"], "logprobs": logprobs_json(ask, c["logprobs"])} for c in choices]
        return out
    created = int(time.time())
    if ask.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": use,
            "muser": muser}


def chunk(ask: Ask, rid: str, model: str, text: str | None, finish: str | None, *, first: bool = False,
          use: dict | None = None, muser: dict | None = None,
          tool_calls: list[dict[str, Any]] | None = None, index: int = 0,
          logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One streamed chunk; ``use`` alone (no choice): the usage chunk of include_usage;
    ``tool_calls``: the delta's tool call pieces (``{"index", "id"?, "type"?, "function"}``);
    ``index``: the choice; ``logprobs``: its tokens' logprob entries (the worker's)."""
    created = int(time.time())
    if ask.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choices = [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs_json(ask, logprobs)}]
        obj = "chat.completion.chunk"
    else:
        choices = [{"index": index, "text": text or "", "finish_reason": finish,
                    "logprobs": logprobs_json(ask, logprobs)}]
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


__all__ = ["chunk", "logprobs_json", "new_id", "response", "sse", "usage"]
