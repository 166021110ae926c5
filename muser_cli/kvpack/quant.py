"""Storage-dtype conversions and the int8 quantization scheme (opt-in, lossy, measured).

int8 layout: one float32 scale per (layer, K/V, kv head, token) = max|x| / 127 over the
head dim; q = round(x / scale) in [-127, 127]. A frame's decoded payload is then
  K q (kv_heads, count, head_dim) int8 | K scales (kv_heads, count) float32 |
  V q (kv_heads, count, v_head_dim) int8 | V scales (kv_heads, count) float32.
The reader dequantizes back to the header's dtype, so consumers see ordinary rows.
"""

from __future__ import annotations

import numpy as np

QUANT_SCHEMES = ("none", "int8")


def to_float32(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def from_float32(f: np.ndarray, dtype: str) -> np.ndarray:
    f = np.ascontiguousarray(f, dtype=np.float32)
    if dtype == "bfloat16":
        u = f.view(np.uint32)
        rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))  # round to nearest even
        return (rounded >> np.uint32(16)).astype(np.uint16)
    if dtype == "float16":
        return f.astype("<f2")
    return f


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 (heads, count, dim) -> (q int8 same shape, scales float32 (heads, count))."""
    amax = np.max(np.abs(x), axis=-1)
    scales = (amax / 127.0).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1.0))
    q = np.clip(np.rint(x / safe[..., None]), -127, 127).astype(np.int8)
    return q, scales


def dequantize_int8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scales[..., None]


def int8_row_bytes(kv_heads: int, head_dim: int, v_head_dim: int) -> int:
    return kv_heads * (head_dim + v_head_dim) + kv_heads * 2 * 4


def encode_int8(keys: np.ndarray, values: np.ndarray, dtype: str) -> bytes:
    qk, sk = quantize_int8(to_float32(keys, dtype))
    qv, sv = quantize_int8(to_float32(values, dtype))
    return qk.tobytes() + sk.astype("<f4").tobytes() + qv.tobytes() + sv.astype("<f4").tobytes()


def decode_int8(raw: bytes | memoryview, heads: int, count: int, head_dim: int, v_head_dim: int,
                dtype: str) -> tuple[np.ndarray, np.ndarray]:
    buf = np.frombuffer(raw, dtype=np.uint8)
    o = 0

    def take(n: int, dt: str, shape: tuple[int, ...]) -> np.ndarray:
        nonlocal o
        size = n * np.dtype(dt).itemsize
        arr = buf[o : o + size].view(dt).reshape(shape)
        o += size
        return arr

    qk = take(heads * count * head_dim, "i1", (heads, count, head_dim))
    sk = take(heads * count, "<f4", (heads, count))
    qv = take(heads * count * v_head_dim, "i1", (heads, count, v_head_dim))
    sv = take(heads * count, "<f4", (heads, count))
    return from_float32(dequantize_int8(qk, sk), dtype), from_float32(dequantize_int8(qv, sv), dtype)


def int8_error(keys: np.ndarray, values: np.ndarray, dtype: str) -> dict[str, float]:
    """Max/mean absolute error of an int8 round trip, measured in the storage dtype."""
    out: dict[str, float] = {}
    for name, arr in (("k", keys), ("v", values)):
        x = to_float32(arr, dtype)
        q, s = quantize_int8(x)
        back = to_float32(from_float32(dequantize_int8(q, s), dtype), dtype)
        err = np.abs(back - x)
        out[f"{name}_max_abs"] = float(err.max()) if err.size else 0.0
        out[f"{name}_sum_abs"] = float(err.sum(dtype=np.float64))
        out[f"{name}_n"] = float(err.size)
        out[f"{name}_max_value"] = float(np.abs(x).max()) if x.size else 0.0
    return out
