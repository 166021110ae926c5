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
from typing import Any, Sequence

import numpy as np

from muser_cli.engines.vllm.fp8 import FP8_FORMATS
from muser_cli.errors import DataError

LAYOUTS = ("BHNC", "CPU_KT_V", "CPU_AMX", "KBNHD", "KBHND", "BKNHD", "BKHND")
QUANTS = ("none", "fp8", "fp8_per_token_head")
NULL_BLOCK_ID = 0  # vLLM's BlockPool reserves block 0 as the null block

# Per layout: (ndim, kv axis or None, block axis, head axis, token axis).
_AXES: dict[str, tuple[int, int | None, int, int, int]] = {
    "BHNC": (4, None, 0, 1, 2),
    "CPU_KT_V": (4, None, 0, 1, 2),
    "CPU_AMX": (4, None, 0, 1, 2),
    "KBNHD": (5, 0, 1, 3, 2),
    "KBHND": (5, 0, 1, 2, 3),
    "BKNHD": (5, 1, 0, 3, 2),
    "BKHND": (5, 1, 0, 2, 3),
}
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


def _fail(msg: str) -> DataError:
    return DataError(msg.replace("\n", " "))


def _is_torch(x: Any) -> bool:
    return not isinstance(x, np.ndarray) and hasattr(x, "detach") and hasattr(x, "index_select")


def _torch_to_numpy(t: Any) -> np.ndarray:
    """A CPU copy of a torch tensor as numpy; bfloat16 -> uint16 bits, fp8 -> uint8 bits."""
    import torch  # lazy: only reached with a torch tensor in hand

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    if t.dtype in tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz") if hasattr(torch, n)):
        return t.contiguous().view(torch.uint8).numpy()
    return t.numpy()


def _as_index_array(x: Any, what: str) -> np.ndarray:
    if _is_torch(x):
        x = _torch_to_numpy(x)
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError):
        raise _fail(f"{what} is not an array of integers") from None
    if arr.ndim != 1:
        raise _fail(f"{what} must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise _fail(f"{what} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def _dense_interior(cache: Any) -> bool:
    """Whether each ``cache[b, h]`` (a ``(block_size, C)`` slab) is one dense run of memory."""
    n, c = int(cache.shape[2]), int(cache.shape[3])
    if _is_torch(cache):
        st = tuple(int(x) for x in cache.stride())
        return (c == 1 or st[3] == 1) and (n == 1 or st[2] == c)
    item = cache.dtype.itemsize
    return (c == 1 or cache.strides[3] == item) and (n == 1 or cache.strides[2] == c * item)


def storage_name(dtype: Any) -> str | None:
    """Storage dtype name of a cache (numpy dtype or torch dtype)."""
    text = str(dtype).replace("torch.", "")
    return {
        "float16": "float16",
        "float32": "float32",
        "bfloat16": "bfloat16",
        "uint16": "bfloat16",  # numpy carries bfloat16 as raw 16-bit words
        "uint8": "fp8",
        "int8": "fp8",
        "float8_e4m3fn": "fp8",
        "float8_e5m2": "fp8",
        "float8_e4m3fnuz": "fp8",
    }.get(text)


def _check_scale(scale: Any, name: str, kv_heads: int) -> np.ndarray:
    if scale is None:
        raise _fail(f"quant 'fp8' needs {name}")
    arr = _torch_to_numpy(scale) if _is_torch(scale) else np.asarray(scale)
    if arr.dtype.kind not in "fiu":
        raise _fail(f"{name} must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(np.float32)
    if arr.shape == (1,):
        arr = arr.reshape(())
    if arr.shape not in ((), (kv_heads,)):
        raise _fail(f"{name} must be a scalar or have shape ({kv_heads},), got {tuple(arr.shape)}")
    if not np.all(np.isfinite(arr)) or not np.all(arr > 0):
        raise _fail(f"{name} must be finite and positive")
    return arr


def slots_from_block_table(
    block_table: Any,
    *,
    block_size: int,
    start: int,
    stop: int,
    num_blocks: int,
    null_block: int | None = NULL_BLOCK_ID,
) -> tuple[np.ndarray, np.ndarray]:
    """(block ids, in-block offsets) of positions ``[start, stop)`` under ``block_table``.

    Every table entry must be a valid block id (null blocks included: a sliding-window
    table holds the null block for blocks wholly before the window); the entries that
    cover ``[start, stop)`` must be distinct and must not be the null block.
    """
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size <= 0:
        raise _fail(f"block_size must be a positive integer, got {block_size!r}")
    for name, value in (("start", start), ("stop", stop)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise _fail(f"{name} must be an integer, got {value!r}")
    if not 0 <= start <= stop:
        raise _fail(f"row range [{start}, {stop}) is not a valid range")
    table = _as_index_array(block_table, "block table")
    if table.size and (table.min() < 0 or table.max() >= num_blocks):
        bad = int(table[(table < 0) | (table >= num_blocks)][0])
        raise _fail(f"block table holds block id {bad}, outside [0, {num_blocks})")
    if stop > table.size * block_size:
        raise _fail(
            f"block table holds {table.size} blocks ({table.size * block_size} slots) "
            f"but rows up to {stop} were requested"
        )
    positions = np.arange(start, stop, dtype=np.int64)
    if positions.size == 0:
        return positions, positions
    first_j, last_j = start // block_size, (stop - 1) // block_size
    used = table[first_j : last_j + 1]
    if null_block is not None and np.any(used == null_block):
        j = first_j + int(np.argmax(used == null_block))
        raise _fail(
            f"position {max(start, j * block_size)} maps to the null block {null_block} "
            f"(block table entry {j}): its KV is not in the cache"
        )
    if np.unique(used).size != used.size:
        raise _fail(f"block table maps rows [{start}, {stop}) to a block id more than once")
    return table[positions // block_size], positions % block_size


def _check_amx(storage: str, kernel_bs: int, head_dim: int) -> None:
    if storage != "bfloat16":
        raise _fail(f"layout CPU_AMX holds bfloat16 only (vLLM's AMX kernels), got a {storage} cache")
    if kernel_bs % _AMX_GROUP or head_dim % _AMX_GROUP:
        raise _fail(f"layout CPU_AMX needs block size and head_dim multiples of {_AMX_GROUP}, "
                    f"got {kernel_bs} and {head_dim}")


def _amx_blocks(halves: np.ndarray, kernel_bs: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """CPU_AMX halves ``(B, H, K|V, N*D)`` as K ``[B, H, N/16, D/2, 16 tokens, 2 dims]`` and
    V ``[B, H, D/16, N/2, 16 dims, 2 tokens]`` (views)."""
    n, h, g = halves.shape[0], halves.shape[1], _AMX_GROUP
    return (halves[:, :, 0].reshape(n, h, kernel_bs // g, head_dim // 2, g, 2),
            halves[:, :, 1].reshape(n, h, head_dim // g, kernel_bs // 2, g, 2))


def _cpu_sides(layout: str, taken: np.ndarray, kernel_bs: int, head_dim: int) -> list[np.ndarray]:
    """K and V of CPU_ATTN blocks ``(B, H, N, 2D)`` as ``(B, H, N, D)`` each."""
    n, h = taken.shape[0], taken.shape[1]
    halves = np.ascontiguousarray(taken).reshape(n, h, 2, kernel_bs * head_dim)  # (B, H, K|V, N*D)
    if layout == "CPU_KT_V":
        return [halves[:, :, 0].reshape(n, h, head_dim, kernel_bs).transpose(0, 1, 3, 2),  # K^T -> (B, H, N, D)
                halves[:, :, 1].reshape(n, h, kernel_bs, head_dim)]  # V: (B, H, N, D)
    k, v = _amx_blocks(halves, kernel_bs, head_dim)
    return [k.transpose(0, 1, 2, 4, 3, 5).reshape(n, h, kernel_bs, head_dim),
            v.transpose(0, 1, 3, 5, 2, 4).reshape(n, h, kernel_bs, head_dim)]


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
    if layout not in _AXES:
        raise _fail(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
    if quant not in QUANTS:
        raise _fail(f"unknown quant {quant!r} (known: {', '.join(QUANTS)})")
    if fp8_format not in FP8_FORMATS:
        raise _fail(f"unknown fp8 format {fp8_format!r} (known: {', '.join(FP8_FORMATS)})")
    if quant == "fp8_per_token_head" and layout != "BHNC":
        raise _fail("fp8_per_token_head exists only in the 'BHNC' layout")
    if layout in _CPU_LAYOUTS and quant != "none":
        raise _fail(f"layout {layout} is read unquantized only (vLLM's CPU fp8 cache is not checked)")
    torch_in = _is_torch(cache)
    if not torch_in and not isinstance(cache, np.ndarray):
        raise _fail(f"cache must be a numpy array or a torch tensor, got {type(cache).__name__}")
    shape = tuple(int(s) for s in cache.shape)
    ndim, kv_axis, b_axis, h_axis, n_axis = _AXES[layout]
    if len(shape) != ndim:
        raise _fail(f"layout {layout} needs a {ndim}-d cache, got shape {shape}")
    if kv_axis is not None and shape[kv_axis] != 2:
        raise _fail(f"layout {layout} needs size 2 on axis {kv_axis} (K, V), got shape {shape}")
    storage = storage_name(cache.dtype)
    if storage is None:
        raise _fail(f"cache dtype {cache.dtype} is not a KV storage dtype")
    if (quant == "none") != (storage != "fp8"):
        raise _fail(f"cache dtype {cache.dtype} does not fit quant {quant!r}")
    kernel_blocks, kv_heads, kernel_bs = shape[b_axis], shape[h_axis], shape[n_axis]
    if 0 in shape:
        raise _fail(f"cache has an empty axis: shape {shape}")

    # Content split.
    if layout in _CPU_LAYOUTS:
        content = shape[3]
        if content % 2 or (head_dim not in (None, content // 2)) or (v_head_dim not in (None, content // 2)):
            raise _fail(f"layout {layout} needs head_dim == v_head_dim == {content} / 2, "
                        f"got K {head_dim} and V {v_head_dim}")
        head_dim = v_head_dim = content // 2
        if not _dense_interior(cache):
            raise _fail(f"layout {layout} needs each (block, head) of the cache dense in memory")
        if layout == "CPU_AMX":
            _check_amx(storage, kernel_bs, head_dim)
    elif layout == "BHNC":
        content = shape[3]
        extra = 2 * _SCALE_BYTES if quant == "fp8_per_token_head" else 0
        if head_dim is None:
            if (content - extra) % 2:
                raise _fail(f"content axis {content} does not split into equal K and V halves")
            head_dim = (content - extra) // 2
        if v_head_dim is None:
            v_head_dim = content - extra - head_dim
        if quant == "fp8_per_token_head" and head_dim != v_head_dim:
            raise _fail("fp8_per_token_head needs head_dim == v_head_dim")
        if head_dim <= 0 or v_head_dim <= 0 or head_dim + v_head_dim + extra != content:
            raise _fail(
                f"content axis {content} != head_dim {head_dim} + v_head_dim {v_head_dim}"
                + (f" + {extra} scale bytes" if extra else "")
            )
    else:
        d = shape[4]
        if head_dim is None:
            head_dim = d
        if v_head_dim is None:
            v_head_dim = head_dim
        if head_dim != d or v_head_dim != d:
            raise _fail(f"layout {layout} holds head_dim {d}, expected K {head_dim} and V {v_head_dim}")

    # Manager blocks vs kernel blocks.
    if block_size is None:
        block_size = kernel_bs
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size <= 0:
        raise _fail(f"block_size must be a positive integer, got {block_size!r}")
    if block_size % kernel_bs:
        raise _fail(f"block_size {block_size} is not a multiple of the cache's {kernel_bs}-token blocks")
    ratio = block_size // kernel_bs
    if kernel_blocks % ratio:
        raise _fail(f"{kernel_blocks} kernel blocks do not group into {block_size}-token blocks")
    num_blocks = kernel_blocks // ratio

    blocks, offsets = slots_from_block_table(
        block_table, block_size=block_size, start=start, stop=stop, num_blocks=num_blocks, null_block=null_block
    )
    if quant == "fp8":
        ks = _check_scale(k_scale, "k_scale", kv_heads)
        vs = _check_scale(v_scale, "v_scale", kv_heads)
    elif k_scale is not None or v_scale is not None:
        raise _fail(f"quant {quant!r} takes no external k_scale / v_scale")
    kblocks = blocks * ratio + offsets // kernel_bs
    koff = offsets % kernel_bs

    # Bring only the needed blocks to host memory, then index them there.
    needed, compact = np.unique(kblocks, return_inverse=True)
    if torch_in:
        import torch  # lazy

        idx = torch.as_tensor(needed, dtype=torch.long, device=cache.device)
        taken = _torch_to_numpy(cache.index_select(b_axis, idx))
    else:
        taken = np.take(cache, needed, axis=b_axis)
    # Canonical order: (blocks, heads, tokens, content) per side.
    if layout in _CPU_LAYOUTS:
        sides = _cpu_sides(layout, taken, kernel_bs, head_dim)
    elif layout == "BHNC":
        sides = [taken]
    else:
        order = (b_axis, h_axis, n_axis, 4)
        sides = [np.take(taken, i, axis=kv_axis).transpose([a - (a > kv_axis) for a in order]) for i in (0, 1)]
    rows = [np.ascontiguousarray(s[compact, :, koff].transpose(1, 0, 2)) for s in sides]  # (H, rows, C)

    k_out: np.ndarray | None = None
    v_out: np.ndarray | None = None
    if layout == "BHNC":
        cells = rows[0]
        if quant == "fp8_per_token_head":
            hd = head_dim
            keys = cells[..., :hd]
            ks_bytes = np.ascontiguousarray(cells[..., hd : hd + _SCALE_BYTES]).view(np.uint8)
            values = cells[..., hd + _SCALE_BYTES : 2 * hd + _SCALE_BYTES]
            vs_bytes = np.ascontiguousarray(cells[..., 2 * hd + _SCALE_BYTES :]).view(np.uint8)
            k_out = ks_bytes.view("<f4")[..., 0].astype(np.float32)
            v_out = vs_bytes.view("<f4")[..., 0].astype(np.float32)
        else:
            keys = cells[..., :head_dim]
            values = cells[..., head_dim:]
    else:  # CPU_KT_V, CPU_AMX and the separate-K/V layouts
        keys, values = rows
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
    s = _as_index_array(slots, "slot mapping")
    layout = kw.get("layout", "BHNC")
    if layout not in _AXES:
        raise _fail(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
    bs = block_size or int(cache.shape[_AXES[layout][4]])
    if s.size == 0:
        return gather_paged_kv(cache, [], start=0, stop=0, block_size=bs, **kw)
    if s.min() < 0:
        raise _fail(f"slot mapping holds a negative slot {int(s.min())}")
    # Position i of the request lives at slots[i]; rebuild the table block by block.
    first = int(s[0] % bs)
    positions = np.arange(s.size) + first
    table_len = int((positions[-1]) // bs) + 1
    table = np.full(table_len, -1, dtype=np.int64)
    j = positions // bs
    table[j] = s // bs
    if np.any(table[j] * bs + positions % bs != s):
        raise _fail("slot mapping is not token-ordered slots of consecutive blocks")
    return gather_paged_kv(cache, table, start=first, stop=first + s.size, block_size=bs, **kw)


def layer_rows_for(kind: str, window: int | None, total_rows: int) -> tuple[int, int]:
    """``(first_row, stop)`` a kvpack carries for a layer after ``total_rows`` positions:
    full attention every row, a sliding window its last ``window - 1`` rows."""
    if kind == "sliding":
        if window is None or window < 1:
            raise _fail(f"sliding layer needs a positive window, got {window!r}")
        return max(0, total_rows - (window - 1)), total_rows
    if kind != "full":
        raise _fail(f"unknown layer kind {kind!r}")
    return 0, total_rows


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
    ndim, kv_axis, b_axis, h_axis, n_axis = _AXES[layout]
    kernel_bs = cache.shape[n_axis]
    bs = block_size or kernel_bs
    ratio = bs // kernel_bs
    table = np.asarray(block_table, dtype=np.int64)
    pos = np.arange(start, start + keys.shape[1])
    kb = table[pos // bs] * ratio + (pos % bs) // kernel_bs
    ko = pos % kernel_bs
    if layout in _CPU_LAYOUTS:  # per (block, head): K then V, packed as the layout says
        _scatter_cpu(cache, layout, kb, ko, keys, values)
        return
    if layout == "BHNC":
        hd = keys.shape[2]
        cache[kb, :, ko, :hd] = keys.transpose(1, 0, 2)
        cache[kb, :, ko, hd:] = values.transpose(1, 0, 2)
        return
    for side, rows in ((0, keys), (1, values)):
        idx: list[Any] = [slice(None)] * ndim
        idx[kv_axis] = side
        sub = cache[tuple(idx)]  # a view
        order = [a - (a > kv_axis) for a in (b_axis, h_axis, n_axis, 4)]
        canon = sub.transpose(order)  # (B, H, N, D) view
        canon[kb, :, ko] = rows.transpose(1, 0, 2)


def _scatter_cpu(cache: np.ndarray, layout: str, kb: np.ndarray, ko: np.ndarray, keys: np.ndarray,
                 values: np.ndarray) -> None:
    if not cache.flags.c_contiguous:
        raise _fail(f"scatter_rows writes a {layout} cache only when it is C-contiguous")
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
