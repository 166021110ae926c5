"""kvpack v1 wire constants, the header model and its validation, and the frame plan.

Rules (docs/kvpack.md is the normative text):
  * preamble: magic (8) | major u16 | minor u16 | header_len u32, little-endian;
  * header: canonical JSON (sorted keys, no spaces, ASCII), then zero padding so the
    first frame starts on a 64-byte boundary;
  * frames: a 64-byte frame header, the stored payload, zero padding to 64, then a
    64-byte digest block (32-byte SHA-256 chain digest + 32 zero bytes);
  * the digest chain starts from the header digest and binds every frame's header
    (with its sequence number) and stored bytes; the end frame carries the root digest.
    v1.0 chains SHA-256 over header and stored bytes; v1.1 names its digest (``blake3``
    or ``sha256``) and chains each frame header with the digest of its payload
    (muser_cli/kvpack/digest.py). v1.2 adds ``ring_extra``: sliding layers carry that
    many rows more than ``window - 1`` (written only when > 0; a pack without it keeps
    the minor it had). v1.3 adds the layer kinds ``latent`` (MLA rows of latent + rope
    key) and ``state`` (a recurrent layer's snapshot per chunk, the newest superseding the
    rest); a header holding one is 1.3, any other keeps its minor.
All lengths are checked against hard limits before anything is allocated.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from muser_cli.errors import KVPackError, MuserError
from muser_cli.kvpack.digest import DEFAULT_DIGEST, DIGESTS
from muser_cli.kvpack.layers import (
    DTYPES, LAYER_KINDS, MAX_STATE_TENSORS, NEW_KINDS_MINOR, ROPE_STYLES, STATE_NAME_CHARS, LayerSpec, RopeSpec,
    StateTensor,
)
from muser_cli.kvpack.quant import int8_row_bytes
from muser_cli.strict import canonical_json  # noqa: F401 - the one canonical JSON; kvpack callers import it here

MAGIC = b"\x89KVPACK\n"
MAJOR = 1
MINOR = 3  # the newest minor this code reads and writes; it reads every 1.y with y <= MINOR
MINORS = (0, 1, 2, 3)
# What each minor added, named when an older reader refuses a newer file (checks.check_preamble).
MINOR_ADDS = {1: "a named chain digest", 2: "ring_extra", 3: "layer kinds latent and state"}
MAX_STATE_DIMS = 6
WRITE_MINOR = 1  # what a header is written as unless it needs more (ring_extra > 0: 1.2)
MAX_RING_EXTRA = 1 << 22  # MAX_TOKENS: a sliding layer may carry every row (its history); readers before it read <= 1024
PREAMBLE = struct.Struct("<8sHHI")  # magic, major, minor, header_len
FRAME_HEADER = struct.Struct("<4sIIIIBBHQQ24x")  # tag, seq, layer, start, count, codec, flags, rsv, raw_len, stored_len
ALIGN = 64
DIGEST_BLOCK = 64  # 32-byte digest + 32 zero bytes
TAG_DATA = b"KVFR"
TAG_END = b"KVND"

CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_ZSTD_GROUPED = 2
CODEC_NAMES = {CODEC_RAW: "none", CODEC_ZSTD: "zstd", CODEC_ZSTD_GROUPED: "zstd+bytegroup"}

# Hard limits. A reader refuses anything beyond them before allocating.
MAX_HEADER_BYTES = 8 * 1024 * 1024
MAX_LAYERS = 1024
MAX_TOKENS = 1 << 22  # 4,194,304 prompt tokens
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_FRAME_ROWS = 1 << 16
MAX_FRAME_BYTES = 1 << 30  # 1 GiB decoded per frame
MAX_TOTAL_BYTES = 1 << 40  # 1 TiB decoded per pack
MAX_JSON_DEPTH = 16
MAX_TOKEN_ID = (1 << 31) - 1

HEADER_KEYS_V1_0 = {
    "format", "version", "model", "tokenizer", "tokens", "positions", "schedule",
    "dtype", "layers", "codec", "quant", "producer", "base",
}
HEADER_KEYS = {0: HEADER_KEYS_V1_0, 1: HEADER_KEYS_V1_0 | {"digest"}, 2: HEADER_KEYS_V1_0 | {"digest", "ring_extra"},
               3: HEADER_KEYS_V1_0 | {"digest", "ring_extra", "state_every"}}
MAX_STATE_EVERY = 1 << 16


def pad_len(n: int) -> int:
    return (-n) % ALIGN


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def token_digest(ids: list[int] | tuple[int, ...]) -> str:
    """``sha256:`` over the ids as little-endian uint32 (the prompt's identity)."""
    h = hashlib.sha256()
    h.update(struct.pack(f"<{len(ids)}I", *ids))
    return "sha256:" + h.hexdigest()


def header_digest(preamble: bytes, header_json: bytes) -> bytes:
    return sha256(b"kvpack/v1 header\x00" + preamble + header_json)


def chain(prev: bytes, frame_header: bytes | memoryview, *stored: bytes | memoryview) -> bytes:
    """d_k = sha256(d_{k-1} || frame_header || stored payload); the payload may come in parts."""
    h = hashlib.sha256(prev)
    h.update(frame_header)
    for part in stored:
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class PackHeader:
    """The identity and structure of a pack. ``rows_end`` positions are covered: [rows_start, rows_end)."""

    model_fingerprint: str
    tokenizer_fingerprint: str
    token_ids: tuple[int, ...]
    layers: tuple[LayerSpec, ...]
    dtype: str
    chunk_tokens: int
    rows_start: int = 0  # first position carried by full-attention layers (0 unless a delta)
    frame_tokens: int | None = None  # frame grid; defaults to chunk_tokens
    model_name: str = ""
    architecture: str = ""
    codec: dict[str, Any] = field(default_factory=lambda: {"name": "none"})
    quant: dict[str, Any] = field(default_factory=lambda: {"scheme": "none"})
    producer: dict[str, Any] = field(default_factory=dict)
    base: dict[str, Any] | None = None
    minor: int | None = None  # None: WRITE_MINOR (1.1 becomes 1.2 when ring_extra > 0)
    raw: dict[str, Any] = field(default_factory=dict, compare=False)
    digest: str | None = None  # v1.1: "blake3" (default) or "sha256"; v1.0 is always sha256
    ring_extra: int = 0  # v1.2: rows sliding layers carry beyond window - 1
    state_every: int = 1  # v1.3: a state layer's snapshot every this many grid chunks (and at the end)

    def __post_init__(self) -> None:
        if self.minor is None:
            object.__setattr__(self, "minor", WRITE_MINOR)
        needs = max((NEW_KINDS_MINOR.get(spec.kind, 0) for spec in self.layers), default=0)
        if needs and self.minor in (1, 2):  # a latent or state layer: the header is 1.3
            object.__setattr__(self, "minor", needs)
        if needs > self.minor:
            kinds = sorted({s.kind for s in self.layers if NEW_KINDS_MINOR.get(s.kind, 0) > self.minor})
            raise KVPackError(f"layer kind(s) {', '.join(kinds)} need kvpack 1.{needs} (this header is 1.{self.minor})")
        if not 0 <= self.ring_extra <= MAX_RING_EXTRA:
            raise KVPackError(f"ring_extra {self.ring_extra} outside [0, {MAX_RING_EXTRA}]")
        if self.ring_extra and self.minor == 1:  # 1.1 has no such field: the header is 1.2 (or 1.3)
            object.__setattr__(self, "minor", 2)
        if self.ring_extra and self.minor < 2:
            raise KVPackError(f"ring_extra needs kvpack 1.2 (this header is 1.{self.minor})")
        if self.ring_extra and not any(spec.kind == "sliding" for spec in self.layers):
            raise KVPackError("ring_extra needs a sliding layer")
        if not 1 <= self.state_every <= MAX_STATE_EVERY:
            raise KVPackError(f"state_every {self.state_every} outside [1, {MAX_STATE_EVERY}]")
        if self.state_every > 1 and not any(spec.kind == "state" for spec in self.layers):
            raise KVPackError("state_every needs a state layer")
        if self.minor == 0:
            object.__setattr__(self, "digest", "sha256")
        elif self.digest is None:
            object.__setattr__(self, "digest", DEFAULT_DIGEST)
        if self.digest not in DIGESTS:
            raise KVPackError(f"digest {self.digest!r} is unknown (known: {', '.join(DIGESTS)})")

    @property
    def rows_end(self) -> int:
        """Positions a pack covers end before the last prompt token (the consumer runs it)."""
        return len(self.token_ids) - 1

    @property
    def grid(self) -> int:
        return self.frame_tokens or self.chunk_tokens

    @property
    def token_digest(self) -> str:
        return token_digest(self.token_ids)

    def layer_first_row(self, index: int) -> int:
        spec = self.layers[index]
        if spec.kind == "sliding":
            return self.rows_end - spec.carried_rows(self.rows_end, self.ring_extra)
        return self.rows_start

    def layer_rows(self, index: int) -> int:
        """Positions layer ``index`` covers (a state layer: those its snapshots absorb)."""
        return self.rows_end - self.layer_first_row(index)

    def layer_frames(self, index: int) -> int:
        """Data frames of layer ``index`` in the plan: one per grid chunk its positions touch
        (a state layer: one per ``state_every`` chunks, counted from position 0, and the last)."""
        first, end, g = self.layer_first_row(index), self.rows_end, self.grid
        if end <= first:
            return 0
        k0, k1 = first // g, (end - 1) // g  # the first and last chunk the layer touches
        if self.layers[index].kind != "state":
            return k1 - k0 + 1
        e = self.state_every
        return (k1 + 1) // e - k0 // e + (1 if (k1 + 1) % e else 0)

    def snapshot_due(self, chunk_end: int) -> bool:
        """Whether state layers carry a snapshot at ``chunk_end`` (a grid chunk's end, or the pack's end)."""
        return chunk_end == self.rows_end or chunk_end % (self.grid * self.state_every) == 0

    def frame_raw_len(self, index: int, count: int) -> int:
        """Decoded bytes of a frame of layer ``index`` covering ``count`` positions: its rows,
        or for a state layer one whole snapshot (never quantized)."""
        spec = self.layers[index]
        return spec.state_bytes if spec.kind == "state" else self.row_bytes(index) * count

    def frame_elem(self, index: int) -> int:
        """The element size a frame's byte grouping uses (1 for int8 rows)."""
        spec = self.layers[index]
        if spec.kind == "state":
            return spec.state_elem
        return 1 if self.quant_scheme == "int8" else self.elem_bytes()

    def layer_logical_bytes(self, index: int) -> int:
        """What a consumer holds of layer ``index``: its rows in the header dtype, or one snapshot."""
        spec = self.layers[index]
        if spec.kind == "state":
            return spec.state_bytes if self.layer_rows(index) else 0
        return self.logical_row_bytes(index) * self.layer_rows(index)

    def elem_bytes(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def quant_scheme(self) -> str:
        return str(self.quant.get("scheme", "none"))

    def logical_row_bytes(self, index: int) -> int:
        """Bytes of one row of layer ``index`` in the header's dtype."""
        spec = self.layers[index]
        return spec.kv_heads * (spec.head_dim + spec.v_head_dim) * self.elem_bytes()

    def row_bytes(self, index: int) -> int:
        """Bytes of one row of layer ``index`` in a frame's decoded payload (after the codec)."""
        if self.quant_scheme == "int8":
            spec = self.layers[index]
            return int8_row_bytes(spec.kv_heads, spec.head_dim, spec.v_head_dim)
        return self.logical_row_bytes(index)

    def total_logical_bytes(self) -> int:
        return sum(self.layer_logical_bytes(i) for i in range(len(self.layers)))

    def layer_raw_bytes(self, index: int) -> int:
        """Decoded bytes of all frames of layer ``index`` (a state layer: every snapshot)."""
        if self.layers[index].kind == "state":
            return self.layers[index].state_bytes * self.layer_frames(index)
        return self.row_bytes(index) * self.layer_rows(index)

    def total_raw_bytes(self) -> int:
        return sum(self.layer_raw_bytes(i) for i in range(len(self.layers)))

    def frame_plan(self) -> Iterator[tuple[int, int, int]]:
        """Yield (layer, start, count) in stream order: chunk-major, then layer order.

        The grid is absolute (multiples of ``grid`` from position 0), so a producer can
        emit every frame of a prefill chunk as soon as that chunk is computed.
        """
        end = self.rows_end
        firsts = [self.layer_first_row(i) for i in range(len(self.layers))]
        if not firsts or end <= min(firsts):
            return
        g = self.grid
        c = (min(firsts) // g) * g
        since = list(firsts)  # state layers: the position of the last snapshot (positions absorbed since)
        state = [spec.kind == "state" for spec in self.layers]
        while c < end:
            hi = min(c + g, end)
            for i, first in enumerate(firsts):
                lo = max(c, first)
                if lo >= hi:
                    continue
                if not state[i]:
                    yield i, lo, hi - lo
                elif self.snapshot_due(hi):  # a snapshot: the state after [0, hi)
                    yield i, since[i], hi - since[i]
                    since[i] = hi
            c += g

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": "kvpack",
            "version": [MAJOR, self.minor],
            "model": {"fingerprint": self.model_fingerprint, "name": self.model_name, "architecture": self.architecture},
            "tokenizer": {"fingerprint": self.tokenizer_fingerprint},
            "tokens": {"ids": list(self.token_ids), "count": len(self.token_ids), "digest": self.token_digest},
            "positions": {"start": self.rows_start, "end": self.rows_end},
            "schedule": {"chunk_tokens": self.chunk_tokens, "frame_tokens": self.grid},
            "dtype": self.dtype,
            "layers": [spec.to_json() for spec in self.layers],
            "codec": self.codec,
            "quant": self.quant,
            "producer": self.producer,
            "base": self.base,
        }
        if self.minor >= 1:
            out["digest"] = self.digest
        if self.ring_extra:
            out["ring_extra"] = self.ring_extra
        if self.state_every > 1:
            out["state_every"] = self.state_every
        return out

    def encode(self) -> bytes:
        return canonical_json(self.to_json())


# ---------------------------------------------------------------- validation
def _fail(msg: str) -> KVPackError:
    return KVPackError(f"bad kvpack header: {msg}")


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str, fail: Callable[[str], MuserError] = _fail) -> Any:
    if not isinstance(obj, dict):
        raise fail(f"{where} is not an object")
    if key not in obj:
        raise fail(f"missing {where}.{key}")
    value = obj[key]
    if kind is int and isinstance(value, bool):
        raise fail(f"{where}.{key} must be an integer")
    if not isinstance(value, kind):
        raise fail(f"{where}.{key} has the wrong type")
    return value


def _int(obj: Any, key: str, where: str, lo: int, hi: int, fail: Callable[[str], MuserError] = _fail) -> int:
    value = _get(obj, key, int, where, fail)
    if not lo <= value <= hi:
        raise fail(f"{where}.{key}={value} outside [{lo}, {hi}]")
    return value


def _fingerprint(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.startswith("sha256:") or len(value) != 71:
        raise _fail(f"{where} is not a sha256 fingerprint")
    try:
        int(value[7:], 16)
    except ValueError:
        raise _fail(f"{where} is not a sha256 fingerprint") from None
    return value


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _json_depth_ok(data: bytes) -> bool:
    """No array/object nesting deeper than MAX_JSON_DEPTH (checked before json.loads).

    Strings are removed first (with their escapes), then only brackets are walked, so a
    header of 100k token ids costs a regex pass, not a Python loop over every byte. An
    unterminated string leaves its quote and brackets in place: rejected either way."""
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    depth = 0
    for b in brackets:
        if b in (0x7B, 0x5B):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        else:
            depth -= 1
    return True


def parse_layer_spec(obj: Any, where: str, fail: Callable[[str], MuserError] = _fail) -> LayerSpec:
    """A :class:`LayerSpec` from its ``to_json()`` form, strictly: the one layer-spec parser
    (a pack header's ``layers[i]``, and the vLLM connector's config). Every refusal is
    ``fail(message)`` naming ``where``; by default a :class:`KVPackError` about the header."""
    kind = _get(obj, "kind", str, where, fail)
    if kind not in LAYER_KINDS:
        raise fail(f"{where}.kind {kind!r} is unknown (known: {', '.join(LAYER_KINDS)})")
    if kind == "latent":
        return _parse_latent(obj, where, fail)
    if kind == "state":
        return _parse_state(obj, where, fail)
    kv_heads = _int(obj, "kv_heads", where, 1, MAX_HEADS, fail)
    head_dim = _int(obj, "head_dim", where, 1, MAX_HEAD_DIM, fail)
    v_head_dim = _int(obj, "v_head_dim", where, 1, MAX_HEAD_DIM, fail)
    window = obj.get("window") if isinstance(obj, dict) else None
    if kind == "sliding":
        window = _int(obj, "window", where, 2, MAX_TOKENS, fail)
    elif window is not None:
        raise fail(f"{where}.window must be null for a full layer")
    rope = _parse_rope(obj.get("rope"), f"{where}.rope", head_dim, fail)
    return LayerSpec(kind=kind, kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, window=window, rope=rope)


def _parse_rope(rope_obj: Any, w: str, max_dims: int, fail: Callable[[str], MuserError]) -> RopeSpec | None:
    if rope_obj is None:
        return None
    theta = _get(rope_obj, "theta", (int, float), w, fail)
    if isinstance(theta, bool) or not (0 < float(theta) < 1e12):
        raise fail(f"{w}.theta out of range")
    dims = _int(rope_obj, "dims", w, 2, max_dims, fail)
    style = _get(rope_obj, "style", str, w, fail)
    if style not in ROPE_STYLES:
        raise fail(f"{w}.style {style!r} is unknown (known: {', '.join(ROPE_STYLES)})")
    scaling = rope_obj.get("scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise fail(f"{w}.scaling must be an object or null")
    return RopeSpec(theta=float(theta), dims=dims, style=style, scaling=scaling)


def _exact_keys(obj: dict, keys: set[str], where: str, fail: Callable[[str], MuserError]) -> None:
    if set(obj) != keys:
        raise fail(f"{where} must have exactly the keys {sorted(keys)} (has {sorted(obj)})")


def _parse_latent(obj: dict, where: str, fail: Callable[[str], MuserError]) -> LayerSpec:
    """v1.3 ``latent``: {kind, kv_lora_rank, rope_dim, rope} (docs/kvpack.md 1.4)."""
    _exact_keys(obj, {"kind", "kv_lora_rank", "rope_dim", "rope"}, where, fail)
    rank = _int(obj, "kv_lora_rank", where, 1, MAX_HEAD_DIM, fail)
    rope_dim = _int(obj, "rope_dim", where, 1, MAX_HEAD_DIM, fail)
    rope = _parse_rope(obj.get("rope"), f"{where}.rope", rope_dim, fail)
    return LayerSpec(kind="latent", kv_heads=1, head_dim=rank, v_head_dim=rope_dim, rope=rope)


def _parse_state(obj: dict, where: str, fail: Callable[[str], MuserError]) -> LayerSpec:
    """v1.3 ``state``: {kind, mixer, tensors: [{name, shape, dtype}, ...]} (docs/kvpack.md 1.4)."""
    _exact_keys(obj, {"kind", "mixer", "tensors"}, where, fail)
    mixer = _get(obj, "mixer", str, where, fail)
    if not 1 <= len(mixer) <= 64 or not set(mixer) <= STATE_NAME_CHARS:
        raise fail(f"{where}.mixer must be 1-64 of [a-z0-9_]")
    items = _get(obj, "tensors", list, where, fail)
    if not 1 <= len(items) <= MAX_STATE_TENSORS:
        raise fail(f"{where}.tensors: {len(items)} tensors outside [1, {MAX_STATE_TENSORS}]")
    tensors: list[StateTensor] = []
    for j, t in enumerate(items):
        w = f"{where}.tensors[{j}]"
        if not isinstance(t, dict):
            raise fail(f"{w} is not an object")
        _exact_keys(t, {"name", "shape", "dtype"}, w, fail)
        name = _get(t, "name", str, w, fail)
        if not 1 <= len(name) <= 64 or not set(name) <= STATE_NAME_CHARS:
            raise fail(f"{w}.name must be 1-64 of [a-z0-9_]")
        if any(x.name == name for x in tensors):
            raise fail(f"{w}.name {name!r} is a duplicate")
        shape = _get(t, "shape", list, w, fail)
        if not 1 <= len(shape) <= MAX_STATE_DIMS or any(
                not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= MAX_FRAME_BYTES for d in shape):
            raise fail(f"{w}.shape must be 1-{MAX_STATE_DIMS} dimensions, each in [1, {MAX_FRAME_BYTES}]")
        dtype = _get(t, "dtype", str, w, fail)
        if dtype not in DTYPES:
            raise fail(f"{w}.dtype {dtype!r} is unknown (known: {', '.join(DTYPES)})")
        tensors.append(StateTensor(name, tuple(shape), dtype))
    spec = LayerSpec(kind="state", kv_heads=0, head_dim=0, v_head_dim=0, mixer=mixer, tensors=tuple(tensors))
    if spec.state_bytes > MAX_FRAME_BYTES:
        raise fail(f"{where}: a snapshot of {spec.state_bytes} bytes exceeds {MAX_FRAME_BYTES}")
    return spec


def parse_header(header_json: bytes, major: int, minor: int) -> PackHeader:
    """Validate canonical header bytes strictly and build a :class:`PackHeader`."""
    if not _json_depth_ok(header_json):
        raise _fail(f"JSON nested deeper than {MAX_JSON_DEPTH}")
    try:
        text = header_json.decode("ascii")
    except UnicodeDecodeError:
        raise _fail("not ASCII-encoded canonical JSON") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise _fail(f"not valid JSON ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise _fail("top level is not an object")
    try:
        canon = canonical_json(obj)
    except ValueError:
        raise _fail("not canonical JSON") from None
    if canon != header_json:
        raise _fail("not canonical JSON (duplicate keys, spacing or key order)")
    if minor not in MINORS:  # the preamble check refuses newer minors first; this guards direct calls
        raise _fail(f"version {major}.{minor} is not one this reader reads (1.0 to {MAJOR}.{MINOR})")
    unknown = set(obj) - HEADER_KEYS[minor]
    if unknown:
        raise _fail(f"unknown key(s) {sorted(unknown)} for version {major}.{minor}")
    if obj.get("format") != "kvpack":
        raise _fail("format is not 'kvpack'")
    version = _get(obj, "version", list, "header")
    if version != [major, minor]:
        raise _fail(f"version field {version} disagrees with preamble {major}.{minor}")

    model = _get(obj, "model", dict, "header")
    model_fp = _fingerprint(model.get("fingerprint"), "model.fingerprint")
    model_name = _get(model, "name", str, "model")
    arch = _get(model, "architecture", str, "model")
    tok_fp = _fingerprint(_get(obj, "tokenizer", dict, "header").get("fingerprint"), "tokenizer.fingerprint")

    tokens = _get(obj, "tokens", dict, "header")
    ids = _get(tokens, "ids", list, "tokens")
    count = _int(tokens, "count", "tokens", 1, MAX_TOKENS)
    if len(ids) != count:
        raise _fail(f"tokens.count={count} but {len(ids)} ids")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_TOKEN_ID:
            raise _fail("tokens.ids holds a value that is not a token id")
    if _get(tokens, "digest", str, "tokens") != token_digest(ids):
        raise _fail("tokens.digest does not match tokens.ids")

    positions = _get(obj, "positions", dict, "header")
    rows_end = _int(positions, "end", "positions", 0, MAX_TOKENS)
    if rows_end != count - 1:
        raise _fail(f"positions.end={rows_end} must be tokens.count-1={count - 1}")
    rows_start = _int(positions, "start", "positions", 0, rows_end)

    schedule = _get(obj, "schedule", dict, "header")
    chunk = _int(schedule, "chunk_tokens", "schedule", 1, MAX_FRAME_ROWS)
    frame_tokens = _int(schedule, "frame_tokens", "schedule", 1, MAX_FRAME_ROWS)

    dtype = _get(obj, "dtype", str, "header")
    if dtype not in DTYPES:
        raise _fail(f"dtype {dtype!r} is unknown (known: {', '.join(DTYPES)})")
    layers_obj = _get(obj, "layers", list, "header")
    if not 1 <= len(layers_obj) <= MAX_LAYERS:
        raise _fail(f"{len(layers_obj)} layers outside [1, {MAX_LAYERS}]")
    layers = tuple(parse_layer_spec(layer, f"layers[{i}]") for i, layer in enumerate(layers_obj))
    for i, spec in enumerate(layers):
        if NEW_KINDS_MINOR.get(spec.kind, 0) > minor:
            raise _fail(f"layers[{i}].kind {spec.kind!r} needs kvpack 1.{NEW_KINDS_MINOR[spec.kind]} "
                        f"(this header is {major}.{minor})")

    codec = _get(obj, "codec", dict, "header")
    if codec.get("name") not in CODEC_NAMES.values():
        raise _fail(f"codec {codec.get('name')!r} is unknown (known: {', '.join(CODEC_NAMES.values())})")
    quant = _get(obj, "quant", dict, "header")
    if quant.get("scheme") not in ("none", "int8"):
        raise _fail(f"quant scheme {quant.get('scheme')!r} is unknown (known: none, int8)")
    if quant.get("scheme") == "int8":
        if quant.get("granularity") != "token_head" or quant.get("scale_dtype") != "float32":
            raise _fail("int8 quant needs granularity 'token_head' and scale_dtype 'float32'")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise _fail("int8 quant of this dtype is not defined")
    producer = _get(obj, "producer", dict, "header")
    digest = None
    if minor >= 1:
        digest = _get(obj, "digest", str, "header")
        if digest not in DIGESTS:
            raise _fail(f"digest {digest!r} is unknown (known: {', '.join(DIGESTS)})")
    ring_extra = 0
    if "ring_extra" in obj:  # only 1.2 headers may hold it (HEADER_KEYS); absent means 0
        ring_extra = _int(obj, "ring_extra", "header", 1, MAX_RING_EXTRA)
        if not any(spec.kind == "sliding" for spec in layers):
            raise _fail("ring_extra needs a sliding layer")
    state_every = 1
    if "state_every" in obj:  # only 1.3 headers may hold it; absent means 1 (a snapshot every chunk)
        state_every = _int(obj, "state_every", "header", 2, MAX_STATE_EVERY)
        if not any(spec.kind == "state" for spec in layers):
            raise _fail("state_every needs a state layer")
    base = obj.get("base")
    if base is not None and not isinstance(base, dict):
        raise _fail("base must be an object or null")
    if rows_start > 0 and base is None:
        raise _fail("positions.start > 0 needs a base (a delta pack names its prefix)")

    header = PackHeader(
        model_fingerprint=model_fp, tokenizer_fingerprint=tok_fp, token_ids=tuple(ids), layers=layers,
        dtype=dtype, chunk_tokens=chunk, rows_start=rows_start, frame_tokens=frame_tokens,
        model_name=model_name, architecture=arch, codec=codec, quant=quant, producer=producer,
        base=base, minor=minor, raw=obj, digest=digest, ring_extra=ring_extra, state_every=state_every,
    )
    # Checked sizes: Python ints do not overflow; compare against hard caps.
    total = 0
    for i in range(len(layers)):
        if header.frame_raw_len(i, min(frame_tokens, max(header.layer_rows(i), 1))) > MAX_FRAME_BYTES:
            raise _fail(f"layers[{i}] frames would exceed {MAX_FRAME_BYTES} bytes")
        total += header.layer_raw_bytes(i)
    if total > MAX_TOTAL_BYTES:
        raise _fail(f"declared KV size {total} exceeds the {MAX_TOTAL_BYTES}-byte limit")
    return header


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")
