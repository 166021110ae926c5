"""Layer descriptions carried in a kvpack header (pure Python, no ML framework).

A layer is described by what a consumer must honour to use its rows:
its attention class (full, sliding window or chunked-local), whether RoPE was applied to the cached
keys and with which parameters (or NoPE), the number of KV heads and the head dims.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from muser_cli.errors import DataError

LAYER_KINDS = ("full", "sliding", "latent", "state", "chunked")
ROW_KINDS = ("full", "sliding", "latent", "chunked")  # kinds whose frames are rows of positions
NEW_KINDS_MINOR = {"latent": 3, "state": 3, "chunked": 4}  # the kvpack minor that introduced each later kind
LOCAL_KINDS = ("sliding", "chunked")  # kinds that carry only their last rows, and ring_extra more
MAX_STATE_TENSORS = 16
STATE_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")
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
class StateTensor:
    """One named fixed-shape tensor of a ``state`` layer (docs/kvpack.md 1.4)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype][0]
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's cache description.

    ``kind == "sliding"``: the layer attends to the last ``window`` positions including
    the current token, so an engine's cache holds its last ``min(rows, window - 1)`` rows;
    a v1.2 kvpack may carry ``ring_extra`` more (docs/kvpack.md 1.3).
    ``rope is None`` means NoPE: keys carry no positional rotation.

    ``kind == "latent"`` (v1.3, MLA): a row is one compressed latent (``head_dim`` =
    ``kv_lora_rank``) then one shared RoPE key (``v_head_dim`` = ``qk_rope_head_dim``),
    laid out as a one-head row layer (``kv_heads`` == 1); see :func:`latent_spec`.
    ``kind == "state"`` (v1.3, recurrent layers): no rows; a snapshot of ``tensors`` at
    a position (``kv_heads``/``head_dim``/``v_head_dim`` are 0); see :func:`state_spec`.
    ``kind == "chunked"`` (v1.4, chunked-local attention, Llama 4): position p attends to
    ``[floor(p / chunk) * chunk, p]``, so a cache holds only the current chunk's rows.
    """

    kind: str
    kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None = None
    rope: RopeSpec | None = None
    tensors: tuple[StateTensor, ...] = ()  # state only
    mixer: str = ""  # state only: the recurrence that reads the tensors (e.g. "gated_delta_net", "mamba2")
    chunk: int | None = None  # chunked only: attention_chunk_size

    @property
    def state_bytes(self) -> int:
        """Bytes of one snapshot of a state layer (0 for row layers)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def state_elem(self) -> int:
        """The byte-grouping width of a state snapshot: its smallest element size."""
        return min(DTYPES[t.dtype][0] for t in self.tensors)

    def carried_rows(self, total_rows: int, extra: int = 0) -> int:
        """How many of ``total_rows`` cached positions this layer holds: every one (full), the
        last ``window - 1`` (sliding), or those of the current chunk, positions
        ``[floor(total_rows / chunk) * chunk, total_rows)`` (chunked) -- plus ``extra`` older
        rows (a pack's ``ring_extra``, which lets a consumer recompute the last ``extra``
        positions exactly: a chunked layer then starts at the chunk of position
        ``total_rows - extra``). ``extra=0`` is what an engine's cache holds for decoding."""
        if self.kind == "sliding":
            assert self.window is not None
            return min(total_rows, self.window - 1 + extra)
        if self.kind == "chunked":
            assert self.chunk is not None
            return total_rows - (max(0, total_rows - extra) // self.chunk) * self.chunk
        return total_rows

    def to_json(self) -> dict[str, Any]:
        if self.kind == "latent":
            return {"kind": "latent", "kv_lora_rank": self.head_dim, "rope_dim": self.v_head_dim,
                    "rope": None if self.rope is None else self.rope.to_json()}
        if self.kind == "state":
            return {"kind": "state", "mixer": self.mixer, "tensors": [t.to_json() for t in self.tensors]}
        if self.kind == "chunked":
            return {"kind": "chunked", "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                    "v_head_dim": self.v_head_dim, "chunk": self.chunk,
                    "rope": None if self.rope is None else self.rope.to_json()}
        return {
            "kind": self.kind,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "v_head_dim": self.v_head_dim,
            "window": self.window,
            "rope": None if self.rope is None else self.rope.to_json(),
        }


def latent_spec(kv_lora_rank: int, rope_dim: int, rope: RopeSpec | None) -> LayerSpec:
    """A latent (MLA) layer: rows of (latent, rope key), a one-head row layer underneath."""
    return LayerSpec(kind="latent", kv_heads=1, head_dim=kv_lora_rank, v_head_dim=rope_dim, rope=rope)


def state_spec(mixer: str, tensors: "list[tuple[str, tuple[int, ...], str]]") -> LayerSpec:
    """A state layer holding the named tensors ``(name, shape, dtype)`` in this order."""
    return LayerSpec(kind="state", kv_heads=0, head_dim=0, v_head_dim=0, mixer=mixer,
                     tensors=tuple(StateTensor(n, tuple(shape), dt) for n, shape, dt in tensors))


@dataclass(frozen=True)
class StateKV:
    """A state layer's snapshot: ``tensors`` (name -> array of the declared shape, storage
    dtype) after positions ``[0, position)``. A reader hands out the newest verified one;
    a writer of a whole pack also takes the ``earlier`` snapshots its frame plan needs
    (position -> tensors, one per chunk end; docs/kvpack.md 2.5)."""

    tensors: dict[str, Any]
    position: int
    first_row: int = 0
    earlier: dict[int, dict[str, Any]] = field(default_factory=dict)

    def at(self, position: int) -> dict[str, Any] | None:
        return self.tensors if position == self.position else self.earlier.get(position)


def resume_snapshot(kv: Any, index: int, spec: LayerSpec, rows: int) -> StateKV | None:
    """``kv`` checked as the snapshot an engine installs in state layer ``index`` of a cache
    resuming at ``rows``: a :class:`StateKV` at ``rows`` holding each of ``spec``'s tensors in
    its declared shape (DataError otherwise). None when there is nothing to install (``rows`` 0)."""
    import numpy as np

    if not isinstance(kv, StateKV):
        raise DataError(f"layer {index} is a {spec.mixer} state layer: rows of K and V cannot fill it")
    if rows == 0:
        return None
    if kv.position != rows or not kv.tensors:
        raise DataError(f"layer {index}: a state snapshot at position {kv.position}, the cache resumes at {rows}")
    for t in spec.tensors:
        arr = kv.tensors.get(t.name)
        if arr is None or tuple(np.shape(arr)) != t.shape:
            raise DataError(f"layer {index}: state {t.name!r} is {None if arr is None else tuple(np.shape(arr))}, "
                            f"expected {t.shape}")
    return kv


def split_state(spec: LayerSpec, raw: Any) -> dict[str, Any]:
    """The named tensors of one decoded state payload (views of ``raw``, no copy)."""
    import numpy as np

    buf = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1).view(np.uint8)
    out, at = {}, 0
    for t in spec.tensors:
        out[t.name] = buf[at : at + t.nbytes].view(DTYPES[t.dtype][1]).reshape(t.shape)
        at += t.nbytes
    return out


def state_kv(header: Any, index: int, raw: Any, earlier: "dict[int, Any] | None" = None) -> StateKV:
    """The newest snapshot of state layer ``index`` of a pack with ``header``, from its
    decoded payload (None: the layer has no frame, positions [first, first)); ``earlier``:
    the superseded snapshots' payloads by position (a whole pack read keeps them: a store
    entry resumes from one at a chunk boundary)."""
    first, end = header.layer_first_row(index), header.rows_end
    if raw is None:
        return StateKV(tensors={}, position=first, first_row=first)
    spec = header.layers[index]
    before = {p: split_state(spec, r) for p, r in (earlier or {}).items() if p != end}
    return StateKV(tensors=split_state(spec, raw), position=end, first_row=first, earlier=before)


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


def chunked_spec(kv_heads: int, head_dim: int, v_head_dim: int, chunk: int, rope: RopeSpec | None) -> LayerSpec:
    """A chunked-local attention layer (v1.4) of ``chunk`` positions per chunk."""
    return LayerSpec(kind="chunked", kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, chunk=chunk,
                     rope=rope)


def extra_matters(spec: LayerSpec, rows: int, extra: int) -> bool:
    """Whether ``extra`` ring rows change what ``spec`` carries after ``rows`` positions (a
    sliding layer past its window; a chunked layer whose extra rows reach into an earlier chunk)."""
    return extra > 0 and spec.kind in LOCAL_KINDS and spec.carried_rows(rows, extra) > spec.carried_rows(rows)


def ring_extra_held(specs: "tuple[LayerSpec, ...] | list[LayerSpec]", layers: "list[LayerKV]", rows: int) -> int:
    """The ``ring_extra`` a pack of ``layers`` (each ending at ``rows``) can declare: the
    fewest rows beyond ``window - 1`` any sliding layer past its window holds (0 when none
    is past its window, or one holds no more), and no more than each chunked layer holds
    (for it, the largest k whose rows it holds). A layer holding every row from position 0
    (the sliding history) bounds nothing: any ``ring_extra`` gives it all it holds."""
    bounded, whole = [], []
    for spec, kv in zip(specs, layers):
        if spec.kind == "sliding" and spec.window is not None and rows > spec.window - 1:
            extra = rows - kv.first_row - (spec.window - 1)
        elif spec.kind == "chunked" and extra_matters(spec, rows, rows):
            # carried_rows grows with k; the largest k whose rows start at or after first_row
            extra = rows - kv.first_row if kv.first_row % int(spec.chunk or 1) == 0 else 0
        else:
            continue
        (whole if kv.first_row == 0 else bounded).append(extra)
    if not bounded and not whole:
        return 0
    extra = min(bounded) if bounded else max(whole)
    return min(max(0, extra), 1 << 22)  # MAX_RING_EXTRA (format.py)


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
