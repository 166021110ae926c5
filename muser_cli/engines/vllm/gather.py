"""Paged KV cache -> kvpack's logical rows: a pure function over numpy (or torch) arrays.

vLLM keeps a layer's KV in fixed-size *blocks* of ``block_size`` token slots; a request
owns a *block table* (block ids in token order: position ``p`` lives in block
``table[p // block_size]`` at slot ``p % block_size``). kvpack wants, per layer,
contiguous rows in token order: keys ``(kv_heads, rows, head_dim)`` and values
``(kv_heads, rows, v_head_dim)``. :func:`gather_paged_kv` does that conversion. Which
layout a vLLM backend uses is decided (and checked) in :mod:`.layouts`, not here.

Layouts (the *logical* axis order of the tensor handed over):

``"BHNC"``
    vLLM 0.30-0.33 GPU backends (FlashAttention, FlashInfer, Triton): one per-layer view
    ``(num_blocks, kv_heads, block_size, head_dim + v_head_dim)`` with K and V side by
    side in the last axis, split by ``kv_cache.transpose(1, 2).split(head_size, -1)``.
    Its physical order is one of vLLM's ``KVCacheLayout`` members (``LBNHC`` = NHD,
    ``LBHNC`` = HND, ``LHBNC``, ``BLHNC``, ``BLNHC``, ``BHLNC``); indexing follows the
    view's strides, so the same code reads all.
``"CPU_KT_V"``
    vLLM's CPU backend (``CPU_ATTN``) with the ``vec`` / ``vec16`` kernels: the same
    4-d tensor shape, but the backend views it as ``(num_blocks, kv_heads, 2 *
    block_size, head_size)`` and cuts the slot axis in two: per (block, head) the first
    ``block_size * head_size`` elements hold K **transposed**, ``[head_size,
    block_size]``, the next ones V as ``[block_size, head_size]`` (what the wheel's
    ``cpu_attn_reshape_and_cache`` writes). The (block, head) interior must be dense.
``"CPU_AMX"``
    the same backend with the ``amx`` kernels (bfloat16 on CPUs with AMX tiles): the
    same 4-d tensor and K-then-V halves per (block, head), each packed for AMX tiles
    (``reshape_and_cache`` of vLLM's ``cpu_attn_amx.hpp``). K: groups of 16 tokens, in
    a group the head's dims in pairs, each pair the 16 tokens' 4-byte words -- axes
    ``[block_size / 16, head_dim / 2, 16 tokens, 2 dims]``. V: groups of 16 dims, in a
    group the tokens in pairs -- axes ``[head_dim / 16, block_size / 2, 16 dims, 2
    tokens]``. bfloat16 only (the pairs are 4-byte words); block_size a multiple of 16,
    head_dim of 16.
``"KBNHD"`` / ``"KBHND"``
    older vLLM FlashAttention ``(2, num_blocks, block_size, kv_heads, head_dim)`` (NHD)
    and its HND variant ``(2, num_blocks, kv_heads, block_size, head_dim)``.
``"BKNHD"`` / ``"BKHND"``
    older vLLM FlashInfer ``(num_blocks, 2, block_size, kv_heads, head_dim)`` (NHD)
    and ``(num_blocks, 2, kv_heads, block_size, head_dim)`` (HND).

Quantized caches (``quant``):

``"none"``   float16 / float32 / bfloat16 (bfloat16 as raw ``uint16`` bits in numpy).
``"fp8"``    one byte per element (fp8 e4m3fn, e5m2 or e4m3fnuz bits) with external
             scales: ``k_scale`` / ``v_scale`` per tensor (a scalar) or per KV head
             (shape ``(kv_heads,)``), as vLLM keeps them on the attention layer.
``"fp8_per_token_head"``  ``"BHNC"`` only: each (head, slot) cell packs
             ``[K (head_dim bytes) | k_scale f32 | V (head_dim bytes) | v_scale f32]``
             (vLLM's Triton backend); scales come back as ``(kv_heads, rows)``.

Rows come back in the storage dtype, bit for bit; :func:`.fp8.dequantize_fp8` turns
fp8 rows into float32 values. Nothing heavy is imported at module import; torch
tensors are accepted by duck typing (only the blocks a request needs leave the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from muser_cli.engines.vllm.blocks import (
    NULL_BLOCK_ID, as_index_array, check_block_size, fail, is_torch, layer_rows_for, slots_from_block_table,
    storage_name, torch_to_numpy,
)
from muser_cli.engines.vllm.fp8 import FP8_FORMATS

LAYOUTS = ("BHNC", "CPU_KT_V", "CPU_AMX", "KBNHD", "KBHND", "BKNHD", "BKHND")
QUANTS = ("none", "fp8", "fp8_per_token_head")

_CPU_LAYOUTS = ("CPU_KT_V", "CPU_AMX")  # vLLM CPU_ATTN: per (block, head) K then V, dense
_AMX_GROUP = 16  # CPU_AMX: tokens per K group, dims per V group (a 64-byte tile row of 4-byte words)
_SCALE_BYTES = 4  # fp8_per_token_head: one little-endian float32 per (head, slot, side)


@dataclass(frozen=True)
class GatheredKV:
    """One layer's rows ``[first_row, first_row + rows)`` in token order.

    ``keys`` ``(kv_heads, rows, head_dim)``, ``values`` ``(kv_heads, rows, v_head_dim)``,
    in the storage dtype (``dtype`` names it: float16, float32, bfloat16 as uint16
    bits, or fp8 as uint8 bits). Scales are float32: ``()`` per tensor, ``(kv_heads,)``
    per head, ``(kv_heads, rows)`` per token and head; None when not quantized.
    """

    keys: np.ndarray
    values: np.ndarray
    first_row: int
    dtype: str
    quant: str = "none"
    fp8_format: str | None = None
    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return int(self.keys.shape[1])


def _dense_interior(cache: Any) -> bool:
    """Whether each ``cache[b, h]`` (a ``(block_size, C)`` slab) is one dense run of memory."""
    n, c = int(cache.shape[2]), int(cache.shape[3])
    if is_torch(cache):
        st = tuple(int(x) for x in cache.stride())
        return (c == 1 or st[3] == 1) and (n == 1 or st[2] == c)
    item = cache.dtype.itemsize
    return (c == 1 or cache.strides[3] == item) and (n == 1 or cache.strides[2] == c * item)


def _check_scale(scale: Any, name: str, kv_heads: int) -> np.ndarray:
    if scale is None:
        raise fail(f"quant 'fp8' needs {name}")
    arr = torch_to_numpy(scale) if is_torch(scale) else np.asarray(scale)
    if arr.dtype.kind not in "fiu":
        raise fail(f"{name} must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(np.float32)
    if arr.shape == (1,):
        arr = arr.reshape(())
    if arr.shape not in ((), (kv_heads,)):
        raise fail(f"{name} must be a scalar or have shape ({kv_heads},), got {tuple(arr.shape)}")
    if not np.all(np.isfinite(arr)) or not np.all(arr > 0):
        raise fail(f"{name} must be finite and positive")
    return arr


def _check_amx(storage: str, kernel_bs: int, head_dim: int) -> None:
    if storage != "bfloat16":
        raise fail(f"layout CPU_AMX holds bfloat16 only (vLLM's AMX kernels), got a {storage} cache")
    if kernel_bs % _AMX_GROUP or head_dim % _AMX_GROUP:
        raise fail(f"layout CPU_AMX needs block size and head_dim multiples of {_AMX_GROUP}, "
                    f"got {kernel_bs} and {head_dim}")


def _amx_blocks(halves: np.ndarray, kernel_bs: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """CPU_AMX halves ``(B, H, K|V, N*D)`` as K ``[B, H, N/16, D/2, 16 tokens, 2 dims]`` and
    V ``[B, H, D/16, N/2, 16 dims, 2 tokens]`` (views)."""
    n, h, g = halves.shape[0], halves.shape[1], _AMX_GROUP
    return (halves[:, :, 0].reshape(n, h, kernel_bs // g, head_dim // 2, g, 2),
            halves[:, :, 1].reshape(n, h, head_dim // g, kernel_bs // 2, g, 2))


# --- the layout table: per layout, its axes, how its content axis splits into K and V
# (checked against head_dim / v_head_dim), how blocks come out as (blocks, heads, tokens,
# content) sides, and how those sides' rows become keys, values and per-row scales.

def _cpu_dims(layout: str, cache: Any, shape: tuple[int, ...], head_dim: int | None, v_head_dim: int | None,
              quant: str, storage: str) -> tuple[int, int]:
    content = shape[3]
    if content % 2 or (head_dim not in (None, content // 2)) or (v_head_dim not in (None, content // 2)):
        raise fail(f"layout {layout} needs head_dim == v_head_dim == {content} / 2, "
                    f"got K {head_dim} and V {v_head_dim}")
    if not _dense_interior(cache):
        raise fail(f"layout {layout} needs each (block, head) of the cache dense in memory")
    if layout == "CPU_AMX":
        _check_amx(storage, shape[2], content // 2)
    return content // 2, content // 2


def _bhnc_dims(layout: str, cache: Any, shape: tuple[int, ...], head_dim: int | None, v_head_dim: int | None,
               quant: str, storage: str) -> tuple[int, int]:
    content = shape[3]
    extra = 2 * _SCALE_BYTES if quant == "fp8_per_token_head" else 0
    if head_dim is None:
        if (content - extra) % 2:
            raise fail(f"content axis {content} does not split into equal K and V halves")
        head_dim = (content - extra) // 2
    if v_head_dim is None:
        v_head_dim = content - extra - head_dim
    if quant == "fp8_per_token_head" and head_dim != v_head_dim:
        raise fail("fp8_per_token_head needs head_dim == v_head_dim")
    if head_dim <= 0 or v_head_dim <= 0 or head_dim + v_head_dim + extra != content:
        raise fail(f"content axis {content} != head_dim {head_dim} + v_head_dim {v_head_dim}"
                    + (f" + {extra} scale bytes" if extra else ""))
    return head_dim, v_head_dim


def _kv_dims(layout: str, cache: Any, shape: tuple[int, ...], head_dim: int | None, v_head_dim: int | None,
             quant: str, storage: str) -> tuple[int, int]:
    d = shape[4]
    head_dim = d if head_dim is None else head_dim
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    if head_dim != d or v_head_dim != d:
        raise fail(f"layout {layout} holds head_dim {d}, expected K {head_dim} and V {v_head_dim}")
    return head_dim, v_head_dim


def _whole(layout: str, blocks: np.ndarray, kernel_bs: int, head_dim: int) -> list[np.ndarray]:
    return [blocks]  # BHNC: already (B, H, N, K|V), one side holding both


def _cpu_sides(layout: str, blocks: np.ndarray, kernel_bs: int, head_dim: int) -> list[np.ndarray]:
    """K and V of CPU_ATTN blocks ``(B, H, N, 2D)`` as ``(B, H, N, D)`` each."""
    n, h = blocks.shape[0], blocks.shape[1]
    halves = np.ascontiguousarray(blocks).reshape(n, h, 2, kernel_bs * head_dim)  # (B, H, K|V, N*D)
    if layout == "CPU_KT_V":
        return [halves[:, :, 0].reshape(n, h, head_dim, kernel_bs).transpose(0, 1, 3, 2),  # K^T -> (B, H, N, D)
                halves[:, :, 1].reshape(n, h, kernel_bs, head_dim)]  # V: (B, H, N, D)
    k, v = _amx_blocks(halves, kernel_bs, head_dim)
    return [k.transpose(0, 1, 2, 4, 3, 5).reshape(n, h, kernel_bs, head_dim),
            v.transpose(0, 1, 3, 5, 2, 4).reshape(n, h, kernel_bs, head_dim)]


def _kv_sides(layout: str, blocks: np.ndarray, kernel_bs: int = 0, head_dim: int = 0) -> list[np.ndarray]:
    """K and V of a separate-K/V layout as ``(B, H, N, D)`` views each."""
    lay = _LAYOUTS[layout]
    assert lay.kv is not None
    order = [a - (a > lay.kv) for a in (lay.block, lay.head, lay.token, 4)]
    return [blocks[(slice(None),) * lay.kv + (i,)].transpose(order) for i in (0, 1)]


def _bhnc_split(rows: list[np.ndarray], head_dim: int, quant: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """BHNC cells ``(H, rows, C)`` as keys, values and (fp8_per_token_head) their scales."""
    cells, hd = rows[0], head_dim
    if quant != "fp8_per_token_head":
        return cells[..., :hd], cells[..., hd:], None, None
    ks_bytes = np.ascontiguousarray(cells[..., hd : hd + _SCALE_BYTES]).view(np.uint8)
    vs_bytes = np.ascontiguousarray(cells[..., 2 * hd + _SCALE_BYTES :]).view(np.uint8)
    return (cells[..., :hd], cells[..., hd + _SCALE_BYTES : 2 * hd + _SCALE_BYTES],
            ks_bytes.view("<f4")[..., 0].astype(np.float32), vs_bytes.view("<f4")[..., 0].astype(np.float32))


def _kv_split(rows: list[np.ndarray], head_dim: int, quant: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    return rows[0], rows[1], None, None


@dataclass(frozen=True)
class _Layout:
    """One row of the layout table (the logical axes of the tensor handed over)."""
    ndim: int
    kv: int | None  # the K/V axis (size 2), None where K and V share a block
    block: int
    head: int
    token: int
    dims: Callable[..., tuple[int, int]]  # content axis -> (head_dim, v_head_dim), checked
    sides: Callable[..., list[np.ndarray]]  # blocks -> (B, H, N, C) sides
    split: Callable[..., Any]  # the sides' rows -> keys, values, k_scale, v_scale


_LAYOUTS: dict[str, _Layout] = {
    "BHNC": _Layout(4, None, 0, 1, 2, _bhnc_dims, _whole, _bhnc_split),
    "CPU_KT_V": _Layout(4, None, 0, 1, 2, _cpu_dims, _cpu_sides, _kv_split),
    "CPU_AMX": _Layout(4, None, 0, 1, 2, _cpu_dims, _cpu_sides, _kv_split),
    "KBNHD": _Layout(5, 0, 1, 3, 2, _kv_dims, _kv_sides, _kv_split),
    "KBHND": _Layout(5, 0, 1, 2, 3, _kv_dims, _kv_sides, _kv_split),
    "BKNHD": _Layout(5, 1, 0, 3, 2, _kv_dims, _kv_sides, _kv_split),
    "BKHND": _Layout(5, 1, 0, 2, 3, _kv_dims, _kv_sides, _kv_split),
}


def _check_args(layout: str, quant: str, fp8_format: str) -> _Layout:
    if layout not in _LAYOUTS:
        raise fail(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
    if quant not in QUANTS:
        raise fail(f"unknown quant {quant!r} (known: {', '.join(QUANTS)})")
    if fp8_format not in FP8_FORMATS:
        raise fail(f"unknown fp8 format {fp8_format!r} (known: {', '.join(FP8_FORMATS)})")
    if quant == "fp8_per_token_head" and layout != "BHNC":
        raise fail("fp8_per_token_head exists only in the 'BHNC' layout")
    if layout in _CPU_LAYOUTS and quant != "none":
        raise fail(f"layout {layout} is read unquantized only (vLLM's CPU fp8 cache is not checked)")
    return _LAYOUTS[layout]


def _check_cache(cache: Any, layout: str, lay: _Layout, quant: str) -> tuple[tuple[int, ...], str]:
    """The cache's shape and storage dtype name, checked against the layout and quant."""
    if not is_torch(cache) and not isinstance(cache, np.ndarray):
        raise fail(f"cache must be a numpy array or a torch tensor, got {type(cache).__name__}")
    shape = tuple(int(s) for s in cache.shape)
    if len(shape) != lay.ndim:
        raise fail(f"layout {layout} needs a {lay.ndim}-d cache, got shape {shape}")
    if lay.kv is not None and shape[lay.kv] != 2:
        raise fail(f"layout {layout} needs size 2 on axis {lay.kv} (K, V), got shape {shape}")
    storage = storage_name(cache.dtype)
    if storage is None:
        raise fail(f"cache dtype {cache.dtype} is not a KV storage dtype")
    if (quant == "none") != (storage != "fp8"):
        raise fail(f"cache dtype {cache.dtype} does not fit quant {quant!r}")
    if 0 in shape:
        raise fail(f"cache has an empty axis: shape {shape}")
    return shape, storage


def _kernel_ratio(block_size: int, kernel_bs: int, kernel_blocks: int) -> int:
    """Kernel blocks per manager block (vLLM may cut a manager block into kernel blocks)."""
    check_block_size(block_size)
    if block_size % kernel_bs:
        raise fail(f"block_size {block_size} is not a multiple of the cache's {kernel_bs}-token blocks")
    ratio = block_size // kernel_bs
    if kernel_blocks % ratio:
        raise fail(f"{kernel_blocks} kernel blocks do not group into {block_size}-token blocks")
    return ratio


def _take_blocks(cache: Any, needed: np.ndarray, axis: int) -> np.ndarray:
    """Only the needed blocks, in host memory (a torch cache leaves its device for these alone)."""
    if not is_torch(cache):
        return np.take(cache, needed, axis=axis)
    import torch  # lazy

    idx = torch.as_tensor(needed, dtype=torch.long, device=cache.device)
    return torch_to_numpy(cache.index_select(axis, idx))


def gather_paged_kv(
    cache: Any,
    block_table: Any,
    *,
    start: int,
    stop: int,
    layout: str = "BHNC",
    head_dim: int | None = None,
    v_head_dim: int | None = None,
    block_size: int | None = None,
    quant: str = "none",
    fp8_format: str = "e4m3fn",
    k_scale: Any = None,
    v_scale: Any = None,
    null_block: int | None = NULL_BLOCK_ID,
) -> GatheredKV:
    """Rows ``[start, stop)`` of one layer from its paged cache, in token order.

    ``cache``: one layer's paged tensor in ``layout`` (see the module docstring).
    ``block_table``: the request's block ids in token order, in units of ``block_size``
    tokens (vLLM's *manager* block size). When the tensor's token axis is smaller
    (vLLM split each manager block into kernel blocks), manager block ``b`` is kernel
    blocks ``b * ratio ... b * ratio + ratio - 1``; ``block_size`` defaults to the
    tensor's token axis. ``head_dim`` / ``v_head_dim`` split the ``"BHNC"`` content
    axis (default: two equal halves). Raises :class:`DataError` on any inconsistency.
    """
    lay = _check_args(layout, quant, fp8_format)
    shape, storage = _check_cache(cache, layout, lay, quant)
    kernel_blocks, kv_heads, kernel_bs = shape[lay.block], shape[lay.head], shape[lay.token]
    head_dim, v_head_dim = lay.dims(layout, cache, shape, head_dim, v_head_dim, quant, storage)
    block_size = kernel_bs if block_size is None else block_size
    ratio = _kernel_ratio(block_size, kernel_bs, kernel_blocks)
    blocks, offsets = slots_from_block_table(
        block_table, block_size=block_size, start=start, stop=stop, num_blocks=kernel_blocks // ratio,
        null_block=null_block,
    )
    if quant == "fp8":
        ks, vs = _check_scale(k_scale, "k_scale", kv_heads), _check_scale(v_scale, "v_scale", kv_heads)
    elif k_scale is not None or v_scale is not None:
        raise fail(f"quant {quant!r} takes no external k_scale / v_scale")
    needed, compact = np.unique(blocks * ratio + offsets // kernel_bs, return_inverse=True)
    sides = lay.sides(layout, _take_blocks(cache, needed, lay.block), kernel_bs, head_dim)
    koff = offsets % kernel_bs
    rows = [np.ascontiguousarray(s[compact, :, koff].transpose(1, 0, 2)) for s in sides]  # (H, rows, C)
    keys, values, k_out, v_out = lay.split(rows, head_dim, quant)
    if quant == "fp8":
        k_out, v_out = ks, vs
    if storage == "fp8":
        keys, values = keys.view(np.uint8), values.view(np.uint8)
    return GatheredKV(
        keys=np.ascontiguousarray(keys),
        values=np.ascontiguousarray(values),
        first_row=int(start),
        dtype=storage,
        quant=quant,
        fp8_format=fp8_format if storage == "fp8" else None,
        k_scale=k_out,
        v_scale=v_out,
    )


def gather_slots(cache: Any, slots: Any, *, block_size: int | None = None, **kw: Any) -> GatheredKV:
    """Rows at vLLM slot ids (``slot = block * block_size + offset``), in the given order.

    A convenience over :func:`gather_paged_kv` for callers that hold a slot mapping: the
    slots must be consecutive blocks' worth of one request (checked by rebuilding the
    block table they imply).
    """
    s = as_index_array(slots, "slot mapping")
    layout = kw.get("layout", "BHNC")
    if layout not in _LAYOUTS:
        raise fail(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
    bs = block_size or int(cache.shape[_LAYOUTS[layout].token])
    if s.size == 0:
        return gather_paged_kv(cache, [], start=0, stop=0, block_size=bs, **kw)
    if s.min() < 0:
        raise fail(f"slot mapping holds a negative slot {int(s.min())}")
    # Position i of the request lives at slots[i]; rebuild the table block by block.
    first = int(s[0] % bs)
    positions = np.arange(s.size) + first
    table_len = int((positions[-1]) // bs) + 1
    table = np.full(table_len, -1, dtype=np.int64)
    j = positions // bs
    table[j] = s // bs
    if np.any(table[j] * bs + positions % bs != s):
        raise fail("slot mapping is not token-ordered slots of consecutive blocks")
    return gather_paged_kv(cache, table, start=first, stop=first + s.size, block_size=bs, **kw)


def scatter_rows(
    cache: np.ndarray,
    block_table: Sequence[int],
    keys: np.ndarray,
    values: np.ndarray,
    *,
    start: int = 0,
    layout: str = "BHNC",
    block_size: int | None = None,
) -> None:
    """Write rows into a paged numpy cache in place (the inverse of :func:`gather_paged_kv`
    for unquantized layouts; used by tests and simulations, never on the hot path)."""
    lay = _LAYOUTS[layout]
    kernel_bs = cache.shape[lay.token]
    bs = block_size or kernel_bs
    ratio = bs // kernel_bs
    table = np.asarray(block_table, dtype=np.int64)
    pos = np.arange(start, start + keys.shape[1])
    kb = table[pos // bs] * ratio + (pos % bs) // kernel_bs
    ko = pos % kernel_bs
    if layout in _CPU_LAYOUTS:  # per (block, head): K then V, packed as the layout says
        _scatter_cpu(cache, layout, kb, ko, keys, values)
    elif layout == "BHNC":
        hd = keys.shape[2]
        cache[kb, :, ko, :hd] = keys.transpose(1, 0, 2)
        cache[kb, :, ko, hd:] = values.transpose(1, 0, 2)
    else:
        for canon, rows in zip(_kv_sides(layout, cache), (keys, values)):  # (B, H, N, D) views
            canon[kb, :, ko] = rows.transpose(1, 0, 2)


def _scatter_cpu(cache: np.ndarray, layout: str, kb: np.ndarray, ko: np.ndarray, keys: np.ndarray,
                 values: np.ndarray) -> None:
    if not cache.flags.c_contiguous:
        raise fail(f"scatter_rows writes a {layout} cache only when it is C-contiguous")
    n_blocks, heads, n, c = cache.shape
    d = c // 2
    halves = cache.reshape(n_blocks, heads, 2, n * d)  # a view of the dense cache
    if layout == "CPU_KT_V":  # K^T [D, N] then V [N, D]
        k_t = halves[:, :, 0].reshape(n_blocks, heads, d, n)
        v_r = halves[:, :, 1].reshape(n_blocks, heads, n, d)
        for i, (b, o) in enumerate(zip(kb, ko)):
            k_t[b, :, :, o] = keys[:, i]
            v_r[b, :, o] = values[:, i]
        return
    k6, v6 = _amx_blocks(halves, n, d)
    g = _AMX_GROUP
    for i, (b, o) in enumerate(zip(kb, ko)):
        k6[b, :, o // g, :, o % g, :] = keys[:, i].reshape(heads, d // 2, 2)
        v6[b, :, :, o // 2, :, o % 2] = values[:, i].reshape(heads, d // g, g)


# layer_rows_for, slots_from_block_table and storage_name live in .blocks; named here too,
# as the readers of this module have always found them.
__all__ = ["LAYOUTS", "NULL_BLOCK_ID", "QUANTS", "GatheredKV", "gather_paged_kv", "gather_slots", "layer_rows_for",
           "scatter_rows", "slots_from_block_table", "storage_name"]


def gather_latent_rows(cache: Any, block_table: Any, *, start: int, stop: int, rank: int, block_size: int
                       ) -> GatheredKV:
    """An MLA layer's rows ``[start, stop)`` as kvpack ``latent`` rows: vLLM's MLA backends
    (CPU_MLA, AMX_MLA, and the GPU ones in source) keep one token-major row of ``rank + rope``
    elements a slot, ``[latent after kv_a_layernorm | rope key, rotated, interleaved pairs]``,
    the cache ``(num_blocks, [1,] block_size, rank + rope)``: keys ``(1, n, rank)`` = the
    latents, values ``(1, n, rope)`` = the rope keys, bit for bit (kvpack's own order)."""
    check_block_size(block_size)
    shape = tuple(int(s) for s in cache.shape)
    if len(shape) == 4 and shape[1] == 1:
        shape = (shape[0], shape[2], shape[3])
    if len(shape) != 3 or shape[1] != block_size or shape[2] <= rank:
        raise fail(f"an MLA cache of shape {tuple(cache.shape)} is not (blocks, [1,] {block_size}, {rank} + rope)")
    if is_torch(cache) and not cache.is_contiguous():
        raise fail("the MLA cache is not contiguous: its rows are not token-major")
    storage = storage_name(cache.dtype)
    if storage not in ("float16", "float32", "bfloat16"):
        raise fail(f"MLA cache dtype {cache.dtype} is not read (fp8 MLA caches are refused)")
    blocks, offsets = slots_from_block_table(block_table, block_size=block_size, start=start, stop=stop,
                                             num_blocks=shape[0])
    flat = cache.reshape(shape[0] * shape[1], shape[2])
    slots = blocks * block_size + offsets
    if is_torch(flat):
        import torch  # lazy: a torch cache in hand

        rows = torch_to_numpy(flat.index_select(0, torch.as_tensor(slots, dtype=torch.long, device=flat.device)))
    else:
        rows = np.take(flat, slots, axis=0)
    rows = np.ascontiguousarray(rows)
    return GatheredKV(keys=np.ascontiguousarray(rows[None, :, :rank]), values=np.ascontiguousarray(rows[None, :, rank:]),
                      first_row=int(start), dtype=storage)
