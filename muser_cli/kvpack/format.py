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
    rest); a header holding one is 1.3, any other keeps its minor. v1.4 adds the layer kind
    ``chunked`` (chunked-local attention: the current chunk's rows); a header holding one
    is 1.4.
All lengths are checked against hard limits before anything is allocated. Parsing and
validating a header is :mod:`muser_cli.kvpack.validate`.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any, Iterator

from muser_cli.errors import KVPackError
from muser_cli.kvpack.digest import DEFAULT_DIGEST, DIGESTS
from muser_cli.kvpack.layers import DTYPES, LOCAL_KINDS, NEW_KINDS_MINOR, LayerSpec
from muser_cli.kvpack.quant import int8_row_bytes
from muser_cli.strict import canonical_json  # noqa: F401 - the one canonical JSON; kvpack callers import it here

MAGIC = b"\x89KVPACK\n"
MAJOR = 1
MINOR = 4  # the newest minor this code reads and writes; it reads every 1.y with y <= MINOR
MINORS = (0, 1, 2, 3, 4)
# What each minor added, named when an older reader refuses a newer file (checks.check_preamble).
MINOR_ADDS = {1: "a named chain digest", 2: "ring_extra", 3: "layer kinds latent and state", 4: "layer kind chunked"}
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
               3: HEADER_KEYS_V1_0 | {"digest", "ring_extra", "state_every"},
               4: HEADER_KEYS_V1_0 | {"digest", "ring_extra", "state_every"}}
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
        if needs and 1 <= self.minor < needs:  # a latent or state layer: 1.3; a chunked one: 1.4
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
        if self.ring_extra and not any(spec.kind in LOCAL_KINDS for spec in self.layers):
            raise KVPackError("ring_extra needs a sliding or chunked layer")
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
        if spec.kind in LOCAL_KINDS:
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
