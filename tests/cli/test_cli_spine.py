"""The spine through the command line: prefill | pack | verify | decode, fallback, refusals.

Exactness: on the same engine, dtype and threads, tokens decoded from a kvpack (file,
pipe, after pack) are identical to the local fallback path's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from muser_cli.commands import app
from handoff_kit import HANG_S

PROMPT = ("The committee met on a grey Tuesday to decide where the new bridge would go. "
          "After a long debate about costs, traffic and the river's spring floods, they chose")


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    p = tmp_path / "prompt.txt"
    p.write_text(PROMPT)
    return p


def run(args, input: bytes | None = None):
    runner = CliRunner()
    return runner.invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)


def muser(*args, input: bytes | None = None, env=None, check=False):
    cmd = [sys.executable, "-m", "muser_cli.commands", *map(str, args)]
    return subprocess.run(cmd, input=input, capture_output=True, env={**os.environ, **(env or {})}, check=check)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["tiny_llama", "tiny_hybrid"])
def test_handoff_equals_fallback_tiny(request, which, dtype, prompt_file, tmp_path):
    model = request.getfixturevalue(which)
    pack = tmp_path / "p.kvpack"
    r = run(["prefill", "-m", model.path, "--dtype", dtype, "--chunk", "8", prompt_file, "-o", pack])
    assert r.exit_code == 0, r.output
    v = run(["verify", "-m", model.path, "--prompt", prompt_file, pack, "--json"])
    assert v.exit_code == 0, v.output
    report = json.loads(v.stdout)
    assert report["ok"] and {c["name"] for c in report["checks"]} >= {"integrity", "model", "tokenizer", "structure", "prompt"}
    h = run(["decode", "-m", model.path, pack, "-n", "12", "--json"])
    assert h.exit_code == 0, h.output
    f = run(["decode", "-m", model.path, "--dtype", dtype, "--chunk", "8", "--prompt", prompt_file, "-n", "12", "--json"],
            input=b"")
    assert f.exit_code == 0, f.output
    hj, fj = json.loads(h.stdout), json.loads(f.stdout)
    assert hj["fallback"] is False and fj["fallback"] is True
    assert hj["token_ids"] == fj["token_ids"] and len(hj["token_ids"]) > 0
    for key in ("text", "token_ids", "fallback", "load_s", "prefill_s", "ttft_s", "decode_tok_s"):
        assert key in hj
    # pack re-encodes faithfully: same tokens after a zstd round
    packed = tmp_path / "z.kvpack"
    assert run(["pack", pack, "-o", packed, "--zstd", "3"]).exit_code == 0
    z = run(["decode", "-m", model.path, packed, "-n", "12", "--json"])
    assert json.loads(z.stdout)["token_ids"] == hj["token_ids"]


def test_pipeline_and_stdin(tiny_hybrid, prompt_file, tmp_path):
    """prefill | pack | verify | decode as real processes joined by pipes."""
    m = str(tiny_hybrid.path)
    p1 = subprocess.Popen([sys.executable, "-m", "muser_cli.commands", "prefill", "-m", m, "--chunk", "8",
                           str(prompt_file)], stdout=subprocess.PIPE)
    p2 = subprocess.Popen([sys.executable, "-m", "muser_cli.commands", "pack"], stdin=p1.stdout, stdout=subprocess.PIPE)
    p3 = subprocess.Popen([sys.executable, "-m", "muser_cli.commands", "verify", "-m", m], stdin=p2.stdout,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p4 = subprocess.Popen([sys.executable, "-m", "muser_cli.commands", "decode", "-m", m, "-n", "8", "--json"],
                          stdin=p3.stdout, stdout=subprocess.PIPE)
    for p in (p1, p2, p3):
        p.stdout.close()
    out, _ = p4.communicate(timeout=HANG_S)
    assert [p.wait() for p in (p1, p2, p3)] == [0, 0, 0] and p4.returncode == 0
    assert b"verified" in p3.stderr.read()
    piped = json.loads(out)
    fb = muser("decode", "-m", m, "--chunk", "8", "--prompt", prompt_file, "-n", "8", "--json", input=b"")
    assert fb.returncode == 0 and b"fallback" in fb.stderr
    assert json.loads(fb.stdout)["token_ids"] == piped["token_ids"]


# ------------------------------------------------------------ identity refusals
def test_refuses_other_model_and_prompt(tiny_llama, tiny_hybrid, prompt_file, tmp_path):
    pack = tmp_path / "p.kvpack"
    assert run(["prefill", "-m", tiny_llama.path, prompt_file, "-o", pack]).exit_code == 0
    v = run(["verify", "-m", tiny_hybrid.path, pack, "--json"])
    assert v.exit_code == 65 and not json.loads(v.stdout)["ok"]
    d = run(["decode", "-m", tiny_hybrid.path, pack])
    assert d.exit_code == 65 and d.stdout == "" and "model mismatch" in d.stderr
    other = tmp_path / "other.txt"
    other.write_text(PROMPT.replace("bridge", "tunnel"))
    v = run(["verify", "-m", tiny_llama.path, "--prompt", other, pack])
    assert v.exit_code == 65 and "prompt" in v.stderr
    # issue 29 item 3 (docs/cli-contract.md, one rule): with --prompt the pack is set aside for a
    # local prefill, with one warning naming why; --strict keeps the refusal
    d = run(["decode", "-m", tiny_llama.path, "--prompt", other, pack])
    assert d.exit_code == 0 and d.stdout and "set aside" in d.stderr and "prompt" in d.stderr
    d = run(["decode", "-m", tiny_llama.path, "--prompt", other, "--strict", pack])
    assert d.exit_code == 65 and d.stdout == ""


# ------------------------------------------------------------ bad input
def test_bad_packs_give_one_line_and_65(tiny_llama, prompt_file, tmp_path):
    pack = tmp_path / "p.kvpack"
    assert run(["prefill", "-m", tiny_llama.path, prompt_file, "-o", pack]).exit_code == 0
    data = pack.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    cases = {"truncated": data[: len(data) - 100], "flipped": bytes(flipped), "garbage": b"GET / HTTP/1.1\r\n\r\n",
             "trailing": data + b"x"}
    for name, blob in cases.items():
        d = run(["decode", "-m", tiny_llama.path, "-"], input=blob)
        assert d.exit_code == 65, (name, d.output)
        assert d.stdout == "", name
        lines = [l for l in d.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("muser: error:") and "Traceback" not in d.stderr, (name, d.stderr)
        out = tmp_path / f"{name}.out"
        r = run(["pack", "-", "-o", out], input=blob)
        assert r.exit_code == 65 and not out.exists(), name
        assert not list(tmp_path.glob(f".{name}.out*")), "temporary file left behind"


def test_missing_things(tiny_llama, prompt_file, tmp_path):
    r = run(["decode", "-m", tmp_path / "nope", "--prompt", prompt_file])
    assert r.exit_code == 66 and "Traceback" not in r.stderr
    r = run(["decode", "-m", tiny_llama.path, tmp_path / "absent.kvpack"])
    assert r.exit_code == 66
    r = run(["decode", "-m", tiny_llama.path, "-"], input=b"")
    assert r.exit_code == 66 and "--prompt" in r.stderr
    out = tmp_path / "never.kvpack"
    r = run(["prefill", "-m", tmp_path / "nope", prompt_file, "-o", out])
    assert r.exit_code == 66 and not out.exists()


def test_prompt_longer_than_context(tiny_llama, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * (tiny_llama.max_positions * 2))
    out = tmp_path / "x.kvpack"
    r = run(["prefill", "-m", tiny_llama.path, long, "-o", out])
    assert r.exit_code == 65 and "context" in r.stderr and not out.exists()


def test_missing_file_with_prompt_falls_back(tiny_llama, prompt_file, tmp_path):
    r = run(["decode", "-m", tiny_llama.path, tmp_path / "not-yet.kvpack", "--prompt", prompt_file, "-n", "4", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["fallback"] is True and "fallback" in r.stderr


def test_binary_never_to_a_terminal(tiny_llama, prompt_file):
    import pty

    master, slave = pty.openpty()
    try:
        p = subprocess.run([sys.executable, "-m", "muser_cli.commands", "prefill", "-m", str(tiny_llama.path),
                            str(prompt_file)], stdout=slave, stderr=subprocess.PIPE, timeout=HANG_S)
    finally:
        os.close(slave)
        os.close(master)
    assert p.returncode == 2 and b"terminal" in p.stderr


# ------------------------------------------------------------ the real model
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_real_model_lane_bit_identical(real_model, dtype, tmp_path):
    prompt = tmp_path / "q.txt"
    prompt.write_text("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is")
    m = str(real_model.path)
    p1 = subprocess.Popen([sys.executable, "-m", "muser_cli.commands", "prefill", "-m", m, "--dtype", dtype,
                           "--chunk", "8", str(prompt)], stdout=subprocess.PIPE)
    p2 = subprocess.Popen([sys.executable, "-m", "muser_cli.commands", "pack"], stdin=p1.stdout, stdout=subprocess.PIPE)
    p1.stdout.close()
    d = subprocess.run([sys.executable, "-m", "muser_cli.commands", "decode", "-m", m, "-n", "10", "--json"],
                       stdin=p2.stdout, capture_output=True, timeout=HANG_S)
    p2.stdout.close()
    assert p1.wait() == 0 and p2.wait() == 0 and d.returncode == 0, d.stderr
    fb = muser("decode", "-m", m, "--dtype", dtype, "--chunk", "8", "--prompt", prompt, "-n", "10", "--json", input=b"")
    assert fb.returncode == 0, fb.stderr
    h, f = json.loads(d.stdout), json.loads(fb.stdout)
    assert h["token_ids"] == f["token_ids"]
    assert "Madrid" in h["text"]
