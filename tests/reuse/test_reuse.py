"""Reuse and delta handoff through the command line, on real engines.

Exactness: the stored prefix + a delta reassembles to the very KV bytes of one full
pack, and decodes to the very tokens of the full handoff and of a cold local prefill;
warm starts from the store (full and partial hits) give the cold path's tokens too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from muser_cli.commands import app
from muser_cli.kvpack import read_pack_bytes
from muser_cli.kvpack.layers import ring_tail
from muser_cli.reuse import Store, resolve_delta
from test_reuse_store import expected_delta_bytes
from handoff_kit import HANG_S

DOC = ("The producer computes the prompt once and ships its keys and values to the consumer. "
       "The consumer checks every frame, installs the rows and decodes the next token itself.")
MORE = (" A sliding window layer keeps only the last few rows; a full attention layer keeps them all. "
        "When the network fails, the consumer falls back to a local prefill and still answers.")


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    # Bit-exactness holds on one engine, dtype and thread count; one thread is also the
    # fastest on a shared 2-core machine.
    monkeypatch.setenv("MUSER_THREADS", "1")


@pytest.fixture
def docs(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "doc.txt", tmp_path / "doc2.txt"
    a.write_text(DOC)
    b.write_text(DOC + MORE)
    return a, b


def run(*args, input: bytes | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)


def ok(*args, **kw):
    r = run(*args, **kw)
    assert r.exit_code == 0, r.output
    return r


def decode_json(*args, **kw) -> dict:
    return json.loads(ok("decode", *args, "--json", **kw).stdout)


def same_kv(a, b) -> None:
    for got, want in zip(a, b):
        assert got.first_row == want.first_row
        assert np.array_equal(got.keys, want.keys) and np.array_equal(got.values, want.values)


def test_delta_lane_hybrid(tiny_hybrid, docs, tmp_path):
    """reuse put → reuse have → prefill --have | pack --have → decode: exact, and the delta
    is the formula to the byte (sliding rings whole, full-attention rows only past `held`)."""
    m, (doc, doc2) = tiny_hybrid.path, docs
    pre, full, have = tmp_path / "doc.kvpack", tmp_path / "full.kvpack", tmp_path / "have.json"
    ok("prefill", "-m", m, "--chunk", "8", doc, "-o", pre)
    assert "stored" in ok("reuse", "put", pre).stderr
    ok("reuse", "have", "-m", m, doc2, "-o", have)
    manifest = json.loads(have.read_text())
    held = manifest["held_tokens"]
    assert manifest["format"] == "muser-have" and held > 0 and held % 8 == 0 and not manifest["complete"]
    assert manifest["entry"]["chunk_tokens"] == 8 and manifest["entry"]["chain"].startswith("sha256:")

    # producer: only the suffix, as a delta; the same bytes as cutting the full pack
    delta = tmp_path / "delta.kvpack"
    ok("prefill", "-m", m, doc2, "--have", have, "-o", delta)
    ok("prefill", "-m", m, "--chunk", "8", doc2, "-o", full)
    cut = tmp_path / "cut.kvpack"
    ok("pack", "--no-zstd", "--have", have, full, "-o", cut)
    assert cut.read_bytes() == delta.read_bytes()
    d = read_pack_bytes(delta.read_bytes())
    assert d.header.rows_start == held and d.header.base["chain"] == manifest["entry"]["chain"]
    assert len(delta.read_bytes()) == expected_delta_bytes(d.header)[0]

    # consumer: stored prefix + delta == the full pack's KV, and the same tokens
    merged, entry = resolve_delta(d, Store())
    assert entry == manifest["entry"]["id"]
    # the full pack carries its sliding history (every row); the merged rings start where the delta's do
    want = read_pack_bytes(full.read_bytes()).layers
    same_kv(merged, [ring_tail(w, m.first_row, w.first_row + w.keys.shape[1]) for m, w in zip(merged, want)])
    zd = tmp_path / "delta.z.kvpack"
    ok("pack", "--have", have, delta, "-o", zd)  # compressed on the wire, same rows
    v = ok("verify", "-m", m, zd, "--json")
    assert {c["name"]: c["ok"] for c in json.loads(v.stdout)["checks"]}["base"] is True
    via_delta = decode_json("-m", m, zd, "-n", "12")
    via_full = decode_json("-m", m, full, "-n", "12")
    cold = decode_json("-m", m, "--chunk", "8", "--no-reuse", "--prompt", doc2, "-n", "12", input=b"")
    assert via_delta["source"] == "delta" and via_delta["reuse"]["held_tokens"] == held
    assert via_delta["token_ids"] == via_full["token_ids"] == cold["token_ids"]

    # warm: the exact prompt in the store decodes with no prefill at all
    warm = decode_json("-m", m, "--prompt", doc, "-n", "12", input=b"")
    cold = decode_json("-m", m, "--chunk", "8", "--no-reuse", "--prompt", doc, "-n", "12", input=b"")
    assert warm["source"] == "store" and warm["reuse"]["computed_tokens"] == 0
    assert warm["token_ids"] == cold["token_ids"]


def test_partial_hit_and_producer_resume(tiny_llama, docs, tmp_path):
    """All-full-attention model: any stored chunk boundary resumes a prefill exactly."""
    m, (doc, doc2) = tiny_llama.path, docs
    ok("prefill", "-m", m, "--chunk", "8", "--store", doc, "-o", tmp_path / "doc.kvpack")
    warm = decode_json("-m", m, "--prompt", doc2, "-n", "12", input=b"")
    cold = decode_json("-m", m, "--chunk", "8", "--no-reuse", "--prompt", doc2, "-n", "12", input=b"")
    assert warm["source"] == "store+local" and 0 < warm["reuse"]["held_tokens"] < warm["prompt_tokens"] - 1
    assert warm["token_ids"] == cold["token_ids"]
    # the producer starts from its own store: fewer tokens computed, the same bytes
    resumed, plain = tmp_path / "resumed.kvpack", tmp_path / "plain.kvpack"
    r = ok("prefill", "-m", m, "--chunk", "8", "--reuse", "--json", doc2, "-o", resumed)
    assert json.loads(r.stdout)["reused_tokens"] == warm["reuse"]["held_tokens"]
    ok("prefill", "-m", m, "--chunk", "8", doc2, "-o", plain)
    assert resumed.read_bytes() == plain.read_bytes()
    # decode --store keeps the whole prompt: the manifest is then complete (no producer needed)
    decode_json("-m", m, plain, "-n", "2", "--store")
    manifest = json.loads(ok("reuse", "have", "-m", m, doc2).stdout)
    assert manifest["complete"] and manifest["held_tokens"] == manifest["prompt_tokens"] - 1
    ls = json.loads(ok("reuse", "ls", "--json", "-m", m).stdout)["entries"]
    assert len(ls) == 2 and {e["tokens"] for e in ls} == {manifest["prompt_tokens"], len(read_pack_bytes(
        (tmp_path / "doc.kvpack").read_bytes()).header.token_ids)}


def test_refusals_and_fallbacks(tiny_hybrid, tiny_llama, docs, tmp_path, monkeypatch):
    m, (doc, doc2) = tiny_hybrid.path, docs
    pre, have, delta = tmp_path / "doc.kvpack", tmp_path / "have.json", tmp_path / "delta.kvpack"
    ok("prefill", "-m", m, "--chunk", "8", "--store", doc, "-o", pre)
    ok("reuse", "have", "-m", m, doc2, "-o", have)
    ok("prefill", "-m", m, doc2, "--have", have, "-o", delta)
    # a manifest for another model, another prompt, or not a manifest: refused (65), nothing written
    out = tmp_path / "never.kvpack"
    r = run("prefill", "-m", tiny_llama.path, doc2, "--have", have, "-o", out)
    assert r.exit_code == 65 and "manifest is for model" in r.stderr and not out.exists()
    r = run("pack", "--have", have, delta, "-o", out)
    assert r.exit_code == 0  # the same consumer again: the delta passes through
    r = run("prefill", "-m", m, doc, "--have", have, "-o", out)
    assert r.exit_code == 65 and "prompt" in r.stderr
    junk = tmp_path / "junk.json"
    junk.write_text('{"format": "muser-have", "version": [9, 0]}')
    r = run("pack", "--have", junk, delta, "-o", out)
    assert r.exit_code == 65 and "version" in r.stderr

    # another consumer, whose store lacks the base: refused with a hint, or with --prompt a fallback
    monkeypatch.setenv("MUSER_HOME", str(tmp_path / "other-home"))
    r = run("decode", "-m", m, delta, "-n", "4")
    assert r.exit_code == 65 and r.stdout == "" and "does not hold" in r.stderr and "hint:" in r.stderr
    r = run("verify", "-m", m, delta)
    assert r.exit_code == 65 and "FAIL base" in r.stdout
    fb = decode_json("-m", m, delta, "--prompt", doc2, "-n", "8")
    assert fb["fallback"] and fb["source"] == "local" and "does not hold" in fb["reason"]

    # back home: a corrupt stored pack is found, reported, removed, and never used
    monkeypatch.setenv("MUSER_HOME", str(tmp_path / "muser-home"))
    store = Store()
    (entry,) = store.entries()
    path = store.pack_path(entry.id)
    blob = bytearray(path.read_bytes())
    blob[-200] ^= 0x40
    path.write_bytes(bytes(blob))
    r = run("decode", "-m", m, "--prompt", doc, "-n", "4", "--json", input=b"")
    assert r.exit_code == 0 and json.loads(r.stdout)["source"] == "local"
    assert "removed store entry" in r.stderr and Store().entries() == []
    r = run("decode", "-m", m, delta, "-n", "4")
    assert r.exit_code == 65 and "does not hold" in r.stderr


def test_pipeline_processes(tiny_hybrid, docs, tmp_path):
    """The brief's shell lines as real processes: prefill --have | pack --have > delta; decode."""
    m, (doc, doc2) = str(tiny_hybrid.path), docs
    mu = [sys.executable, "-m", "muser_cli.commands"]
    env_run = dict(capture_output=True, timeout=HANG_S)
    assert subprocess.run([*mu, "prefill", "-m", m, "--chunk", "8", "--store", str(doc), "-o",
                           str(tmp_path / "d.kvpack")], **env_run).returncode == 0
    have = subprocess.run([*mu, "reuse", "have", "-m", m, str(doc2)], **env_run)
    assert have.returncode == 0 and json.loads(have.stdout)["held_tokens"] > 0
    (tmp_path / "have.json").write_bytes(have.stdout)
    p1 = subprocess.Popen([*mu, "prefill", "-m", m, str(doc2), "--have", str(tmp_path / "have.json")],
                          stdout=subprocess.PIPE)
    with open(tmp_path / "delta.kvpack", "wb") as f:
        p2 = subprocess.run([*mu, "pack", "--have", str(tmp_path / "have.json")], stdin=p1.stdout, stdout=f,
                            stderr=subprocess.PIPE, timeout=HANG_S)
    p1.stdout.close()
    assert p1.wait() == 0 and p2.returncode == 0 and b"delta from token" in p2.stderr
    d = subprocess.run([*mu, "decode", "-m", m, str(tmp_path / "delta.kvpack"), "-n", "8", "--json"], **env_run)
    assert d.returncode == 0, d.stderr
    cold = subprocess.run([*mu, "decode", "-m", m, "--chunk", "8", "--no-reuse", "--prompt", str(doc2), "-n", "8",
                           "--json"], input=b"", **env_run)
    assert json.loads(d.stdout)["token_ids"] == json.loads(cold.stdout)["token_ids"]


@pytest.mark.slow
def test_real_model_delta_and_warm_start(real_model, tmp_path):
    """SmolLM2: stored prefix + delta == one full pack, byte for byte; same tokens; then warm."""
    m = real_model.path
    doc, doc2 = tmp_path / "doc.txt", tmp_path / "doc2.txt"
    doc.write_text("The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is Berlin.")
    doc2.write_text(doc.read_text() + " The capital of Spain is")
    have, delta, full = tmp_path / "have.json", tmp_path / "delta.kvpack", tmp_path / "full.kvpack"
    ok("prefill", "-m", m, "--chunk", "8", "--store", doc, "-o", tmp_path / "doc.kvpack")
    ok("reuse", "have", "-m", m, doc2, "-o", have)
    held = json.loads(have.read_text())["held_tokens"]
    assert held >= 16
    r = ok("prefill", "-m", m, doc2, "--have", have, "--json", "-o", delta)
    assert json.loads(r.stdout)["reused_tokens"] == held  # the producer resumed from its own store
    ok("prefill", "-m", m, "--chunk", "8", doc2, "-o", full)
    d = read_pack_bytes(delta.read_bytes())
    merged, _ = resolve_delta(d, Store())
    same_kv(merged, read_pack_bytes(full.read_bytes()).layers)
    via_delta = decode_json("-m", m, delta, "-n", "8", "--store")
    via_full = decode_json("-m", m, full, "-n", "8")
    assert via_delta["token_ids"] == via_full["token_ids"] and "Madrid" in via_delta["text"]
    warm = decode_json("-m", m, "--prompt", doc2, "-n", "8", input=b"")
    assert warm["source"] == "store" and warm["token_ids"] == via_full["token_ids"]
