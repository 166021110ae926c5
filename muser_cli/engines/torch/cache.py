"""A transformers cache whose full-attention layers are sized once.

transformers' ``DynamicLayer`` grows by ``torch.cat`` on every update, so each generated
token copies the layer's whole K and V: at 8,064 tokens of context on the embedded model
that is ~370 MB moved per token, more than the attention itself reads. A
:class:`SizedLayer` holds one buffer per K and V with room for the prompt and every token
decode may add, writes each update in place, and hands attention a view of the rows held
so far — the same values, in the same ``(batch, heads, rows, head_dim)`` shape, so the
model computes the same numbers (``tests/engines/test_torch_cache.py`` checks the bits).

A buffer can also be *adopted*: rows that already sit in a numpy array with spare room
after them (a streamed pack's rows, placed frame by frame as they verified) become the
cache without a copy. Sliding-window layers keep transformers' own layer: they hold at
most ``window - 1`` rows, so their growth is bounded.

A producer's sliding layers are :class:`RingLayer`: transformers' sliding layer that keeps
``extra`` more of its oldest rows (a kvpack's ``ring_extra``) but hands attention exactly
the rows transformers' own would, so every number computed is the same.

This module imports transformers at the top; :mod:`muser_cli.engines.torch.engine`
imports it only when a cache is built.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from muser_cli.engines.torch.state import is_state_layer


class SizedLayer(DynamicLayer):
    """A full-attention layer backed by buffers of ``capacity`` rows (grown by doubling only
    if a caller writes past them, which :func:`sized_cache` callers never do)."""

    def __init__(self, capacity: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.capacity = max(1, int(capacity))
        self.buffer_dtype = dtype  # the buffers' (None: the first update's); updates are cast into it
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, rows: int) -> None:
        """Use ``keys``/``values`` (``(1, heads, capacity, dim)``, the first ``rows`` rows
        filled) as this layer's buffers, without copying them."""
        self.device = keys.device
        self._k, self._v = keys, values
        self.capacity = keys.shape[-2]
        self.length = rows
        self.keys, self.values = keys[..., :rows, :], values[..., :rows, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if self._k is None or end > self._k.shape[-2]:
            self._grow(key_states, value_states, end)
        assert self._k is not None and self._v is not None
        self._k[..., start:end, :].copy_(key_states)
        self._v[..., start:end, :].copy_(value_states)
        self.length = end
        self.keys, self.values = self._k[..., :end, :], self._v[..., :end, :]
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, need: int) -> None:
        cap = max(need, self.capacity if self._k is None else 2 * self._k.shape[-2])
        dtype = self.buffer_dtype or key_states.dtype
        k = torch.empty((*key_states.shape[:-2], cap, key_states.shape[-1]), dtype=dtype, device=key_states.device)
        v = torch.empty((*value_states.shape[:-2], cap, value_states.shape[-1]), dtype=dtype,
                        device=value_states.device)
        if self._k is not None and self.length:
            k[..., : self.length, :].copy_(self._k[..., : self.length, :])
            v[..., : self.length, :].copy_(self._v[..., : self.length, :])  # type: ignore[index]
        self._k, self._v = k, v
        self.capacity = cap

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)
        assert self._k is not None and self._v is not None
        self.keys, self.values = self._k[..., : self.length, :], self._v[..., : self.length, :]

    def reset(self) -> None:
        self._k = self._v = None
        self.length = 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:  # not used by muser; kept honest
        raise NotImplementedError("a sized cache holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a sized cache holds one sequence")


class RingLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer that keeps its last ``window - 1 + extra`` rows.

    ``update`` hands attention the rows transformers' own layer would (its last ``window -
    1`` held rows, then the new ones: the same tensors, so the same numbers); only what is
    kept afterwards is ``extra`` rows longer. Masks come from ``cumulative_length``, which
    is unchanged. Prefill only: a decoding cache needs no more than ``window - 1``."""

    def __init__(self, sliding_window: int, extra: int) -> None:
        super().__init__(sliding_window=sliding_window)
        self.extra = int(extra)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        ring = self.sliding_window - 1
        held_k, held_v = self.keys, self.values  # an empty 1-D tensor before the first update
        if held_k.dim() == 4:
            start = max(0, held_k.shape[-2] - ring)  # what transformers holds (none when window is 1)
            held_k, held_v = held_k[:, :, start:, :], held_v[:, :, start:, :]
        full_k = torch.cat([held_k, key_states], dim=-2)
        full_v = torch.cat([held_v, value_states], dim=-2)
        keep = ring + self.extra
        self.keys = torch.cat([self.keys, key_states], dim=-2)[:, :, -keep:, :]
        self.values = torch.cat([self.values, value_states], dim=-2)[:, :, -keep:, :]
        return full_k, full_v

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a prefill ring is never cropped")


def sized_cache(config: Any, capacity: int, dtype: torch.dtype | None = None, *, ring_extra: int = 0) -> Any:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`SizedLayer`
    of ``capacity`` rows in ``dtype``; sliding layers stay transformers' own, or are
    :class:`RingLayer` keeping ``ring_extra`` more rows when that is > 0."""
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = SizedLayer(capacity, dtype)
    return with_ring(cache, ring_extra)


def with_ring(cache: Any, ring_extra: int) -> Any:
    """``cache`` with its sliding layers replaced by :class:`RingLayer` (``ring_extra`` > 0)."""
    if ring_extra > 0:
        for i, layer in enumerate(cache.layers):
            if type(layer) is DynamicSlidingWindowLayer:
                cache.layers[i] = RingLayer(layer.sliding_window, ring_extra)
    return cache


def built_layout(model: Any, cache: Any | None = None) -> list[tuple[str, int | None]]:
    """The cache layers transformers builds for ``model`` (in ``cache``, a fresh
    ``DynamicCache(config=model.config)`` by default): (kind, window or chunk size) each. A
    chunked-attention layer is transformers' sliding layer of the chunk's size (only its mask
    differs); a recurrent-state layer has no size."""

    cache = DynamicCache(config=model.config) if cache is None else cache
    types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []
    built = [("state", None) if is_state_layer(layer) else
             ("sliding", getattr(layer, "sliding_window", None)) if getattr(layer, "is_sliding", False) else ("full", None)
             for layer in cache.layers]
    return [("chunked", b[1]) if i < len(types) and types[i] == "chunked_attention" and b[0] == "sliding" else b
            for i, b in enumerate(built)]


def described_layout(specs: Any) -> list[tuple[str, int | None]]:
    """What ``specs`` say transformers builds, as :func:`built_layout` reports it: a latent
    (MLA) layer is a full layer of latent rows to transformers, a state layer has no size."""
    return [("full", None) if spec.kind == "latent" else (spec.kind, None) if spec.kind == "state" else
            (spec.kind, spec.chunk if spec.kind == "chunked" else spec.window) for spec in specs]
