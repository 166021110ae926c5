"""Read a kvpack: a sans-IO streaming parser (``PackReader``) and ``read_pack`` on top.

The parser verifies each frame as it arrives (plan position, sequence, lengths, digest
chain, codec bounds) and reports the pack complete only when the end frame's root digest
verifies and no byte follows. Memory grows with bytes actually received, never with
sizes a header merely declares. Every failure is a :class:`KVPackError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Union

import numpy as np

from muser_cli.errors import KVPackError
from muser_cli.kvpack.codec import decode_payload
from muser_cli.kvpack.format import (
    DIGEST_BLOCK, FRAME_HEADER, MAGIC, MAJOR, MAX_HEADER_BYTES, PREAMBLE, TAG_DATA, TAG_END,
    CODEC_NAMES, PackHeader, chain, header_digest, pad_len, parse_header,
)
from muser_cli.kvpack.layers import DTYPES, LayerKV


@dataclass(frozen=True)
class HeaderEvent:
    header: PackHeader


@dataclass(frozen=True)
class FrameEvent:
    seq: int
    layer: int
    start: int
    count: int
    codec: int
    stored_bytes: int
    keys: np.ndarray  # (kv_heads, count, head_dim), storage dtype
    values: np.ndarray  # (kv_heads, count, v_head_dim)


@dataclass(frozen=True)
class EndEvent:
    root_digest: bytes
    total_bytes: int  # bytes of the whole pack as received
    raw_bytes: int  # decoded KV bytes


Event = Union[HeaderEvent, FrameEvent, EndEvent]


class PackReader:
    """Feed bytes, get events. ``finish()`` at end of input raises if the pack is incomplete.

    ``decode=False`` checks structure and digests without decoding payloads (fast verify
    for relays); FrameEvent arrays are then empty.
    """

    def __init__(self, *, max_bytes: int | None = None, decode: bool = True) -> None:
        self._buf = bytearray()
        self._pos = 0  # bytes consumed
        self._state = "preamble"
        self._max_bytes = max_bytes
        self._decode = decode
        self.header: PackHeader | None = None
        self._plan: list[tuple[int, int, int]] = []
        self._seq = 0
        self._digest = b""
        self._raw_total = 0
        self._hlen = 0
        self._pre = b""
        self._frame: tuple | None = None
        self.root_digest: bytes | None = None

    @property
    def done(self) -> bool:
        return self._state == "done"

    @property
    def bytes_consumed(self) -> int:
        return self._pos

    def want(self) -> int:
        """Bytes still needed to complete the current step (0 when done): a pull-based
        caller that reads exactly this much gets zero-copy parsing."""
        st = self._state
        if st == "preamble":
            need = PREAMBLE.size
        elif st == "header":
            need = self._hlen + pad_len(PREAMBLE.size + self._hlen)
        elif st == "frame_body":
            stored_len = self._frame[6]  # type: ignore[index]
            need = stored_len + pad_len(stored_len) + DIGEST_BLOCK
        elif st in ("frame_header", "end_digest"):
            need = FRAME_HEADER.size
        else:
            return 0
        return max(0, need - len(self._buf))

    def feed(self, data: bytes | memoryview) -> list[Event]:
        if data and self._state == "done":
            raise KVPackError("bytes after the end frame")
        if self._max_bytes is not None and self._pos + len(self._buf) + len(data) > self._max_bytes:
            raise KVPackError(f"pack larger than the allowed {self._max_bytes} bytes")
        if self._buf:
            short = len(data) < self.want()
            self._buf += data
            if short:  # still incomplete: keep appending, copy nothing twice
                if self._state == "preamble":
                    self._check_magic(self._buf)
                return []
            src = bytes(self._buf)
            self._buf = bytearray()
        else:
            src = data if isinstance(data, bytes) else bytes(data)
        self._src = memoryview(src)
        self._off = 0
        events: list[Event] = []
        try:
            while True:
                ev = self._step()
                if ev is None:
                    break
                if ev is not True:
                    events.append(ev)  # type: ignore[arg-type]
        finally:
            rest = self._src[self._off :]
            if len(rest):
                self._buf = bytearray(rest)
            self._src = memoryview(b"")
            self._off = 0
        if self._state == "done" and self._buf:
            raise KVPackError("bytes after the end frame")
        return events

    def _check_magic(self, head: bytes | bytearray | memoryview) -> None:
        head = bytes(head[: len(MAGIC)])
        if not MAGIC.startswith(head):
            raise KVPackError("not a kvpack (bad magic)")

    def finish(self) -> None:
        if self._state != "done":
            where = {"preamble": "in the preamble", "header": "in the header"}.get(self._state, f"after {self._seq} frames")
            if self._pos == 0 and not self._buf:
                raise KVPackError("empty input: no kvpack")
            raise KVPackError(f"truncated kvpack: input ended {where}")

    # -------------------------------------------------------------- internals
    def _take(self, n: int) -> memoryview | None:
        if len(self._src) - self._off < n:
            return None
        out = self._src[self._off : self._off + n]
        self._off += n
        self._pos += n
        return out

    def _step(self) -> Event | bool | None:
        st = self._state
        if st == "preamble":
            self._check_magic(self._src[self._off :])
            pre = self._take(PREAMBLE.size)
            if pre is None:
                return None
            _, major, minor, hlen = PREAMBLE.unpack(pre)
            if major != MAJOR:
                raise KVPackError(f"kvpack major version {major} is not supported (this reader reads {MAJOR}.x)")
            if not 2 <= hlen <= MAX_HEADER_BYTES:
                raise KVPackError(f"header length {hlen} outside [2, {MAX_HEADER_BYTES}]")
            if self._max_bytes is not None and hlen > self._max_bytes:
                raise KVPackError(f"header length {hlen} exceeds the allowed size")
            self._pre, self._hlen, self._minor = bytes(pre), hlen, minor
            self._state = "header"
            return True
        if st == "header":
            need = self._hlen + pad_len(PREAMBLE.size + self._hlen)
            block = self._take(need)
            if block is None:
                return None
            hjson, padding = bytes(block[: self._hlen]), block[self._hlen :]
            if any(padding):
                raise KVPackError("non-zero header padding")
            header = parse_header(hjson, MAJOR, self._minor)
            self.header = header
            self._plan = list(header.frame_plan())
            self._digest = header_digest(self._pre, hjson)
            self._state = "frame_header"
            return HeaderEvent(header)
        if st == "frame_header":
            fh = self._take(FRAME_HEADER.size)
            if fh is None:
                return None
            tag, seq, layer, start, count, codec, flags, rsv, raw_len, stored_len = FRAME_HEADER.unpack(fh)
            if any(fh[40:]) or flags or rsv:
                raise KVPackError(f"frame {self._seq}: reserved bytes are not zero")
            if seq != self._seq:
                raise KVPackError(f"frame sequence {seq} where {self._seq} was expected (reordered or duplicated)")
            if tag == TAG_END:
                if self._seq != len(self._plan):
                    raise KVPackError(f"end frame after {self._seq} of {len(self._plan)} frames (frames missing)")
                if (layer, start, count, codec, stored_len) != (0, 0, 0, 0, 0):
                    raise KVPackError("malformed end frame")
                assert self.header is not None
                if raw_len != self._raw_total or raw_len != self.header.total_raw_bytes():
                    raise KVPackError("end frame byte count disagrees with the frames")
                self._frame = ("end", fh)
                self._state = "end_digest"
                return True
            if tag != TAG_DATA:
                raise KVPackError(f"frame {self._seq}: unknown frame tag {tag!r}")
            if self._seq >= len(self._plan):
                raise KVPackError(f"frame {self._seq} beyond the {len(self._plan)} the header plans")
            exp = self._plan[self._seq]
            if (layer, start, count) != exp:
                raise KVPackError(
                    f"frame {self._seq} is (layer {layer}, start {start}, rows {count}); the plan says {exp}"
                )
            if codec not in CODEC_NAMES:
                raise KVPackError(f"frame {self._seq}: unknown codec id {codec}")
            assert self.header is not None
            expect_raw = self.header.row_bytes(layer) * count
            if raw_len != expect_raw:
                raise KVPackError(f"frame {self._seq}: raw length {raw_len} != {expect_raw} implied by the header")
            if stored_len > raw_len + 1024 or (codec == 0 and stored_len != raw_len):
                raise KVPackError(f"frame {self._seq}: stored length {stored_len} is impossible")
            if self._max_bytes is not None and self._pos + stored_len > self._max_bytes:
                raise KVPackError(f"pack larger than the allowed {self._max_bytes} bytes")
            self._frame = (fh, layer, start, count, codec, raw_len, stored_len)
            self._state = "frame_body"
            return True
        if st == "frame_body":
            fh, layer, start, count, codec, raw_len, stored_len = self._frame  # type: ignore[misc]
            need = stored_len + pad_len(stored_len) + DIGEST_BLOCK
            body = self._take(need)
            if body is None:
                return None
            assert body is not None
            stored = memoryview(body)[:stored_len]
            if any(body[stored_len : stored_len + pad_len(stored_len)]) or any(body[-32:]):
                raise KVPackError(f"frame {self._seq}: non-zero padding")
            digest = chain(self._digest, fh, stored)
            if digest != body[-DIGEST_BLOCK:-32]:
                raise KVPackError(f"frame {self._seq} (layer {layer}, start {start}): digest mismatch (corrupt)")
            self._digest = digest
            self._raw_total += raw_len
            assert self.header is not None
            spec = self.header.layers[layer]
            np_dtype = np.dtype(DTYPES[self.header.dtype][1])
            int8 = self.header.quant_scheme == "int8"
            if self._decode and int8:
                from muser_cli.kvpack.quant import decode_int8

                raw = decode_payload(stored, codec, raw_len=raw_len, elem=1)  # int8 payload
                keys, values = decode_int8(raw, spec.kv_heads, count, spec.head_dim, spec.v_head_dim, self.header.dtype)
            elif self._decode:
                raw = decode_payload(stored, codec, raw_len=raw_len, elem=np_dtype.itemsize)
                flat = np.frombuffer(raw, dtype=np_dtype)
                nk = spec.kv_heads * count * spec.head_dim
                keys = flat[:nk].reshape(spec.kv_heads, count, spec.head_dim)
                values = flat[nk:].reshape(spec.kv_heads, count, spec.v_head_dim)
            else:
                keys = values = np.empty((0,), dtype=np_dtype)
            ev = FrameEvent(self._seq, layer, start, count, codec, stored_len, keys, values)
            self._seq += 1
            self._state = "frame_header"
            return ev
        if st == "end_digest":
            block = self._take(DIGEST_BLOCK)
            if block is None:
                return None
            _, fh = self._frame  # type: ignore[misc]
            root = chain(self._digest, fh, b"")
            if block[:32] != root or any(block[32:]):
                raise KVPackError("end frame root digest mismatch (corrupt)")
            self.root_digest = root
            self._state = "done"
            return EndEvent(root, self._pos, self._raw_total)
        return None


@dataclass
class KVPack:
    """A verified pack in memory."""

    header: PackHeader
    layers: list[LayerKV]
    root_digest: bytes
    total_bytes: int
    stored_bytes: int = 0


READ_BLOCK = 1 << 20
MAX_READ = 1 << 30


def read_pack(stream: BinaryIO, *, max_bytes: int | None = None, progress=None) -> KVPack:
    """Read and verify a whole pack from a binary stream. Nothing is returned unless the
    end frame verifies and nothing follows it."""
    reader = PackReader(max_bytes=max_bytes)
    parts: list[list[tuple[np.ndarray, np.ndarray]]] = []
    header: PackHeader | None = None
    end: EndEvent | None = None
    stored = 0
    while True:
        # Read exactly what the parser needs next: each frame arrives in one piece (no copies).
        chunk = stream.read(max(1, min(reader.want(), MAX_READ)) if not reader.done else 1)
        if not chunk:
            break
        for ev in reader.feed(chunk):
            if isinstance(ev, HeaderEvent):
                header = ev.header
                parts = [[] for _ in header.layers]
            elif isinstance(ev, FrameEvent):
                parts[ev.layer].append((ev.keys, ev.values))
                stored += ev.stored_bytes
                if progress is not None and header is not None:
                    progress("read", ev.seq + 1, len(reader._plan))
            else:
                end = ev
    reader.finish()
    assert header is not None and end is not None
    layers: list[LayerKV] = []
    for i, frames in enumerate(parts):
        spec = header.layers[i]
        np_dtype = np.dtype(DTYPES[header.dtype][1])
        if frames:
            keys = np.concatenate([k for k, _ in frames], axis=1) if len(frames) > 1 else frames[0][0]
            values = np.concatenate([v for _, v in frames], axis=1) if len(frames) > 1 else frames[0][1]
        else:
            keys = np.empty((spec.kv_heads, 0, spec.head_dim), dtype=np_dtype)
            values = np.empty((spec.kv_heads, 0, spec.v_head_dim), dtype=np_dtype)
        frames.clear()
        layers.append(LayerKV(keys=keys, values=values, first_row=header.layer_first_row(i)))
    return KVPack(header=header, layers=layers, root_digest=end.root_digest, total_bytes=end.total_bytes, stored_bytes=stored)


def read_pack_bytes(data: bytes, **kw) -> KVPack:
    import io

    return read_pack(io.BytesIO(data), **kw)
