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
    from muser_cli.tinymodels import make_tiny_llama

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
