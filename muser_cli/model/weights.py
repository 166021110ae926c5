"""A model's weights files checked without reading the tensors: each .safetensors header
(length prefix, JSON, every entry's dtype, shape and offsets, offsets tiling the data to
the end of the file) and the embedding's row count against config.json's vocab_size.
Every failure is a :class:`DataError` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from muser_cli.errors import DataError

# Bytes per element of the safetensors dtypes whose sizes we check (others: structure only).
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own cap


def safetensors_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Read and validate a .safetensors header without reading the tensors: {name: (dtype, shape)}.

    Checks what a loader would trip on: the length prefix, the JSON, every entry's dtype,
    shape and offsets, and that the offsets tile the data exactly to the end of the file.
    Raises :class:`DataError` (exit 65) naming the file.
    """
    file = Path(file)

    def bad(why: str) -> DataError:
        return DataError(f"corrupt weights file {file}: {why}",
                         hint="re-download or re-convert the model; the file is not a valid safetensors file")

    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(prefix, "little")
            if n < 2 or n > MAX_SAFETENSORS_HEADER or 8 + n > size:
                raise bad(f"header length {n} does not fit the file ({size} bytes)")
            raw = handle.read(n)
    except OSError as exc:
        raise DataError(f"cannot read weights file {file}: {exc.strerror or exc}") from exc
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("header is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise bad("header is not a JSON object")
    data_size = size - 8 - n
    spans: list[tuple[int, int]] = []
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in obj.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise bad(f"tensor {name!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str):
            raise bad(f"tensor {name!r} has no dtype")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise bad(f"tensor {name!r} has an invalid shape")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise bad(f"tensor {name!r} has data offsets {offsets!r} outside the {data_size} data bytes")
        if dtype in _ST_ITEMSIZE:
            count = 1
            for d in shape:
                count *= d
            if count * _ST_ITEMSIZE[dtype] != offsets[1] - offsets[0]:
                raise bad(f"tensor {name!r} ({dtype} {shape}) needs {count * _ST_ITEMSIZE[dtype]} bytes, "
                          f"its offsets span {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1]))
        out[name] = (dtype, tuple(shape))
    end = 0
    for lo, hi in sorted(spans):
        if lo != end:
            raise bad(f"tensor data {'overlaps' if lo < end else 'has a gap'} at byte {min(lo, end)}")
        end = hi
    if end != data_size:
        raise bad(f"tensors cover {end} of {data_size} data bytes (truncated or padded file)")
    return out


def check_weights(path: Path, vocab_size: int) -> None:
    """Validate every weights file's header, and that the embedding has ``vocab_size`` rows."""
    path = Path(path)
    for file in sorted(p for p in path.glob("*.safetensors") if p.is_file()):
        for name, (_dtype, shape) in safetensors_header(file).items():
            if name.endswith("embed_tokens.weight") and shape and shape[0] != vocab_size:
                raise DataError(f"model folder {path}: config.json says vocab_size {vocab_size}, but {file.name}'s "
                                f"{name} has {shape[0]} rows", hint="config.json does not belong to these weights")
