"""Arrays between numpy (a pack's rows, in their storage dtype) and torch (the engine's cache).

A pack's arrays are float32, float16 or bfloat16 bits in uint16 (numpy has no bfloat16);
:data:`FROM_NUMPY` says which torch dtype those bytes mean. :func:`view_torch` and
:func:`adoptable` share the array's memory; :func:`to_torch` copies when it must.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from muser_cli.errors import DataError

# numpy dtype of the arrays a pack carries -> the torch dtype those bytes mean.
FROM_NUMPY = {np.dtype("<f4"): torch.float32, np.dtype("<f2"): torch.float16, np.dtype("<u2"): torch.bfloat16}


def chunk_ring(keys: "torch.Tensor", values: "torch.Tensor", rows: int, chunk: int | None
                ) -> tuple["torch.Tensor", "torch.Tensor"]:
    """A chunked layer's rows (those of the current chunk) as transformers' own layer holds them
    after ``rows`` positions: its last ``min(rows, chunk - 1)`` rows, the older ones belonging to
    earlier chunks, which its chunked mask never lets a later position see: zeros here."""
    assert chunk is not None
    pad = min(rows, chunk - 1) - keys.shape[-2]
    if pad <= 0:
        return keys, values
    zk = torch.zeros((*keys.shape[:-2], pad, keys.shape[-1]), dtype=keys.dtype, device=keys.device)
    zv = torch.zeros((*values.shape[:-2], pad, values.shape[-1]), dtype=values.dtype, device=values.device)
    return torch.cat([zk, keys], dim=-2), torch.cat([zv, values], dim=-2)


def to_numpy(t: "torch.Tensor") -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()  # raw bits; numpy has no bfloat16
    if t.dtype in (torch.float32, torch.float16):
        return t.numpy()
    raise DataError(f"unexpected cache dtype {t.dtype}")


def adoptable(a: Any, need: int, dtype: "torch.dtype") -> "torch.Tensor | None":
    """``a``'s whole backing array as a ``(1, heads, capacity, dim)`` tensor sharing its
    memory, when ``a`` is its leading rows, the array is C-contiguous, writable, in the
    engine's dtype, and has room for ``need`` rows; else None (the caller copies)."""
    base = getattr(a, "base", None)
    if not isinstance(a, np.ndarray) or not isinstance(base, np.ndarray) or base.ndim != 3 or a.ndim != 3:
        return None
    if not (base.flags.c_contiguous and base.flags.writeable) or base.shape[1] < need:
        return None
    if (base.shape[0], base.shape[2]) != (a.shape[0], a.shape[2]) or a.strides != base.strides:
        return None
    if a.__array_interface__["data"][0] != base.__array_interface__["data"][0] or FROM_NUMPY.get(base.dtype) != dtype:
        return None
    t = torch.from_numpy(base)
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.unsqueeze(0)


def view_torch(a: Any) -> "torch.Tensor":
    """``a``'s memory as a tensor of the dtype its bytes mean, strides kept (no copy). Never
    written: the sized layer copies it into its own buffer, casting as it goes."""
    import warnings

    a = np.asarray(a)
    source = FROM_NUMPY.get(a.dtype)
    if source is None:
        raise DataError(f"KV arrays of numpy dtype {a.dtype} are not a storage dtype (float32, float16, bfloat16 bits)")
    if any(st < 0 for st in a.strides):
        a = np.ascontiguousarray(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only arrays (memory-mapped packs): only read here
        t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if source == torch.bfloat16 else t


def to_torch(a: Any, dtype: "torch.dtype") -> "torch.Tensor":
    a = np.asarray(a)
    source = FROM_NUMPY.get(a.dtype)
    if source is None:
        raise DataError(f"KV arrays of numpy dtype {a.dtype} are not a storage dtype (float32, float16, bfloat16 bits)")
    if not (a.flags.c_contiguous and a.flags.writeable):
        a = np.array(a, order="C", copy=True)
    t = torch.from_numpy(a)
    if source == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t if t.dtype == dtype else t.to(dtype)
