"""Per-frame payload codecs: raw, zstd, and zstd over byte-grouped values.

Byte grouping stores byte 0 of every element, then byte 1, ... (for 16- and 32-bit
values); exponent bytes of nearby values repeat, which zstd then finds.
Decompression is bounded: a frame never expands past its declared raw length.
"""

from __future__ import annotations

import numpy as np

from muser_cli.errors import KVPackError
from muser_cli.kvpack.format import CODEC_NAMES, CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_GROUPED


def codec_id(name: str) -> int:
    for cid, cname in CODEC_NAMES.items():
        if cname == name:
            return cid
    raise KVPackError(f"unknown codec {name!r} (known: {', '.join(CODEC_NAMES.values())})")


_UINT = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def group_bytes(raw: bytes | memoryview, elem: int) -> bytes | memoryview:
    """byte 0 of every element, then byte 1, ... (shifts, not a strided transpose)."""
    if elem == 1:
        return raw
    words = np.frombuffer(raw, dtype=_UINT[elem])
    n = words.size
    out = np.empty(elem * n, dtype=np.uint8)
    for b in range(elem):
        out[b * n : (b + 1) * n] = (words >> (8 * b)) & 0xFF
    return memoryview(out)


def ungroup_bytes(grouped: bytes | memoryview, elem: int) -> bytes | memoryview:
    if elem == 1:
        return grouped
    planes = np.frombuffer(grouped, dtype=np.uint8).reshape(elem, -1)  # (elem, n)
    words = planes[0].astype(_UINT[elem])
    for b in range(1, elem):
        words |= planes[b].astype(_UINT[elem]) << (8 * b)
    return memoryview(words).cast("B")


_cctx: dict[int, object] = {}


def encode_payload(raw: bytes | memoryview, codec: int, *, elem: int, level: int = 1) -> bytes | memoryview:
    if codec == CODEC_RAW:
        return raw
    import zstandard

    cctx = _cctx.get(level)
    if cctx is None:
        cctx = _cctx[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
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
        dctx = zstandard.ZstdDecompressor()
        out = dctx.decompress(stored, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise KVPackError(f"zstd frame does not decode ({exc})") from None
    if len(out) != raw_len:
        raise KVPackError(f"zstd frame decodes to {len(out)} bytes, header says {raw_len}")
    if codec == CODEC_ZSTD_GROUPED:
        out = ungroup_bytes(out, elem)
    return out
