"""fp8 KV bytes -> float32 values: the lookup tables of vLLM's three fp8 formats.

kvpack has no fp8 dtype, so the connector dequantizes fp8 rows (value x scale) before
they are stored. Pure numpy.
"""

from __future__ import annotations

import numpy as np

from muser_cli.errors import DataError

FP8_FORMATS = ("e4m3fn", "e5m2", "e4m3fnuz")


def _fail(msg: str) -> DataError:
    return DataError(msg.replace("\n", " "))


_LUTS: dict[str, np.ndarray] = {}


def fp8_table(fmt: str) -> np.ndarray:
    """float32 value of each of the 256 fp8 bit patterns in ``fmt`` (NaN where none)."""
    if fmt not in FP8_FORMATS:
        raise _fail(f"unknown fp8 format {fmt!r} (known: {', '.join(FP8_FORMATS)})")
    lut = _LUTS.get(fmt)
    if lut is not None:
        return lut
    codes = np.arange(256, dtype=np.uint16)
    if fmt == "e5m2":  # the top byte of an IEEE binary16
        lut = (codes << 8).astype(np.uint16).view(np.float16).astype(np.float32)
    else:
        bias = 7 if fmt == "e4m3fn" else 8
        sign = np.where(codes & 0x80, -1.0, 1.0)
        exp = (codes >> 3) & 0xF
        man = (codes & 0x7).astype(np.float64)
        normal = (1.0 + man / 8.0) * np.exp2(exp.astype(np.float64) - bias)
        sub = (man / 8.0) * np.exp2(1.0 - bias)
        lut = (sign * np.where(exp == 0, sub, normal)).astype(np.float32)
        if fmt == "e4m3fn":
            lut[(exp == 0xF) & ((codes & 0x7) == 0x7)] = np.nan
        else:
            lut[codes == 0x80] = np.nan  # fnuz: the only NaN, and no negative zero
            lut[codes == 0] = 0.0
    lut.setflags(write=False)
    _LUTS[fmt] = lut
    return lut


def dequantize_fp8(data: np.ndarray, scale: np.ndarray | float, fmt: str = "e4m3fn") -> np.ndarray:
    """float32 values of fp8 rows ``(kv_heads, rows, dim)`` times their scale.

    ``scale``: a scalar, ``(kv_heads,)`` or ``(kv_heads, rows)``. Raises DataError on a
    NaN bit pattern (vLLM's quantizer saturates; a NaN means a corrupt cache).
    """
    arr = np.asarray(data)
    if arr.dtype != np.uint8 or arr.ndim != 3:
        raise _fail(f"fp8 rows must be uint8 (kv_heads, rows, dim), got {arr.dtype} {tuple(arr.shape)}")
    s = np.asarray(scale, dtype=np.float32)
    if s.shape == ():
        pass
    elif s.shape == arr.shape[:1]:
        s = s[:, None, None]
    elif s.shape == arr.shape[:2]:
        s = s[:, :, None]
    else:
        raise _fail(f"scale shape {tuple(s.shape)} does not fit fp8 rows {tuple(arr.shape)}")
    values = fp8_table(fmt)[arr]
    if np.isnan(values).any():
        raise _fail("fp8 rows hold a NaN bit pattern")
    return (values * s).astype(np.float32)
