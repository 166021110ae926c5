"""MLX engine, part 1: translating the model folder for mlx-lm and checking that the
loaded model honours the pack's layer descriptions (RoPE above all).

transformers 5.x keeps RoPE under ``rope_parameters``; mlx-lm reads a top-level
``rope_theta``/``rope_scaling``; Cohere2 states ``layer_types`` where mlx-lm derives them
from ``sliding_window_pattern``. :func:`mlx_config_overrides` bridges the names;
:func:`check_rope` reads a loaded attention module and probes its rotation numerically
against a :class:`~muser_cli.kvpack.layers.RopeSpec`, raising
:class:`~muser_cli.errors.IdentityMismatch` naming the field (a lost ``rope_theta`` once
made valid KV decode to garbage). :func:`check_model` checks the loaded model's cache layout and
heads the same way. No MLX import at module level.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from muser_cli.engines.mlx.gemma2 import windowed_gemma2
from muser_cli.errors import ConfigError, DataError, IdentityMismatch
from muser_cli.kvpack.layers import LayerSpec, RopeSpec
from muser_cli.model.info import ModelInfo
from muser_cli.model.resolve import layer_specs

_TIE_DEFAULTS = {"llama": False, "mistral": False, "qwen2": False, "cohere2": True}
# Which layers apply RoPE, where an architecture has NoPE layers (per attention module).
APPLIES_ROPE = {"cohere2": lambda attn: bool(getattr(attn, "use_sliding_window", True)),
                 "smollm3": lambda attn: type(getattr(attn, "rope", None)).__name__ not in ("NoPE", "NoneType"),
                 "exaone4": lambda attn: bool(getattr(attn, "use_rope", True)),
                 "llama4_text": lambda attn: bool(getattr(attn, "use_rope", True)),
                 "llama4": lambda attn: bool(getattr(attn, "use_rope", True))}
# Families mlx-lm implements differently from transformers, refused by name before loading.
MLX_REFUSED: dict[str, str] = {}
#: model_type -> why the batched decode (engines/mlx/batch.py) leaves it out: its sequences decode
#: alone, one per call, even beside others (docs/serve.md). Chunked layers (Llama 4) have no batch
#: cache in mlx-lm and are left out by their cache kind.
MLX_DECODES_ALONE: dict[str, str] = {
    "gemma2": "mlx-lm's gemma2 attention cannot take a batch's padding mask (its soft-capped scores are "
              "shaped per head group)",
}
# transformers model_type -> the mlx-lm module that implements it, where the names differ.
_MLX_MODULE = {"muse_glimmer_text": "muse_glimmer", "llama4_text": "llama4"}
# mlx-lm module -> weight-name prefixes of towers it does not implement (a multimodal
# checkpoint's vision tower as transformers 5 names it), dropped before its sanitize.
_DROP_WEIGHTS = {"muse_glimmer": ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")}
_ROPE_SCALINGS = ("default", "linear", "llama3", "yarn")  # scaling types this engine can check
_PROBE_POSITIONS = (1, 3, 17, 64, 511, 4095)


def check_supported(info: ModelInfo, config: dict[str, Any]) -> None:
    """Refuse by name, before loading, a configuration mlx-lm's module for the family cannot
    build (it would stop in an ``assert`` of mlx-lm's): Llama 4's mixture of experts routes
    exactly one expert per token in mlx-lm 0.32."""
    if info.architecture in ("llama4", "llama4_text"):
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        k = text.get("num_experts_per_tok", 1)
        if k != 1:
            raise ConfigError(f"the mlx engine cannot run this {info.architecture}: it routes {k} experts per token, "
                              "mlx-lm's Llama 4 routes exactly 1", hint="use --engine torch")


def check_dtype(info: ModelInfo, model: Any, dtype: str) -> None:
    """Refuse, before any forward, what this MLX build cannot compute: on the CPU, MLX's
    ``gather_mm`` (mlx-lm's mixture-of-experts layers, ``switch_layers``) runs float32 only, so
    a bfloat16 MoE model would fail in its first forward with MLX's own traceback."""
    if dtype == "float32":
        return
    import mlx.core as mx
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    if mx.default_device() != mx.cpu:
        return
    if any(isinstance(module, (SwitchLinear, QuantizedSwitchLinear)) for _, module in model.named_modules()):
        raise ConfigError(f"the mlx engine cannot run {info.architecture}'s mixture-of-experts layers in {dtype} on "
                          "the CPU: MLX's gather_mm computes float32 only there", hint="pass --dtype float32")


def read_config(info: ModelInfo) -> dict[str, Any]:
    try:
        config = json.loads((info.path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read {info.path / 'config.json'}: {exc}") from exc
    if not isinstance(config, dict):
        raise DataError(f"{info.path / 'config.json'}: expected a JSON object")
    return config


def mlx_config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """Keys to pass mlx-lm so that it builds the model transformers builds from ``config``.

    RoPE comes from the same reading of the config that made the model's layer specs
    (``rope_parameters`` first, as transformers 5.x does), never from mlx-lm's defaults.
    """

    model_type = str(config.get("model_type"))
    overrides: dict[str, Any] = {}
    specs = layer_specs(config)
    ropes = [spec.rope for spec in specs if spec.rope is not None]
    if ropes:
        rope = ropes[0]
        overrides["rope_theta"] = rope.theta
        scaling = dict(rope.scaling or {})
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default":
            overrides["rope_scaling"] = {**scaling, "rope_type": kind, "type": kind}
        elif config.get("rope_scaling") is not None:
            overrides["rope_scaling"] = None
    if "tie_word_embeddings" not in config and model_type in _TIE_DEFAULTS:
        overrides["tie_word_embeddings"] = _TIE_DEFAULTS[model_type]
    if model_type in _MLX_MODULE:
        overrides["model_type"] = _MLX_MODULE[model_type]
    if model_type == "cohere2":
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        overrides["head_dim"] = hidden // heads  # transformers derives it; mlx-lm defaults to 128
        pattern = _sliding_pattern(config.get("layer_types"))
        if pattern is not None:
            overrides["sliding_window_pattern"] = pattern
    # partial rotary (transformers 5 moved the factor); a hybrid's state layers have no head_dim, and a latent
    # layer's rope key is not a slice of a head
    roped = [spec for spec in specs if spec.rope is not None and spec.kind != "latent"]
    if roped and roped[0].rope.dims != roped[0].head_dim:
        overrides["partial_rotary_factor"] = roped[0].rope.dims / roped[0].head_dim
    if model_type in ("llama4_text", "llama4"):  # mlx-lm's llama4 (chunked attention) nests the text tower
        text = config["text_config"] if model_type == "llama4" else config  # the hub's composite nests it already
        overrides = {"model_type": "llama4",
                     "text_config": {**text, **{k: v for k, v in overrides.items() if k != "model_type"},
                                     "rope_scaling": overrides.get("rope_scaling"), "model_type": "llama4_text"}}
        return overrides
    rule = _FAMILY_KEYS.get(model_type)
    if rule is not None:
        overrides.update(rule(config, specs))
    return overrides


def _gemma3_keys(config: dict[str, Any], specs: tuple[LayerSpec, ...]) -> dict[str, Any]:
    """mlx-lm's gemma3_text: one theta per layer class, and a pattern instead of layer_types."""
    out: dict[str, Any] = {}
    pattern = _sliding_pattern(config.get("layer_types"))
    if pattern is not None:
        out["sliding_window_pattern"] = pattern
    for spec in specs:
        if spec.rope is not None:
            out["rope_local_base_freq" if spec.kind == "sliding" else "rope_theta"] = spec.rope.theta
    return out


def _exaone4_keys(config: dict[str, Any], specs: tuple[LayerSpec, ...]) -> dict[str, Any]:
    """mlx-lm's exaone4 reads the layer plan as an "L"/"G" string and needs rope_scaling named."""
    out: dict[str, Any] = {"sliding_window_pattern": "".join("L" if s.kind == "sliding" else "G" for s in specs)}
    if "rope_scaling" not in config:
        out["rope_scaling"] = None
    if not any(s.kind == "sliding" for s in specs):
        out["sliding_window_pattern"] = None
    return out


def _qwen3_next_keys(config: dict[str, Any], specs: tuple[LayerSpec, ...]) -> dict[str, Any]:
    """mlx-lm's qwen3_next places its full-attention layers every ``full_attention_interval``
    (counted from 1), not from layer_types: the interval the layer plan has, or refused."""
    full = [i for i, spec in enumerate(specs) if spec.kind != "state"]
    n = full[0] + 1 if full else len(specs) + 1
    if full != [i for i in range(len(specs)) if (i + 1) % n == 0]:
        raise ConfigError(f"qwen3_next: full-attention layers at {full} are not every n-th layer, the only plan "
                          "mlx-lm's qwen3_next builds", hint="use --engine torch")
    return {"full_attention_interval": n}


_FAMILY_KEYS = {
    "qwen3_next": _qwen3_next_keys,
    # mlx-lm's granitemoehybrid reads the hub's layer names (transformers 5 saves linear/full_attention)
    "granitemoehybrid": lambda config, specs: {"layer_types": ["mamba" if s.kind == "state" else "attention"
                                                               for s in specs]},
    "gemma3_text": _gemma3_keys,
    "exaone4": _exaone4_keys,
    "qwen3_moe": lambda config, specs: ({"num_experts": config["num_local_experts"]}
                                        if "num_experts" not in config and "num_local_experts" in config else {}),
}


def model_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's (Model, ModelArgs) for ``config`` (its ``get_model_classes`` hook), the Model
    dropping the weights of towers mlx-lm does not implement (:data:`_DROP_WEIGHTS`)."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    module = str(config.get("model_type"))
    if module == "gemma2":  # mlx-lm's has no sliding window: given one (engines/mlx/gemma2.py)
        return windowed_gemma2(model_cls, config), args_cls
    drop, translate = _DROP_WEIGHTS.get(module, ()), _TRANSLATE_WEIGHTS.get(module)
    if not drop and translate is None:
        return model_cls, args_cls

    class Translated(model_cls):  # type: ignore[misc, valid-type]
        def sanitize(self, weights: dict) -> dict:
            kept = {k: v for k, v in weights.items() if not (drop and k.startswith(drop))}
            if translate is not None:
                kept = translate(kept)
            return super().sanitize(kept) if hasattr(model_cls, "sanitize") else kept

    return Translated, args_cls


def _gpt_oss_weights(weights: dict) -> dict:
    """transformers' unquantized gpt-oss experts (``gate_up_proj`` (E, hidden, 2I) with gate and
    up interleaved, ``down_proj`` (E, I, hidden), ``*_bias``) as mlx-lm's per-projection
    weights (E, out, in); mlx-lm's own sanitize reads only the hub's MXFP4 blocks."""
    import mlx.core as mx

    out = {}
    for k, v in weights.items():
        if k.endswith("experts.gate_up_proj"):
            out[k[: -len("gate_up_proj")] + "gate_proj.weight"] = mx.contiguous(mx.swapaxes(v[..., ::2], 1, 2))
            out[k[: -len("gate_up_proj")] + "up_proj.weight"] = mx.contiguous(mx.swapaxes(v[..., 1::2], 1, 2))
        elif k.endswith("experts.gate_up_proj_bias"):
            out[k[: -len("gate_up_proj_bias")] + "gate_proj.bias"] = mx.contiguous(v[..., ::2])
            out[k[: -len("gate_up_proj_bias")] + "up_proj.bias"] = mx.contiguous(v[..., 1::2])
        elif k.endswith("experts.down_proj"):
            out[k + ".weight"] = mx.contiguous(mx.swapaxes(v, 1, 2))
        elif k.endswith("experts.down_proj_bias"):
            out[k[: -len("_bias")] + ".bias"] = v
        else:
            out[k] = v
    return out


def _llama4_text_weights(weights: dict) -> dict:
    """A text-only Llama 4 folder's weights (``model.*``, ``lm_head.*``) under the names mlx-lm's
    composite llama4 gives its text tower (``language_model.``); its sanitize splits the experts."""
    return {("language_model." + k if k.startswith(("model.", "lm_head.")) else k): v for k, v in weights.items()}


_TRANSLATE_WEIGHTS = {"gpt_oss": _gpt_oss_weights, "llama4": _llama4_text_weights}


def _sliding_pattern(layer_types: Any) -> int | None:
    """The p with layer_types[i] == full iff (i+1) % p == 0, if layer_types has that shape."""
    if not isinstance(layer_types, list) or not layer_types:
        return None
    for p in range(1, len(layer_types) + 1):
        expect = ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(len(layer_types))]
        if expect == layer_types:
            return p
    return None  # not expressible: the layout check will refuse it


# --------------------------------------------------------------------------- RoPE check


def check_model(info: ModelInfo, model: Any, caches: list[Any]) -> None:
    """Refuse a loaded model whose caches (``caches``: the set mlx-lm builds for it) or RoPE
    differ from ``info.layers``. Imports mlx-lm (its cache classes)."""
    from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache

    specs = info.layers
    blocks = list(getattr(model, "layers", []))
    if len(caches) != len(specs) or len(blocks) != len(specs):
        raise IdentityMismatch(
            f"model {info.name}: mlx-lm builds {len(caches)} cache layers, the model describes {len(specs)}")
    for index, (spec, cache, block) in enumerate(zip(specs, caches, blocks)):
        if type(cache) is KVCache:
            built = ("full", None)
        elif type(cache) is RotatingKVCache and cache.keep == 0:
            built = ("sliding", cache.max_size)
        elif type(cache) is ChunkedKVCache:
            built = ("chunked", cache.chunk_size)
        elif type(cache) is ArraysCache and spec.kind == "state":  # a recurrent layer (engines/mlx/state.py)
            continue
        else:
            raise IdentityMismatch(f"layer {index}: mlx-lm builds a {type(cache).__name__} the mlx engine cannot fill")
        size = spec.chunk if spec.kind == "chunked" else spec.window
        if spec.kind == "latent":  # MLA: mlx-lm keeps the latent and the rope key in a KVCache
            _check_latent(index, spec, cache, block, info.max_positions)
            continue
        if built != (spec.kind, size):
            raise IdentityMismatch(
                f"layer {index} kind: the model describes {_kind_text(spec.kind, size)}, "
                f"mlx-lm builds {_kind_text(*built)}",
                hint="mlx-lm's implementation of this architecture lays the layers out differently")
        attn = getattr(block, "self_attn", None)
        if attn is None:
            raise IdentityMismatch(f"layer {index}: no attention module the mlx engine recognises")
        for field_name, want, attr in (("kv_heads", spec.kv_heads, "n_kv_heads"), ("head_dim", spec.head_dim, "head_dim")):
            got = getattr(attn, attr, None)
            if got is not None and int(got) != want:
                raise IdentityMismatch(f"layer {index} {field_name}: the model describes {want}, mlx-lm uses {got}")
        rule = APPLIES_ROPE.get(info.architecture)
        applies = rule(attn) if rule else getattr(attn, "rope", None) is not None
        check_rope(index, spec, attn.rope if applies else None, info.max_positions)


def _check_latent(index: int, spec: LayerSpec, cache: Any, block: Any, max_positions: int) -> None:
    """A latent layer: a KVCache of one head whose keys are the latent after kv_a_layernorm
    (kv_lora_rank) and whose values are the rope key after RoPE (qk_rope_head_dim), as mlx-lm's
    MLA attention (deepseek_v3) caches them; its RoPE checked on the rope key's width."""
    from mlx_lm.models.cache import KVCache

    attn = getattr(block, "self_attn", None)
    if type(cache) is not KVCache or attn is None or not hasattr(attn, "kv_a_layernorm"):
        raise IdentityMismatch(f"layer {index} kind: the model describes latent (MLA) rows, mlx-lm builds "
                               f"{type(cache).__name__} without an MLA attention")
    built = (int(getattr(attn, "kv_lora_rank", -1)), int(getattr(attn, "qk_rope_head_dim", -1)))
    if built != (spec.head_dim, spec.v_head_dim):
        raise IdentityMismatch(f"layer {index}: the model describes latent {spec.head_dim} + rope {spec.v_head_dim}, "
                               f"mlx-lm caches {built[0]} + {built[1]}")
    rope_key = LayerSpec("full", 1, spec.v_head_dim, spec.v_head_dim, rope=spec.rope)
    check_rope(index, rope_key, getattr(attn, "rope", None), max_positions)


def _kind_text(kind: str, window: int | None) -> str:
    if kind == "chunked":
        return f"chunked (chunk {window})"
    return f"sliding (window {window})" if kind == "sliding" else "full attention"


def check_rope(index: int, spec: LayerSpec, module: Any, max_positions: int) -> None:
    """Raise :class:`IdentityMismatch` naming the field where ``module`` (the RoPE mlx-lm
    applies at this layer, or ``None`` for none) differs from ``spec.rope``."""
    want = spec.rope
    if want is None:
        if module is not None:
            raise IdentityMismatch(f"layer {index} rope: the model has no RoPE here (NoPE), mlx-lm applies RoPE")
        return
    if module is None:
        raise IdentityMismatch(f"layer {index} rope: the model applies RoPE (theta {want.theta:g}), mlx-lm applies none")
    scaling = dict(want.scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _ROPE_SCALINGS:
        raise DataError(f"layer {index} rope.scaling: type {kind!r} is not supported by the mlx engine",
                        hint="supported: " + ", ".join(_ROPE_SCALINGS))
    declared = {"dims": getattr(module, "dims", None), "style": None, "theta": getattr(module, "base", None)}
    if getattr(module, "traditional", None) is not None:
        declared["style"] = "interleaved" if module.traditional else "rotate_half"
    for name in ("dims", "style"):
        if declared[name] is not None and declared[name] != getattr(want, name):
            raise IdentityMismatch(f"layer {index} rope.{name}: the model uses {getattr(want, name)!r}, mlx-lm {declared[name]!r}")
    if declared["theta"] is not None and not math.isclose(float(declared["theta"]), want.theta, rel_tol=1e-6):
        raise IdentityMismatch(f"layer {index} rope.theta: the model uses {want.theta:g}, mlx-lm would use {float(declared['theta']):g}",
                               hint="mlx-lm reads a top-level rope_theta; transformers 5.x writes rope_parameters")
    scale = getattr(module, "scale", None)
    want_scale = 1.0 / float(scaling["factor"]) if kind == "linear" else 1.0
    if scale is not None and kind not in ("llama3", "yarn") and not math.isclose(float(scale), want_scale, rel_tol=1e-6):
        raise IdentityMismatch(f"layer {index} rope.scaling: the model scales positions by {want_scale:g}, mlx-lm by {float(scale):g}")
    error, position = _probe(module, want, spec.head_dim, max_positions)
    if error is not None:
        raise IdentityMismatch(
            f"layer {index} rope: mlx-lm's rotation differs from the model's (theta {want.theta:g}, dims {want.dims}, "
            f"{want.style}, scaling {kind}) by {error:.3g} at position {position}")


def _probe(module: Any, rope: RopeSpec, head_dim: int, max_positions: int) -> tuple[float | None, int]:
    """Rotate a fixed vector with ``module`` and with a float64 reference built from ``rope``."""
    import mlx.core as mx

    x = np.random.default_rng(0).uniform(-1.0, 1.0, size=head_dim).astype(np.float32)
    inv = _inverse_frequencies(rope)
    for position in [p for p in _PROBE_POSITIONS if p < max_positions] + [max_positions - 1]:
        got = np.array(module(mx.array(x.reshape(1, 1, 1, head_dim)), offset=position)).reshape(-1).astype(np.float64)
        want = _rotate(x.astype(np.float64), inv, rope, position)
        tolerance = 1e-4 + 8.0 * position * np.finfo(np.float32).eps  # float32 angles lose ~p*eps
        error = float(np.max(np.abs(got - want)))
        if not error <= tolerance:
            return error, position
    return None, 0


def _inverse_frequencies(rope: RopeSpec) -> np.ndarray:
    """transformers' inverse frequencies for default, linear and llama3 RoPE (float64)."""
    inv = 1.0 / rope.theta ** (np.arange(0, rope.dims, 2, dtype=np.float64) / rope.dims)
    scaling = dict(rope.scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = np.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv = _yarn_inverse_frequencies(rope, scaling, inv)
    return inv


def _yarn_inverse_frequencies(rope: RopeSpec, scaling: dict[str, Any], extrapolated: np.ndarray) -> np.ndarray:
    """transformers' YaRN frequencies: a ramp between interpolated and extrapolated ones over
    the correction range (floored/ceiled only when ``truncate``, its default)."""
    if "factor" not in scaling or "original_max_position_embeddings" not in scaling:
        raise DataError("rope.scaling: yarn needs factor and original_max_position_embeddings",
                        hint="the config's rope_parameters lack them")
    factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction(rotations: float) -> float:
        return rope.dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction(fast), correction(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope.dims - 1)
    ramp = np.clip((np.arange(rope.dims // 2, dtype=np.float64) - low) / ((high - low) or 0.001), 0, 1)
    extrapolation = 1 - ramp
    return extrapolated / factor * (1 - extrapolation) + extrapolated * extrapolation


def _attention_factor(rope: RopeSpec) -> float:
    """The factor YaRN multiplies cos and sin by (so the cached keys carry it)."""
    scaling = dict(rope.scaling or {})
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale()


def _rotate(x: np.ndarray, inv: np.ndarray, rope: RopeSpec, position: int) -> np.ndarray:
    out = x.copy()
    angle = position * inv
    cos, sin = np.cos(angle) * _attention_factor(rope), np.sin(angle) * _attention_factor(rope)
    half = rope.dims // 2
    if rope.style == "interleaved":
        a, b = x[0 : rope.dims : 2], x[1 : rope.dims : 2]
        out[0 : rope.dims : 2], out[1 : rope.dims : 2] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = x[:half], x[half : rope.dims]
        out[:half], out[half : rope.dims] = a * cos - b * sin, b * cos + a * sin
    return out
