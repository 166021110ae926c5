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


def group_bytes(raw: bytes | memoryview, elem: int) -> bytes:
    if elem == 1:
        return bytes(raw)
    a = np.frombuffer(raw, dtype=np.uint8).reshape(-1, elem)  # (n, elem)
    return a.T.tobytes()  # (elem, n)


def ungroup_bytes(grouped: bytes | memoryview, elem: int) -> bytes:
    if elem == 1:
        return bytes(grouped)
    a = np.frombuffer(grouped, dtype=np.uint8).reshape(elem, -1)  # (elem, n)
    return a.T.tobytes()  # (n, elem)


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
        dctx = zstandard.ZstdDecompressor()
        # Bounded: zstandard refuses to produce more than max_output_size.
        out = dctx.decompress(bytes(stored), max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise KVPackError(f"zstd frame does not decode ({exc})") from None
    if len(out) != raw_len:
        raise KVPackError(f"zstd frame decodes to {len(out)} bytes, header says {raw_len}")
    if codec == CODEC_ZSTD_GROUPED:
        out = ungroup_bytes(out, elem)
    return out
