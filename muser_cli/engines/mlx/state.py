"""Recurrent state layers (kvpack 1.3 ``state``) on mlx-lm's own ``ArraysCache``.

mlx-lm 0.32 keeps a qwen3_next gated DeltaNet layer and a granitemoehybrid Mamba-2 layer in
an ``ArraysCache(size=2)``: ``cache[0]`` the conv window, ``(1, kernel - 1, channels)`` (the
last inputs, in the model's dtype), ``cache[1]`` the recurrent matrix, float32 --
``(1, heads, v_dim, k_dim)`` for gated DeltaNet, ``(1, heads, head_dim, d_state)`` for
Mamba-2. A kvpack snapshot is ``conv`` ``(channels, kernel - 1)`` and ``recurrent`` as
transformers holds it (``(heads, k_dim, v_dim)`` / ``(heads, head_dim, d_state)``), float32:
this module transposes between the two. Both models' forwards continue from the held arrays
on any later call (one token or many), so installing a snapshot is all a decode needs.

During a prefill the engine records each state layer's snapshot at every chunk end
(``snaps``: position -> layer -> tensors), as the torch engine does.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from muser_cli.errors import DataError
from muser_cli.kvpack.layers import LayerSpec, StateKV, resume_snapshot

_TRANSPOSED = {"gated_delta_net": True, "mamba2": False}  # mlx-lm's recurrent matrix: last two axes swapped


def _transposed(spec: LayerSpec, index: int) -> bool:
    if spec.mixer not in _TRANSPOSED or {t.name for t in spec.tensors} != {"conv", "recurrent"}:
        raise DataError(f"layer {index}: the mlx engine keeps no {spec.mixer!r} state of {[t.name for t in spec.tensors]}")
    return _TRANSPOSED[spec.mixer]


def is_state_cache(cache: Any) -> bool:
    from mlx_lm.models.cache import ArraysCache

    return type(cache) is ArraysCache


def snapshot(cache: Any, index: int, spec: LayerSpec) -> dict[str, np.ndarray]:
    """The layer's state as the spec's tensors (fresh float32 arrays; zeros before its first step)."""
    import mlx.core as mx

    swap = _transposed(spec, index)
    shapes = {t.name: t.shape for t in spec.tensors}
    if cache[0] is None or cache[1] is None:
        return {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    conv = np.array(cache[0][0].astype(mx.float32)).T
    rec = np.array(cache[1][0].astype(mx.float32))
    out = {"conv": np.ascontiguousarray(conv), "recurrent": np.ascontiguousarray(rec.swapaxes(-1, -2) if swap else rec)}
    for name, arr in out.items():
        if arr.shape != shapes[name]:
            raise DataError(f"layer {index}: mlx-lm holds a {name} state of {arr.shape}, config.json describes "
                            f"{shapes[name]}")
    return out


def record(snaps: dict, caches: Sequence[Any], specs: Sequence[LayerSpec], position: int) -> None:
    """Keep every state layer's snapshot at ``position`` (a chunk end) in ``snaps``."""
    got = {i: snapshot(caches[i], i, spec) for i, spec in enumerate(specs) if spec.kind == "state"}
    if got:
        snaps[position] = got


def rows_of(snaps: dict, caches: Sequence[Any], index: int, spec: LayerSpec, hi: int, n: int) -> tuple[dict, None]:
    """A frame writer's state frame ending at ``hi``: the snapshot there, ``(tensors, None)``."""
    got = snaps.get(hi, {}).get(index)
    if got is None and hi == n:
        got = snapshot(caches[index], index, spec)
    if got is None:
        raise DataError(f"layer {index}: no state snapshot at {hi} in a cache at {n}")
    return got, None


def extract(snaps: dict, cache: Any, index: int, spec: LayerSpec, n: int) -> StateKV:
    earlier = {p: got[index] for p, got in snaps.items() if p != n and index in got}
    last = snaps.get(n, {}).get(index)
    return StateKV(tensors=last if last is not None else snapshot(cache, index, spec), position=n, earlier=earlier)


def install(snaps: dict, cache: Any, index: int, spec: LayerSpec, kv: Any, rows: int, dtype: Any) -> None:
    """Put a snapshot at ``rows`` into mlx-lm's own ``ArraysCache`` (conv in the model's
    ``dtype``, the recurrent matrix in float32) and keep it, with the ones before it, in ``snaps``."""
    import mlx.core as mx

    kv = resume_snapshot(kv, index, spec, rows)
    if kv is None:
        return
    conv = np.ascontiguousarray(np.asarray(kv.tensors["conv"], np.float32).T)[None]
    rec = np.asarray(kv.tensors["recurrent"], np.float32)
    rec = np.ascontiguousarray(rec.swapaxes(-1, -2) if _transposed(spec, index) else rec)[None]
    cache[0] = mx.array(conv).astype(dtype)
    cache[1] = mx.array(rec)
    for position, tensors in {**kv.earlier, rows: kv.tensors}.items():
        snaps.setdefault(position, {})[index] = tensors
