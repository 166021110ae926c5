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
    ``readinto`` into a buffer of that step's size -- grown as the bytes arrive, so a
    length the input merely declares allocates nothing large (:func:`read_exact_into`).

The parser lives in :mod:`~muser_cli.kvpack.parser`, the whole-buffer reader in
:mod:`~muser_cli.kvpack.buffer`, the checks both make in :mod:`~muser_cli.kvpack.checks`;
this module reads streams and keeps every name importable from here.
"""

from __future__ import annotations

from typing import Any, BinaryIO

import numpy as np

from muser_cli.kvpack.alloc import slab_arrays
from muser_cli.kvpack.buffer import PARALLEL_MIN_BYTES, KVPack, buffer_events, map_file, read_buffer
from muser_cli.kvpack.format import PackHeader
from muser_cli.kvpack.layers import DTYPES, LayerKV, state_kv
from muser_cli.kvpack.parser import EndEvent, Event, FrameEvent, HeaderEvent, PackReader

__all__ = [
    "MAX_READ", "PARALLEL_MIN_BYTES", "READ_BLOCK", "EndEvent", "Event", "FrameEvent", "HeaderEvent", "KVPack",
    "PackReader", "buffer_events", "map_file", "read_buffer", "read_exact_into", "read_pack", "read_pack_bytes",
    "read_step",
]

READ_BLOCK = 1 << 20
MAX_READ = 1 << 30


# ---------------------------------------------------------------- streams
def read_exact_into(stream: BinaryIO, n: int, *, trusted: int = 0) -> memoryview:
    """Up to ``n`` bytes (fewer only at end of input) read with ``readinto`` into a fresh
    buffer the caller owns. The buffer grows with the bytes that arrive, never to a length
    merely declared: it starts at ``max(READ_BLOCK, trusted)`` bytes (``trusted``: what
    this stream has already delivered) and doubles when full -- so a 1 KiB input whose
    frame header declares 1 GiB allocates 1 MiB, while a stream that has carried more than
    a frame's size reads each frame into one buffer of exactly its size, as before.
    Streams without readinto use read, in pieces bounded the same way."""
    readinto = getattr(stream, "readinto", None)
    if readinto is None:
        parts: list[bytes] = []
        got = 0
        while got < n:
            data = stream.read(min(n - got, max(READ_BLOCK, trusted, got)))
            if not data:
                break
            parts.append(data)
            got += len(data)
        return memoryview(parts[0] if len(parts) == 1 else b"".join(parts))
    size = min(n, max(READ_BLOCK, trusted))
    view = memoryview(np.empty(size, dtype=np.uint8) if size > 4096 else bytearray(size)).cast("B")
    got = 0
    while got < n:
        if got == len(view):  # full, and more is due: the bytes that came earn a larger buffer
            bigger = np.empty(min(n, 2 * got), dtype=np.uint8)
            bigger[:got] = np.frombuffer(view, dtype=np.uint8)
            view = memoryview(bigger).cast("B")
        k = readinto(view[got:])
        if not k:
            break
        got += k
    return view[:got]


def read_step(stream: BinaryIO, reader: PackReader) -> memoryview:
    """The next parser step of ``stream`` for ``reader`` (past the end frame, one byte: a
    trailing byte is then refused), read by :func:`read_exact_into`, so what is allocated
    is bounded by the bytes that arrived, not by the lengths the input declares."""
    if reader.done:
        return read_exact_into(stream, 1)
    return read_exact_into(stream, max(1, min(reader.want(), MAX_READ)), trusted=reader.bytes_consumed)


def read_pack(stream: BinaryIO, *, max_bytes: int | None = None, progress=None, use_mmap: bool = True,
              spare_rows: int = 0) -> KVPack:
    """Read and verify a whole pack from a binary stream. Nothing is returned unless the
    end frame verifies and nothing follows it. A regular file is memory-mapped (``use_mmap``)
    and read as :func:`read_buffer`; the stream is then left at its end. Rows may be views
    of the map: a muser file is never rewritten in place (it is replaced by rename), and
    a file truncated under a live map would fault the process (see docs/kvpack.md 4.2).
    ``spare_rows``: see :func:`read_buffer` (files only; a stream is read as without it)."""
    if use_mmap:
        mapped = map_file(stream)
        if mapped is not None:
            view, end = mapped
            try:
                return read_buffer(view, max_bytes=max_bytes, progress=progress, spare_rows=spare_rows)
            finally:
                stream.seek(end)
    reader = PackReader(max_bytes=max_bytes)
    parts: list[list[tuple[np.ndarray, np.ndarray]]] = []
    header: PackHeader | None = None
    end_ev: EndEvent | None = None
    snaps: dict[int, dict[int, Any]] = {}  # per state layer: its superseded snapshots by position
    stored = 0
    while True:
        # Read exactly what the parser needs next, into a buffer of its own (no copies).
        chunk = read_step(stream, reader)
        if not len(chunk):
            break
        for ev in reader.feed(chunk, owned=True):
            if isinstance(ev, HeaderEvent):
                header = ev.header
                parts = [[] for _ in header.layers]
            elif isinstance(ev, FrameEvent):
                if header is not None and header.layers[ev.layer].kind == "state":
                    if parts[ev.layer]:  # the newest snapshot supersedes the last, which is kept as earlier
                        snaps.setdefault(ev.layer, {})[parts[ev.layer][0][1]] = parts[ev.layer][0][0]
                    parts[ev.layer][:] = [(ev.keys, ev.start + ev.count)]
                else:
                    parts[ev.layer].append((ev.keys, ev.values))
                stored += ev.stored_bytes
                if progress is not None and header is not None:
                    progress("read", ev.seq + 1, len(reader._plan))
            else:
                end_ev = ev
    reader.finish()
    assert header is not None and end_ev is not None
    layers: list = []
    np_dtype = np.dtype(DTYPES[header.dtype][1])
    # layers in several frames are joined into views of one allocation (kvpack/alloc.py)
    joined = {i: (sum(k.shape[1] for k, _ in f), f[0][0].shape, f[0][1].shape) for i, f in enumerate(parts) if len(f) > 1}
    carved = iter(slab_arrays([(ks[0], n, ks[2]) if j == 0 else (vs[0], n, vs[2])
                               for n, ks, vs in joined.values() for j in (0, 1)], np_dtype)) if joined else iter(())
    for i, frames in enumerate(parts):
        spec = header.layers[i]
        if spec.kind == "state":
            layers.append(state_kv(header, i, frames[0][0] if frames else None, snaps.get(i)))
            continue
        if len(frames) > 1:
            keys = np.concatenate([k for k, _ in frames], axis=1, out=next(carved))
            values = np.concatenate([v for _, v in frames], axis=1, out=next(carved))
        elif frames:
            keys, values = frames[0]
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
