"""The readers of tool calls in a model's answer, without any ML framework: the call formats
(:class:`ToolFormat`: ``hermes``, ``llama3``, ``mistral``, and muser's ``generic``; what each looks
like: :mod:`muser_cli.service.tools`), :class:`ToolStream` (a template's own format, read piece by
piece as the answer streams) and :class:`GenericStream` (the generic format's one JSON object),
and a call as streamed (:func:`call_deltas`). Which format a model gets, and how its conversation
is rendered, is :mod:`muser_cli.service.tools`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from muser_cli.service.api import ApiError
from muser_cli.service.schema import instance_problem

PYTHON_TAG = "<|python_tag|>"


class ToolCallFailed(ApiError):
    """``tool_choice`` asked for a call and the model's answer holds none that parses."""

    def __init__(self, message: str) -> None:
        super().__init__(500, message, type="server_error", code="tool_call_failed")


@dataclass(frozen=True)
class ToolFormat:
    name: str  # "hermes" | "llama3" | "mistral"
    opening: str  # what opens a call in the text ("" for llama3: the call is the answer itself)
    closing: str  # what closes one ("" where the call runs to its JSON's end)
    args_key: str  # the key the template writes the arguments under

    def forced(self, function: str | None) -> str:
        """The text the answer is made to start with for ``required`` (``function`` None) or
        a named function: the call's opening, then the name (and the arguments' key) as the
        template writes them."""
        head = (f'{{"name": {json.dumps(function)}, "{self.args_key}": ' if function is not None
                else '{"name": "')
        if self.name == "hermes":
            return f"{self.opening}\n{head}"
        if self.name == "mistral":
            return f"{self.opening} [{head}"
        if self.name == "generic":
            return ""  # the grammar steers the whole answer (service/structured.py)
        return head


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
LLAMA3 = ToolFormat("llama3", "", "", "parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments")
GENERIC = ToolFormat("generic", "", "", "arguments")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def as_json(obj: Any) -> str:
    """JSON as the grammar makes the model write it (", " and ": ", no other blank)."""
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


@dataclass
class ToolStream:
    """The calls in a model's answer, read piece by piece (:meth:`feed`, then :meth:`finish`):
    each gives events ``("text", str)`` (content) and ``("call", {"index", "id", "name",
    "arguments"})`` (a whole call, its arguments a JSON string). Text that may be the start of a
    call's opening is held back until it is not, so an opening never shows as content. Content
    is the text outside the calls, with the whitespace that touches a call dropped.

    ``required``: an answer with no call that parses is :class:`ToolCallFailed` (never text
    passed off as a call); ``named``: the call must name that function; ``single``: generation
    may stop after the first call (:attr:`done`). Without ``required`` a call that does not parse
    (bad JSON, a function not offered) stays content, as the model wrote it. ``prefix``: the
    forced opening, the start of the answer already. ``strict``: the parameters of the tools given
    with ``strict: true``, by name: a call of one whose arguments do not match them is
    :class:`ToolCallFailed` (checked after the fact; under ``tool_choice`` ``required`` or named, on an
    engine that constrains decoding, the arguments were steered by the schema too:
    service/structured.py), so a strict tool's call is never returned with arguments its schema
    refuses."""

    fmt: ToolFormat
    names: tuple[str, ...]
    required: bool = False
    named: str | None = None
    single: bool = False
    prefix: str = ""
    strict: dict[str, Any] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)
    error: ToolCallFailed | None = None
    _pending: str = ""
    _mode: str = "out"  # out | call | plain (llama3: the answer is text, no call follows)
    _after_call: bool = False
    _content: list[str] = field(default_factory=list)
    _started: bool = False

    def __post_init__(self) -> None:
        self._pending = self.prefix
        if self.prefix:
            self._mode, self._started = "call", True

    @property
    def content(self) -> str | None:
        text = "".join(self._content)
        return None if self.calls and not text else text

    @property
    def done(self) -> bool:
        """No more is wanted: the one call asked for is complete, or the answer failed."""
        return self.error is not None or (self.single and bool(self.calls))

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        if self.done:
            return []
        self._pending += piece
        events: list[tuple[str, Any]] = []
        self._step(events, final=False)
        return events

    def finish(self) -> list[tuple[str, Any]]:
        """The rest, once the answer ended; :attr:`error` set when a required call is missing."""
        events: list[tuple[str, Any]] = []
        if not self.done:
            self._step(events, final=True)
        if self.error is None and self.required and not self.calls:
            self.error = ToolCallFailed("tool_choice asked for a tool call and the model's answer holds none that "
                                        "parses (cut by max_tokens, or an engine that does not constrain decoding: "
                                        "the answer was made to start with the call's opening only)")
        return events

    # ------------------------------------------------------------------ the machine
    def _text(self, events: list, text: str) -> None:
        if text:
            self._content.append(text)
            events.append(("text", text))

    def _call(self, events: list, obj: Any) -> bool:
        """Record ``obj`` as a call when it is one of an offered function; False otherwise."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return False
        name = obj["name"]
        if name not in self.names or (self.named is not None and name != self.named):
            return False
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = _DECODER.decode(args)
            except ValueError:
                return False
        if not isinstance(args, dict):
            return False
        if self.single and self.calls:
            return True  # one was asked for: a further one is dropped
        if name in self.strict:
            problem = instance_problem(args, self.strict[name])
            if problem:
                self.error = ToolCallFailed(f"the model called {name!r} (strict) with arguments its schema refuses: "
                                            f"{problem} (checked after the fact: an automatic call is not "
                                            "constrained by its schema)")
                return True  # no call, and no text either: the answer failed
        call = {"index": len(self.calls), "id": new_call_id(), "name": name,
                "arguments": json.dumps(args, ensure_ascii=False)}
        self.calls.append(call)
        events.append(("call", call))
        return True

    def _fail(self, events: list, raw: str, why: str) -> None:
        """A call region that does not parse: an error when a call was required, else content."""
        if self.required:
            self.error = ToolCallFailed(f"tool_choice asked for a tool call and the model's answer does not parse "
                                        f"as one ({why})")
        else:
            self._text(events, raw)
            self._after_call = False

    def _step(self, events: list, *, final: bool) -> None:
        while not self.done:
            if self._mode == "plain":
                self._text(events, self._pending)
                self._pending = ""
                return
            if self._mode == "out":
                if not self._out(events, final):
                    return
            elif not self._region(events, final):
                return

    def _out(self, events: list, final: bool) -> bool:
        """Content until a call opens; True when the mode changed (go on)."""
        if self._after_call:
            self._pending = self._pending.lstrip()
            if not self._pending:
                return False
            self._after_call = False
        if not self.fmt.opening:  # llama3: a call is the whole answer, so only its start can open one
            if self._started:
                self._mode = "plain"
                return True
            head = self._pending.lstrip()
            if not head:
                if final:
                    self._text(events, self._pending)
                    self._pending = ""
                return False
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self._started, self._mode = True, "call"
                return True
            if PYTHON_TAG.startswith(head) and not final:
                return False  # perhaps the tag, still coming
            self._started, self._mode = True, "plain"
            return True
        at = self._pending.find(self.fmt.opening)
        if at >= 0:
            self._text(events, self._pending[:at].rstrip())
            self._pending = self._pending[at:]
            self._mode = "call"
            return True
        if final:
            self._text(events, self._pending)
            self._pending = ""
            return False
        keep = _partial(self._pending, self.fmt.opening)
        safe = self._pending[: len(self._pending) - keep]
        body = safe.rstrip()  # whitespace before a call is not content: held until text follows
        self._text(events, body)
        self._pending = self._pending[len(body):]
        return False

    def _region(self, events: list, final: bool) -> bool:
        """A call's text; True when it was read (go on)."""
        name = self.fmt.name
        if name == "hermes":
            body_at = len(self.fmt.opening)
            end = self._pending.find(self.fmt.closing, body_at)
            if end < 0 and not final:
                return False
            raw = self._pending if end < 0 else self._pending[: end + len(self.fmt.closing)]
            body = self._pending[body_at:] if end < 0 else self._pending[body_at:end]
            self._pending = "" if end < 0 else self._pending[end + len(self.fmt.closing):]
            try:
                obj = _DECODER.decode(body.strip())
            except ValueError as exc:
                self._fail(events, raw, f"not JSON: {exc}" if end >= 0 else "it ended inside the call")
            else:
                if self._call(events, obj):
                    self._after_call = True
                else:
                    self._fail(events, raw, _not_a_call(obj, self.names, self.named))
            self._mode = "out"
            return True
        if name == "llama3":
            return self._json_calls(events, final, opening=PYTHON_TAG)
        return self._mistral(events, final)

    def _json_calls(self, events: list, final: bool, *, opening: str) -> bool:
        """One or more JSON objects, ``;`` or whitespace between them (Llama 3)."""
        raw = self._pending
        text = raw.lstrip()
        if self.calls and text.startswith(";"):
            text = text[1:].lstrip()
        if text.startswith(opening):
            text = text[len(opening):].lstrip()
        if not text:
            if final:
                self._pending, self._mode = "", "plain"
                if not self.calls:
                    self._fail(events, raw, "nothing after the call's opening")
            return False
        if self.calls and not text.startswith("{"):  # text after the calls: content
            self._mode, self._after_call = "out", True
            return True
        try:
            obj, end = _DECODER.raw_decode(text)
        except ValueError as exc:
            if not final:
                return False
            self._pending, self._mode = "", "plain"
            self._fail(events, raw, f"not JSON: {exc}")
            return True
        if not self._call(events, obj):
            self._pending, self._mode = "", "plain"
            self._fail(events, raw, _not_a_call(obj, self.names, self.named))
            return True
        self._pending = text[end:]
        return True

    def _mistral(self, events: list, final: bool) -> bool:
        text = self._pending[len(self.fmt.opening):].lstrip()
        if not text:
            if final:
                self._pending, self._mode = "", "out"
                self._fail(events, self.fmt.opening, "nothing after [TOOL_CALLS]")
                return True
            return False
        try:
            if text.startswith("["):
                obj, end = _DECODER.raw_decode(text)
                objs = obj if isinstance(obj, list) else [obj]
            else:  # name[ARGS]{...}
                if "[ARGS]" not in text:
                    raise ValueError("no [ARGS] after the function's name")
                fn, _, args_text = text.partition("[ARGS]")
                args, end = _DECODER.raw_decode(args_text.lstrip())
                end += len(text) - len(args_text.lstrip())
                objs = [{"name": fn.strip(), "arguments": args}]
        except ValueError as exc:
            if not final:
                return False
            self._pending, self._mode = "", "out"
            self._fail(events, self.fmt.opening + text, f"not JSON: {exc}")
            return True
        raw = self.fmt.opening + text[:end]
        self._pending, self._mode = text[end:], "out"
        good = [o for o in objs if _ok(o, self.names, self.named)]
        if not objs or len(good) != len(objs):
            bad = next((o for o in objs if not _ok(o, self.names, self.named)), None)
            self._fail(events, raw, _not_a_call(bad, self.names, self.named) if objs else "an empty list")
            return True
        for obj in objs:
            self._call(events, obj)
        self._after_call = True
        return True


def _ok(obj: Any, names: tuple[str, ...], named: str | None) -> bool:
    if not isinstance(obj, dict) or obj.get("name") not in names or (named is not None and obj["name"] != named):
        return False
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = _DECODER.decode(args)
        except ValueError:
            return False
    return isinstance(args, dict)


def _not_a_call(obj: Any, names: tuple[str, ...], named: str | None) -> str:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return "not an object with a name"
    if obj["name"] not in names:
        return f"{obj['name'][:64]!r} is not one of the tools offered"
    if named is not None and obj["name"] != named:
        return f"it calls {obj['name']!r}, not {named!r}"
    return "its arguments are not an object"


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_GENERIC_HEADS = ('{"response": "', '{"tool_calls": [')


@dataclass
class GenericStream(ToolStream):
    """The answer in muser's generic format (one JSON object, the grammar's doing): the text of
    ``{"response": "..."}`` given out as it comes (its JSON escapes decoded), each call of
    ``{"tool_calls": [...]}`` as soon as its own JSON is whole. An answer in neither shape (an engine that
    did not constrain it) is content as written, or :class:`ToolCallFailed` where a call was
    required."""

    _kind: str = ""  # "" (not known yet) | "response" | "calls" | "text" | "end"
    _at: int = 0  # the next character of the answer not read yet (in the string, or the list)
    _seen: set = field(default_factory=set)  # the calls read, as JSON: a repeat ends the list

    def _step(self, events: list, *, final: bool) -> None:
        if not self._kind:
            head = self._pending.lstrip()
            for want, kind in zip(_GENERIC_HEADS, ("response", "calls")):
                if head.startswith(want):
                    self._kind, self._pending = kind, head
                    self._at = len(want)
                    break
            else:
                if not final and any(w.startswith(head) for w in _GENERIC_HEADS):
                    return  # perhaps one of the two, still coming
                self._kind = "text"
        if self._kind == "response":
            self._response(events, final)
        elif self._kind == "calls":
            self._calls(events, final)
        elif self._kind == "text":
            if self.required:
                if final:
                    self._fail(events, self._pending, "the answer is not the JSON of a tool call")
                return
            self._text(events, self._pending)
            self._pending = ""

    def _response(self, events: list, final: bool) -> None:
        text, i, out = self._pending, self._at, []
        while i < len(text):
            ch = text[i]
            if ch == '"':
                self._kind = "end"  # the rest is the object's closing brace
                i += 1
                break
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            n = _escape_length(text, i)
            if n is None:  # an escape cut by the piece's end: the next piece completes it
                break
            out.append(_unescape(text[i:i + n]))
            i += n
        self._at = i
        self._text(events, "".join(out))
        if self.required and final and not self.calls:
            self.error = ToolCallFailed("tool_choice asked for a tool call and the model answered in text")

    @property
    def done(self) -> bool:
        """As :attr:`ToolStream.done`, or the calls' list ended (a text answer ends with the grammar's end)."""
        return super().done or (self._kind == "end" and bool(self.calls))

    def _calls(self, events: list, final: bool) -> None:
        """Each call of the list given out as soon as its JSON is whole; the list's end (or a call
        that repeats one before it, name and arguments alike: a small model's loop) ends the answer.
        An answer cut inside the list keeps the calls that were whole."""
        text = self._pending
        while True:
            i = self._at
            while i < len(text) and text[i] in " \n\t\r,":
                i += 1
            if i < len(text) and text[i] == "]":
                self._kind = "end"
                break
            try:
                obj, end = _DECODER.raw_decode(text, i) if i < len(text) else (None, i)
            except ValueError as exc:
                if final:
                    self._kind = "end"
                    if not self.calls:
                        self._fail(events, text, f"it ended inside the call ({exc})")
                return
            if obj is None:
                if final:
                    self._kind = "end"
                    if not self.calls:
                        self._fail(events, text, "it ended before a call")
                return
            self._at = end
            key = as_json(obj)
            if key in self._seen:
                self._kind = "end"  # the same call again: the model loops
                break
            self._seen.add(key)
            if not self._call(events, obj):
                self._kind = "end"
                if not self.calls:
                    self._fail(events, text, _not_a_call(obj, self.names, self.named))
                break
            if self.done:
                break


def _escape_length(text: str, i: int) -> int | None:
    """The length of the JSON escape at ``text[i]`` (a backslash), None where it is not whole yet
    (a high surrogate's ``\\uXXXX`` waits for what follows: its low half makes one escape of 12)."""
    if i + 1 >= len(text):
        return None
    if text[i + 1] != "u":
        return 2
    if i + 6 > len(text):
        return None
    code = _hex(text[i + 2:i + 6])
    if code is None or not 0xD800 <= code < 0xDC00:
        return 6
    if i + 8 > len(text):  # what follows not seen yet
        return None if len(text) - (i + 6) < 1 or text[i + 6] == "\\" else 6
    if text[i + 6:i + 8] != "\\u":
        return 6  # a lone high half
    if i + 12 > len(text):
        return None
    low = _hex(text[i + 8:i + 12])
    return 12 if low is not None and 0xDC00 <= low < 0xE000 else 6


def _hex(digits: str) -> int | None:
    try:
        return int(digits, 16)
    except ValueError:
        return None


def _unescape(escape: str) -> str:
    """One JSON escape's text; a lone surrogate half (JSON allows it, UTF-8 cannot carry it)
    becomes U+FFFD, as a decoder replaces bytes it cannot read."""
    try:
        text = json.loads(f'"{escape}"')
    except ValueError:
        return escape
    return "".join("\ufffd" if 0xD800 <= ord(ch) < 0xE000 else ch for ch in text)


def call_deltas(call: dict[str, Any]) -> list[dict[str, Any]]:
    """A call as streamed: its id, type and name first (arguments ""), then its arguments."""
    return [{"index": call["index"], "id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": ""}},
            {"index": call["index"], "function": {"arguments": call["arguments"]}}]


__all__ = ["GENERIC", "HERMES", "LLAMA3", "MISTRAL", "PYTHON_TAG", "GenericStream", "ToolCallFailed", "ToolFormat",
           "ToolStream", "as_json", "call_deltas", "new_call_id"]
