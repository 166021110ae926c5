"""Between mlx-lm's caches and kvpack rows: where a sliding layer's ring stands.

Full layers are mlx-lm ``KVCache``; sliding layers ``RotatingKVCache`` (``max_size ==
window``, ``keep == 0``) whose ring is stored in physical order, while a kvpack carries a
sliding layer's last ``window - 1`` rows in temporal order. :func:`install_rotating`
reproduces the ring mlx-lm itself reaches after a prefill (next write slot:
:func:`ring_slot`); :func:`temporal` un-rotates a ring; :func:`cut_rows` reduces rows to
what a pack of a shorter prefix would carry. mlx is imported only when a cache is read.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from muser_cli.errors import DataError
from muser_cli.kvpack.layers import LayerKV, LayerSpec, StateKV


def ring_slot(rows: int, window: int, chunk_tokens: int) -> int:
    """The slot mlx-lm's RotatingKVCache writes next after prefilling ``rows >= window`` tokens
    in chunks of ``chunk_tokens``; the ``window - 1`` rows it keeps follow that slot, oldest first.

    Multi-token chunks leave the rows in temporal order and the next write trims to the window
    and wraps to slot 0. A last chunk of one token was itself written at slot 0, so the next
    write goes to slot 1. One-token chunks throughout put position p at slot p % window.
    """
    if chunk_tokens == 1:
        return rows % window
    if rows % chunk_tokens == 1 and rows - 1 >= window:
        return 1
    return 0


def install_rotating(mx: Any, cache: Any, keys: Any, values: Any, rows: int, chunk_tokens: int) -> None:
    """Put a sliding layer's last ``window - 1`` rows (temporal order) into a RotatingKVCache
    in the physical state mlx-lm reaches itself after prefilling ``rows`` tokens.

    Not yet wrapped (rows < window): rows in order, next write at slot ``rows``. Wrapped: a
    ring of ``window`` slots whose next-write slot (:func:`ring_slot`) holds a spare row and
    is followed by the carried rows, oldest first: a single-token write replaces the spare,
    then the oldest row, and so on, exactly as in the producer's own cache.
    """
    window = cache.max_size
    held = keys.shape[2]
    if rows < window:
        cache.state = (keys, values, rows, 0, window, held)
        return
    slot = ring_slot(rows, window, chunk_tokens)
    spare_k = mx.zeros((*keys.shape[:2], 1, keys.shape[3]), keys.dtype)
    spare_v = mx.zeros((*values.shape[:2], 1, values.shape[3]), values.dtype)
    ring_k = mx.concatenate([spare_k, keys], axis=2)  # temporal ring starting at the spare
    ring_v = mx.concatenate([spare_v, values], axis=2)
    if slot:  # rotate so that the spare sits at ``slot``
        ring_k = mx.concatenate([ring_k[..., window - slot :, :], ring_k[..., : window - slot, :]], axis=2)
        ring_v = mx.concatenate([ring_v[..., window - slot :, :], ring_v[..., : window - slot, :]], axis=2)
    cache.state = (ring_k, ring_v, rows, 0, window, slot or window)


def temporal(cache: Any) -> tuple[Any, Any]:
    """(keys, values) of an mlx-lm cache, oldest row first: (1, kv_heads, held, head_dim)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache

    if isinstance(cache, ChunkedKVCache):  # llama4's chunked layers: rows [start_position, offset)
        return cache.keys_and_values()
    if not isinstance(cache, RotatingKVCache):
        return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
    keys, values, offset, keep, _, idx = cache.state
    if keep:
        raise DataError("a rotating cache with kept sink rows is not a sliding window")
    size = keys.shape[2]
    if idx == size:
        return keys, values
    if idx < offset:  # wrapped: slots [idx, size) are older than [0, idx)
        return (mx.concatenate([keys[..., idx:, :], keys[..., :idx, :]], axis=2),
                mx.concatenate([values[..., idx:, :], values[..., :idx, :]], axis=2))
    return keys[..., :idx, :], values[..., :idx, :]


def cut_rows(specs: Sequence[LayerSpec], layers: Sequence[LayerKV], rows: int, start: int) -> list[LayerKV]:
    """``layers`` (covering [0, rows)) reduced to what a pack of [0, start) would carry."""
    if len(layers) != len(specs):
        raise DataError(f"{len(layers)} layers of KV for a model with {len(specs)} layers")
    out: list = []
    for index, (spec, kv) in enumerate(zip(specs, layers)):
        if spec.kind == "state":  # its snapshot at ``start`` (none at 0)
            snap = kv.at(start) if start else {}
            if snap is None:
                raise DataError(f"layer {index} (state): no snapshot at position {start} to recompute from")
            out.append(StateKV(tensors=snap, position=start))
            continue
        begin = start - spec.carried_rows(start)
        held = int(np.shape(kv.keys)[1])
        if begin < kv.first_row or start > kv.first_row + held:
            raise DataError(
                f"layer {index} ({spec.kind}): recomputing from position {start} needs rows [{begin}, {start}), "
                f"the KV holds [{kv.first_row}, {kv.first_row + held})",
                hint="a sliding layer carries only its last window - 1 rows; start at the end of the KV")
        a, b = begin - kv.first_row, start - kv.first_row
        out.append(LayerKV(keys=np.asarray(kv.keys)[:, a:b], values=np.asarray(kv.values)[:, a:b], first_row=begin))
    return out
