"""A small, bounded safetensors reader and writer (pure Python + numpy).

mlx-lm's prompt caches are safetensors files whose ``__metadata__`` carries the cache
structure. Reading them here (instead of through ``mx.load``) lets muser check every
size and offset before it touches a byte, and works where MLX is not installed.

Layout: 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}``, then the data buffer.
Offsets are relative to the buffer; tensors must not overlap and must fill their
range exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, BinaryIO, Mapping

import numpy as np

from muser_cli.errors import DataError
from muser_cli.strict import unique_keys

# safetensors dtype -> numpy dtype (bfloat16 is carried as raw uint16 bits, as elsewhere in muser)
NP_DTYPES: dict[str, str] = {
    "F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8",
    "I8": "i1", "U8": "u1", "I16": "<i2", "U16": "<u2", "I32": "<i4", "U32": "<u4", "I64": "<i8", "U64": "<u8",
    "BOOL": "?",
}
MAX_HEADER_BYTES = 16 << 20
MAX_DIMS = 8


@dataclass(frozen=True)
class Tensor:
    dtype: str  # safetensors name, e.g. "F32", "BF16"
    shape: tuple[int, ...]
    array: np.ndarray  # a read-only view into the file's buffer


@dataclass(frozen=True)
class SafetensorsFile:
    tensors: dict[str, Tensor]
    metadata: dict[str, str]


def parse(buffer: Any, *, name: str = "input") -> SafetensorsFile:
    """Parse a whole safetensors file held in ``buffer`` (bytes, mmap). Every size, dtype
    and offset is checked before an array view is made; nothing is copied."""
    view = memoryview(buffer)
    total = len(view)
    if total < 8:
        raise DataError(f"{name}: {total} bytes, too short for a safetensors file")
    hlen = int.from_bytes(view[:8], "little")
    if hlen < 2 or hlen > MAX_HEADER_BYTES or 8 + hlen > total:
        raise DataError(f"{name}: safetensors header length {hlen} does not fit a file of {total} bytes")
    try:
        header = json.loads(bytes(view[8 : 8 + hlen]).decode("utf-8"), object_pairs_hook=unique_keys("safetensors header"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{name}: the safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise DataError(f"{name}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise DataError(f"{name}: safetensors __metadata__ must map strings to strings")
    data = view[8 + hlen :]
    size = len(data)
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, Tensor] = {}
    for key, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise DataError(f"{name}: tensor {key!r}: expected dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in NP_DTYPES:
            raise DataError(f"{name}: tensor {key!r} has dtype {dtype!r}, which muser does not read")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise DataError(f"{name}: tensor {key!r} has a bad shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise DataError(f"{name}: tensor {key!r} has bad data_offsets {offsets!r}")
        begin, end = offsets
        np_dtype = np.dtype(NP_DTYPES[dtype])
        want = math.prod(shape) * np_dtype.itemsize
        if not 0 <= begin <= end <= size or end - begin != want:
            raise DataError(f"{name}: tensor {key!r} {dtype}{shape} needs {want} bytes, its offsets "
                            f"[{begin}, {end}) do not fit (data is {size} bytes)")
        spans.append((begin, end, key))
        arr = np.frombuffer(data[begin:end], dtype=np_dtype).reshape(shape) if want else np.empty(shape, np_dtype)
        tensors[key] = Tensor(dtype, tuple(shape), arr)
    spans.sort()
    for (b0, e0, k0), (b1, e1, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise DataError(f"{name}: tensors {k0!r} and {k1!r} overlap")
    return SafetensorsFile(tensors=tensors, metadata=dict(meta))


def write(out: BinaryIO, tensors: Mapping[str, tuple[str, np.ndarray]], metadata: Mapping[str, str]) -> int:
    """Write ``tensors`` (name -> (safetensors dtype, array)) in name order, then their
    bytes contiguously. Returns the bytes written."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    order = list(tensors)
    for key in order:
        dtype, arr = tensors[key]
        nbytes = int(arr.nbytes)
        header[key] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    blob += b" " * (-(len(blob)) % 8)  # the data buffer starts 8-aligned
    out.write(len(blob).to_bytes(8, "little"))
    out.write(blob)
    written = 8 + len(blob)
    for key in order:
        dtype, arr = tensors[key]
        arr = np.ascontiguousarray(arr, dtype=np.dtype(NP_DTYPES[dtype]))
        out.write(memoryview(arr.reshape(-1)).cast("B") if arr.nbytes else b"")
        written += arr.nbytes
    return written
