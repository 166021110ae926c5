"""A kvpack as a transformers ``DynamicCache``, and back (``muser_cli.to_transformers`` /
``muser_cli.from_transformers``).

The cache a kvpack becomes holds prompt[:-1], exactly as the torch engine installs it:
full layers every row, sliding layers (``DynamicSlidingWindowLayer``) their last
``window - 1`` rows with ``cumulative_length`` set to the absolute length, so masks and
positions are those of the producer's live cache. ``model.generate`` given the *whole*
prompt and this cache runs only the last prompt token, then continues: the tokens
``muser decode`` gives (greedy, same dtype).

Going back, a ``DynamicCache`` that covers prompt[:-1] (or the whole prompt, on models
without sliding layers: the last row is then left to the consumer) becomes a kvpack bound
to the model folder's fingerprints and the prompt's token ids. Imports torch.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, BinaryIO, Sequence

from muser_cli.errors import DataError, UsageError
from muser_cli.kvpack import KVPack, LayerKV, read_pack, write_pack
from muser_cli.kvpack.layers import ring_tail
from muser_cli.model.binding import require_identity
from muser_cli.model.info import ModelInfo
from muser_cli.model.resolve import resolve_model
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS, build_header, check_chunk, check_prompt


def _model_info(model: Any, info: ModelInfo | str | os.PathLike | None) -> ModelInfo:
    """The :class:`ModelInfo` of the folder ``model`` was loaded from (or ``info``)."""

    if isinstance(info, ModelInfo):
        return info
    if info is not None:
        return resolve_model(info)
    if isinstance(model, (str, os.PathLike)):
        return resolve_model(model)
    ref = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if ref and Path(ref).is_dir():
        return resolve_model(ref)
    raise UsageError("cannot tell which model folder this transformers model was loaded from",
                     hint="pass info=<model folder> (its fingerprint binds the pack)")


def _read(pack: Any) -> KVPack:
    if isinstance(pack, KVPack):
        return pack
    if isinstance(pack, (bytes, bytearray, memoryview)):
        return read_pack(io.BytesIO(bytes(pack)))
    if isinstance(pack, (str, os.PathLike)):
        with open(pack, "rb") as f:
            return read_pack(f)
    if hasattr(pack, "read"):
        return read_pack(pack)
    raise UsageError(f"not a kvpack: {type(pack).__name__} (pass a path, bytes, a binary file or a KVPack)")


def _no_state(specs: Sequence[Any]) -> None:
    """Refuse state layers by name importing a cache: rows (and latent rows) only (issue 27)."""
    if any(spec.kind == "state" for spec in specs):
        raise DataError("the transformers cache import carries rows only, not state layers",
                        hint="muser prefill moves them")


def _size(spec: Any) -> int | None:
    """The window of a sliding layer, the chunk of a chunked one (None for a full one)."""
    return spec.chunk if spec.kind == "chunked" else spec.window


def to_transformers(pack: Any, model: Any, *, info: ModelInfo | str | os.PathLike | None = None) -> Any:
    """A ``DynamicCache`` holding a verified kvpack's rows (prompt[:-1]) for ``model``.

    ``pack``: a path, bytes, binary file or :class:`~muser_cli.kvpack.KVPack`. The pack
    must be for the model folder ``model`` was loaded from (fingerprints and layer
    descriptions checked; ``info`` names the folder when the model does not). Continue with
    ``model.generate(input_ids=<the whole prompt>, past_key_values=cache, ...)``.

    A v1.2 pack's extra ring rows (``ring_extra``) are dropped: transformers' sliding layer
    holds ``window - 1`` rows. A pack made by :func:`from_transformers` carries no extra
    rows (such a cache holds none), so its consumers' spot-check covers the layers up to
    the first sliding one only.
    """
    import torch
    from transformers import DynamicCache

    from muser_cli.engines.torch.arrays import chunk_ring, to_torch  # lazy: pulls torch
    from muser_cli.engines.torch.cache import built_layout, described_layout  # lazy: pulls torch, transformers
    from muser_cli.engines.torch.latent import deinterleaves, rope_from_pack  # lazy: pulls torch

    p = _read(pack)
    header = p.header
    minfo = _model_info(model, info)
    require_identity(header, minfo)
    if header.rows_start or header.base is not None:
        raise DataError(f"a delta pack (rows from position {header.rows_start}) is not a whole cache",
                        hint="merge it with its base first (muser decode does)")
    built, described = built_layout(model), described_layout(header.layers)
    if built != described:
        raise DataError(f"the pack's layers {described} differ from the cache layers transformers builds {built}")
    rows = header.rows_end
    dtype = getattr(model, "dtype", torch.float32)
    device = getattr(model, "device", torch.device("cpu"))
    cache = DynamicCache(config=model.config)
    for index, (spec, kv) in enumerate(zip(header.layers, p.layers)):
        if spec.kind == "state":  # a recurrent layer: its newest snapshot, into transformers' own layer
            from muser_cli.engines.torch import state  # lazy: pulls torch

            state.install(cache, index, spec, kv, rows, dtype, state.conv_kernel(model.config))
            continue
        kv = ring_tail(kv, rows - spec.carried_rows(rows), rows)  # ring_extra rows: not part of this cache
        keys = to_torch(kv.keys, dtype).unsqueeze(0).to(device)  # (1, kv_heads, carried, head_dim)
        values = to_torch(kv.values, dtype).unsqueeze(0).to(device)
        if spec.kind == "latent" and deinterleaves(model):  # transformers caches an MLA rope key de-interleaved
            values = rope_from_pack(values)
        if spec.kind == "chunked":  # as transformers holds it: rows of earlier chunks (masked) as zeros
            keys, values = chunk_ring(keys, values, rows, spec.chunk)
        cache.update(keys, values, index)
        if spec.kind in ("sliding", "chunked"):
            cache.layers[index].cumulative_length = rows  # absolute length, not rows held
    return cache


def _ids(token_ids: Any) -> list[int]:
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    if token_ids and isinstance(token_ids[0], (list, tuple)):
        if len(token_ids) != 1:
            raise UsageError(f"a kvpack holds one prompt; got a batch of {len(token_ids)}")
        token_ids = token_ids[0]
    return [int(t) for t in token_ids]


def cache_layers(cache: Any, specs: Sequence[Any], token_ids: Sequence[int], *, rope_deinterleaved: bool = False
                 ) -> tuple[list[LayerKV], str]:
    """The rows a kvpack of ``token_ids`` carries, read from a ``DynamicCache``; (layers, dtype).
    ``rope_deinterleaved``: latent layers' rope keys are cached de-interleaved (an MLA model with
    ``rope_interleave``, :func:`muser_cli.engines.torch.latent.deinterleaves`); the pack gets them interleaved."""
    import torch

    from muser_cli.engines.torch.arrays import to_numpy  # lazy: pulls torch
    from muser_cli.engines.torch.latent import rope_to_pack  # lazy: pulls torch

    layers = getattr(cache, "layers", None)
    if layers is None:
        raise UsageError(f"not a transformers DynamicCache: {type(cache).__name__}")
    _no_state(specs)
    if len(layers) != len(specs):
        raise DataError(f"the cache has {len(layers)} layers, the model {len(specs)}")
    tokens = len(token_ids)
    rows = tokens - 1
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    out: list[LayerKV] = []
    dtype = None
    for index, (spec, layer) in enumerate(zip(specs, layers)):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None or keys.dim() != 4:
            raise DataError(f"layer {index} of the cache holds no rows")
        if keys.shape[0] != 1:
            raise UsageError(f"a kvpack holds one prompt; the cache has a batch of {keys.shape[0]}")
        sliding = bool(getattr(layer, "is_sliding", False))  # a chunked layer too: transformers' sliding layer
        if (spec.kind in ("sliding", "chunked")) != sliding or (sliding and getattr(layer, "sliding_window", None)
                                                                 != _size(spec)):
            raise DataError(f"layer {index}: the cache layer is {'sliding' if sliding else 'full'}, "
                            f"the model describes {spec.kind}")
        held = keys.shape[2]
        total = int(layer.get_seq_length())
        if total not in (rows, tokens):
            raise DataError(f"the cache holds {total} positions, the prompt is {tokens} tokens",
                            hint=f"the cache must cover the prompt ({tokens}) or all but its last token ({rows})")
        if tuple(keys.shape[1::2]) != (spec.kv_heads, spec.head_dim) or tuple(values.shape[1::2]) != (
                spec.kv_heads, spec.v_head_dim):
            raise DataError(f"layer {index}: K {tuple(keys.shape)} V {tuple(values.shape)}, the model has "
                            f"{spec.kv_heads} KV heads of dims {spec.head_dim}/{spec.v_head_dim}")
        name = names.get(keys.dtype)
        if name is None or values.dtype != keys.dtype or (dtype is not None and name != dtype):
            raise DataError(f"layer {index}: rows of dtype {keys.dtype}/{values.dtype} (float32, bfloat16, float16, one for all)")
        dtype = name
        first_held = total - held
        carried = spec.carried_rows(rows)
        first = rows - carried
        if first < first_held:
            raise DataError(f"layer {index} ({spec.kind}) holds positions [{first_held}, {total}), a kvpack of this "
                            f"prompt needs [{first}, {rows})",
                            hint="a sliding layer keeps window - 1 rows: pass the cache before the last prompt token")
        a, b = first - first_held, rows - first_held
        if spec.kind == "latent" and rope_deinterleaved:
            values = rope_to_pack(values)
        out.append(LayerKV(keys=to_numpy(keys[0, :, a:b].cpu()), values=to_numpy(values[0, :, a:b].cpu()), first_row=first))
    assert dtype is not None
    return out, dtype


def from_transformers(cache: Any, token_ids: Any, model: Any, *, info: ModelInfo | str | os.PathLike | None = None,
                      chunk_tokens: int = DEFAULT_CHUNK_TOKENS, out: BinaryIO | None = None,
                      codec: str = "none", level: int = 1) -> bytes | None:
    """A kvpack of the prompt ``token_ids`` from a transformers ``DynamicCache`` that covers
    prompt[:-1] (or the whole prompt, when no layer is sliding). Bound to the folder
    ``model`` was loaded from (or ``info``). Returns the pack's bytes, or writes them to
    ``out`` and returns None. ``chunk_tokens`` is recorded as the schedule (the frame grid)."""
    import torch

    from muser_cli.engines.torch.latent import deinterleaves  # lazy: pulls torch

    check_chunk(chunk_tokens)
    minfo = _model_info(model, info)
    ids = _ids(token_ids)
    check_prompt(minfo, ids)
    layers, dtype = cache_layers(cache, minfo.layers, ids, rope_deinterleaved=deinterleaves(model))
    try:
        from importlib.metadata import version

        extra = {"transformers": version("transformers"), "torch": version("torch")}
    except Exception:  # noqa: BLE001 - versions are information only
        extra = {}
    header = build_header(minfo, ids, dtype=dtype, chunk_tokens=chunk_tokens, engine="transformers",
                          threads=torch.get_num_threads(), extra=extra)
    require_identity(header, minfo, prompt_ids=ids)
    sink = out if out is not None else io.BytesIO()
    write_pack(sink, header, layers, codec=codec, level=level)
    return None if out is not None else sink.getvalue()  # type: ignore[union-attr]


__all__ = ["cache_layers", "from_transformers", "to_transformers"]
