"""What a model's config.json says about its KV cache, read without loading anything.

Each supported model family is described once, as data (:data:`FAMILIES`): how its
layers' kinds follow from the config (``layer_types``, or the family's own default
pattern), which layers are NoPE, its RoPE style, where a composite config keeps the text
tower, which transformers auto class loads it. ``layer_specs(config)`` reads a config.json
in the hub's (transformers 4) or transformers 5's spelling and mirrors the per-layer caches
transformers builds (kind, KV heads, head dims, window, RoPE per layer); the engines check
that description against the cache objects they build before anything runs.
``eos_token_ids`` reads the end-of-sequence ids. Families whose cache is not rows of K and
V (``Family.cache``: latent attention, recurrent state) are described in kvpack 1.3's
latent and state kinds (:func:`cache_plan`, which ``layer_specs`` is). Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from muser_cli.errors import ConfigError, DataError
from muser_cli.kvpack.layers import LayerSpec, RopeSpec, chunked_spec, latent_spec, state_spec


@dataclass(frozen=True)
class Family:
    """One model family's KV layout rules (what transformers' config class and modeling do)."""

    name: str
    style: str = "rotate_half"  # RoPE style of its keys
    # Which layers carry no RoPE: "" none; "full" every full-attention layer ("full_if_window":
    # when the config sets a sliding window); "layer_rope_theta"
    # those whose layer_rope_theta is 0; "no_rope_layers" those whose no_rope_layers entry is 0.
    nope: str = ""
    window: int | None = None  # the config class's sliding_window default
    # layer_types when config.json has none: "window" (every layer sliding iff a window is
    # set, transformers' generic rule), "qwen2" (use_sliding_window/max_window_layers),
    # "every:N" (every Nth layer full, counted from the first), "back:N" (every Nth counted
    # back from the last), "alternate" (sliding, full, ...), "all_full", "llama4" (chunked
    # where no_rope_layers says RoPE and attention_chunk_size is set, full elsewhere).
    layers: str = "window"
    head_dim_derived: bool = False  # hidden_size / heads, whatever head_dim says
    text_config: bool = False  # a composite config: the text tower's keys are under text_config
    torch_auto: str = "AutoModelForCausalLM"  # "" where transformers has no LM class for the config
    qk_norm: bool = False  # informational: the model normalises Q and K (its own business)
    sinks: bool = False  # informational: learned attention sinks (weights, not KV rows)
    chunked: bool = False  # its modeling implements chunked_attention layers (attention_chunk_size)
    notes: str = ""
    # What the cache holds: "rows" (K and V rows), "latent" (MLA: a latent and a shared RoPE
    # key per position), "gated_delta_net" or "mamba2" (hybrids: recurrent state layers
    # beside full attention). All four move.
    cache: str = "rows"


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama"),
    Family("mistral", window=4096),
    Family("qwen2", layers="qwen2"),
    Family("cohere2", style="interleaved", nope="full", window=4096, layers="every:4", head_dim_derived=True),
    Family("muse_glimmer", nope="layer_rope_theta", window=2048, layers="back:4", text_config=True,
           torch_auto="AutoModelForImageTextToText", qk_norm=True,
           notes="text tower of MuseGlimmerForConditionalGeneration; NoPE where layer_rope_theta is 0; gated attention output"),
    Family("muse_glimmer_text", nope="layer_rope_theta", window=2048, layers="back:4", qk_norm=True, torch_auto="",
           notes="the text tower alone, flat (MuseGlimmerTextConfig): mlx-lm runs it; transformers has no LM class for it"),
    Family("qwen3", layers="qwen2", qk_norm=True),
    Family("qwen3_moe", layers="qwen2", qk_norm=True),
    Family("mixtral"),
    Family("gemma2", window=4096, layers="alternate",
           notes="on MLX the engine gives mlx-lm's gemma2 (no window of its own) a ring and a mask per sliding layer"),
    Family("gemma3_text", window=4096, layers="every:6", qk_norm=True, notes="RoPE base per layer class"),
    Family("phi3", notes="partial rotary"),
    Family("olmo2", qk_norm=True),
    Family("smollm3", nope="no_rope_layers", layers="all_full", notes="NoPE where no_rope_layers is 0 (every 4th)"),
    Family("granite"),
    Family("glm4", style="interleaved", notes="partial rotary"),
    Family("exaone4", nope="full_if_window", window=4096, layers="every:4", qk_norm=True,
           notes="full layers NoPE when a window is set"),
    Family("gpt_oss", window=128, layers="alternate", sinks=True, notes="YaRN RoPE"),
    Family("llama4_text", style="interleaved", nope="no_rope_layers", layers="llama4", qk_norm=True, chunked=True,
           notes="chunked-local attention (attention_chunk_size) on its RoPE layers, kvpack 1.4 chunked: a pack "
                 "carries the current chunk's rows; full NoPE layers where no_rope_layers is 0 (every 4th)"),
    Family("llama4", style="interleaved", nope="no_rope_layers", layers="llama4", qk_norm=True, chunked=True,
           text_config=True,  # transformers' AutoModelForCausalLM loads its text tower (Llama4ForCausalLM)
           notes="the hub's composite Llama 4 config (Llama4ForConditionalGeneration): its text tower, as llama4_text"),
    Family("deepseek_v3", cache="latent", layers="all_full",
           notes="MLA: kvpack 1.3 latent layers (kv_lora_rank + qk_rope_head_dim a token), the latent after "
                 "kv_a_layernorm and the rope key after RoPE in the model's own (interleaved) order, as mlx-lm "
                 "caches them (transformers caches the rope key de-interleaved: the torch engine reorders it)"),
    Family("qwen3_next", cache="gated_delta_net", layers="all_full", qk_norm=True,
           notes="gated DeltaNet state layers beside gated full attention (kvpack 1.3 state: a snapshot per chunk)"),
    Family("granitemoehybrid", cache="mamba2", layers="all_full",
           notes="Mamba-2 state layers beside full attention (kvpack 1.3 state: a snapshot per chunk)"),
)}
ARCHITECTURES = FAMILIES  # the older name


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
    for source in (config, text_config(config), generation):
        value = source.get("eos_token_id")
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and not isinstance(item, bool) and item not in found:
                found.append(item)
    return tuple(found)


def family_of(config: dict[str, Any]) -> Family:
    """The :class:`Family` of a config.json, or :class:`ConfigError` naming the supported ones."""
    model_type = config.get("model_type")
    family = FAMILIES.get(str(model_type))
    if family is None:
        raise ConfigError(
            f"unsupported architecture {model_type!r} ({', '.join(config.get('architectures') or []) or 'no class named'})",
            hint="supported model types: " + ", ".join(sorted(FAMILIES)),
        )
    return family


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text tower's keys: a composite config's ``text_config`` over its top level."""
    family = FAMILIES.get(str(config.get("model_type")))
    nested = config.get("text_config")
    if family is None or not family.text_config or not isinstance(nested, dict):
        return config
    return {**config, **nested, "model_type": config["model_type"]}


#: the dtype of every tensor of an engine's state layers: transformers and mlx-lm keep the
#: recurrent matrix in float32 whatever the model's dtype; a bfloat16 conv window widens exactly
STATE_DTYPE = "float32"


def layer_specs(config: dict[str, Any]) -> tuple[LayerSpec, ...]:
    """Per-layer cache descriptions from a config.json dict, mirroring what transformers builds:
    row layers; kvpack 1.3 latent layers for MLA (deepseek_v3); for the hybrids (qwen3_next,
    granitemoehybrid) state layers in :data:`STATE_DTYPE` beside full ones (:func:`cache_plan`)."""
    return cache_plan(config)


def cache_plan(config: dict[str, Any], *, state_dtype: str = STATE_DTYPE) -> tuple[LayerSpec, ...]:
    """Every layer's cache as kvpack 1.3 describes it: row layers, latent layers for MLA
    (deepseek_v3), state and full layers for hybrids (qwen3_next, granitemoehybrid), the state
    in ``state_dtype`` (the engines write :data:`STATE_DTYPE`)."""
    family = family_of(config)
    if family.cache == "rows":
        return _row_specs(config, family)
    config = text_config(config)
    try:
        if family.cache == "latent":
            return _latent_specs(config, family)
        return _hybrid_specs(config, family, state_dtype)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"config.json of a {family.name} model lacks a usable {exc}") from exc


def expanded_row_bytes(config: dict[str, Any], element: int) -> int:
    """An MLA layer's bytes a token once expanded to per-head K and V (what transformers caches):
    heads x (qk_nope_head_dim + qk_rope_head_dim + v_head_dim) x element."""
    c = text_config(config)
    return int(c["num_attention_heads"]) * (int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])
                                            + int(c["v_head_dim"])) * element


def _latent_specs(config: dict[str, Any], family: Family) -> tuple[LayerSpec, ...]:
    rope_dim = int(config["qk_rope_head_dim"])
    style = "interleaved" if config.get("rope_interleave", True) else "rotate_half"
    rope = _rope_spec(config, "full_attention", rope_dim, style)
    return tuple(latent_spec(int(config["kv_lora_rank"]), rope_dim, rope) for _ in range(int(config["num_hidden_layers"])))


def _hybrid_specs(config: dict[str, Any], family: Family, dtype: str) -> tuple[LayerSpec, ...]:
    """State layers where the config lists linear attention / mamba, full layers elsewhere.
    Snapshot tensors: ``conv`` (channels x kernel - 1 inputs, the window before the position:
    the layout transformers' conv state has, less its oldest column, which no later step
    reads) and ``recurrent``, both in ``dtype``."""
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types") or config.get("layers_block_type") or ["linear_attention"] * n
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(f"config.json: layer_types does not list {n} layers")
    if family.cache == "gated_delta_net":
        k_heads, v_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
        dk, dv = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
        kernel = int(config["linear_conv_kernel_dim"])
        tensors = [("conv", (2 * k_heads * dk + v_heads * dv, kernel - 1), dtype), ("recurrent", (v_heads, dk, dv), dtype)]
    else:
        inner = int(config["mamba_expand"]) * int(config["hidden_size"])
        heads, groups, d_state = int(config["mamba_n_heads"]), int(config["mamba_n_groups"]), int(config["mamba_d_state"])
        d_head = config.get("mamba_d_head")
        d_head = inner // heads if d_head in (None, "auto") else int(d_head)
        kernel = int(config["mamba_d_conv"])
        tensors = [("conv", (inner + 2 * groups * d_state, kernel - 1), dtype), ("recurrent", (heads, d_head, d_state), dtype)]
    state = state_spec(family.cache, tensors)
    rows = _row_specs({**config, "layer_types": ["full_attention"] * n}, family)
    if family.cache == "mamba2" and config.get("position_embedding_type") != "rope":
        rows = tuple(LayerSpec(s.kind, s.kv_heads, s.head_dim, s.v_head_dim, s.window, None) for s in rows)  # NoPE
    out = []
    for i, kind in enumerate(types):
        if kind in ("linear_attention", "mamba"):
            out.append(state)
        elif kind in ("full_attention", "attention"):
            out.append(rows[i])
        else:
            raise ConfigError(f"unsupported layer type {kind!r} in config.json of a {family.name} model",
                              hint="supported: linear_attention (mamba), full_attention (attention)")
    return tuple(out)


def _row_specs(config: dict[str, Any], family: Family) -> tuple[LayerSpec, ...]:
    config = text_config(config)
    model_type = family.name
    try:
        n_layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        hidden = int(config["hidden_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"config.json of a {model_type} model lacks a usable {exc}") from exc
    head_dim = config.get("head_dim")
    if family.head_dim_derived or not head_dim:
        head_dim = hidden // heads
    head_dim = int(head_dim)

    window = config.get("sliding_window", family.window)
    kinds = _layer_kinds(config, family, n_layers, window)
    if any(kind == "sliding" for kind in kinds) and not (isinstance(window, int) and window >= 2):
        raise ConfigError(f"config.json has sliding layers but sliding_window is {window!r}")
    chunk = config.get("attention_chunk_size")
    if "chunked" in kinds and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 2):
        raise ConfigError(f"config.json has chunked attention layers but attention_chunk_size is {chunk!r}")
    nope = _nope_layers(config, family, kinds)
    specs = []
    for i, kind in enumerate(kinds):
        rope = None if i in nope else _rope_spec(config, f"{kind}_attention", head_dim, family.style)
        if kind == "chunked":
            specs.append(chunked_spec(kv_heads, head_dim, head_dim, int(chunk), rope))
            continue
        specs.append(LayerSpec(kind=kind, kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim,
                               window=int(window) if kind == "sliding" else None, rope=rope))
    return tuple(specs)


def _default_layer_types(config: dict[str, Any], rule: str, n_layers: int, window: Any) -> list[str]:
    """What the family's config class fills in when config.json lists no layer_types."""
    full, sliding = "full_attention", "sliding_attention"
    if rule == "qwen2":
        use = bool(config.get("use_sliding_window", False)) and window is not None
        first = int(config.get("max_window_layers", 28))
        return [sliding if use and i >= first else full for i in range(n_layers)]
    named = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
    if isinstance(named, str) and named and set(named) <= {"L", "G"}:  # the hub's EXAONE 4 spelling, "LLLG"
        return [sliding if named[i % len(named)] == "L" else full for i in range(n_layers)]
    if rule.startswith(("every:", "back:")):
        pattern = int(named or rule.split(":")[1])
        if rule.startswith("back:"):
            return [full if (n_layers - 1 - i) % pattern == 0 else sliding for i in range(n_layers)]
        return [sliding if (i + 1) % pattern else full for i in range(n_layers)]
    if rule == "alternate":
        return [sliding if (i + 1) % 2 else full for i in range(n_layers)]
    if rule == "all_full":
        return [full] * n_layers
    if rule == "llama4":  # Llama4TextConfig: chunked where RoPE (no_rope_layers 1), if a chunk size is set
        flags = config.get("no_rope_layers") or [int((i + 1) % int(config.get("no_rope_layer_interval", 4)) != 0)
                                                 for i in range(n_layers)]
        chunked = config.get("attention_chunk_size") is not None
        return ["chunked_attention" if flag and chunked else full for flag in flags]
    return [sliding if window is not None else full] * n_layers  # transformers' generic rule


def _layer_kinds(config: dict[str, Any], family: Family, n_layers: int, window: Any) -> list[str]:
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = _default_layer_types(config, family.layers, n_layers, window)
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ConfigError(f"config.json: layer_types does not list {n_layers} layers")
    kinds = []
    for value in layer_types:
        known = ("full_attention", "sliding_attention") + (("chunked_attention",) if family.chunked else ())
        if value not in known:
            raise ConfigError(f"unsupported layer type {value!r} in config.json of a {family.name} model",
                              hint="supported: " + ", ".join(known))
        kinds.append(value.split("_")[0])
    return kinds


def _nope_layers(config: dict[str, Any], family: Family, kinds: list[str]) -> set[int]:
    """Indices of the layers whose keys carry no RoPE."""
    if family.nope == "full" or (family.nope == "full_if_window" and "sliding" in kinds):
        return {i for i, kind in enumerate(kinds) if kind == "full"}
    key = {"layer_rope_theta": "layer_rope_theta", "no_rope_layers": "no_rope_layers"}.get(family.nope)
    if key is None:
        return set()
    flags = config.get(key)
    if flags is None:
        return _default_nope(config, family, kinds)
    if not isinstance(flags, list) or len(flags) != len(kinds):
        raise ConfigError(f"config.json: {key} does not list {len(kinds)} layers")
    return {i for i, flag in enumerate(flags) if not flag}


def _default_nope(config: dict[str, Any], family: Family, kinds: list[str]) -> set[int]:
    if family.nope == "layer_rope_theta":  # MuseGlimmerTextConfig: NoPE exactly on the full layers
        n = len(kinds)
        return {i for i in range(n) if (n - 1 - i) % 4 == 0}
    interval = int(config.get("no_rope_layer_interval", 4))  # SmolLM3Config: every 4th layer NoPE
    return {i for i in range(len(kinds)) if (i + 1) % interval == 0}


def _rope_spec(config: dict[str, Any], layer_type: str, head_dim: int, style: str) -> RopeSpec:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):  # nested per layer type
        params = params[layer_type]
    params = dict(params) if isinstance(params, dict) else {}
    theta = params.pop("rope_theta", None)
    if theta is None and layer_type == "sliding_attention":
        theta = config.get("rope_local_base_freq")  # the hub's (transformers 4) Gemma 3 spelling
    if theta is None:
        theta = config.get("rope_theta", 10000.0)
    if layer_type == "sliding_attention" and "rope_local_base_freq" in config and "rope_parameters" not in config:
        params = {}  # transformers 4's Gemma 3: rope_scaling applies to the global layers only
    factor = params.pop("partial_rotary_factor", config.get("partial_rotary_factor"))
    dims = int(head_dim * float(factor)) if factor is not None else head_dim
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = None
    if rope_type != "default" or any(k not in ("rope_type", "type") for k in params):
        scaling = json.loads(json.dumps(params, sort_keys=True))  # plain JSON values
    return RopeSpec(theta=float(theta), dims=dims, style=style, scaling=scaling)
