"""JSON Schema, the part a tool's ``strict: true`` parameters use, checked without any library:
:func:`schema_problem` says whether a schema stays within the keywords this module checks (a
request whose strict schema uses another is refused, never half-checked), :func:`instance_problem`
whether a call's arguments match it.

Checked: ``type`` (one or a list: object, array, string, number, integer, boolean, null),
``properties``, ``required``, ``additionalProperties`` (false or a schema), ``items``,
``minItems``/``maxItems``, ``enum``, ``const``, ``anyOf``, ``allOf``, ``$ref`` to ``#`` or inside
the schema (``$defs``, ``definitions``), ``minLength``/``maxLength``, ``pattern``, ``minimum``,
``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``, ``multipleOf``. Annotations (``title``,
``description``, ``default``, ``examples``, ``format`` — an annotation unless a validator opts in —,
``$schema``, ``$id``, ``$comment``, ``deprecated``, ``readOnly``, ``writeOnly``) are read as such."""

from __future__ import annotations

import math
import re
from typing import Any

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
CHECKED = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                     "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength",
                     "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "format", "$schema", "$id", "$comment",
                         "deprecated", "readOnly", "writeOnly"})
MAX_DEPTH = 64  # $ref hops and nesting followed before a schema is called too deep


def schema_problem(schema: Any, root: Any = None, where: str = "", depth: int = 0) -> str | None:
    """Why ``schema`` cannot be checked here (a keyword not in :data:`CHECKED`, a malformed one),
    or None."""
    root = schema if root is None else root
    if depth > MAX_DEPTH:
        return f"{where or 'the schema'} nests too deep"
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where or 'the schema'} is not a schema (an object)"
    for key, value in schema.items():
        at = f"{where}.{key}" if where else key
        if key in ANNOTATIONS:
            continue
        if key not in CHECKED:
            return f"{at}: this server does not check the keyword {key!r}"
        if key == "type":
            kinds = value if isinstance(value, list) else [value]
            if not kinds or not all(k in TYPES for k in kinds):
                return f"{at} must be one of {', '.join(TYPES)} (or a list of them)"
        elif key == "required":
            if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
                return f"{at} must be a list of names"
        elif key in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                return f"{at} must map names to schemas"
            for name, sub in value.items():
                problem = schema_problem(sub, root, f"{at}.{name}", depth + 1)
                if problem:
                    return problem
        elif key in ("additionalProperties", "items"):
            problem = schema_problem(value, root, at, depth + 1)
            if problem:
                return problem
        elif key in ("anyOf", "allOf"):
            if not isinstance(value, list) or not value:
                return f"{at} must be a non-empty list of schemas"
            for i, sub in enumerate(value):
                problem = schema_problem(sub, root, f"{at}[{i}]", depth + 1)
                if problem:
                    return problem
        elif key == "enum":
            if not isinstance(value, list) or not value:
                return f"{at} must be a non-empty list"
        elif key == "$ref":
            if _resolve(root, value) is None:
                return f"{at}: {str(value)[:64]!r} does not point inside the schema"
        elif key == "pattern":
            try:
                re.compile(value)
            except (re.error, TypeError):
                return f"{at} is not a regular expression this server reads"
        elif key in ("minItems", "maxItems", "minLength", "maxLength"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return f"{at} must be a non-negative integer"
        elif key != "const" and (isinstance(value, bool) or not isinstance(value, (int, float)) or  # numeric bounds
                                 not math.isfinite(value) or (key == "multipleOf" and value <= 0)):
            return f"{at} must be a {'positive ' if key == 'multipleOf' else ''}number"
    return None


def _resolve(root: Any, ref: Any) -> Any:
    """The schema a local ``$ref`` (``#``, ``#/$defs/name``, any JSON pointer into ``root``) names."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in (p for p in ref[1:].split("/") if p):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, (dict, bool)) else None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _same(a: Any, b: Any) -> bool:
    """JSON equality: ``1`` equals ``1.0``, ``true`` is not ``1``."""
    ka, kb = _kind(a), _kind(b)
    if {ka, kb} <= {"integer", "number"}:
        return a == b
    if ka != kb:
        return False
    if ka == "array":
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if ka == "object":
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _is(value: Any, kind: str) -> bool:
    got = _kind(value)
    if kind == "number":
        return got in ("integer", "number")
    if kind == "integer":
        return got == "integer" or (got == "number" and float(value).is_integer())
    return got == kind


def instance_problem(value: Any, schema: Any, root: Any = None, where: str = "", depth: int = 0) -> str | None:
    """Why ``value`` does not match ``schema`` (one checked by :func:`schema_problem`), or None."""
    root = schema if root is None else root
    at = where or "the arguments"
    if depth > MAX_DEPTH:
        return f"{at}: the schema nests too deep"
    if schema is True:
        return None
    if schema is False:
        return f"{at}: nothing is allowed here"
    if "$ref" in schema:
        problem = instance_problem(value, _resolve(root, schema["$ref"]), root, where, depth + 1)
        if problem:
            return problem
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(_is(value, k) for k in kinds):
            return f"{at} is {_kind(value)}, not {' or '.join(kinds)}"
    if "enum" in schema and not any(_same(value, v) for v in schema["enum"]):
        return f"{at} is not one of the enum's values"
    if "const" in schema and not _same(value, schema["const"]):
        return f"{at} is not the const value"
    for sub in schema.get("allOf") or []:
        problem = instance_problem(value, sub, root, where, depth + 1)
        if problem:
            return problem
    if "anyOf" in schema and all(instance_problem(value, sub, root, where, depth + 1)
                                 for sub in schema["anyOf"]):
        return f"{at} matches none of anyOf's schemas"
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for name in schema.get("required") or []:
            if name not in value:
                return f"{at}: the required property {name!r} is missing"
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            sub = props.get(name, extra)
            problem = instance_problem(item, sub, root, f"{where}.{name}" if where else name, depth + 1)
            if problem:
                return problem if name in props or extra is not False else \
                    f"{at}: the property {name[:64]!r} is not allowed"
    elif isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            return f"{at} has {len(value)} items, outside [{schema.get('minItems', 0)}, {schema.get('maxItems')}]"
        if "items" in schema:
            for i, item in enumerate(value):
                problem = instance_problem(item, schema["items"], root, f"{at}[{i}]", depth + 1)
                if problem:
                    return problem
    elif isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            return f"{at} has {len(value)} characters, outside its bounds"
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            return f"{at} does not match the pattern"
    elif _kind(value) in ("integer", "number"):
        for key, ok in (("minimum", lambda v, b: v >= b), ("maximum", lambda v, b: v <= b),
                        ("exclusiveMinimum", lambda v, b: v > b), ("exclusiveMaximum", lambda v, b: v < b)):
            if key in schema and not ok(value, schema[key]):
                return f"{at} breaks its {key} {schema[key]}"
        step = schema.get("multipleOf")
        if step is not None and not math.isclose(value / step, round(value / step), abs_tol=1e-9):
            return f"{at} is not a multiple of {step}"
    return None


__all__ = ["instance_problem", "schema_problem"]
