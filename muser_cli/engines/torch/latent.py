"""Latent (MLA) layers on the torch engine: DeepSeek-V3's multi-head latent attention.

transformers 5.24's ``DeepseekV3Attention`` writes its cache while the KV is still
compressed: ``cache.update(kv_nope, k_rot)`` with ``kv_nope`` the latent after
``kv_a_layernorm`` (``(1, 1, n, kv_lora_rank)``) and ``k_rot`` the shared RoPE key after
the rotary (``(1, 1, n, qk_rope_head_dim)``), then expands both to per-head K and V with
its own ``kv_b_proj`` on every step (``expand_kv``). That is exactly a kvpack 1.3
``latent`` layer (docs/kvpack.md 1.4): a one-head row layer whose "keys" are the latents
and whose "values" the rope keys. So the engine's producer extracts, and its consumer
installs, those rows into transformers' own cache unchanged, and transformers' own forward
expands them: the consumer's expanded K and V are the producer's, bit for bit, because the
same weights expand the same latent bytes on the same shapes.

:func:`check_layout` refuses a transformers whose MLA attention would cache something else
(an older one cached the expanded K and V). :func:`expand` is the one definition of the
latent -> expanded conversion (the model's own ``expand_kv``, i.e. its ``kv_b_proj``; never
the other way), for a consumer or a check that needs per-head K and V.
"""

from __future__ import annotations

from typing import Any

import torch

from muser_cli.engines.torch.arrays import to_torch
from muser_cli.errors import ConfigError, DataError
from muser_cli.kvpack.layers import LayerKV

LATENT_PARTS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")


# The rope key's order. With ``rope_interleave`` (DeepSeek-V3's weights pair rotary dims
# (0, 1), (2, 3), ...) transformers rotates the even and the odd dims and caches them side by
# side, ``[even dims, odd dims]`` (``apply_rotary_pos_emb_interleave``); the pack carries the
# key in the model's own order (pairs interleaved, RoPE style "interleaved", as mlx-lm and
# vLLM cache it). The two are a permutation of the same values, moved without arithmetic.

def deinterleaves(model: Any) -> bool:
    """Whether transformers caches this model's rope keys de-interleaved (``rope_interleave``)."""
    return bool(getattr(model.config.get_text_config(decoder=True), "rope_interleave", False))


def rope_to_pack(t: torch.Tensor) -> torch.Tensor:
    """transformers' ``[even dims, odd dims]`` -> the pack's interleaved order (a copy)."""
    half = t.shape[-1] // 2
    return torch.stack((t[..., :half], t[..., half:]), dim=-1).reshape(t.shape)


def rope_from_pack(t: torch.Tensor) -> torch.Tensor:
    """The pack's interleaved order -> transformers' ``[even dims, odd dims]`` (a copy)."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def to_pack(engine: Any, index: int, values: torch.Tensor) -> torch.Tensor:
    """A layer's cached values as the pack carries them (a latent layer's rope keys reordered)."""
    return rope_to_pack(values) if engine._rope_order and engine.info.layers[index].kind == "latent" else values


def from_pack(engine: Any, index: int, values: torch.Tensor) -> torch.Tensor:
    """A pack's values of a layer as transformers caches them (the inverse of :func:`to_pack`)."""
    return rope_from_pack(values) if engine._rope_order and engine.info.layers[index].kind == "latent" else values


def attentions(model: Any) -> list[Any]:
    """The model's attention modules, one a decoder layer (the text model's own ``layers``)."""
    return [layer.self_attn for layer in model.model.layers]


def check_layout(engine: Any) -> bool:
    """Every latent layer of ``engine.info.layers`` is an MLA attention of transformers that
    caches the latent (``kv_lora_rank`` = the spec's head_dim) and the rope key
    (``qk_rope_head_dim`` = its v_head_dim), and expands them itself (``expand_kv``). Returns
    whether its rope keys are cached de-interleaved (:func:`deinterleaves`)."""
    mods = attentions(engine.model)
    reordered = deinterleaves(engine.model)
    style = "interleaved" if reordered else "rotate_half"
    if len(mods) != len(engine.info.layers):
        raise ConfigError(f"model {engine.info.name}: transformers built {len(mods)} layers, config.json describes "
                          f"{len(engine.info.layers)}")
    for index, (spec, attn) in enumerate(zip(engine.info.layers, mods)):
        if spec.kind != "latent":
            continue
        missing = [p for p in LATENT_PARTS if not isinstance(getattr(attn, p, None), torch.nn.Module)]
        if missing or not callable(getattr(attn, "expand_kv", None)):
            raise ConfigError(
                f"model {engine.info.name}: layer {index}'s attention ({type(attn).__name__}) does not cache the "
                f"latent (missing {', '.join(missing) or 'expand_kv'})",
                hint="the torch engine moves MLA with transformers >= 5.24, whose attention caches the latent")
        built = (int(attn.kv_lora_rank), int(attn.qk_rope_head_dim))
        if built != (spec.head_dim, spec.v_head_dim):
            raise ConfigError(f"model {engine.info.name}: layer {index} caches latent {built[0]} + rope {built[1]}, "
                              f"config.json describes {spec.head_dim} + {spec.v_head_dim}")
        if spec.rope is not None and spec.rope.style != style:
            raise ConfigError(f"model {engine.info.name}: layer {index}'s rope key is {style}, config.json describes "
                              f"{spec.rope.style}")
    return reordered


def expand(engine: Any, index: int, kv: LayerKV, *, chunk_tokens: int | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``index``'s per-head K ``(heads, n, qk_nope + qk_rope)`` and V ``(heads, n, v_head_dim)``
    from its latent rows, with the model's own up-projection (``expand_kv``: ``kv_b_proj`` then
    the shared rope key beside each head's nope part). ``chunk_tokens``: expand that many rows
    at a time (the matmul shapes of a producer that expanded chunk by chunk); default all at once,
    as transformers' attention does over the cache it reads."""

    if engine.info.layers[index].kind != "latent":
        raise DataError(f"layer {index} is not a latent layer")
    attn = attentions(engine.model)[index]
    latents = to_torch(kv.keys, engine.torch_dtype).unsqueeze(0)  # (1, 1, n, rank)
    ropes = from_pack(engine, index, to_torch(kv.values, engine.torch_dtype)).unsqueeze(0)  # (1, 1, n, rope)
    n = latents.shape[2]
    step = n if not chunk_tokens else max(1, int(chunk_tokens))
    keys, values = [], []
    with engine._session():
        for lo in range(0, max(n, 1), step):
            k, v = attn.expand_kv(latents[:, :, lo:lo + step], ropes[:, :, lo:lo + step])
            keys.append(k[0])
            values.append(v[0])
    return torch.cat(keys, dim=1), torch.cat(values, dim=1)
