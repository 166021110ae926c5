"""Tool calls in ``/v1/chat/completions``, without any ML framework: the format a model's chat
template writes calls in (read from the template's own text, never from a class name), the
prompt's plan (the tools rendered, a forced opening for ``tool_choice`` ``"required"`` or a
named function), and the calls parsed out of the generated text as it streams.

Formats (the families' own templates write them so, and their models answer so):

* ``hermes`` (Qwen 2/2.5/3, Hermes, and every template with ``<tool_call>``):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several in a row;
* ``llama3`` (Llama 3.1-3.3: ``<|start_header_id|>`` and the ``ipython`` role): the answer is
  one JSON object ``{"name": ..., "parameters": {...}}`` (or several, ``;``-separated),
  possibly after ``<|python_tag|>``;
* ``mistral`` (``[TOOL_CALLS]``): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``,
  or the newer ``[TOOL_CALLS]name[ARGS]{...}``.

:class:`ToolStream` reads the text piece by piece and says what is content and what is a call;
the whole answer is the same machine fed at once, so a streamed answer and a whole one agree.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from muser_cli.service.api import ApiError, Ask
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
        return head


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
LLAMA3 = ToolFormat("llama3", "", "", "parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments")


def tool_format(template: str | None) -> ToolFormat | None:
    """The call format of a chat template's text, or None when it writes none this server parses."""
    if not template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|start_header_id|>" in template and "ipython" in template and "parameters" in template:
        return LLAMA3
    return None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def template_call_id(fmt: ToolFormat | None, call_id: str) -> str:
    """The id as the template is given it: Mistral's templates take only 9 letters and digits, so
    an OpenAI id becomes 9 hex digits of its hash (the same id, the same 9: a conversation renders
    the same tokens every turn)."""
    if fmt is not None and fmt.name == "mistral" and not (len(call_id) == 9 and call_id.isalnum()):
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]
    return call_id


def template_turns(fmt: ToolFormat | None, turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation in the shape chat templates read: ``tool_calls`` with their arguments as
    objects (what the templates ``tojson``), a tool message carrying its call's ``name`` (some
    templates write it), ids as the template takes them."""
    names: dict[str, str] = {}
    out = []
    for turn in turns:
        turn = dict(turn)
        if turn.get("tool_calls"):
            calls = []
            for call in turn["tool_calls"]:
                names[call["id"]] = call["function"]["name"]
                calls.append({"id": template_call_id(fmt, call["id"]), "type": "function",
                              "function": {"name": call["function"]["name"],
                                           "arguments": json.loads(call["function"]["arguments"])}})
            turn["tool_calls"] = calls
        if turn["role"] == "tool":
            if "name" not in turn and turn["tool_call_id"] in names:
                turn["name"] = names[turn["tool_call_id"]]
            turn["tool_call_id"] = template_call_id(fmt, turn["tool_call_id"])
        out.append(turn)
    return out


@dataclass
class ToolPlan:
    """How one chat request is rendered and read: the turns and tools given to the template, the
    text its answer is made to start with, and the parser of its calls (None: no parsing)."""

    turns: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    prefix: str = ""
    fmt: ToolFormat | None = None
    names: tuple[str, ...] = ()
    required: bool = False
    named: str | None = None
    parallel: bool = True
    strict: dict[str, Any] = field(default_factory=dict)  # the strict tools' parameters, by name

    def stream(self) -> "ToolStream | None":
        if self.tools is None or self.fmt is None:
            return None
        return ToolStream(self.fmt, self.names, required=self.required, named=self.named,
                          single=self.named is not None or not self.parallel, prefix=self.prefix,
                          strict=self.strict)


def plan_tools(ask: Ask, template: str | None) -> ToolPlan:
    """The plan of ``ask`` for a model whose chat template's text is ``template``. Tools with
    ``tool_choice`` ``"none"`` are not rendered (the model is not told of them, nothing is parsed).
    A template that writes no call format this server parses is a 400 naming it; a model with no
    chat template at all takes no chat (a 400 that says what to do instead)."""
    if not template:
        raise ApiError(400, "the model has no chat template (its files carry none: `muser model check` says so), so "
                            "no conversation can be rendered for it: send the text as the model expects it to "
                            "/v1/completions, or serve a model whose files carry a chat template", param="messages")
    fmt = tool_format(template)
    turns = template_turns(fmt, ask.prompt) if isinstance(ask.prompt, list) else ask.prompt
    if not ask.tools or ask.tool_choice == "none":
        return ToolPlan(turns=turns)
    if fmt is None:
        raise ApiError(400, "the model's chat template writes tool calls in no format this server reads "
                            "(<tool_call> JSON, Llama 3 JSON, [TOOL_CALLS]); tools cannot be used with it",
                       param="tools")
    named = ask.tool_choice.get("function", {}).get("name") if isinstance(ask.tool_choice, dict) else None
    required = named is not None or ask.tool_choice == "required"
    # the template is given each tool as OpenAI defines one, without muser's strict mark
    tools = [{"type": "function", "function": {k: v for k, v in t["function"].items() if k != "strict"}}
             for t in ask.tools]
    strict = {t["function"]["name"]: t["function"]["parameters"] for t in ask.tools if t["function"].get("strict")}
    return ToolPlan(turns=turns, tools=tools, prefix=fmt.forced(named) if required else "", fmt=fmt,
                    names=tuple(t["function"]["name"] for t in ask.tools), required=required, named=named,
                    parallel=ask.parallel_tool_calls, strict=strict)


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


def call_deltas(call: dict[str, Any]) -> list[dict[str, Any]]:
    """A call as streamed: its id, type and name first (arguments ""), then its arguments."""
    return [{"index": call["index"], "id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": ""}},
            {"index": call["index"], "function": {"arguments": call["arguments"]}}]
