"""The torch engine's masked one-step recompute (:meth:`TorchEngine.recompute_at`): the rows
of several positions, each from the installed rows before it, in one forward with a custom
mask. A hybrid model's layer types each get their own mask (the window, the chunk), over a
cache whose every layer holds its rows from position 0 (the pack's sliding history).

Functions of a loaded :class:`muser_cli.engines.torch.engine.TorchEngine` (``engine``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from muser_cli.engines.torch import latent
from muser_cli.engines.torch.arrays import to_numpy, view_torch
from muser_cli.errors import UsageError
from muser_cli.kvpack.layers import LayerKV

# Model types whose transformers forward takes ``attention_mask`` as a mapping from layer
# type to mask (``causal_mask_mapping := attention_mask``), read in the pinned modelling code.
MASK_MAPPING_TYPES = frozenset({"gemma2", "gemma3_text", "cohere2", "gpt_oss", "llama4_text", "exaone4",
                                "muse_glimmer_text"})


def recompute_at(engine: Any, layers: Sequence[LayerKV], *, rows: int, positions: Sequence[int],
                 token_ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """:meth:`TorchEngine.recompute_at`."""
    hybrid = any(spec.kind not in ("full", "latent") for spec in engine.info.layers)  # latent: full rows
    if hybrid and not recomputes_at_hybrid(engine, layers, rows):
        raise UsageError("recompute_at on this model needs every layer's rows from position 0 (the sliding "
                         "history) and per-type masks")
    ids = engine._check_ids(token_ids)
    pos = torch.tensor([int(p) for p in positions], dtype=torch.long)
    if len(ids) != len(pos) or not ids or int(pos.min()) < 0 or int(pos.max()) >= rows:
        raise UsageError(f"recompute_at: {len(pos)} positions in [0, {rows}) for {len(ids)} tokens")
    m = len(ids)
    with engine._session():
        if hybrid:
            cache = _install_whole(engine, layers, rows, extra=m)
            mask: Any = {t: _mask_at(engine, _attention_of(engine, t), pos, rows) for t in set(_layer_types(engine))}
        else:
            cache = engine._install(layers, rows, extra=m, adopt=True)
            mask = _mask_at(engine, ("full", None), pos, rows)
        engine.model(input_ids=torch.tensor([ids], dtype=torch.long), position_ids=pos[None], attention_mask=mask,
                     use_cache=True, logits_to_keep=1, **{engine._cache_kw: cache})
        return [(to_numpy(layer.keys[0, :, rows : rows + m]),
                 to_numpy(latent.to_pack(engine, i, layer.values[0, :, rows : rows + m])))
                for i, layer in enumerate(cache.layers)]


def recomputes_at_hybrid(engine: Any, layers: Sequence[LayerKV], rows: int) -> bool:
    """:meth:`TorchEngine.recomputes_at_hybrid`."""
    if engine.info.architecture not in MASK_MAPPING_TYPES and _model_type(engine) not in MASK_MAPPING_TYPES:
        return False
    types = _layer_types(engine)
    if len(types) != len(engine.info.layers) or any(_attention_of(engine, t)[0] is None for t in set(types)):
        return False
    return all(l.first_row == 0 and l.keys.shape[1] >= rows for l in layers)


def _model_type(engine: Any) -> str:
    return str(getattr(engine.model.config.get_text_config(decoder=True), "model_type", ""))


def _layer_types(engine: Any) -> list[str]:
    return list(getattr(engine.model.config.get_text_config(decoder=True), "layer_types", None) or [])


def _attention_of(engine: Any, layer_type: str) -> tuple[str | None, int | None]:
    """(kind, window or chunk) of the layers of ``layer_type``, from the pack's own specs."""
    kinds = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}
    kind = kinds.get(layer_type)
    specs = [s for s, t in zip(engine.info.layers, _layer_types(engine)) if t == layer_type]
    if kind is None or not specs or any(s.kind != kind for s in specs):
        return None, None
    sizes = {s.window if kind == "sliding" else s.chunk if kind == "chunked" else None for s in specs}
    return (kind, sizes.pop()) if len(sizes) == 1 else (None, None)


def _mask_at(engine: Any, attention: tuple[str | None, int | None], pos: "torch.Tensor", rows: int) -> "torch.Tensor":
    """The mask of ``len(pos)`` queries at positions ``pos`` over ``rows`` installed rows and
    themselves: rows before each position (within its window, or its chunk), and itself."""
    kind, size = attention
    r = torch.arange(rows + len(pos))[None, :]
    allowed = r < pos[:, None]
    if kind == "sliding":
        allowed &= r > pos[:, None] - int(size)
    elif kind == "chunked":
        allowed &= r >= (pos[:, None] // int(size)) * int(size)
    allowed[:, rows:] = torch.eye(len(pos), dtype=torch.bool)
    mask = allowed[None, None]
    if getattr(engine.model.config, "_attn_implementation", "sdpa") == "eager":
        low = torch.finfo(engine.torch_dtype).min
        mask = torch.zeros(mask.shape, dtype=engine.torch_dtype).masked_fill(~mask, low)
    return mask


def _install_whole(engine: Any, layers: Sequence[LayerKV], rows: int, *, extra: int) -> Any:
    """A cache whose every layer, sliding and chunked ones too, holds rows [0, rows) whole
    (the masks, not the cache, then keep each within its window), with room for ``extra``."""
    from transformers import DynamicCache

    from muser_cli.engines.torch.cache import SizedLayer  # lazy: pulls transformers

    cache = DynamicCache()
    cache.layers = [SizedLayer(rows + extra, engine.torch_dtype) for _ in engine.info.layers]
    for index, kv in enumerate(layers):
        keys = view_torch(kv.keys[:, :rows]).unsqueeze(0)
        values = view_torch(kv.values[:, :rows]).unsqueeze(0)
        cache.update(keys, values, index)
    return cache
