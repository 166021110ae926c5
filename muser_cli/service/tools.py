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
  or the newer ``[TOOL_CALLS]name[ARGS]{...}``;
* ``generic`` (muser's own, for every chat template that writes none of the above, as llama.cpp's
  server does for templates it does not know): the tools are described in a system turn
  (:func:`generic_turns`, fixed text), and the whole answer is one JSON object, constrained by the
  grammar (service/structured.py) to ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}``
  or ``{"response": "..."}`` (the text answer). :class:`GenericStream` reads it.

:class:`ToolStream` (service/toolstream.py) reads the text piece by piece and says what is content
and what is a call; the whole answer is the same machine fed at once, so a streamed answer and a
whole one agree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from muser_cli.service.api import ApiError, Ask
from muser_cli.service.toolstream import (
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    PYTHON_TAG,
    GenericStream,
    ToolCallFailed,
    ToolFormat,
    ToolStream,
    as_json,
    call_deltas,
    new_call_id,
)


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


GENERIC_INTRO = "You can call these tools. Each is a JSON object: its name, what it does, and the JSON Schema of its " \
                "arguments:"
GENERIC_AUTO = ('Answer with one JSON object: {"tool_calls": [{"name": "<a tool\'s name>", "arguments": {<its '
                'arguments>}}]} to call one or more of the tools, or {"response": "<your answer>"} to answer '
                'without them. A tool\'s result comes back as {"tool_response": {"name": ..., "content": ...}}.')
GENERIC_REQUIRED = ('Answer with one JSON object: {"tool_calls": [{"name": "<a tool\'s name>", "arguments": '
                    '{<its arguments>}}]}: call one or more of the tools now. A tool\'s result comes back as '
                    '{"tool_response": {"name": ..., "content": ...}}.')
GENERIC_NAMED = ('Answer with one JSON object: {{"tool_calls": [{{"name": "{name}", "arguments": {{<its arguments>}}}}]}}:'
                 ' call the tool {name} now. A tool\'s result comes back as {{"tool_response": {{"name": ..., '
                 '"content": ...}}}}.')



def generic_system(tools: list[dict[str, Any]], *, required: bool, named: str | None) -> str:
    """The system text that tells a model of ``tools`` in muser's generic format (docs/serve.md,
    "Tool calls on any chat model"): the tools, one JSON object a line, then how to answer."""
    lines = [GENERIC_INTRO]
    for tool in tools:
        fn = tool["function"]
        lines.append(as_json({"name": fn["name"], **({"description": fn["description"]} if fn.get("description") else {}),
                            "parameters": fn.get("parameters") or {"type": "object"}}))
    lines.append(GENERIC_NAMED.format(name=named) if named is not None else
                 GENERIC_REQUIRED if required else GENERIC_AUTO)
    return "\n".join(lines)


def generic_turns(turns: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: ``system`` (the tools' text, None: no
    tools offered now) joined to the first turn where that is a system one (else a system turn
    of its own, first); an assistant's calls written as the JSON it was made to answer with
    (after its text, if it had some), its text answers as they were (the text of the
    ``response``); a tool's result as a user turn ``{"tool_response": {"name", "content"}}``;
    turns of one role in a row joined into one (templates that want roles to alternate)."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for turn in turns:
        role = turn["role"]
        if role == "assistant" and turn.get("tool_calls"):
            calls = []
            for call in turn["tool_calls"]:
                names[call["id"]] = call["function"]["name"]
                calls.append({"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])})
            text = (turn.get("content") or "").strip()
            turn = {"role": "assistant", "content": (text + "\n" if text else "") + as_json({"tool_calls": calls})}
        elif role == "tool":
            name = turn.get("name") or names.get(turn.get("tool_call_id", ""), "")
            turn = {"role": "user", "content": as_json({"tool_response": {"name": name, "content": turn.get("content")}})}
        else:
            turn = {k: v for k, v in turn.items() if k in ("role", "content", "name")}
        if out and turn["role"] in ("user", "assistant") and out[-1]["role"] == turn["role"]:
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{turn['content']}"}
        else:
            out.append(turn)
    if system is not None:
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}" if out[0]["content"] else system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _has_tool_turns(turns: Any) -> bool:
    return isinstance(turns, list) and any(t.get("role") == "tool" or t.get("tool_calls") for t in turns)


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

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template is given (generic: none, they are in the system turn)."""
        return None if self.fmt is GENERIC else self.tools

    def stream(self) -> "ToolStream | None":
        if self.tools is None or self.fmt is None:
            return None
        if self.fmt is GENERIC:
            return GenericStream(self.fmt, self.names, required=self.required, named=self.named,
                                 single=self.named is not None or not self.parallel, strict=self.strict)
        return ToolStream(self.fmt, self.names, required=self.required, named=self.named,
                          single=self.named is not None or not self.parallel, prefix=self.prefix,
                          strict=self.strict)


def plan_tools(ask: Ask, template: str | None) -> ToolPlan:
    """The plan of ``ask`` for a model whose chat template's text is ``template``. Tools with
    ``tool_choice`` ``"none"`` are not rendered (the model is not told of them, nothing is parsed).
    A template that writes none of the call formats this server parses gets muser's ``generic``
    format (the tools in a system turn, the answer constrained to JSON: :func:`generic_turns`);
    a model with no chat template at all takes no chat (a 400 that says what to do instead)."""
    if not template:
        raise ApiError(400, "the model has no chat template (its files carry none: `muser model check` says so), so "
                            "no conversation can be rendered for it: send the text as the model expects it to "
                            "/v1/completions, or serve a model whose files carry a chat template", param="messages")
    native = tool_format(template)
    fmt = native or GENERIC
    offered = bool(ask.tools) and ask.tool_choice != "none"
    named = ask.tool_choice.get("function", {}).get("name") if isinstance(ask.tool_choice, dict) else None
    required = named is not None or ask.tool_choice == "required"
    if native is None:
        turns = ask.prompt
        if offered or _has_tool_turns(ask.prompt):  # the template cannot render calls or tool turns itself
            system = generic_system(ask.tools, required=required, named=named) if offered else None
            turns = generic_turns(ask.prompt, system)
    else:
        turns = template_turns(fmt, ask.prompt) if isinstance(ask.prompt, list) else ask.prompt
    if not offered:
        return ToolPlan(turns=turns)
    strict = {t["function"]["name"]: t["function"]["parameters"] for t in ask.tools if t["function"].get("strict")}
    names = tuple(t["function"]["name"] for t in ask.tools)
    # the template is given each tool as OpenAI defines one, without muser's strict mark (generic: in the text)
    tools = [{"type": "function", "function": {k: v for k, v in t["function"].items() if k != "strict"}}
             for t in ask.tools]
    return ToolPlan(turns=turns, tools=tools, prefix=fmt.forced(named) if required else "", fmt=fmt, names=names,
                    required=required, named=named, parallel=ask.parallel_tool_calls, strict=strict)


__all__ = ["GENERIC", "HERMES", "LLAMA3", "MISTRAL", "PYTHON_TAG", "GenericStream", "ToolCallFailed", "ToolFormat",
           "ToolPlan", "ToolStream", "call_deltas", "generic_system", "generic_turns", "new_call_id", "plan_tools",
           "template_call_id", "template_turns", "tool_format"]
