"""Anthropic's Messages API (``POST /v1/messages``) on ``decode --serve``, without any web
framework: a request body becomes the server's one internal request (:class:`~.api.Ask`, a
chat whose tools are OpenAI function tools, so the worker, the chat template's rendering and
the tool-call parsing are the ones ``/v1/chat/completions`` uses), and the worker's events
become Anthropic's answer, its server-sent events and its errors.

Read: ``model``, ``max_tokens`` (both required), ``messages`` (``user`` / ``assistant``, content
a string or ``text``, ``tool_use`` and ``tool_result`` blocks), ``system`` (a string or text
blocks), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``stream``, ``tools`` (custom
tools: ``name``, ``description``, ``input_schema``, ``strict``), ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``; ``disable_parallel_tool_use``), ``metadata`` (accepted, it changes nothing),
the extensions the OpenAI routes take too (``min_p``, ``repetition_penalty``) and muser's
``muser_prefill_deadline``. Anything else is a 400 naming it: never accepted and ignored."""

from __future__ import annotations

import json
import uuid
from typing import Any

from muser_cli.service.api import (ApiError, Ask, int_field, is_name, number_field, parse_tool_choice, parse_tools,
                                   sampling_extensions)
from muser_cli.service.replies import sse

FIELDS = frozenset({"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                    "min_p", "repetition_penalty", "stream", "tools", "tool_choice", "metadata",
                    "muser_prefill_deadline"})
MAX_STOP_SEQUENCES = 16
#: The error ``type`` Anthropic gives each status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}
#: The answer's ``stop_reason`` for the worker's finish reasons (``stop``: the end of the turn,
#: unless a stop sequence ended it).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _bad(message: str) -> ApiError:
    return ApiError(400, message)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _keys(obj: dict, allowed: set[str] | frozenset[str], where: str) -> None:
    extra = sorted(k for k in obj if k not in allowed)
    if extra:
        raise _bad(f"{where}.{extra[0]}: not a field this server reads" if where else
                   f"{extra[0]}: not a field this server reads")


def _text_blocks(value: Any, where: str) -> str:
    """A string, or a list of ``{"type": "text", "text"}`` blocks: their text joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(f"{where} must be a string or a list of text blocks")
    parts = []
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise _bad(f"{at}: only text blocks are supported here" + (f", not {_shown(kind)}" if kind else ""))
        _keys(block, {"type", "text"}, at)
        if not isinstance(block.get("text"), str):
            raise _bad(f"{at}.text must be a string")
        parts.append(block["text"])
    return "".join(parts)


def _blocks(message: dict, i: int) -> list[dict]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"messages[{i}].content must be a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"messages[{i}].content[{j}] must be a content block (an object with a type)")
    return content


def _turns(messages: Any) -> list[dict[str, Any]]:
    """Anthropic's messages as the chat turns the worker renders (OpenAI's roles and keys):
    a user's text a ``user`` turn, each ``tool_result`` a ``tool`` turn, an assistant's text
    and ``tool_use`` blocks one ``assistant`` turn with ``tool_calls``."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            role = message.get("role") if isinstance(message, dict) else None
            raise _bad(f"messages[{i}].role must be 'user' or 'assistant'" + (f", not {_shown(role)}" if role else ""))
        _keys(message, {"role", "content"}, f"messages[{i}]")
        role = message["role"]
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results = 0
        for j, block in enumerate(_blocks(message, i)):
            at, kind = f"messages[{i}].content[{j}]", block["type"]
            if kind == "text":
                _keys(block, {"type", "text"}, at)
                if not isinstance(block.get("text"), str):
                    raise _bad(f"{at}.text must be a string")
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                _keys(block, {"type", "id", "name", "input"}, at)
                if not isinstance(block.get("id"), str) or not 0 < len(block["id"]) <= 256:
                    raise _bad(f"{at}.id must be a non-empty string")
                if not isinstance(block.get("name"), str) or not is_name(block["name"]):
                    raise _bad(f"{at}.name must be 1 to 64 letters, digits, '_' or '-'")
                if not isinstance(block.get("input"), dict):
                    raise _bad(f"{at}.input must be an object")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
            elif kind == "tool_result" and role == "user":
                _keys(block, {"type", "tool_use_id", "content", "is_error"}, at)
                if not isinstance(block.get("tool_use_id"), str) or not 0 < len(block["tool_use_id"]) <= 256:
                    raise _bad(f"{at}.tool_use_id must be the id of the tool_use it answers")
                error = block.get("is_error", False)
                if not isinstance(error, bool):
                    raise _bad(f"{at}.is_error must be true or false")
                result = _text_blocks(block.get("content", ""), f"{at}.content")
                if texts:  # the user's text before it is a turn of its own, in order
                    turns.append({"role": "user", "content": "".join(texts)})
                    texts = []
                # chat templates have no error flag: a failed tool's answer says so in its text
                results += 1
                turns.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                              "content": f"Error: {result}" if error else result})
            elif kind in ("tool_use", "tool_result"):
                raise _bad(f"{at}: a {kind} block belongs in {'an assistant' if kind == 'tool_use' else 'a user'} "
                           "message")
            else:
                raise _bad(f"{at}: content blocks of type {_shown(kind)} are not supported (text, tool_use, "
                           "tool_result)")
        if role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            turns.append(turn)
        elif texts or not results:
            turns.append({"role": "user", "content": "".join(texts)})
    if turns[-1]["role"] == "assistant":
        raise _bad("the last message is the assistant's: continuing a prefilled answer is not supported here "
                   "(end with a user message)")
    return turns


def _in_anthropic_words(message: str) -> str:
    """An error about the OpenAI tool (``tools[0].function.parameters``) in Anthropic's words."""
    return message.replace(".function.parameters", ".input_schema").replace(".function.", ".")


def _anthropic_tools(body: dict) -> list[dict[str, Any]] | None:
    """``tools``: Anthropic's custom tools, checked as the OpenAI function tools they become."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list of tools")
    converted = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object")
        if tool.get("type", "custom") != "custom":
            raise _bad(f"{where}.type {_shown(tool['type'])}: only custom tools (name, description, input_schema) "
                       "are supported here")
        _keys(tool, {"type", "name", "description", "input_schema", "strict"}, where)
        if not isinstance(tool.get("input_schema"), dict):
            raise _bad(f"{where}.input_schema must be a JSON schema of type 'object'")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for key in ("description", "strict"):
            if key in tool:
                fn[key] = tool[key]
        converted.append({"type": "function", "function": fn})
    try:
        return parse_tools({"tools": converted})
    except ApiError as exc:
        raise _bad(_in_anthropic_words(exc.message)) from None


def _choice(body: dict, tools: list[dict[str, Any]] | None) -> tuple[str | dict[str, Any], bool]:
    """``tool_choice`` as the OpenAI choice it is, and whether calls may come in parallel."""
    choice = body.get("tool_choice")
    if choice is None:
        return parse_tool_choice({}, tools), True
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"tool\", \"name\"} "
                   "or {\"type\": \"none\"}")
    kind = choice["type"]
    if kind != "none" and not tools:  # as Anthropic: a choice among no tools is refused, not ignored
        raise _bad(f"tool_choice {kind!r} without tools is not supported")
    _keys(choice, {"type"} | ({"name"} if kind == "tool" else set()) |
          ({"disable_parallel_tool_use"} if kind != "none" else set()), "tool_choice")
    single = choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise _bad("tool_choice.disable_parallel_tool_use must be true or false")
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise _bad("tool_choice.name must name one of the tools")
    openai = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
        {"type": "function", "function": {"name": choice["name"]}}
    return parse_tool_choice({"tool_choice": openai}, tools), not single


def parse_messages(body: dict[str, Any], *, default_max_tokens: int | None = None) -> Ask:
    """A ``/v1/messages`` request body as the worker's :class:`Ask` (a chat); a 400 naming the field
    for anything this server does not read or does not honour. ``default_max_tokens`` is not used:
    ``max_tokens`` is required, as Anthropic requires it."""
    _keys(body, FIELDS, "")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model: a string is required")
    if body.get("max_tokens") is None:
        raise _bad("max_tokens: a field required by the Messages API")
    max_tokens = int_field(body, "max_tokens", 1)
    turns = _turns(body.get("messages"))
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            turns.insert(0, {"role": "system", "content": text})
    stops = body.get("stop_sequences")
    if stops is None:
        stops = []
    if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES or \
            not all(isinstance(s, str) and s for s in stops):
        raise _bad(f"stop_sequences must be a list of up to {MAX_STOP_SEQUENCES} non-empty strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false")
    metadata = body.get("metadata")
    if metadata is not None:  # accepted, as Anthropic's clients send it; it changes nothing here
        if not isinstance(metadata, dict):
            raise _bad("metadata must be an object")
        _keys(metadata, {"user_id"}, "metadata")
        if metadata.get("user_id") is not None and not isinstance(metadata["user_id"], str):
            raise _bad("metadata.user_id must be a string")
    deadline = body.get("muser_prefill_deadline")
    if deadline is not None:
        deadline = number_field(body, "muser_prefill_deadline", 0.0, 0.0, 3600.0)
    tools = _anthropic_tools(body)
    choice, parallel = _choice(body, tools)
    extensions = sampling_extensions(body)
    return Ask(kind="chat", model=model, prompt=turns, max_tokens=max_tokens, **extensions,
               temperature=number_field(body, "temperature", 1.0, 0.0, 1.0), top_p=number_field(body, "top_p", 1.0, 1e-9, 1.0),
               stop=list(stops), stream=stream, prefill_deadline=deadline, tools=tools, tool_choice=choice,
               parallel_tool_calls=parallel)


def error_body(exc: ApiError) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def usage(s: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` the prompt tokens this machine's store did not hold
    (computed here or shipped), ``cache_read_input_tokens`` those it held."""
    held = int(s.get("held_rows") or 0)
    return {"input_tokens": int(s["prompt_tokens"]) - held, "output_tokens": int(s.get("completion_tokens") or 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": held}


def tool_use_id(call: dict[str, Any]) -> str:
    """A call's id as Anthropic writes them (``toolu_...``)."""
    cid = call["id"]
    return "toolu_" + (cid.removeprefix("call_"))


def stop_reason(s: dict[str, Any]) -> str:
    if s.get("stop_sequence") is not None:
        return "stop_sequence"
    return STOP_REASONS.get(s["finish_reason"], "end_turn")


class MessagesShape:
    """``/v1/messages`` for :meth:`muser_cli.service.app.Service.generate`."""

    endpoint = "messages"

    def parse(self, body: dict, *, default_max_tokens: int) -> Ask:
        return parse_messages(body, default_max_tokens=default_max_tokens)

    def error(self, exc: ApiError) -> dict[str, Any]:
        return error_body(exc)

    def new_id(self, ask: Ask) -> str:
        return "msg_" + uuid.uuid4().hex[:24]

    def whole(self, ask: Ask, rid: str, model: str, s: dict, calls: list[dict]) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if s.get("text"):
            content.append({"type": "text", "text": s["text"]})
        for call in calls:
            content.append({"type": "tool_use", "id": tool_use_id(call), "name": call["name"],
                            "input": json.loads(call["arguments"])})
        return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": stop_reason(s), "stop_sequence": s.get("stop_sequence"), "usage": usage(s),
                "muser": s["muser"]}

    def streamer(self, ask: Ask, rid: str, model: str, early: dict | None) -> MessagesStream:
        return MessagesStream(rid, model, early)


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with its ``event:`` line, as Anthropic streams them."""
    return f"event: {name}\n".encode() + sse({"type": name, **data})


class MessagesStream:
    """One streamed answer as Anthropic's events: ``message_start``; per content block
    ``content_block_start``, its deltas (``text_delta``; a whole call's arguments in one
    ``input_json_delta``), ``content_block_stop``; ``message_delta`` (stop reason, usage, the
    ``muser`` field); ``message_stop``. An error after the start is an ``error`` event."""

    def __init__(self, rid: str, model: str, early: dict | None) -> None:
        self.rid, self.model, self.early = rid, model, early
        self.index = -1  # the current content block
        self.open: str | None = None  # its type while it is open

    def start(self) -> list[bytes]:
        use = usage({**self.early, "completion_tokens": 0}) if self.early else \
            {"input_tokens": 0, "output_tokens": 0}
        return [event("message_start", {"message": {
            "id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": use}})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def text(self, piece: str) -> list[bytes]:
        out = []
        if self.open != "text":
            out = self._close()
            self.index += 1
            self.open = "text"
            out.append(event("content_block_start", {"index": self.index,
                                                     "content_block": {"type": "text", "text": ""}}))
        out.append(event("content_block_delta", {"index": self.index,
                                                 "delta": {"type": "text_delta", "text": piece}}))
        return out

    def call(self, call: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        out += [event("content_block_start", {"index": self.index, "content_block": {
                    "type": "tool_use", "id": tool_use_id(call), "name": call["name"], "input": {}}}),
                event("content_block_delta", {"index": self.index,
                                              "delta": {"type": "input_json_delta", "partial_json": call["arguments"]}}),
                event("content_block_stop", {"index": self.index})]
        return out

    def error(self, err: ApiError) -> list[bytes]:
        return [event("error", {"error": error_body(err)["error"]})]

    def done(self, s: dict[str, Any]) -> list[bytes]:
        return self._close() + [
            event("message_delta", {"delta": {"stop_reason": stop_reason(s), "stop_sequence": s.get("stop_sequence")},
                                    "usage": usage(s), "muser": s["muser"]}),
            event("message_stop", {})]


__all__ = ["MessagesShape", "MessagesStream", "error_body", "parse_messages"]
