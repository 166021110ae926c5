"""vLLM block tables as rows: which (block, slot) holds a position, which rows a layer
keeps, and arrays handed over as numpy or torch (read by duck typing: torch is imported
only with a torch tensor in hand). The paged caches themselves are read in :mod:`.gather`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from muser_cli.errors import DataError
from muser_cli.kvpack.layers import LOCAL_KINDS

NULL_BLOCK_ID = 0  # vLLM's BlockPool reserves block 0 as the null block


def fail(msg: str) -> DataError:
    return DataError(msg.replace("\n", " "))


def is_torch(x: Any) -> bool:
    return not isinstance(x, np.ndarray) and hasattr(x, "detach") and hasattr(x, "index_select")


def torch_to_numpy(t: Any) -> np.ndarray:
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


def as_index_array(x: Any, what: str) -> np.ndarray:
    if is_torch(x):
        x = torch_to_numpy(x)
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError):
        raise fail(f"{what} is not an array of integers") from None
    if arr.ndim != 1:
        raise fail(f"{what} must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise fail(f"{what} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


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


def check_block_size(block_size: Any) -> None:
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size <= 0:
        raise fail(f"block_size must be a positive integer, got {block_size!r}")


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
    check_block_size(block_size)
    for name, value in (("start", start), ("stop", stop)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise fail(f"{name} must be an integer, got {value!r}")
    if not 0 <= start <= stop:
        raise fail(f"row range [{start}, {stop}) is not a valid range")
    table = as_index_array(block_table, "block table")
    if table.size and (table.min() < 0 or table.max() >= num_blocks):
        bad = int(table[(table < 0) | (table >= num_blocks)][0])
        raise fail(f"block table holds block id {bad}, outside [0, {num_blocks})")
    if stop > table.size * block_size:
        raise fail(
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
        raise fail(
            f"position {max(start, j * block_size)} maps to the null block {null_block} "
            f"(block table entry {j}): its KV is not in the cache"
        )
    if np.unique(used).size != used.size:
        raise fail(f"block table maps rows [{start}, {stop}) to a block id more than once")
    return table[positions // block_size], positions % block_size


def layer_rows_for(kind: str, window: int | None, total_rows: int, chunk: int | None = None) -> tuple[int, int]:
    """``(first_row, stop)`` a kvpack carries for a layer after ``total_rows`` positions:
    full attention every row, a sliding window its last ``window - 1`` rows, a chunked
    layer (``chunk``: its attention chunk) the rows of the current chunk."""
    if kind == "sliding":
        if window is None or window < 1:
            raise fail(f"sliding layer needs a positive window, got {window!r}")
        return max(0, total_rows - (window - 1)), total_rows
    if kind == "chunked":
        if chunk is None or chunk < 1:
            raise fail(f"chunked layer needs a positive chunk, got {chunk!r}")
        return (total_rows // chunk) * chunk, total_rows
    if kind not in ("full", "latent", "state"):  # latent: every row; state: the positions its snapshots absorb
        raise fail(f"unknown layer kind {kind!r}")
    return 0, total_rows


def carried_range(spec: Any, total_rows: int, history: bool = False) -> tuple[int, int]:
    """:func:`layer_rows_for` of a LayerSpec; with the ``history`` (the connector's setting) a
    sliding or chunked layer carries every row."""
    if history and spec.kind in LOCAL_KINDS:
        return 0, total_rows
    return layer_rows_for(spec.kind, spec.window, total_rows, spec.chunk)
