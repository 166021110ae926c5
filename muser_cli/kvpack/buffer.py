"""A whole kvpack held in memory (or memory-mapped), verified and read in place.

:func:`read_buffer` hashes the frames' payloads on a small thread pool (v1.1), checks the
chain in order, decompresses zstd frames on the pool, and hands out rows -- views of the
buffer for an uncompressed layer held in one frame -- only after the root digest
verified. Its verdicts are those of :class:`~muser_cli.kvpack.parser.PackReader` fed the
same bytes (both use :mod:`muser_cli.kvpack.checks`).
"""

from __future__ import annotations

import io
import mmap
import os
import stat
from collections import deque
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Iterator

import numpy as np

from muser_cli.errors import DAMAGED_PACK_HINT, KVPackError, TRUNCATED_PACK_HINT
from muser_cli.kvpack.alloc import slab_arrays
from muser_cli.kvpack.checks import (
    body_len, check_frame_header, check_header, check_magic, check_padding, check_preamble, check_root, decode_frame,
    header_block_len,
)
from muser_cli.kvpack.digest import Chain, pool, task_bytes, workers
from muser_cli.kvpack.format import DIGEST_BLOCK, FRAME_HEADER, MINOR, PREAMBLE, PackHeader
from muser_cli.kvpack.layers import DTYPES, LayerKV, state_kv
from muser_cli.kvpack.parser import EndEvent, FrameEvent, HeaderEvent


@dataclass
class KVPack:
    """A verified pack in memory."""

    header: PackHeader
    layers: list[LayerKV]
    root_digest: bytes
    total_bytes: int
    stored_bytes: int = 0


PARALLEL_MIN_BYTES = 1 << 20  # below this, a thread pool costs more than it saves
POPULATE_MAX_BYTES = 1 << 30  # files up to this are mapped whole at once (MAP_POPULATE)


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


def map_file(stream: BinaryIO) -> tuple[memoryview, int] | None:
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
        # Linux: map every page in one call, not one fault per page -- for files that fit
        # easily in memory; a larger one is read ahead in the background while it is hashed.
        populate = getattr(mmap, "MAP_POPULATE", 0) if st.st_size <= POPULATE_MAX_BYTES else 0
        if populate:
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)
        else:
            mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    for advice in ("MADV_SEQUENTIAL", "MADV_WILLNEED"):
        try:
            mm.madvise(getattr(mmap, advice))
        except (AttributeError, OSError):
            pass
    return memoryview(mm)[pos:], st.st_size


def batches(frames: list, min_bytes: int) -> list[list]:
    """Consecutive runs of ``frames`` of at least ``min_bytes`` stored bytes each (the last may be smaller)."""
    out: list[list] = [[]]
    n = 0
    for f in frames:
        out[-1].append(f)
        n += len(f.stored)
        if n >= min_bytes:
            out.append([])
            n = 0
    return [b for b in out if b]


def _truncated(where: str) -> KVPackError:
    return KVPackError(f"truncated kvpack: input ended {where}", hint=TRUNCATED_PACK_HINT)


@dataclass
class _Scan:
    """Step 1 of reading a whole buffer: its structure, up to the end frame or the first
    structural failure (kept, and raised only after every frame before it verified)."""

    buf: memoryview
    header: PackHeader
    minor: int
    d_header: bytes
    plan: list
    frames: list[_Scanned]
    failure: KVPackError | None
    end: tuple[bytes, memoryview] | None
    pos: int
    root: bytes = b""

    @property
    def stored_total(self) -> int:
        return sum(len(f.stored) for f in self.frames)


def _scan(buf: memoryview | bytes, max_bytes: int | None, max_minor: int) -> _Scan:
    buf = memoryview(buf)
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")
    size = len(buf)
    if max_bytes is not None and size > max_bytes:
        raise KVPackError(f"pack larger than the allowed {max_bytes} bytes")
    if size == 0:
        raise KVPackError("empty input: no kvpack")
    check_magic(buf[:8])
    if size < PREAMBLE.size:
        raise _truncated("in the preamble")
    minor, hlen = check_preamble(buf[: PREAMBLE.size], max_minor, max_bytes)
    pos = PREAMBLE.size
    hblock = header_block_len(hlen)
    if size - pos < hblock:
        raise _truncated("in the header")
    header, d_header = check_header(buf[pos : pos + hblock], bytes(buf[: PREAMBLE.size]), hlen, minor)
    pos += hblock
    plan = list(header.frame_plan())
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
            got = check_frame_header(fh, seq, plan, header, raw_total, pos + FRAME_HEADER.size, max_bytes)
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
        blen = body_len(stored_len)
        if size - pos < blen:
            failure = _truncated(f"after {seq} frames")
            break
        body = buf[pos : pos + blen]
        try:
            check_padding(body, stored_len, seq)
        except KVPackError as exc:
            failure = exc
            break
        frames.append(_Scanned(seq, bytes(fh), layer, start, count, codec, raw_len, body[:stored_len],
                               bytes(body[-DIGEST_BLOCK:-32])))
        raw_total += raw_len
        seq += 1
        pos += blen
    return _Scan(buf, header, minor, d_header, plan, frames, failure, end, pos)


def _pooled(ex, run: Callable[[list], list], runs: Iterable[list], ahead: int) -> Iterator:
    """The results of ``run`` over ``runs``, in order, computed on ``ex`` with at most
    ``ahead`` runs submitted beyond the one being consumed: memory stays bounded by a few
    runs however large the pack, and a consumer that stops early leaves nothing queued."""
    flight: deque = deque()
    try:
        for r in runs:
            flight.append(ex.submit(run, r))
            if len(flight) > ahead:
                yield from flight.popleft().result()
        while flight:
            yield from flight.popleft().result()
    finally:
        for fut in flight:  # stopped early: what has not started never runs
            fut.cancel()


def _verified(scan: _Scan, work: Callable[[_Scanned], tuple]) -> Iterator[tuple[_Scanned, bytes | None, object]]:
    """Step 2: ``work(frame) -> (p, got)`` for every frame -- its payload digest (v1.1) and
    whatever else the caller does with it while it is hot in cache -- on the worker pool,
    in runs of consecutive frames (``task_bytes`` each), a few runs ahead of the consumer;
    the chain checked in stream order. Yields ``(frame, p, got)`` for each frame as its
    digest verifies; a ``got`` that is an exception (``work`` failed on that frame) is
    raised there, after the frame's digest was checked, so a corrupt frame is reported as
    such whatever else went wrong with it. Then the structural failure, if any, the root
    and the end of input; ``scan.root`` is set when all of it verified."""
    chain = Chain(scan.minor, scan.header.digest or "sha256", scan.d_header)

    def guarded(f: _Scanned) -> tuple:
        try:
            return work(f)
        except Exception as exc:  # noqa: BLE001 -- raised in stream order, after the digest check
            return None, exc

    ex = pool() if scan.stored_total >= PARALLEL_MIN_BYTES else None
    if ex is not None:
        results = _pooled(ex, lambda fs: [guarded(f) for f in fs], batches(scan.frames, task_bytes(scan.stored_total)),
                          2 * workers())
    else:
        results = map(guarded, scan.frames)
    try:
        for f, (p, got) in zip(scan.frames, results):
            if p is None and isinstance(got, BaseException):
                p = chain.payload((f.stored,))  # work failed before its digest: take it here
            d = chain.compute(f.fh, (f.stored,), p)
            if d != f.digest:
                raise KVPackError(f"frame {f.seq} (layer {f.layer}, start {f.start}): digest mismatch (corrupt)",
                                  hint=DAMAGED_PACK_HINT)
            chain.value = d
            if isinstance(got, BaseException):
                raise got
            yield f, p, got
    finally:
        del results  # an error: the rest is cancelled or finishes unseen
    if scan.failure is not None:
        raise scan.failure
    assert scan.end is not None
    root = chain.root(scan.end[0])
    check_root(scan.end[1], root)
    if scan.pos != len(scan.buf):
        raise KVPackError("bytes after the end frame")
    scan.root = root


def buffer_events(buf: memoryview | bytes, *, max_bytes: int | None = None, max_minor: int = MINOR,
                  decode: bool = True) -> Iterator[HeaderEvent | FrameEvent | EndEvent]:
    """The events :class:`PackReader` would give for the whole pack in ``buf``, with the
    same verdicts, but with the payloads hashed (and zstd frames decoded) on the worker
    pool ahead of the frame being yielded. Each FrameEvent comes once its digest and the
    chain up to it verified; its ``stored`` is a view of ``buf`` and ``payload_digest``
    is p_k (v1.1). One difference, stricter: the EndEvent comes only once nothing follows
    the end frame (PackReader gives it, then refuses the bytes after it). ``decode=False``:
    arrays are left empty, as PackReader's. Used to pass
    a memory-mapped pack on (``muser pack``) at the rate of the pool's hashing.

    ``buf`` must not change until the generator is done: a frame is hashed a few runs
    ahead of its event, and its ``stored`` view is read again by whoever passes it on
    (``read_pack_bytes`` copies a writable buffer first; a muser file is never rewritten
    in place, see docs/kvpack.md 4.2)."""
    scan = _scan(buf, max_bytes, max_minor)
    header = scan.header
    hashing = Chain(scan.minor, header.digest or "sha256", scan.d_header)  # p_k only: None for v1.0
    yield HeaderEvent(header)

    def work(f: _Scanned):
        p = hashing.payload((f.stored,))
        try:
            return p, decode_frame(header, f.layer, f.count, f.codec, f.stored, f.raw_len, decode)
        except KVPackError as exc:
            return p, exc

    raw = 0
    for f, p, (keys, values) in _verified(scan, work):
        raw += f.raw_len
        yield FrameEvent(f.seq, f.layer, f.start, f.count, f.codec, len(f.stored), keys, values, stored=f.stored,
                         payload_digest=p)
    yield EndEvent(scan.root, scan.pos, raw)


def read_buffer(buf: memoryview | bytes, *, max_bytes: int | None = None, progress: Callable | None = None,
                max_minor: int = MINOR, spare_rows: int = 0) -> KVPack:
    """Verify and read a whole pack held in memory (or memory-mapped) without copying it.

    Same verdicts as :class:`PackReader` fed the same bytes (the first failure in stream
    order is the one reported). Payload digests (v1.1) and zstd frames run on the worker
    pool; nothing is returned unless the root digest verified and nothing follows it.
    Uncompressed rows of a layer held in one frame are views of ``buf``; other layers are
    assembled into arrays of their own.

    ``spare_rows`` > 0: every full-attention layer that starts at position 0 is placed,
    frame by frame as it is hashed, into a writable array with that many rows of room
    after its own, and handed out as the leading rows of it -- the layout an engine may
    adopt as its cache (``Consumer.open(..., adopt=True)``), so that this one placement
    is the install and no other copy follows. Other layers are read as without it.
    """
    # 1. the structure (``_scan``); 2. one task a frame, on the pool: its payload digest (v1.1), its decoding, and --
    #    for a layer spread over several frames -- the copy of its rows into that layer's
    #    own arrays, while the frame is hot in cache. Nothing of it is handed out yet: the
    #    chain is checked in stream order (``_verified``), and rows leave only after the root.
    scan = _scan(buf, max_bytes, max_minor)
    header, chain = scan.header, Chain(scan.minor, scan.header.digest or "sha256", scan.d_header)
    frames, plan = scan.frames, scan.plan
    stored_total = scan.stored_total
    np_dtype = np.dtype(DTYPES[header.dtype][1])
    layer_frames = [0] * len(header.layers)
    for f in frames:
        layer_frames[f.layer] += 1
    dest: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    spare = max(0, int(spare_rows))
    shapes: dict[int, tuple[tuple[int, int, int], tuple[int, int, int]]] = {}
    for li, n in enumerate(layer_frames):
        spec, rows = header.layers[li], header.layer_rows(li)
        room = spare if spec.kind == "full" and header.layer_first_row(li) == 0 else 0
        if spec.kind != "state" and (n > 1 or (n == 1 and room)):  # a state layer keeps its newest frame
            shapes[li] = ((spec.kv_heads, rows + room, spec.head_dim), (spec.kv_heads, rows + room, spec.v_head_dim))
    if shapes:  # one allocation for every layer assembled here (kvpack/alloc.py says why)
        carved = iter(slab_arrays([s for pair in shapes.values() for s in pair], np_dtype))
        dest = {li: (next(carved), next(carved)) for li in shapes}

    def work(f: _Scanned):
        p = chain.payload((f.stored,))
        try:
            keys, values = decode_frame(header, f.layer, f.count, f.codec, f.stored, f.raw_len, True)
        except KVPackError as exc:
            return p, exc
        if f.layer in dest:
            a = f.start - header.layer_first_row(f.layer)
            dk, dv = dest[f.layer]
            np.copyto(dk[:, a : a + f.count], keys)
            np.copyto(dv[:, a : a + f.count], values)
            return p, None
        return p, (keys, values)

    held: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    snaps: dict[int, dict[int, np.ndarray]] = {}  # per state layer: every snapshot by position
    for f, _, got in _verified(scan, work):
        if got is not None:
            held[f.layer] = got  # in stream order: a state layer's newest snapshot supersedes the last
            if header.layers[f.layer].kind == "state":
                snaps.setdefault(f.layer, {})[f.start + f.count] = got[0]
    root, pos = scan.root, scan.pos

    # 3. verified: hand out the rows (a layer in one uncompressed frame: a view of buf)
    layers: list = []
    for li, spec in enumerate(header.layers):
        if spec.kind == "state":
            layers.append(state_kv(header, li, held[li][0] if li in held else None, snaps.get(li)))
            continue
        if li in dest:
            keys, values = dest[li]
            rows = header.layer_rows(li)
            if keys.shape[1] != rows:  # room after the rows: hand out the rows, a view of the whole
                keys, values = keys[:, :rows], values[:, :rows]
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

