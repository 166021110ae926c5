"""Strict input: the one way muser reads bytes it did not write itself.

Everything that crosses a machine or comes from a user — kvpack headers, handoff headers
and trailers, node bundles, have-manifests, sizes and rates on the command line — goes
through these functions, so every reader is equally strict:

* :func:`canonical_json` — the only JSON muser signs or hashes (sorted keys, no spaces,
  ASCII, no NaN/Infinity);
* :func:`loads` — JSON with a byte limit, UTF-8 only, duplicate keys, NaN/Infinity and
  runaway nesting refused, raising the caller's error class with one line naming ``what``;
* :func:`parse_size` and :func:`parse_rate` — one grammar each for ``--max-size 64G``,
  ``MUSER_STORE_MAX=20G``, ``--rate 800Mbit``.

No ML framework, no I/O: safe to import from kvpack and the handoff protocol core.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from muser_cli.errors import DataError, MuserError, UsageError

MAX_DEPTH = 64


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON bytes: what a digest or a MAC covers."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def depth_ok(data: bytes | str, limit: int = MAX_DEPTH) -> bool:
    """Whether brackets nest at most ``limit`` deep (checked before parsing; strings skipped)."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    depth = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def is_sha256_ref(value: Any) -> bool:
    """Whether ``value`` is ``sha256:`` and 64 hex digits (a fingerprint or digest as muser writes it)."""
    if not isinstance(value, str) or not value.startswith("sha256:") or len(value) != 71:
        return False
    try:
        int(value[7:], 16)
    except ValueError:
        return False
    return True


def unique_keys(what: str, error: type[MuserError] = DataError) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A ``json.loads`` object hook that refuses a key given twice: one ``error`` line naming ``what``."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise error(f"{what}: duplicate key {k!r}")
            out[k] = v
        return out

    return pairs


def loads(data: bytes | str, what: str, *, limit: int, error: type[MuserError] = DataError,
          max_depth: int = MAX_DEPTH) -> Any:
    """Parse untrusted JSON. Refuses: more than ``limit`` bytes, non-UTF-8, nesting deeper
    than ``max_depth``, duplicate keys, NaN/Infinity. Every refusal is one ``error`` line."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > limit:
        raise error(f"{what} is {len(raw)} bytes, over the {limit}-byte limit")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} is not UTF-8 JSON") from None
    if not depth_ok(text, max_depth):
        raise error(f"{what}: JSON nested deeper than {max_depth}")

    pairs = unique_keys(what, error)

    def no_constants(name: str) -> Any:
        raise error(f"{what}: {name} is not allowed")

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=no_constants)
    except MuserError:
        raise
    except (ValueError, RecursionError) as exc:
        raise error(f"{what} is not valid JSON ({type(exc).__name__})") from None


_SIZE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b)?$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from ``1048576``, ``512K``, ``64M``, ``1.5GiB``, ``2G``, ``1T`` (powers of 1024)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise UsageError(f"{what} {text} is negative")
        return text
    m = _SIZE_RE.match(str(text).strip().lower())
    if not m:
        raise UsageError(f"cannot read {what} {text!r}", hint="write it like 20G, 512M, 1.5GiB or 1048576")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


_RATE_RE = re.compile(r"^([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|b)?(/s|ps)?$")


def parse_rate(text: str) -> float:
    """Bytes per second from ``500M``, ``20MB/s``, ``1.5G`` (bytes) or ``800Mbit``/``100Mbps`` (bits)."""
    m = _RATE_RE.match(text.strip().lower())
    if not m:
        raise UsageError(f"bad rate {text!r}", hint="e.g. 100M (bytes/s), 800Mbit, 1.5G")
    value = float(m.group(1)) * {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    if m.group(3) == "bit" or (m.group(3) == "b" and m.group(4) == "ps"):  # 800Mbit, 100Mbps
        value /= 8
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"rate must be positive: {text!r}")
    return value
