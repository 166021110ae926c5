"""Write a kvpack: whole (``write_pack``) or frame by frame (``PackWriter``), so a producer
can emit each prefill chunk's frames while the next chunk computes."""

from __future__ import annotations

from typing import BinaryIO, Sequence

import numpy as np

from muser_cli.errors import KVPackError
from muser_cli.kvpack.codec import codec_id, encode_payload
from muser_cli.kvpack.format import (
    ALIGN, CODEC_NAMES, FRAME_HEADER, MAGIC, MAJOR, MAX_HEADER_BYTES, PREAMBLE, TAG_DATA, TAG_END,
    PackHeader, chain, header_digest, pad_len,
)
from muser_cli.kvpack.layers import DTYPES, LayerKV

_ZEROS = bytes(ALIGN)


class PackWriter:
    """Streams a pack to ``stream``. Frames must come in ``header.frame_plan()`` order."""

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
        self._plan = list(header.frame_plan())
        self._next = 0
        self.bytes_written = 0
        self.raw_bytes = 0
        hjson = header.encode()
        if len(hjson) > MAX_HEADER_BYTES:
            raise KVPackError(f"header is {len(hjson)} bytes, over the {MAX_HEADER_BYTES}-byte limit")
        pre = PREAMBLE.pack(MAGIC, MAJOR, header.minor, len(hjson))
        self._digest = header_digest(pre, hjson)
        self._write(pre)
        self._write(hjson)
        self._write(_ZEROS[: pad_len(len(pre) + len(hjson))])

    def _write(self, data: bytes | memoryview) -> None:
        if data:
            self.stream.write(data)
            self.bytes_written += len(data)

    @property
    def done(self) -> bool:
        return self._next >= len(self._plan)

    def expected(self) -> tuple[int, int, int] | None:
        return self._plan[self._next] if self._next < len(self._plan) else None

    def write_frame(self, layer: int, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        """keys (kv_heads, count, head_dim), values (kv_heads, count, v_head_dim), storage dtype."""
        exp = self.expected()
        count = keys.shape[1]
        if exp != (layer, start, count):
            raise KVPackError(f"frame (layer {layer}, start {start}, rows {count}) out of plan; expected {exp}")
        spec = self.header.layers[layer]
        np_dtype = np.dtype(DTYPES[self.header.dtype][1])
        for name, arr, dim in (("keys", keys, spec.head_dim), ("values", values, spec.v_head_dim)):
            if arr.shape != (spec.kv_heads, count, dim):
                raise KVPackError(f"layer {layer} {name} shape {arr.shape} != {(spec.kv_heads, count, dim)}")
            if arr.dtype.newbyteorder("<") != np_dtype and arr.dtype != np_dtype:
                raise KVPackError(f"layer {layer} {name} dtype {arr.dtype} is not {self.header.dtype} storage")
        if self.header.quant_scheme == "int8":
            from muser_cli.kvpack.quant import encode_int8

            parts: list = [encode_int8(keys, values, self.header.dtype)]
            elem = 1
        else:
            # K then V, written as views: no concatenated copy for uncompressed frames.
            parts = [_bytes_view(keys, np_dtype), _bytes_view(values, np_dtype)]
            elem = DTYPES[self.header.dtype][0]
        raw_len = sum(len(p) for p in parts)
        codec = self.codec
        if codec != 0:
            raw = parts[0] if len(parts) == 1 else np.concatenate([np.frombuffer(p, np.uint8) for p in parts])
            stored = encode_payload(memoryview(raw).cast("B") if not isinstance(raw, bytes) else raw, codec,
                                    elem=elem, level=self.level)
            if len(stored) >= raw_len:  # incompressible: store raw
                codec = 0
            else:
                parts = [stored]
        stored_len = sum(len(p) for p in parts)
        fh = FRAME_HEADER.pack(TAG_DATA, self._next, layer, start, count, codec, 0, 0, raw_len, stored_len)
        self._digest = chain(self._digest, fh, *parts)
        self._write(fh)
        for p in parts:
            self._write(p)
        self._write(_ZEROS[: pad_len(stored_len)])
        self._write(self._digest + bytes(32))
        self.raw_bytes += raw_len
        self._next += 1

    def finish(self) -> bytes:
        """Write the end frame; returns the root digest."""
        if not self.done:
            raise KVPackError(f"pack incomplete: {len(self._plan) - self._next} frames missing")
        fh = FRAME_HEADER.pack(TAG_END, self._next, 0, 0, 0, 0, 0, 0, self.raw_bytes, 0)
        root = chain(self._digest, fh, b"")
        self._write(fh)
        self._write(root + bytes(32))
        self.stream.flush()
        self.root_digest = root
        return root


def _bytes_view(arr: np.ndarray, np_dtype: np.dtype) -> memoryview:
    return memoryview(np.ascontiguousarray(arr, dtype=np_dtype)).cast("B")


def _replace_codec(header: PackHeader, spec: dict) -> PackHeader:
    from dataclasses import replace

    return replace(header, codec=spec)


def write_pack(
    stream: BinaryIO,
    header: PackHeader,
    layers: Sequence[LayerKV],
    *,
    codec: str | None = None,
    level: int = 1,
) -> PackWriter:
    """Write a whole pack. ``layers[i]`` rows must start at ``header.layer_first_row(i)``
    (or earlier: extra leading rows are skipped) and end at ``header.rows_end``."""
    if len(layers) != len(header.layers):
        raise KVPackError(f"{len(layers)} layers given, header describes {len(header.layers)}")
    for i, lk in enumerate(layers):
        have_end = lk.first_row + lk.keys.shape[1]
        if lk.first_row > header.layer_first_row(i) or have_end != header.rows_end:
            raise KVPackError(
                f"layer {i} rows [{lk.first_row}, {have_end}) do not cover "
                f"[{header.layer_first_row(i)}, {header.rows_end})"
            )
    writer = PackWriter(stream, header, codec=codec, level=level)
    for layer, start, count in header.frame_plan():
        lk = layers[layer]
        a = start - lk.first_row
        writer.write_frame(layer, start, lk.keys[:, a : a + count], lk.values[:, a : a + count])
    writer.finish()
    return writer
