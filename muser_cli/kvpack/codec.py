"""Per-frame payload codecs: raw, zstd, and zstd over byte-grouped values.

Byte grouping stores byte 0 of every element, then byte 1, ... (for 16- and 32-bit
values); exponent bytes of nearby values repeat, which zstd then finds.
Decompression is bounded: a frame never expands past its declared raw length.
"""

from __future__ import annotations

import threading

import numpy as np

from muser_cli.errors import KVPackError
from muser_cli.kvpack.format import CODEC_NAMES, CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_GROUPED


def codec_id(name: str) -> int:
    for cid, cname in CODEC_NAMES.items():
        if cname == name:
            return cid
    raise KVPackError(f"unknown codec {name!r} (known: {', '.join(CODEC_NAMES.values())})")


def group_bytes(raw: bytes | memoryview, elem: int) -> bytes | memoryview:
    """byte 0 of every element, then byte 1, ... (one strided copy)."""
    if elem == 1:
        return raw
    return group_bytes_parts([raw], elem, len(raw))


def group_bytes_parts(parts: list, elem: int, total: int) -> memoryview:
    """:func:`group_bytes` of the concatenation of ``parts``, written straight from each part."""
    if elem == 1:
        if len(parts) == 1:
            return memoryview(parts[0]).cast("B")
        return memoryview(np.concatenate([np.frombuffer(p, np.uint8) for p in parts]))
    n = total // elem
    out = np.empty((elem, n), dtype=np.uint8)
    off = 0
    for part in parts:
        v = np.frombuffer(part, dtype=np.uint8).reshape(-1, elem)
        np.copyto(out[:, off : off + v.shape[0]], v.T)
        off += v.shape[0]
    return memoryview(out.reshape(-1))


def ungroup_bytes(grouped: bytes | memoryview, elem: int) -> bytes | memoryview:
    if elem == 1:
        return grouped
    planes = np.frombuffer(grouped, dtype=np.uint8).reshape(elem, -1)  # (elem, n)
    # A strided copy per byte plane. Word shifts (high << 8 | low) ran twice as fast alone,
    # but slower on the reader's pool: measured and not kept (docs/benchmarks.md, session 6).
    out = np.empty((planes.shape[1], elem), dtype=np.uint8)
    for b in range(elem):
        out[:, b] = planes[b]
    return memoryview(out.reshape(-1))


# zstandard contexts are not safe to share between threads: one per thread (and level).
_local = threading.local()


def _compressor(level: int):
    import zstandard

    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx


def _decompressor():
    import zstandard

    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def encode_payload(raw: bytes | memoryview, codec: int, *, elem: int, level: int = 1) -> bytes | memoryview:
    """One frame's stored bytes. Safe to call from several threads (zstandard releases the GIL)."""
    if codec == CODEC_RAW:
        return raw
    cctx = _compressor(level)
    if codec == CODEC_ZSTD:
        return cctx.compress(raw)  # type: ignore[attr-defined]
    if codec == CODEC_ZSTD_GROUPED:
        return cctx.compress(group_bytes(raw, elem))  # type: ignore[attr-defined]
    raise KVPackError(f"unknown codec id {codec}")


def decode_payload(stored: bytes | memoryview, codec: int, *, raw_len: int, elem: int) -> bytes | memoryview:
    if codec == CODEC_RAW:
        if len(stored) != raw_len:
            raise KVPackError(f"raw frame holds {len(stored)} bytes, header says {raw_len}")
        return stored
    if codec not in (CODEC_ZSTD, CODEC_ZSTD_GROUPED):
        raise KVPackError(f"unknown codec id {codec}")
    import zstandard

    try:
        # Bounded: a frame that declares a content size other than raw_len is refused before
        # any allocation (zstandard would trust the declared size); one without a declared
        # size is capped by max_output_size.
        declared = zstandard.frame_content_size(stored)
        if declared not in (-1, raw_len):
            raise KVPackError(f"zstd frame declares {declared} bytes, header says {raw_len}")
        dctx = _decompressor()
        out = dctx.decompress(stored, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise KVPackError(f"zstd frame does not decode ({exc})") from None
    if len(out) != raw_len:
        raise KVPackError(f"zstd frame decodes to {len(out)} bytes, header says {raw_len}")
    if codec == CODEC_ZSTD_GROUPED:
        out = ungroup_bytes(out, elem)
    return out
