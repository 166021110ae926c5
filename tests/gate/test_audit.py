"""verify --audit N: numerically wrong KV with valid structure is caught, and the cause named."""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from muser_cli.commands import app
from muser_cli.kvpack import LayerKV, read_pack_bytes, write_pack

PROMPT = "A river runs through the old town, past the mill and under seven stone bridges before the sea."


def run(args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)


def _pack(model_path, prompt_file, tmp_path, name="p.kvpack") -> Path:
    out = tmp_path / name
    r = run(["prefill", "-m", model_path, "--chunk", "8", prompt_file, "-o", out])
    assert r.exit_code == 0, r.output
    return out


def _rewrite(src: Path, dst: Path, *, header=None, layers=None) -> Path:
    pack = read_pack_bytes(src.read_bytes())
    buf = io.BytesIO()
    write_pack(buf, header or pack.header, layers or pack.layers)
    dst.write_bytes(buf.getvalue())
    return dst


def _audit(model_path, pack: Path, n=6):
    r = run(["verify", "-m", model_path, "--audit", n, pack, "--json"])
    report = json.loads(r.stdout)
    audit = next((c for c in report["checks"] if c["name"] == "audit"), None)
    return r.exit_code, audit, report


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text(PROMPT)
    return p


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_hybrid"])
def test_honest_pack_passes_the_audit(request, which, prompt_file, tmp_path):
    model = request.getfixturevalue(which)
    pack = _pack(model.path, prompt_file, tmp_path)
    code, audit, report = _audit(model.path, pack)
    assert code == 0 and audit["ok"], audit
    assert report["summary"]["audit"]["mode"] == ("suffix" if which == "tiny_llama" else "full-recompute")
    assert len(report["summary"]["audit"]["layers"]) == len(model.layers)


def test_wrong_rope_theta_is_caught(tiny_llama, prompt_file, tmp_path):
    """A producer that computed keys with another theta but claims the right model."""
    wrong = tmp_path / "wrong-theta"
    shutil.copytree(tiny_llama.path, wrong, ignore=shutil.ignore_patterns(".muser-*"))
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["rope_theta"] = 10.0 * float(cfg.get("rope_theta", 10000.0))
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"]["rope_theta"] = cfg["rope_theta"]
    (wrong / "config.json").write_text(json.dumps(cfg))
    bad = _pack(wrong, prompt_file, tmp_path, "wrong.kvpack")
    honest = read_pack_bytes(_pack(tiny_llama.path, prompt_file, tmp_path).read_bytes()).header
    forged_header = replace(read_pack_bytes(bad.read_bytes()).header, model_fingerprint=honest.model_fingerprint,
                            tokenizer_fingerprint=honest.tokenizer_fingerprint, layers=honest.layers)
    forged = _rewrite(bad, tmp_path / "forged.kvpack", header=forged_header)
    code, audit, _ = _audit(tiny_llama.path, forged)
    assert code == 65 and not audit["ok"]
    assert "RoPE" in audit["detail"], audit["detail"]
    # and without forging, the structure check refuses it before any audit
    code, _, report = _audit(tiny_llama.path, bad)
    assert code == 65 and any(c["name"] == "model" and not c["ok"] for c in report["checks"])


def test_another_models_kv_with_the_right_shapes(tiny_llama, prompt_file, tmp_path):
    from muser_cli.model.tiny import make_tiny_llama

    other = make_tiny_llama(tmp_path / "other", seed=1)
    bad = _pack(other, prompt_file, tmp_path, "other.kvpack")
    honest = read_pack_bytes(_pack(tiny_llama.path, prompt_file, tmp_path).read_bytes()).header
    forged = _rewrite(bad, tmp_path / "forged.kvpack", header=replace(
        read_pack_bytes(bad.read_bytes()).header, model_fingerprint=honest.model_fingerprint,
        tokenizer_fingerprint=honest.tokenizer_fingerprint))
    code, audit, _ = _audit(tiny_llama.path, forged)
    assert code == 65 and not audit["ok"] and "every layer" in audit["detail"]


def _mutated(tiny_llama, prompt_file, tmp_path, fn):
    good = _pack(tiny_llama.path, prompt_file, tmp_path)
    pack = read_pack_bytes(good.read_bytes())
    layers = [LayerKV(l.keys.copy(), l.values.copy(), l.first_row) for l in pack.layers]
    fn(layers)
    return _rewrite(good, tmp_path / "bad.kvpack", layers=layers)


def test_positions_shifted_by_one(tiny_llama, prompt_file, tmp_path):
    def shift(layers):
        for l in layers:
            l.keys[:, 1:] = l.keys[:, :-1].copy()
            l.values[:, 1:] = l.values[:, :-1].copy()
    code, audit, _ = _audit(tiny_llama.path, _mutated(tiny_llama, prompt_file, tmp_path, shift))
    assert code == 65 and "shifted by one" in audit["detail"], audit["detail"]


def test_two_layers_swapped(tiny_llama, prompt_file, tmp_path):
    def swap(layers):
        layers[1], layers[2] = layers[2], layers[1]
    code, audit, _ = _audit(tiny_llama.path, _mutated(tiny_llama, prompt_file, tmp_path, swap))
    assert code == 65 and "swapped" in audit["detail"], audit["detail"]


def test_a_scaled_layer(tiny_llama, prompt_file, tmp_path):
    def scale(layers):
        l = layers[2]
        layers[2] = LayerKV((l.keys * np.float32(1.5)).astype(l.keys.dtype), (l.values * np.float32(1.5)).astype(l.values.dtype), l.first_row)
    code, audit, _ = _audit(tiny_llama.path, _mutated(tiny_llama, prompt_file, tmp_path, scale))
    assert code == 65 and "layer 2" in audit["detail"] and "scaled by 1.5" in audit["detail"], audit["detail"]


# ------------------------------------------------------------------ the spot-check before the first token
def _engine(kind, info, dtype="float32"):
    from muser_cli.engines.registry import get_engine

    return get_engine(kind, info, dtype=dtype, threads=1)


def _spot(pack_path, eng, **kw):
    from muser_cli.gate.audit import spot_check

    return spot_check(read_pack_bytes(Path(pack_path).read_bytes()), eng, **kw)


def test_spot_check_reason_names_what_differs(tiny_llama, prompt_file, tmp_path):
    from muser_cli.gate.audit import spot_check_reason

    h = read_pack_bytes(_pack(tiny_llama.path, prompt_file, tmp_path).read_bytes()).header
    assert h.producer["engine"] == "torch"
    assert spot_check_reason(h, engine="torch", dtype=h.dtype) is None  # our own engine's pack
    assert "made by torch, decoded on mlx" in spot_check_reason(h, engine="mlx")
    assert "stored as float32, decoded as bfloat16" in spot_check_reason(h, engine="torch", dtype="bfloat16")
    assert "made by an unnamed engine" in spot_check_reason(replace(h, producer={}), engine="torch")
    assert "quantized (int8)" in spot_check_reason(replace(h, quant={"scheme": "int8"}), engine="torch")


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_hybrid"])
def test_spot_check_passes_an_honest_pack(request, which, prompt_file, tmp_path):
    model = request.getfixturevalue(which)
    res = _spot(_pack(model.path, prompt_file, tmp_path), _engine("torch", model), positions=2)
    assert res.ok and res.positions[1] - res.positions[0] == 2
    # a hybrid pack carries its sliding history (prefill's default): every layer is recomputed exactly
    assert res.checked == len(model.layers) and res.unchecked == []
    assert res.to_json()["ok"] is True and res.to_json()["ms"] > 0


def test_spot_check_refuses_swapped_layers_before_any_token(tiny_llama, prompt_file, tmp_path):
    from muser_cli.errors import SpotCheckFailed

    def swap(layers):
        layers[1], layers[2] = layers[2], layers[1]
    bad = _mutated(tiny_llama, prompt_file, tmp_path, swap)
    with pytest.raises(SpotCheckFailed, match="swapped") as exc:
        _spot(bad, _engine("torch", tiny_llama))
    assert exc.value.exit_status == 65 and "layer" in str(exc.value) and "before the first token" in str(exc.value)


def test_spot_check_refuses_a_misread_cache_layout(tiny_llama, prompt_file, tmp_path):
    """What a producer that misreads its backend's block layout writes: each layer's
    [tokens, heads, dim] memory taken as [heads, tokens, dim] (digests all valid)."""
    from muser_cli.errors import SpotCheckFailed

    def misread(layers):
        for i, l in enumerate(layers):
            heads, rows, dim = l.keys.shape
            k = np.ascontiguousarray(l.keys.transpose(1, 0, 2)).reshape(heads, rows, dim)
            v = np.ascontiguousarray(l.values.transpose(1, 0, 2)).reshape(heads, rows, l.values.shape[2])
            layers[i] = LayerKV(k, v, l.first_row)
    bad = _mutated(tiny_llama, prompt_file, tmp_path, misread)
    with pytest.raises(SpotCheckFailed, match="4 of 4 layers differ") as exc:
        _spot(bad, _engine("torch", tiny_llama))
    assert "worst layer" in str(exc.value) and "likely cause: every layer disagrees" in str(exc.value)


def test_spot_check_on_a_hybrid_model_catches_a_wrong_first_layer(tiny_hybrid, prompt_file, tmp_path):
    from muser_cli.errors import SpotCheckFailed

    good = _pack(tiny_hybrid.path, prompt_file, tmp_path)
    pack = read_pack_bytes(good.read_bytes())
    layers = [LayerKV(l.keys.copy(), l.values.copy(), l.first_row) for l in pack.layers]
    l0 = layers[0]
    layers[0] = LayerKV(l0.keys[:, ::-1].copy(), l0.values[:, ::-1].copy(), l0.first_row)  # ring rows reversed
    bad = _rewrite(good, tmp_path / "reversed.kvpack", layers=layers)
    assert pack.header.ring_extra == pack.header.rows_end  # the sliding history: every layer is checked
    with pytest.raises(SpotCheckFailed, match=r"of 4 layers differ.*(worst layer 0 \(sliding|first layer 0\))"):
        _spot(bad, _engine("torch", tiny_hybrid))


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_hybrid"])
@pytest.mark.parametrize("producer, consumer", [("torch", "mlx"), ("mlx", "torch")])
def test_spot_check_passes_honest_cross_engine_packs(request, which, prompt_file, tmp_path, producer, consumer):
    model = request.getfixturevalue(which)
    pytest.importorskip("mlx.core", reason="mlx not installed")
    pytest.importorskip("mlx_lm", reason="mlx-lm not installed")
    from muser_cli.gate.audit import spot_check_reason

    out = tmp_path / f"{producer}.kvpack"
    r = run(["prefill", "-m", model.path, "--engine", producer, "--chunk", "8", prompt_file, "-o", out])
    assert r.exit_code == 0, r.output
    h = read_pack_bytes(out.read_bytes()).header
    assert spot_check_reason(h, engine=consumer, dtype=h.dtype) == f"made by {producer}, decoded on {consumer}"
    res = _spot(out, _engine(consumer, model), positions=2)
    assert res.ok, res.layers
    assert res.checked == len(model.layers)  # torch and mlx both write the sliding history


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_hybrid"])
def test_int8_packs_pass_honestly_and_wrong_ones_do_not(request, which, prompt_file, tmp_path):
    """A quantized prefix perturbs every later layer's recomputation (a depth allowance on
    top of the quantization error); wrong rows are still far outside it."""
    from muser_cli.errors import SpotCheckFailed

    model = request.getfixturevalue(which)
    full = _pack(model.path, prompt_file, tmp_path)
    q8 = tmp_path / "q8.kvpack"
    assert run(["pack", "--quant", "int8", full, "-o", q8]).exit_code == 0
    code, audit, _ = _audit(model.path, q8, n=2)
    assert code == 0 and audit["ok"], audit
    res = _spot(q8, _engine("torch", model), positions=2)
    assert res.ok and all(l["tolerance"] >= res.tolerance for l in res.layers)
    pack = read_pack_bytes(q8.read_bytes())
    layers = list(pack.layers)
    layers[0] = LayerKV(layers[0].keys[:, ::-1].copy(), layers[0].values[:, ::-1].copy(), layers[0].first_row)
    from muser_cli.gate.audit import spot_check

    with pytest.raises(SpotCheckFailed):
        spot_check(replace(pack, layers=layers), _engine("torch", model), positions=2)
