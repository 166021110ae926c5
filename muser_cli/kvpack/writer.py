"""Write a kvpack: whole (``write_pack``) or frame by frame (``PackWriter``), so a producer
can emit each prefill chunk's frames while the next chunk computes.

No needless copies: a frame's rows go out as views of the caller's arrays (one per KV head
when a frame is a slice of a longer cache), gathered with ``os.writev`` when the output is
a plain file or pipe; zstd frames of a whole pack are compressed (and v1.1 payloads
hashed) on a small thread pool, written in plan order.
"""

from __future__ import annotations

import io
import os
import select
from collections import deque
from typing import Any, BinaryIO, Iterable, Sequence

import numpy as np

from muser_cli.errors import KVPackError
from muser_cli.kvpack.codec import codec_id, encode_payload, group_bytes_parts
from muser_cli.kvpack.digest import Chain, pool, task_bytes
from muser_cli.kvpack.format import (
    ALIGN, CODEC_NAMES, CODEC_RAW, CODEC_ZSTD_GROUPED, FRAME_HEADER, MAGIC, MAJOR, MAX_HEADER_BYTES, PREAMBLE, TAG_DATA,
    TAG_END, PackHeader, header_digest, pad_len,
)
from muser_cli.kvpack.layers import DTYPES, LayerKV, StateKV, split_state
from muser_cli.kvpack.quant import encode_int8

_ZEROS = bytes(ALIGN)
_ZERO_HALF = bytes(32)
IOV_MAX = 512  # well under every platform's limit
WINDOW = 4  # runs of frames in flight on the pool in write_pack
OVERLAP_MIN_BYTES = 256 << 10  # a frame this big is hashed on the pool while it is written


def _raw_fd(stream: object) -> int | None:
    """The fd of a plain buffered or raw *file* object, else None.

    Only io.FileIO (and buffered writers directly on one) qualify: a socket's or a TLS
    stream's fileno() is not where its bytes go, nor is a compressor's."""
    raw = stream
    if isinstance(stream, (io.BufferedWriter, io.BufferedRandom)):
        raw = stream.raw
    if isinstance(raw, io.FileIO) and not raw.closed:
        try:
            return raw.fileno()
        except (OSError, ValueError):
            return None
    return None


class _Sink:
    """Writes lists of buffers to ``stream``: ``os.writev`` on a file's fd, the stream's own
    ``writev(buffers) -> int`` when it has one (``fsio.atomic_writer``'s file: same
    syscall, its errors named after the user's path), else ``write``."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.fd = _raw_fd(stream)
        own = getattr(stream, "writev", None) if self.fd is None else None
        self._writev = own if callable(own) else (None if self.fd is None else self._fd_writev)
        self.written = 0

    def _fd_writev(self, views: list) -> int:
        return os.writev(self.fd, views)  # type: ignore[arg-type]

    def write(self, parts: list) -> None:
        parts = [p for p in parts if len(p)]
        if not parts:
            return
        if self._writev is None:
            for p in parts:
                self.stream.write(p)
                self.written += len(p)
            return
        self.stream.flush()  # what went through the buffered object first goes out first
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            batch = views[:IOV_MAX]
            try:
                n = self._writev(batch)
            except BlockingIOError:
                if self.fd is None:
                    raise
                select.select([], [self.fd], [])
                continue
            except InterruptedError:
                continue
            self.written += n
            # drop what went out; keep the rest of a partly written buffer
            while n and views:
                if n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0


def _views(arr: np.ndarray, np_dtype: np.dtype) -> list[memoryview]:
    """The bytes of ``arr`` (heads, rows, dim) in C order as views: one when it is contiguous,
    one per head when it is a row range of a longer cache. A copy only when the dtype
    differs or a head itself is strided."""
    if arr.dtype != np_dtype:
        arr = np.ascontiguousarray(arr, dtype=np_dtype)
    if arr.size == 0:
        return []
    if arr.flags.c_contiguous:
        return [memoryview(arr).cast("B")]
    out = []
    for h in range(arr.shape[0]):
        sub = arr[h]
        if not sub.flags.c_contiguous:
            sub = np.ascontiguousarray(sub)
        out.append(memoryview(sub).cast("B"))
    return out


class _Frame:
    __slots__ = ("layer", "start", "count", "parts", "raw_len", "elem", "codec", "stored", "p")

    def __init__(self, layer: int, start: int, count: int, parts: list, raw_len: int, elem: int) -> None:
        self.layer, self.start, self.count = layer, start, count
        self.parts, self.raw_len, self.elem = parts, raw_len, elem
        self.codec = CODEC_RAW
        self.stored: list = parts
        self.p: bytes | None = None


class PackWriter:
    """Streams a pack to ``stream``. Frames must come in ``header.frame_plan()`` order.

    ``write_frame`` has written (and hashed) the frame when it returns: the caller may
    reuse its arrays. ``write_frames`` takes many frames and keeps a few in flight on the
    worker pool; their arrays must stay unchanged until it returns.
    """

    def __init__(self, stream: BinaryIO, header: PackHeader, *, codec: str | None = None, level: int = 1) -> None:
        name = codec or header.codec.get("name", "none")
        self.codec = codec_id(name)
        self.level = level
        if header.codec.get("name") != CODEC_NAMES[self.codec]:
            spec = {"name": CODEC_NAMES[self.codec]}
            if self.codec != 0:
                spec["level"] = level
            header = _replace_codec(header, spec)
        self.header = header
        self.stream = stream
        self._sink = _Sink(stream)
        self._plan = list(header.frame_plan())
        self._next = 0
        self.raw_bytes = 0
        self._np_dtype = np.dtype(DTYPES[header.dtype][1])
        hjson = header.encode()
        if len(hjson) > MAX_HEADER_BYTES:
            raise KVPackError(f"header is {len(hjson)} bytes, over the {MAX_HEADER_BYTES}-byte limit")
        pre = PREAMBLE.pack(MAGIC, MAJOR, header.minor, len(hjson))
        self._chain = Chain(header.minor, header.digest or "sha256", header_digest(pre, hjson))
        self._sink.write([pre, hjson, _ZEROS[: pad_len(len(pre) + len(hjson))]])

    @property
    def bytes_written(self) -> int:
        return self._sink.written

    @property
    def done(self) -> bool:
        return self._next >= len(self._plan)

    def expected(self) -> tuple[int, int, int] | None:
        return self._plan[self._next] if self._next < len(self._plan) else None

    # ------------------------------------------------------------------ frames
    def _prepare(self, seq: int, layer: int, start: int, keys: Any, values: Any) -> _Frame:
        exp = self._plan[seq] if seq < len(self._plan) else None
        if isinstance(keys, dict):  # a state layer's snapshot at the chunk's end
            return self._prepare_state(exp, layer, start, keys)
        if exp is not None and exp[0] == layer and self.header.layers[layer].kind == "state":
            # a snapshot as a reader decoded it (FrameEvent.keys: its bytes): name its tensors
            return self._prepare_state(exp, layer, start, split_state(self.header.layers[layer], keys))
        count = keys.shape[1] if keys.ndim == 3 else -1
        if exp != (layer, start, count):
            raise KVPackError(f"frame (layer {layer}, start {start}, rows {count}) out of plan; expected {exp}")
        spec = self.header.layers[layer]
        np_dtype = self._np_dtype
        for name, arr, dim in (("keys", keys, spec.head_dim), ("values", values, spec.v_head_dim)):
            if arr.shape != (spec.kv_heads, count, dim):
                raise KVPackError(f"layer {layer} {name} shape {arr.shape} != {(spec.kv_heads, count, dim)}")
            if arr.dtype.newbyteorder("<") != np_dtype and arr.dtype != np_dtype:
                raise KVPackError(f"layer {layer} {name} dtype {arr.dtype} is not {self.header.dtype} storage")
        if self.header.quant_scheme == "int8":
            parts: list = [encode_int8(keys, values, self.header.dtype)]
            elem = 1
        else:
            # K then V as views of the caller's arrays: nothing is concatenated
            parts = _views(keys, np_dtype) + _views(values, np_dtype)
            elem = np_dtype.itemsize
        return _Frame(layer, start, count, parts, sum(len(p) for p in parts), elem)

    def _prepare_state(self, exp: tuple[int, int, int] | None, layer: int, start: int, tensors: dict) -> _Frame:
        """One snapshot: the layer's tensors in declared order, each in its declared dtype."""
        if exp is None or exp[:2] != (layer, start) or self.header.layers[layer].kind != "state":
            raise KVPackError(f"state frame (layer {layer}, start {start}) out of plan; expected {exp}")
        spec = self.header.layers[layer]
        if set(tensors) != {t.name for t in spec.tensors}:
            raise KVPackError(f"layer {layer} state tensors {sorted(tensors)} != {[t.name for t in spec.tensors]}")
        parts = []
        for t in spec.tensors:
            arr, want = tensors[t.name], np.dtype(DTYPES[t.dtype][1])
            if tuple(arr.shape) != t.shape or (arr.dtype != want and arr.dtype.newbyteorder("<") != want):
                raise KVPackError(f"layer {layer} state {t.name!r} is {arr.dtype}{tuple(arr.shape)}, "
                                  f"the header says {t.dtype}{t.shape}")
            parts.append(memoryview(np.ascontiguousarray(arr)).cast("B"))
        return _Frame(layer, start, exp[2], parts, spec.state_bytes, spec.state_elem)

    def _encode(self, fr: _Frame, hash_payload: bool = True) -> _Frame:
        """Compress (if the pack's codec says so) and, for v1.1, hash the stored payload.
        Runs on a worker thread in ``write_frames``; touches nothing shared."""
        if self.codec != CODEC_RAW and fr.raw_len:
            if self.codec == CODEC_ZSTD_GROUPED:
                src = group_bytes_parts(fr.parts, fr.elem, fr.raw_len)
                stored = encode_payload(src, 1, elem=1, level=self.level)  # grouped already: plain zstd of it
            else:
                src = fr.parts[0] if len(fr.parts) == 1 else np.concatenate(
                    [np.frombuffer(p, np.uint8) for p in fr.parts])
                stored = encode_payload(src, self.codec, elem=fr.elem, level=self.level)
            if len(stored) < fr.raw_len:  # else incompressible: store raw
                fr.codec, fr.stored = self.codec, [stored]
        if hash_payload and self._chain.parallel:
            fr.p = self._chain.payload(fr.stored)
        return fr

    def _emit(self, fr: _Frame, seq: int) -> None:
        stored_len = sum(len(p) for p in fr.stored)
        fh = FRAME_HEADER.pack(TAG_DATA, seq, fr.layer, fr.start, fr.count, fr.codec, 0, 0, fr.raw_len, stored_len)
        ex = pool() if stored_len >= OVERLAP_MIN_BYTES and (fr.p is None) else None
        if ex is not None:  # hash on the pool while the frame's bytes go out: d_k is only needed after them
            fut = ex.submit(self._chain.compute, fh, fr.stored, fr.p)
            self._sink.write([fh, *fr.stored, _ZEROS[: pad_len(stored_len)]])
            d = fut.result()
            self._sink.write([d, _ZERO_HALF])
        else:
            d = self._chain.compute(fh, fr.stored, fr.p)
            self._sink.write([fh, *fr.stored, _ZEROS[: pad_len(stored_len)], d, _ZERO_HALF])
        self._chain.value = d
        self.raw_bytes += fr.raw_len

    def write_frame(self, layer: int, start: int, keys: Any, values: Any) -> None:
        """keys (kv_heads, count, head_dim), values (kv_heads, count, v_head_dim), storage dtype;
        for a state layer, keys is the snapshot at the frame's end (name -> array) and values None."""
        fr = self._prepare(self._next, layer, start, keys, values)
        self._emit(self._encode(fr, hash_payload=False), self._next)  # _emit hashes while it writes
        self._next += 1

    def write_stored(self, layer: int, start: int, count: int, stored: memoryview, *,
                     payload_digest: bytes | None = None, digest: str | None = None) -> None:
        """Write a frame from the uncompressed payload of a frame a :class:`PackReader`
        verified (``FrameEvent.stored``: K then V in storage dtype, exactly the bytes the
        frame's rows are). Without re-encoding (this pack is uncompressed), ``payload_digest``
        -- the reader's p = H(stored) under digest ``digest`` -- is linked into this
        pack's chain as it is, so the same bytes are not hashed twice; the chain is still
        over exactly the bytes written, since they are those bytes. In every other case
        (another digest, v1.0, a codec to apply) the payload is encoded and hashed here."""
        exp = self._plan[self._next] if self._next < len(self._plan) else None
        if exp != (layer, start, count):
            raise KVPackError(f"frame (layer {layer}, start {start}, rows {count}) out of plan; expected {exp}")
        if self.header.quant_scheme != "none" and self.header.layers[layer].kind != "state":
            raise KVPackError("write_stored takes unquantized payloads; this pack is quantized")
        view = memoryview(stored).cast("B") if memoryview(stored).format != "B" else memoryview(stored)
        raw_len = self.header.frame_raw_len(layer, count)
        if len(view) != raw_len:
            raise KVPackError(f"layer {layer} payload of {len(view)} bytes, {raw_len} expected for {count} rows")
        fr = _Frame(layer, start, count, [view], raw_len, self.header.frame_elem(layer))
        reuse = (self.codec == CODEC_RAW and payload_digest is not None and self._chain.parallel
                 and digest == self._chain.name)
        if reuse:
            fr.p = payload_digest
            self._emit(fr, self._next)
        else:
            self._emit(self._encode(fr, hash_payload=False), self._next)
        self._next += 1

    def write_frames(self, frames: Iterable[tuple[int, int, np.ndarray, np.ndarray]]) -> None:
        """Write many frames in order, compressing and hashing a few ahead on the pool."""
        ex = pool()
        if ex is None or (self.codec == CODEC_RAW and not self._chain.parallel):
            for layer, start, keys, values in frames:
                self.write_frame(layer, start, keys, values)
            return
        flight: deque = deque()  # futures of runs of consecutive frames, in plan order
        seq = self._next
        run: list[_Frame] = []
        run_bytes = 0
        run_min = task_bytes(sum(self.header.frame_raw_len(layer, count) for layer, _, count in self._plan[seq:]))

        def encode_run(frs: list[_Frame]) -> list[_Frame]:
            return [self._encode(fr) for fr in frs]

        def drain(keep: int) -> None:
            while len(flight) > keep:
                for fr in flight.popleft().result():
                    self._emit(fr, self._next)
                    self._next += 1

        try:
            for layer, start, keys, values in frames:
                fr = self._prepare(seq, layer, start, keys, values)
                seq += 1
                run.append(fr)
                run_bytes += fr.raw_len
                if run_bytes >= run_min:
                    flight.append(ex.submit(encode_run, run))
                    run, run_bytes = [], 0
                    drain(WINDOW)
            if run:
                flight.append(ex.submit(encode_run, run))
            drain(0)
        finally:
            for fut in flight:  # an error: let the rest finish, write nothing more
                fut.cancel()

    def finish(self) -> bytes:
        """Write the end frame; returns the root digest."""
        if not self.done:
            raise KVPackError(f"pack incomplete: {len(self._plan) - self._next} frames missing")
        fh = FRAME_HEADER.pack(TAG_END, self._next, 0, 0, 0, 0, 0, 0, self.raw_bytes, 0)
        root = self._chain.root(fh)
        self._sink.write([fh, root, _ZERO_HALF])
        self.stream.flush()
        self.root_digest = root
        return root


def _replace_codec(header: PackHeader, spec: dict) -> PackHeader:
    from dataclasses import replace

    return replace(header, codec=spec)


def write_pack(
    stream: BinaryIO,
    header: PackHeader,
    layers: Sequence[LayerKV | StateKV],
    *,
    codec: str | None = None,
    level: int = 1,
) -> PackWriter:
    """Write a whole pack. ``layers[i]`` rows must start at ``header.layer_first_row(i)``
    (or earlier: extra leading rows are skipped) and end at ``header.rows_end``; a state
    layer's :class:`StateKV` must hold a snapshot at every chunk end of its frames."""
    if len(layers) != len(header.layers):
        raise KVPackError(f"{len(layers)} layers given, header describes {len(header.layers)}")
    for layer, start, count in header.frame_plan():
        lk = layers[layer]
        if header.layers[layer].kind == "state" and (not isinstance(lk, StateKV) or lk.at(start + count) is None):
            raise KVPackError(f"layer {layer} has no state snapshot at position {start + count}")
    for i, lk in enumerate(layers):
        if isinstance(lk, StateKV):
            continue
        have_end = lk.first_row + lk.keys.shape[1]
        if lk.first_row > header.layer_first_row(i) or have_end != header.rows_end:
            raise KVPackError(
                f"layer {i} rows [{lk.first_row}, {have_end}) do not cover "
                f"[{header.layer_first_row(i)}, {header.rows_end})"
            )
    writer = PackWriter(stream, header, codec=codec, level=level)

    def frames():
        for layer, start, count in header.frame_plan():
            lk = layers[layer]
            if isinstance(lk, StateKV):
                yield layer, start, lk.at(start + count), None
                continue
            a = start - lk.first_row
            yield layer, start, lk.keys[:, a : a + count], lk.values[:, a : a + count]

    writer.write_frames(frames())
    writer.finish()
    return writer
