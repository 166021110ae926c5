"""Layer descriptions carried in a kvpack header (pure Python, no ML framework).

A layer is described by what a consumer must honour to use its rows:
its attention class (full or sliding window), whether RoPE was applied to the cached
keys and with which parameters (or NoPE), the number of KV heads and the head dims.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LAYER_KINDS = ("full", "sliding")
ROPE_STYLES = ("rotate_half", "interleaved")
# Storage dtypes: name -> (bytes per element, numpy dtype string used for the raw buffer).
# bfloat16 is carried as raw 16-bit words (numpy has no bfloat16).
DTYPES: dict[str, tuple[int, str]] = {
    "float32": (4, "<f4"),
    "float16": (2, "<f2"),
    "bfloat16": (2, "<u2"),
}


@dataclass(frozen=True)
class RopeSpec:
    """RoPE as applied to the cached keys."""

    theta: float
    dims: int  # rotary dimensions (== head_dim unless partial rotary)
    style: str = "rotate_half"
    scaling: dict[str, Any] | None = None  # rope_scaling as plain JSON values, or None

    def to_json(self) -> dict[str, Any]:
        return {"theta": self.theta, "dims": self.dims, "style": self.style, "scaling": self.scaling}


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's cache description.

    ``kind == "sliding"``: the layer attends to the last ``window`` positions including
    the current token, so an engine's cache holds its last ``min(rows, window - 1)`` rows;
    a v1.2 kvpack may carry ``ring_extra`` more (docs/kvpack.md 1.3).
    ``rope is None`` means NoPE: keys carry no positional rotation.
    """

    kind: str
    kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None = None
    rope: RopeSpec | None = None

    def carried_rows(self, total_rows: int, extra: int = 0) -> int:
        """How many of ``total_rows`` cached positions this layer holds: every one (full), or
        the last ``window - 1`` (sliding) plus ``extra`` older ring rows (a pack's
        ``ring_extra``, which lets a consumer recompute the last ``extra`` positions
        exactly). ``extra=0`` is what an engine's cache holds for decoding."""
        if self.kind == "sliding":
            assert self.window is not None
            return min(total_rows, self.window - 1 + extra)
        return total_rows

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "v_head_dim": self.v_head_dim,
            "window": self.window,
            "rope": None if self.rope is None else self.rope.to_json(),
        }


@dataclass(frozen=True)
class LayerKV:
    """Rows of one layer: ``keys`` (kv_heads, rows, head_dim), ``values`` (kv_heads, rows, v_head_dim).

    Arrays are numpy arrays in the storage dtype of :data:`DTYPES` (bfloat16 as uint16 bits).
    ``first_row`` is the absolute position of row 0.
    """

    keys: Any
    values: Any
    first_row: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def ring_extra_held(specs: "tuple[LayerSpec, ...] | list[LayerSpec]", layers: "list[LayerKV]", rows: int) -> int:
    """The ``ring_extra`` a pack of ``layers`` (each ending at ``rows``) can declare: the
    fewest rows beyond ``window - 1`` any sliding layer past its window holds (0 when none
    is past its window, or one holds no more)."""
    extras = [rows - kv.first_row - (spec.window - 1) for spec, kv in zip(specs, layers)
              if spec.kind == "sliding" and spec.window is not None and rows > spec.window - 1]
    return min(max(0, min(extras)), 1024) if extras else 0  # MAX_RING_EXTRA (format.py)


def ring_tail(kv: LayerKV, first: int, end: int) -> LayerKV:
    """``kv`` (which must end at ``end``) without its rows before ``first``: views, no copy.

    Engines call it on install: a pack's sliding layer may carry ``ring_extra`` rows older
    than the ``window - 1`` a cache holds; those are dropped here. A layer that already
    starts at or after ``first``, or does not end at ``end``, is returned as it is (the
    engine's own shape check then names what is wrong)."""
    held = int(kv.keys.shape[1])
    if kv.first_row >= first or kv.first_row + held != end:
        return kv
    a = first - kv.first_row
    return LayerKV(keys=kv.keys[:, a:], values=kv.values[:, a:], first_row=first, extra=kv.extra)
