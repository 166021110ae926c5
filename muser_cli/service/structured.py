"""Structured output on ``/v1/chat/completions`` (docs/serve.md, Structured output): the grammar
a request's answer is decoded under, or None.

* ``response_format`` ``json_object``: one JSON object; ``json_schema``: one JSON value by the
  schema (strict: every keyword enforced, else refused when parsed; not strict: the keywords the
  grammar can enforce);
* tools in muser's ``generic`` format (a template with no call format of its own: service/tools.py),
  whatever ``tool_choice``: the whole answer is one JSON object, ``{"tool_calls": [...]}`` (each
  call ``{"name": <an offered tool>, "arguments": <by its parameters>}``; one where parallel calls
  are off or a function is named; only that function's) or, under ``auto``, ``{"response": "<text>"}``;
* ``tool_choice`` ``required`` or a named function: the answer already starts with the call's
  opening (:meth:`muser_cli.service.tools.ToolFormat.forced`); the grammar takes it from there:
  an offered function's name (``required``), the arguments' key as the template writes it, a JSON
  object by that function's ``parameters`` (free whitespace), the brace that closes the call;
  with ``required`` and parallel calls, any further calls, each a whole call's JSON by one
  function's schema after the format's separator; then the format's closing (``</tool_call>``
  may follow, Mistral's ``]`` must), then the end token.

Built only for an engine that shapes its logits (torch, MLX); llguidance is imported here only
when a request asks.
"""

from __future__ import annotations

from typing import Any

from muser_cli.errors import MuserError
from muser_cli.model.info import ModelInfo
from muser_cli.service.api import ApiError, Ask
from muser_cli.service.tools import ToolPlan

#: per call format: the text between two calls, and what may follow the last (Mistral's list: must)
_FORMATS = {"hermes": ("\n</tool_call>\n<tool_call>\n", "\n</tool_call>"), "llama3": ("; ", ""),
            "mistral": (", ", "]")}


def request_constraint(ask: Ask, plan: ToolPlan | None, info: ModelInfo, *, engine: str,
                       shapes: bool) -> Any:
    """The :class:`muser_cli.engines.constraint.Constraint` of ``ask`` (None: unconstrained).
    ``shapes``: whether the engine applies one (``Consumer.shapes_logits``)."""
    fmt = ask.response_format
    tools = plan is not None and bool(plan.tools)
    if fmt is not None:
        if tools:
            raise ApiError(400, "response_format json with tools is not supported (tool_choice 'required' or "
                                "a named function constrains a call's arguments)", param="response_format")
        if not shapes:
            raise ApiError(400, f"response_format json is not supported by the {engine} engine",
                           param="response_format")
    elif tools and plan.fmt is not None and plan.fmt.name == "generic":
        if not shapes:
            raise ApiError(400, f"tools on a model whose chat template writes no tool calls take muser's generic "
                                f"format, made by constrained decoding, which the {engine} engine does not do",
                           param="tools")
    elif not (tools and plan.required and plan.fmt is not None and shapes):
        return None  # a required call on an engine that cannot constrain: the forced opening only
    from muser_cli.engines.constraint import (  # lazy: llguidance
        json_constraint,
        tool_constraint,
    )

    try:
        if fmt is not None:
            return json_constraint(info, fmt.get("schema"), lenient=not fmt.get("strict"))
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in plan.tools}
        if plan.fmt.name == "generic":
            return json_constraint(info, generic_schema(schemas, required=plan.required, named=plan.named,
                                                        parallel=plan.parallel), lenient=True)
        key = plan.fmt.args_key
        if plan.named is not None:
            calls = [("", schemas[plan.named])]
        else:
            calls = [(f'{name}", "{key}": ', schema) for name, schema in schemas.items()]
        parallel = plan.named is None and plan.parallel
        whole = [{"type": "object", "properties": {"name": {"const": name}, key: schema},
                  "required": ["name", key], "additionalProperties": False} for name, schema in schemas.items()]
        between, tail = _FORMATS[plan.fmt.name]
        return tool_constraint(info, calls, "}", between=between if parallel else None, whole=whole, tail=tail,
                               tail_needed=plan.fmt.name == "mistral")
    except MuserError as exc:
        raise ApiError(400, f"structured output: {exc}", param="response_format" if fmt is not None else "tools") \
            from None


def _closed(schema: Any) -> Any:
    """``schema`` with every object that lists its ``properties`` and says nothing of
    ``additionalProperties`` closed (``false``), as OpenAI's strict mode reads a tool's schema:
    a small model steered by it writes the arguments declared, not keys of its own invention.
    An object whose keys other keywords also decide (``allOf``, ``anyOf``, ``oneOf``, ``$ref``,
    ``if``, ``patternProperties``, ``dependentSchemas``, ``unevaluatedProperties``) is left as
    it is, and so is everything under ``allOf`` (closing a part would refuse the whole)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (_closed(v) if k in _SUBSCHEMAS else v) for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties")
_OPEN_KEYS = ("additionalProperties", "allOf", "anyOf", "oneOf", "$ref", "if", "patternProperties",
              "dependentSchemas", "unevaluatedProperties")


def _hoisted(name: str, schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (a tool's parameters) with its ``$defs`` / ``definitions`` moved into ``defs``
    under ``name.KEY`` and its local references rewritten to them: nested under the answer's
    schema, ``#/$defs/...`` resolves from the answer's root, which holds them all."""
    own = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    if not own:
        return schema
    prefix = {f"#/{k}/": f"#/$defs/{name}." for k in ("$defs", "definitions")}

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: walk(v) for k, v in node.items() if k not in ("$defs", "definitions")}
        ref = node.get("$ref")
        if isinstance(ref, str):
            for old, new in prefix.items():
                if ref.startswith(old):
                    out["$ref"] = new + ref[len(old):]
        return out

    for key, sub in own.items():
        defs[f"{name}.{key}"] = walk(sub)
    return walk(schema)


def generic_schema(schemas: dict[str, dict[str, Any]], *, required: bool, named: str | None,
                   parallel: bool) -> dict[str, Any]:
    """The JSON Schema of an answer in the generic tool format (service/tools.py): a list of calls
    (each an offered function's name and its arguments by its parameters, objects closed:
    :func:`_closed`; one only where ``parallel`` is off or ``named``), or, unless a call is
    ``required``, a text answer."""
    defs: dict[str, Any] = {}
    offered = {n: _closed(_hoisted(n, schema, defs)) for n, schema in schemas.items() if named is None or n == named}
    call = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
             "required": ["name", "arguments"], "additionalProperties": False} for name, schema in offered.items()]
    calls: dict[str, Any] = {"type": "array", "items": call[0] if len(call) == 1 else {"anyOf": call}, "minItems": 1}
    if named is not None or not parallel:
        calls["maxItems"] = 1
    as_calls = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                "additionalProperties": False}
    root: dict[str, Any] = {"$defs": {k: _closed(v) for k, v in defs.items()}} if defs else {}
    if required:
        return {**as_calls, **root}
    text = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
            "additionalProperties": False}
    return {"anyOf": [as_calls, text], **root}


__all__ = ["generic_schema", "request_constraint"]
