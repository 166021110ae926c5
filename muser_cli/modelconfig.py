"""What a model's config.json says about its KV cache, read without loading anything.

``layer_specs(config)`` mirrors the per-layer caches transformers builds (kind, heads,
head size, sliding window, RoPE) for the architectures whose layout was checked
(:data:`ARCHITECTURES`); ``eos_token_ids`` reads the end-of-sequence ids. Pure Python.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from muser_cli.errors import ConfigError, DataError
from muser_cli.kvpack.layers import LayerSpec, RopeSpec

# model_type -> (RoPE style, whether full-attention layers are NoPE, class defaults used
# when config.json omits a key). Only architectures whose KV layout was checked.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"style": "rotate_half", "full_nope": False, "sliding_window": None},
    "mistral": {"style": "rotate_half", "full_nope": False, "sliding_window": 4096},
    "qwen2": {"style": "rotate_half", "full_nope": False, "sliding_window": None},
    "cohere2": {"style": "interleaved", "full_nope": True, "sliding_window": 4096},
}


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object")
    return value


def eos_token_ids(config: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from config.json then generation_config.json, in order, without repeats."""
    found: list[int] = []
    for source in (config, generation):
        value = source.get("eos_token_id")
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and not isinstance(item, bool) and item not in found:
                found.append(item)
    return tuple(found)


def layer_specs(config: dict[str, Any]) -> tuple[LayerSpec, ...]:
    """Per-layer cache descriptions from a config.json dict, mirroring what transformers builds."""
    model_type = config.get("model_type")
    arch = ARCHITECTURES.get(str(model_type))
    if arch is None:
        raise ConfigError(
            f"unsupported architecture {model_type!r} ({', '.join(config.get('architectures') or []) or 'no class named'})",
            hint="supported model types: " + ", ".join(sorted(ARCHITECTURES)),
        )
    try:
        n_layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        hidden = int(config["hidden_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"config.json of a {model_type} model lacks a usable {exc}") from exc
    head_dim = config.get("head_dim")
    if model_type == "cohere2" or not head_dim:  # Cohere2Config always derives it
        head_dim = hidden // heads
    head_dim = int(head_dim)

    window = config.get("sliding_window", arch["sliding_window"])
    kinds = _layer_kinds(config, model_type, n_layers, window)
    if any(kind == "sliding" for kind in kinds) and not (isinstance(window, int) and window >= 2):
        raise ConfigError(f"config.json has sliding layers but sliding_window is {window!r}")

    specs = []
    for i, kind in enumerate(kinds):
        rope = None
        if not (kind == "full" and arch["full_nope"]):
            rope = _rope_spec(config, "sliding_attention" if kind == "sliding" else "full_attention", head_dim, arch["style"])
        specs.append(
            LayerSpec(
                kind=kind,
                kv_heads=kv_heads,
                head_dim=head_dim,
                v_head_dim=head_dim,
                window=int(window) if kind == "sliding" else None,
                rope=rope,
            )
        )
    return tuple(specs)


def _layer_kinds(config: dict[str, Any], model_type: str, n_layers: int, window: Any) -> list[str]:
    layer_types = config.get("layer_types")
    if layer_types is None:
        if model_type == "cohere2":
            pattern = int(config.get("sliding_window_pattern", 4))
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        elif model_type == "qwen2":
            use = bool(config.get("use_sliding_window", False)) and window is not None
            first = int(config.get("max_window_layers", 28))
            layer_types = ["sliding_attention" if use and i >= first else "full_attention" for i in range(n_layers)]
        else:  # what transformers infers: a sliding_window on the config makes every layer sliding
            layer_types = ["sliding_attention" if window is not None else "full_attention"] * n_layers
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ConfigError(f"config.json: layer_types does not list {n_layers} layers")
    kinds = []
    for value in layer_types:
        if value == "full_attention":
            kinds.append("full")
        elif value == "sliding_attention":
            kinds.append("sliding")
        else:
            raise ConfigError(f"unsupported layer type {value!r} in config.json", hint="supported: full_attention, sliding_attention")
    return kinds


def _rope_spec(config: dict[str, Any], layer_type: str, head_dim: int, style: str) -> RopeSpec:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):  # nested per layer type
        params = params[layer_type]
    params = dict(params) if isinstance(params, dict) else {}
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta", 10000.0)
    factor = params.pop("partial_rotary_factor", config.get("partial_rotary_factor"))
    dims = int(head_dim * float(factor)) if factor is not None else head_dim
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = None
    if rope_type != "default" or any(k not in ("rope_type", "type") for k in params):
        scaling = json.loads(json.dumps(params, sort_keys=True))  # plain JSON values
    return RopeSpec(theta=float(theta), dims=dims, style=style, scaling=scaling)
