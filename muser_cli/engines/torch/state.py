"""Recurrent state layers (kvpack 1.3 ``state``) on transformers' own cache layers.

transformers 5.24 and 5.25 keep a gated DeltaNet (qwen3_next) or Mamba-2 (granitemoehybrid) layer
in its unified ``DynamicCache`` as a ``LinearAttentionLayer``: ``conv_states[0]`` of shape
``(1, channels, kernel)`` -- the last ``kernel`` conv inputs -- and ``recurrent_states[0]``
(``(1, heads, k_dim, v_dim)`` / ``(1, heads, head_dim, d_state)``, float32 whatever the
model's dtype). Both models' forwards read the held state on every later forward: a one-token
step through ``causal_conv1d_update`` (the window's oldest column only feeds an output it
drops) and a multi-token one by prepending the held window (``update_conv_state``) and
passing the recurrent matrix as the chunked scan's initial state -- so an installed
snapshot is continued by transformers' own code, and a prefill that resumes at a chunk
boundary runs exactly the chunks the canonical schedule runs.

A snapshot (docs/kvpack.md 1.4) is the conv window less its oldest column, ``(channels,
kernel - 1)``, and the recurrent matrix, both float32 (:data:`muser_cli.model.config.STATE_DTYPE`:
a bfloat16 window widens exactly). Installing pads the window back to ``kernel`` columns
with a zero column no step reads.

During a prefill the engine records each state layer's snapshot at every chunk end
(:func:`record`): a whole pack carries one per chunk (docs/kvpack.md 2.5) and a streamed
one sends each as its chunk ends.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from muser_cli.errors import DataError
from muser_cli.kvpack.layers import DTYPES, LayerSpec, StateKV, resume_snapshot

_SNAPS = "_muser_state_snapshots"  # the cache attribute holding {position: {layer: tensors}}


def is_state_layer(layer: Any) -> bool:
    """Whether a transformers cache layer keeps recurrent state (no rows)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return isinstance(layer, LinearAttentionCacheLayerMixin)


def state_indices(specs: Sequence[LayerSpec]) -> list[int]:
    return [i for i, spec in enumerate(specs) if spec.kind == "state"]


def snapshot(cache: Any, index: int, spec: LayerSpec) -> dict[str, np.ndarray]:
    """Layer ``index``'s state as the spec's tensors (fresh float32 arrays): zeros before its
    first forward (the state after no positions)."""
    layer = cache.layers[index]
    want = {t.name: t for t in spec.tensors}
    if set(want) != {"conv", "recurrent"} or any(t.dtype != "float32" for t in spec.tensors):
        raise DataError(f"layer {index}: a {spec.mixer} state of {sorted(want)} is not what this engine keeps")
    if not layer.has_previous_state[0]:
        return {t.name: np.zeros(t.shape, dtype=DTYPES[t.dtype][1]) for t in spec.tensors}
    conv = layer.conv_states[0][0, :, 1:]  # (channels, kernel - 1): the columns a next step reads
    out = {"conv": conv.to(torch.float32).numpy().copy(),
           "recurrent": layer.recurrent_states[0][0].to(torch.float32).numpy().copy()}
    for name, arr in out.items():
        if tuple(arr.shape) != want[name].shape:
            raise DataError(f"layer {index}: transformers holds a {name} state of {tuple(arr.shape)}, "
                            f"config.json describes {want[name].shape}")
    return out


def record(cache: Any, specs: Sequence[LayerSpec], position: int) -> None:
    """Keep every state layer's snapshot at ``position`` (a chunk end) on ``cache``."""
    indices = state_indices(specs)
    if indices:
        held = cache.__dict__.setdefault(_SNAPS, {})
        held[position] = {i: snapshot(cache, i, specs[i]) for i in indices}


def recorded(cache: Any, index: int, position: int) -> dict[str, np.ndarray] | None:
    return cache.__dict__.get(_SNAPS, {}).get(position, {}).get(index)


def rows_of(cache: Any, index: int, spec: LayerSpec, lo: int, hi: int, n: int) -> tuple[dict, None]:
    """What a frame writer takes for a state frame ending at ``hi`` (``n``: the positions the
    cache has seen; an earlier chunk end: its recorded snapshot): ``(tensors, None)``."""
    got = recorded(cache, index, hi)
    if got is None and hi == n:
        got = snapshot(cache, index, spec)
    if got is None:
        raise DataError(f"layer {index}: no state snapshot at {hi} in a cache at {n}")
    return got, None


def extract(cache: Any, index: int, spec: LayerSpec, n: int) -> StateKV:
    """The layer's snapshot at ``n`` with every one recorded before it (``earlier``)."""
    earlier = {p: snaps[index] for p, snaps in cache.__dict__.get(_SNAPS, {}).items() if p != n and index in snaps}
    last = recorded(cache, index, n)
    return StateKV(tensors=last if last is not None else snapshot(cache, index, spec), position=n, earlier=earlier)


def install(cache: Any, index: int, spec: LayerSpec, kv: Any, rows: int, dtype: torch.dtype, kernel: int) -> None:
    """Put a snapshot at ``rows`` into transformers' own layer ``index`` of a fresh ``cache``:
    the conv window padded back to ``kernel`` columns (in the model's ``dtype``), the recurrent
    matrix in float32, and the layer marked as holding a previous state."""
    kv = resume_snapshot(kv, index, spec, rows)
    if kv is None:
        return
    conv = torch.from_numpy(np.array(kv.tensors["conv"], dtype=np.float32)).to(dtype)
    if conv.shape[-1] != kernel - 1:
        raise DataError(f"layer {index}: a conv window of {conv.shape[-1]} columns for a kernel of {kernel}")
    window = torch.nn.functional.pad(conv, (1, 0)).unsqueeze(0)  # (1, channels, kernel)
    recurrent = torch.from_numpy(np.array(kv.tensors["recurrent"], dtype=np.float32)).unsqueeze(0)
    set_state(cache.layers[index], window, recurrent, kernel=kernel, rows=rows)
    held = cache.__dict__.setdefault(_SNAPS, {})  # a prefill resumed here carries them into its pack
    for position, tensors in {**kv.earlier, rows: kv.tensors}.items():
        held.setdefault(position, {})[index] = tensors


def set_state(layer: Any, conv: torch.Tensor, recurrent: torch.Tensor, *, kernel: int, rows: int) -> None:
    """Put a conv window and a recurrent matrix (batch first: one sequence's, or a batch's)
    into transformers' linear-attention cache ``layer``, marked as holding a previous state as
    of ``rows`` positions."""
    layer.lazy_initialization(conv_states=conv, state_idx=0, conv_kernel_size=kernel)
    layer.lazy_initialization(recurrent_states=recurrent, state_idx=0)
    layer.conv_states[0].copy_(conv)
    layer.recurrent_states[0].copy_(recurrent)
    layer.has_previous_state[0] = True
    # transformers 5.25 counts a linear layer's positions itself (``get_seq_length`` of a hybrid
    # whose layer 0 is a state layer reads it: generate's positions and masks); 5.24 has no counter.
    counter = getattr(layer, "cumulative_length_linear", None)
    if isinstance(counter, torch.Tensor):
        counter.fill_(rows)


def conv_kernel(config: Any) -> int:
    """The conv kernel width of a hybrid's state layers, from its transformers config."""
    text = config.get_text_config(decoder=True)
    for key in ("linear_conv_kernel_dim", "mamba_d_conv"):
        value = getattr(text, key, None)
        if isinstance(value, int):
            return value
    raise DataError(f"{type(text).__name__} names no conv kernel width for its state layers")
