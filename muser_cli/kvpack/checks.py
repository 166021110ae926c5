"""The checks both kvpack readers make, frame by frame, in stream order.

:class:`~muser_cli.kvpack.parser.PackReader` (bytes in pieces) and
:func:`~muser_cli.kvpack.buffer.read_buffer` (a whole pack in memory) call the same
functions, so they give the same verdict on the same bytes. Every failure is a
:class:`KVPackError`.
"""

from __future__ import annotations

import numpy as np

from muser_cli.errors import DAMAGED_PACK_HINT, KVPackError
from muser_cli.kvpack.codec import decode_payload
from muser_cli.kvpack.format import (
    CODEC_NAMES, DIGEST_BLOCK, FRAME_HEADER, MAGIC, MAJOR, MAX_HEADER_BYTES, MINOR_ADDS, PREAMBLE, TAG_DATA, TAG_END, PackHeader,
    header_digest, pad_len,
)
from muser_cli.kvpack.validate import parse_header
from muser_cli.kvpack.layers import DTYPES
from muser_cli.kvpack.quant import decode_int8


def check_magic(head: bytes | bytearray | memoryview) -> None:
    head = bytes(head[: len(MAGIC)])
    if not MAGIC.startswith(head):
        raise KVPackError("not a kvpack (bad magic)")


def check_preamble(pre: memoryview | bytes, max_minor: int, max_bytes: int | None) -> tuple[int, int]:
    _, major, minor, hlen = PREAMBLE.unpack(pre)
    if major != MAJOR:
        raise KVPackError(f"kvpack major version {major} is not supported (this reader reads {MAJOR}.x)")
    if minor > max_minor:
        adds = "; ".join(f"{MAJOR}.{m} adds {MINOR_ADDS[m]}" for m in range(max_minor + 1, minor + 1) if m in MINOR_ADDS)
        raise KVPackError(f"kvpack version {major}.{minor} is newer than this reader's {MAJOR}.{max_minor} "
                          f"(it reads {MAJOR}.0 to {MAJOR}.{max_minor}{'; ' + adds if adds else ''}): "
                          f"upgrade muser to read it")
    if not 2 <= hlen <= MAX_HEADER_BYTES:
        raise KVPackError(f"header length {hlen} outside [2, {MAX_HEADER_BYTES}]")
    if max_bytes is not None and hlen > max_bytes:
        raise KVPackError(f"header length {hlen} exceeds the allowed size")
    return minor, hlen


def header_block_len(hlen: int) -> int:
    return hlen + pad_len(PREAMBLE.size + hlen)


def check_header(block: memoryview | bytes, pre: bytes, hlen: int, minor: int) -> tuple[PackHeader, bytes]:
    hjson, padding = bytes(block[:hlen]), block[hlen:]
    if any(padding):
        raise KVPackError("non-zero header padding")
    header = parse_header(hjson, MAJOR, minor)
    return header, header_digest(pre, hjson)


def check_frame_header(fh: memoryview | bytes, seq: int, plan: list, header: PackHeader, raw_total: int,
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
    expect_raw = header.frame_raw_len(layer, count)
    if raw_len != expect_raw:
        raise KVPackError(f"frame {seq}: raw length {raw_len} != {expect_raw} implied by the header")
    if stored_len > raw_len + 1024 or (codec == 0 and stored_len != raw_len):
        raise KVPackError(f"frame {seq}: stored length {stored_len} is impossible")
    if max_bytes is not None and pos_after + stored_len > max_bytes:
        raise KVPackError(f"pack larger than the allowed {max_bytes} bytes")
    return ("data", layer, start, count, codec, raw_len, stored_len)


def body_len(stored_len: int) -> int:
    return stored_len + pad_len(stored_len) + DIGEST_BLOCK


def check_padding(body: memoryview, stored_len: int, seq: int) -> None:
    if any(body[stored_len : stored_len + pad_len(stored_len)]) or any(body[-32:]):
        raise KVPackError(f"frame {seq}: non-zero padding")


def decode_frame(header: PackHeader, layer: int, count: int, codec: int, stored: memoryview, raw_len: int,
            decode: bool) -> tuple[np.ndarray, np.ndarray]:
    """Decoded (keys, values) of one frame; for a state layer, keys is the snapshot's
    decoded bytes as a 1-D uint8 array (``layers.split_state`` names its tensors) and
    values is empty."""
    spec = header.layers[layer]
    np_dtype = np.dtype(DTYPES[header.dtype][1])
    if not decode:
        empty = np.empty((0,), dtype=np_dtype)
        return empty, empty
    if spec.kind == "state":
        raw = decode_payload(stored, codec, raw_len=raw_len, elem=spec.state_elem)
        return np.frombuffer(raw, dtype=np.uint8), np.empty((0,), dtype=np.uint8)
    if header.quant_scheme == "int8":
        raw = decode_payload(stored, codec, raw_len=raw_len, elem=1)  # int8 payload
        return decode_int8(raw, spec.kv_heads, count, spec.head_dim, spec.v_head_dim, header.dtype)
    raw = decode_payload(stored, codec, raw_len=raw_len, elem=np_dtype.itemsize)
    flat = np.frombuffer(raw, dtype=np_dtype)
    nk = spec.kv_heads * count * spec.head_dim
    return (flat[:nk].reshape(spec.kv_heads, count, spec.head_dim),
            flat[nk:].reshape(spec.kv_heads, count, spec.v_head_dim))


def check_root(block: memoryview, root: bytes) -> None:
    if bytes(block[:32]) != root or any(block[32:]):
        raise KVPackError("end frame root digest mismatch (corrupt)", hint=DAMAGED_PACK_HINT)

