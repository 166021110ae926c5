"""Read a kvpack: a sans-IO streaming parser (``PackReader``) and ``read_pack`` on top.

The parser verifies each frame as it arrives (plan position, sequence, lengths, digest
chain, codec bounds) and reports the pack complete only when the end frame's root digest
verifies and no byte follows. Memory grows with bytes actually received, never with
sizes a header merely declares. Every failure is a :class:`KVPackError`.

No needless copies:
  * ``feed`` parses immutable input (``bytes``, read-only views such as a memory map) in
    place, and input the caller hands over (``owned=True``); a frame that arrives in
    pieces is gathered once into a buffer of its own;
  * ``read_pack`` on a regular file memory-maps it, hashes the frames' payloads on a
    small thread pool (v1.1), checks the chain in order, decompresses zstd frames on the
    pool, and hands out rows -- views of the map for an uncompressed layer held in one
    frame -- only after the root digest verified; on a pipe it reads each step with
    ``readinto`` into a buffer of exactly that step's size.
"""

from __future__ import annotations

import io
import mmap
import os
import stat
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Union

import numpy as np

from muser_cli.errors import KVPackError
from muser_cli.kvpack.codec import decode_payload
from muser_cli.kvpack.digest import Chain, pool
from muser_cli.kvpack.format import (
    CODEC_NAMES, DIGEST_BLOCK, FRAME_HEADER, MAGIC, MAJOR, MAX_HEADER_BYTES, MINOR, PREAMBLE, TAG_DATA, TAG_END,
    PackHeader, header_digest, pad_len, parse_header,
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


# ---------------------------------------------------------------- checks shared by both readers
def _check_magic(head: bytes | bytearray | memoryview) -> None:
    head = bytes(head[: len(MAGIC)])
    if not MAGIC.startswith(head):
        raise KVPackError("not a kvpack (bad magic)")


def _check_preamble(pre: memoryview | bytes, max_minor: int, max_bytes: int | None) -> tuple[int, int]:
    _, major, minor, hlen = PREAMBLE.unpack(pre)
    if major != MAJOR:
        raise KVPackError(f"kvpack major version {major} is not supported (this reader reads {MAJOR}.x)")
    if minor > max_minor:
        raise KVPackError(f"kvpack version {major}.{minor} is newer than this reader's {MAJOR}.{max_minor} "
                          f"(it reads {MAJOR}.0 to {MAJOR}.{max_minor}): upgrade muser to read it")
    if not 2 <= hlen <= MAX_HEADER_BYTES:
        raise KVPackError(f"header length {hlen} outside [2, {MAX_HEADER_BYTES}]")
    if max_bytes is not None and hlen > max_bytes:
        raise KVPackError(f"header length {hlen} exceeds the allowed size")
    return minor, hlen


def _header_block_len(hlen: int) -> int:
    return hlen + pad_len(PREAMBLE.size + hlen)


def _check_header(block: memoryview | bytes, pre: bytes, hlen: int, minor: int) -> tuple[PackHeader, bytes]:
    hjson, padding = bytes(block[:hlen]), block[hlen:]
    if any(padding):
        raise KVPackError("non-zero header padding")
    header = parse_header(hjson, MAJOR, minor)
    return header, header_digest(pre, hjson)


def _check_frame_header(fh: memoryview | bytes, seq: int, plan: list, header: PackHeader, raw_total: int,
                        pos_after: int, max_bytes: int | None) -> tuple:
    """('end', raw_len) or ('data', layer, start, count, codec, raw_len, stored_len)."""
    tag, fseq, layer, start, count, codec, flags, rsv, raw_len, stored_len = FRAME_HEADER.unpack(fh)
    if any(fh[40:]) or flags or rsv:
        raise KVPackError(f"frame {seq}: reserved bytes are not zero")
    if fseq != seq:
        raise KVPackError(f"frame sequence {fseq} where {seq} was expected (reordered or duplicated)")
    if tag == TAG_END:
        if seq != len(plan):
            raise KVPackError(f"end frame after {seq} of {len(plan)} frames (frames missing)")
        if (layer, start, count, codec, stored_len) != (0, 0, 0, 0, 0):
            raise KVPackError("malformed end frame")
        if raw_len != raw_total or raw_len != header.total_raw_bytes():
            raise KVPackError("end frame byte count disagrees with the frames")
        return ("end", raw_len)
    if tag != TAG_DATA:
        raise KVPackError(f"frame {seq}: unknown frame tag {tag!r}")
    if seq >= len(plan):
        raise KVPackError(f"frame {seq} beyond the {len(plan)} the header plans")
    exp = plan[seq]
    if (layer, start, count) != exp:
        raise KVPackError(f"frame {seq} is (layer {layer}, start {start}, rows {count}); the plan says {exp}")
    if codec not in CODEC_NAMES:
        raise KVPackError(f"frame {seq}: unknown codec id {codec}")
    expect_raw = header.row_bytes(layer) * count
    if raw_len != expect_raw:
        raise KVPackError(f"frame {seq}: raw length {raw_len} != {expect_raw} implied by the header")
    if stored_len > raw_len + 1024 or (codec == 0 and stored_len != raw_len):
        raise KVPackError(f"frame {seq}: stored length {stored_len} is impossible")
    if max_bytes is not None and pos_after + stored_len > max_bytes:
        raise KVPackError(f"pack larger than the allowed {max_bytes} bytes")
    return ("data", layer, start, count, codec, raw_len, stored_len)


def _body_len(stored_len: int) -> int:
    return stored_len + pad_len(stored_len) + DIGEST_BLOCK


def _check_padding(body: memoryview, stored_len: int, seq: int) -> None:
    if any(body[stored_len : stored_len + pad_len(stored_len)]) or any(body[-32:]):
        raise KVPackError(f"frame {seq}: non-zero padding")


def _decode(header: PackHeader, layer: int, count: int, codec: int, stored: memoryview, raw_len: int,
            decode: bool) -> tuple[np.ndarray, np.ndarray]:
    spec = header.layers[layer]
    np_dtype = np.dtype(DTYPES[header.dtype][1])
    if not decode:
        empty = np.empty((0,), dtype=np_dtype)
        return empty, empty
    if header.quant_scheme == "int8":
        from muser_cli.kvpack.quant import decode_int8

        raw = decode_payload(stored, codec, raw_len=raw_len, elem=1)  # int8 payload
        return decode_int8(raw, spec.kv_heads, count, spec.head_dim, spec.v_head_dim, header.dtype)
    raw = decode_payload(stored, codec, raw_len=raw_len, elem=np_dtype.itemsize)
    flat = np.frombuffer(raw, dtype=np_dtype)
    nk = spec.kv_heads * count * spec.head_dim
    return (flat[:nk].reshape(spec.kv_heads, count, spec.head_dim),
            flat[nk:].reshape(spec.kv_heads, count, spec.v_head_dim))


def _check_root(block: memoryview, root: bytes) -> None:
    if bytes(block[:32]) != root or any(block[32:]):
        raise KVPackError("end frame root digest mismatch (corrupt)")


# ---------------------------------------------------------------- the streaming parser
class PackReader:
    """Feed bytes, get events. ``finish()`` at end of input raises if the pack is incomplete.

    ``decode=False`` checks structure and digests without decoding payloads (fast verify
    for relays); FrameEvent arrays are then empty. ``max_minor`` is the newest minor
    version accepted (a reader limited to 1.0 refuses 1.1 files by version).

    A FrameEvent is emitted only after that frame's own digest (and the chain up to it)
    verified; its arrays may be views of the bytes fed (never of a buffer the caller may
    reuse: writable input is copied unless ``feed(..., owned=True)`` hands it over).
    """

    def __init__(self, *, max_bytes: int | None = None, decode: bool = True, max_minor: int = MINOR) -> None:
        self._pend: np.ndarray | None = None  # a step that arrived in pieces, gathered here
        self._pend_len = 0
        self._pend_need = 0
        self._pos = 0  # bytes consumed
        self._state = "preamble"
        self._max_bytes = max_bytes
        self._decode = decode
        self._max_minor = max_minor
        self.header: PackHeader | None = None
        self._plan: list[tuple[int, int, int]] = []
        self._seq = 0
        self._chain: Chain | None = None
        self._raw_total = 0
        self._hlen = 0
        self._minor = 0
        self._pre = b""
        self._frame: tuple | None = None
        self.root_digest: bytes | None = None
        self._src = memoryview(b"")
        self._off = 0

    @property
    def done(self) -> bool:
        return self._state == "done"

    @property
    def bytes_consumed(self) -> int:
        return self._pos

    def _need(self) -> int:
        st = self._state
        if st == "preamble":
            return PREAMBLE.size
        if st == "header":
            return _header_block_len(self._hlen)
        if st == "frame_body":
            return _body_len(self._frame[6])  # type: ignore[index]
        if st in ("frame_header", "end_digest"):
            return FRAME_HEADER.size
        return 0

    def want(self) -> int:
        """Bytes still needed to complete the current step (0 when done): a pull-based
        caller that reads exactly this much gets zero-copy parsing."""
        if self._state == "done":
            return 0
        return max(0, self._need() - self._pend_len)

    def feed(self, data: bytes | bytearray | memoryview, *, owned: bool = False) -> list[Event]:
        """Parse ``data``. ``owned=True``: the caller will never write to this buffer again,
        so frames may be handed out as views of it."""
        n = len(data)
        if n and self._state == "done":
            raise KVPackError("bytes after the end frame")
        if self._max_bytes is not None and self._pos + self._pend_len + n > self._max_bytes:
            raise KVPackError(f"pack larger than the allowed {self._max_bytes} bytes")
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if not view.readonly and not owned:
            view = memoryview(bytes(view))  # the caller may reuse its buffer: parse our own copy
        events: list[Event] = []
        if self._pend is not None:
            view = self._gather(view, events)
            if self._pend is not None:  # still incomplete
                if self._state == "preamble":
                    _check_magic(self._pend[: self._pend_len])
                return events
        if len(view):
            self._run(view, events)
        return events

    def _gather(self, view: memoryview, events: list[Event]) -> memoryview:
        """Copy into the pending step; when it completes, parse it. Returns what is left."""
        assert self._pend is not None
        take = min(self._pend_need - self._pend_len, len(view))
        end = self._pend_len + take
        if end > len(self._pend):  # grow with what arrived, never to what was merely declared
            bigger = np.empty(min(self._pend_need, max(2 * len(self._pend), end)), dtype=np.uint8)
            bigger[: self._pend_len] = self._pend[: self._pend_len]
            self._pend = bigger
        self._pend[self._pend_len : end] = np.frombuffer(view[:take], dtype=np.uint8)
        self._pend_len = end
        rest = view[take:]
        if self._pend_len < self._pend_need:
            return rest
        step = memoryview(self._pend)[: self._pend_need]
        self._pend, self._pend_len, self._pend_need = None, 0, 0
        self._run(step, events)  # exactly one step: nothing is left over
        return rest

    def _run(self, view: memoryview, events: list[Event]) -> None:
        self._src, self._off = view, 0
        try:
            while True:
                ev = self._step()
                if ev is None:
                    break
                if ev is not True:
                    events.append(ev)  # type: ignore[arg-type]
        finally:
            rest = self._src[self._off :]
            self._src, self._off = memoryview(b""), 0
        if len(rest):
            if self._state == "done":
                raise KVPackError("bytes after the end frame")
            need = self._need()
            self._pend_need = need
            self._pend = np.empty(min(need, max(len(rest), 1 << 20)), dtype=np.uint8)
            self._pend[: len(rest)] = np.frombuffer(rest, dtype=np.uint8)
            self._pend_len = len(rest)
            if self._state == "preamble":
                _check_magic(rest)

    def finish(self) -> None:
        if self._state != "done":
            where = {"preamble": "in the preamble", "header": "in the header"}.get(self._state, f"after {self._seq} frames")
            if self._pos == 0 and not self._pend_len:
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
            _check_magic(self._src[self._off :])
            pre = self._take(PREAMBLE.size)
            if pre is None:
                return None
            self._minor, self._hlen = _check_preamble(pre, self._max_minor, self._max_bytes)
            self._pre = bytes(pre)
            self._state = "header"
            return True
        if st == "header":
            block = self._take(_header_block_len(self._hlen))
            if block is None:
                return None
            header, d_header = _check_header(block, self._pre, self._hlen, self._minor)
            self.header = header
            self._plan = list(header.frame_plan())
            self._chain = Chain(self._minor, header.digest or "sha256", d_header)
            self._state = "frame_header"
            return HeaderEvent(header)
        if st == "frame_header":
            fh = self._take(FRAME_HEADER.size)
            if fh is None:
                return None
            assert self.header is not None
            got = _check_frame_header(fh, self._seq, self._plan, self.header, self._raw_total, self._pos,
                                      self._max_bytes)
            if got[0] == "end":
                self._frame = ("end", bytes(fh))
                self._state = "end_digest"
                return True
            _, layer, start, count, codec, raw_len, stored_len = got
            self._frame = (bytes(fh), layer, start, count, codec, raw_len, stored_len)
            self._state = "frame_body"
            return True
        if st == "frame_body":
            fh, layer, start, count, codec, raw_len, stored_len = self._frame  # type: ignore[misc]
            body = self._take(_body_len(stored_len))
            if body is None:
                return None
            stored = body[:stored_len]
            _check_padding(body, stored_len, self._seq)
            assert self._chain is not None and self.header is not None
            digest = self._chain.compute(fh, (stored,))
            if digest != body[-DIGEST_BLOCK:-32]:
                raise KVPackError(f"frame {self._seq} (layer {layer}, start {start}): digest mismatch (corrupt)")
            self._chain.value = digest
            self._raw_total += raw_len
            keys, values = _decode(self.header, layer, count, codec, stored, raw_len, self._decode)
            ev = FrameEvent(self._seq, layer, start, count, codec, stored_len, keys, values)
            self._seq += 1
            self._state = "frame_header"
            return ev
        if st == "end_digest":
            block = self._take(DIGEST_BLOCK)
            if block is None:
                return None
            _, fh = self._frame  # type: ignore[misc]
            assert self._chain is not None
            root = self._chain.root(fh)
            _check_root(block, root)
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
PARALLEL_MIN_BYTES = 1 << 20  # below this, a thread pool costs more than it saves


# ---------------------------------------------------------------- whole pack from one buffer
@dataclass
class _Scanned:
    seq: int
    fh: bytes
    layer: int
    start: int
    count: int
    codec: int
    raw_len: int
    stored: memoryview
    digest: bytes


def _map_file(stream: BinaryIO) -> tuple[memoryview, int] | None:
    """(a read-only view of the rest of the file, its end offset), when ``stream`` is a
    plain regular file with bytes left; else None (read it as a stream)."""
    raw = stream.raw if isinstance(stream, (io.BufferedReader, io.BufferedRandom)) else stream
    if not isinstance(raw, io.FileIO) or raw.closed:
        return None
    try:
        fd = raw.fileno()
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return None
        pos = stream.tell()
        if pos >= st.st_size:
            return None
        mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    try:
        mm.madvise(mmap.MADV_SEQUENTIAL)
    except (AttributeError, OSError):
        pass
    return memoryview(mm)[pos:], st.st_size


def _truncated(where: str) -> KVPackError:
    return KVPackError(f"truncated kvpack: input ended {where}")


def read_buffer(buf: memoryview | bytes, *, max_bytes: int | None = None, progress: Callable | None = None,
                max_minor: int = MINOR) -> KVPack:
    """Verify and read a whole pack held in memory (or memory-mapped) without copying it.

    Same verdicts as :class:`PackReader` fed the same bytes (the first failure in stream
    order is the one reported). Payload digests (v1.1) and zstd frames run on the worker
    pool; nothing is returned unless the root digest verified and nothing follows it.
    Uncompressed rows of a layer held in one frame are views of ``buf``; other layers are
    assembled into arrays of their own.
    """
    buf = memoryview(buf)
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")
    size = len(buf)
    if max_bytes is not None and size > max_bytes:
        raise KVPackError(f"pack larger than the allowed {max_bytes} bytes")
    if size == 0:
        raise KVPackError("empty input: no kvpack")
    _check_magic(buf[:8])
    if size < PREAMBLE.size:
        raise _truncated("in the preamble")
    minor, hlen = _check_preamble(buf[: PREAMBLE.size], max_minor, max_bytes)
    pos = PREAMBLE.size
    hblock = _header_block_len(hlen)
    if size - pos < hblock:
        raise _truncated("in the header")
    header, d_header = _check_header(buf[pos : pos + hblock], bytes(buf[: PREAMBLE.size]), hlen, minor)
    pos += hblock
    plan = list(header.frame_plan())

    # 1. structure, in stream order, up to the end frame or the first structural failure
    frames: list[_Scanned] = []
    failure: KVPackError | None = None
    end: tuple[bytes, memoryview] | None = None
    raw_total = 0
    seq = 0
    while True:
        if size - pos < FRAME_HEADER.size:
            failure = _truncated(f"after {seq} frames")
            break
        fh = buf[pos : pos + FRAME_HEADER.size]
        try:
            got = _check_frame_header(fh, seq, plan, header, raw_total, pos + FRAME_HEADER.size, max_bytes)
        except KVPackError as exc:
            failure = exc
            break
        pos += FRAME_HEADER.size
        if got[0] == "end":
            if size - pos < DIGEST_BLOCK:
                failure = _truncated(f"after {seq} frames")
                break
            end = (bytes(fh), buf[pos : pos + DIGEST_BLOCK])
            pos += DIGEST_BLOCK
            break
        _, layer, start, count, codec, raw_len, stored_len = got
        blen = _body_len(stored_len)
        if size - pos < blen:
            failure = _truncated(f"after {seq} frames")
            break
        body = buf[pos : pos + blen]
        try:
            _check_padding(body, stored_len, seq)
        except KVPackError as exc:
            failure = exc
            break
        frames.append(_Scanned(seq, bytes(fh), layer, start, count, codec, raw_len, body[:stored_len],
                               bytes(body[-DIGEST_BLOCK:-32])))
        raw_total += raw_len
        seq += 1
        pos += blen

    # 2. one task a frame, on the pool: its payload digest (v1.1), its decoding, and --
    #    for a layer spread over several frames -- the copy of its rows into that layer's
    #    own arrays, while the frame is hot in cache. Nothing of it is handed out yet: the
    #    chain is checked in stream order below, and rows leave only after the root.
    chain = Chain(minor, header.digest or "sha256", d_header)
    stored_total = sum(len(f.stored) for f in frames)
    ex = pool() if stored_total >= PARALLEL_MIN_BYTES else None
    np_dtype = np.dtype(DTYPES[header.dtype][1])
    layer_frames = [0] * len(header.layers)
    for f in frames:
        layer_frames[f.layer] += 1
    dest: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for li, n in enumerate(layer_frames):
        if n > 1:
            spec, rows = header.layers[li], header.layer_rows(li)
            dest[li] = (np.empty((spec.kv_heads, rows, spec.head_dim), dtype=np_dtype),
                        np.empty((spec.kv_heads, rows, spec.v_head_dim), dtype=np_dtype))

    def work(f: _Scanned):
        p = chain.payload((f.stored,))
        try:
            keys, values = _decode(header, f.layer, f.count, f.codec, f.stored, f.raw_len, True)
        except KVPackError as exc:
            return p, exc
        if f.layer in dest:
            a = f.start - header.layer_first_row(f.layer)
            dk, dv = dest[f.layer]
            np.copyto(dk[:, a : a + f.count], keys)
            np.copyto(dv[:, a : a + f.count], values)
            return p, None
        return p, (keys, values)

    results = ex.map(work, frames) if ex is not None else map(work, frames)
    held: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    try:
        for f, (p, got) in zip(frames, results):
            d = chain.compute(f.fh, (f.stored,), p)
            if d != f.digest:
                raise KVPackError(f"frame {f.seq} (layer {f.layer}, start {f.start}): digest mismatch (corrupt)")
            chain.value = d
            if isinstance(got, KVPackError):
                raise got
            if got is not None:
                held[f.layer] = got
    finally:
        del results  # an error: the rest is cancelled or finishes unseen
    if failure is not None:
        raise failure
    assert end is not None
    root = chain.root(end[0])
    _check_root(end[1], root)
    if pos != size:
        raise KVPackError("bytes after the end frame")

    # 3. verified: hand out the rows (a layer in one uncompressed frame: a view of buf)
    layers: list[LayerKV] = []
    for li, spec in enumerate(header.layers):
        if li in dest:
            keys, values = dest[li]
        elif li in held:
            keys, values = held[li]
        else:
            keys = np.empty((spec.kv_heads, 0, spec.head_dim), dtype=np_dtype)
            values = np.empty((spec.kv_heads, 0, spec.v_head_dim), dtype=np_dtype)
        layers.append(LayerKV(keys=keys, values=values, first_row=header.layer_first_row(li)))
    if progress is not None:
        for f in frames:
            progress("read", f.seq + 1, len(plan))
    return KVPack(header=header, layers=layers, root_digest=root, total_bytes=pos, stored_bytes=stored_total)


# ---------------------------------------------------------------- streams
def read_exact_into(stream: BinaryIO, n: int) -> memoryview:
    """Up to ``n`` bytes (fewer only at end of input) read with ``readinto`` into a fresh
    buffer of exactly that size; the caller owns it. Streams without readinto use read."""
    readinto = getattr(stream, "readinto", None)
    if readinto is None:
        data = stream.read(n)
        return memoryview(data or b"")
    buf = np.empty(n, dtype=np.uint8) if n > 4096 else bytearray(n)
    view = memoryview(buf).cast("B")
    got = 0
    while got < n:
        k = readinto(view[got:])
        if not k:
            break
        got += k
    return view[:got]


def read_pack(stream: BinaryIO, *, max_bytes: int | None = None, progress=None, use_mmap: bool = True) -> KVPack:
    """Read and verify a whole pack from a binary stream. Nothing is returned unless the
    end frame verifies and nothing follows it. A regular file is memory-mapped (``use_mmap``)
    and read as :func:`read_buffer`; the stream is then left at its end. Rows may be views
    of the map: a muser file is never rewritten in place (it is replaced by rename), and
    a file truncated under a live map would fault the process (see docs/kvpack.md 4.2)."""
    if use_mmap:
        mapped = _map_file(stream)
        if mapped is not None:
            view, end = mapped
            try:
                return read_buffer(view, max_bytes=max_bytes, progress=progress)
            finally:
                stream.seek(end)
    reader = PackReader(max_bytes=max_bytes)
    parts: list[list[tuple[np.ndarray, np.ndarray]]] = []
    header: PackHeader | None = None
    end_ev: EndEvent | None = None
    stored = 0
    while True:
        # Read exactly what the parser needs next, into a buffer of its own (no copies).
        chunk = read_exact_into(stream, max(1, min(reader.want(), MAX_READ)) if not reader.done else 1)
        if not len(chunk):
            break
        for ev in reader.feed(chunk, owned=True):
            if isinstance(ev, HeaderEvent):
                header = ev.header
                parts = [[] for _ in header.layers]
            elif isinstance(ev, FrameEvent):
                parts[ev.layer].append((ev.keys, ev.values))
                stored += ev.stored_bytes
                if progress is not None and header is not None:
                    progress("read", ev.seq + 1, len(reader._plan))
            else:
                end_ev = ev
    reader.finish()
    assert header is not None and end_ev is not None
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
    return KVPack(header=header, layers=layers, root_digest=end_ev.root_digest, total_bytes=end_ev.total_bytes,
                  stored_bytes=stored)


def read_pack_bytes(data: bytes | memoryview, **kw: Any) -> KVPack:
    """A whole pack from bytes in memory, parsed in place (:func:`read_buffer`); a writable
    buffer is copied first, so no row handed out can change under its reader."""
    if not isinstance(data, bytes) and not memoryview(data).readonly:
        data = bytes(data)
    return read_buffer(data, **kw)
