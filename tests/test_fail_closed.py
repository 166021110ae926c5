"""Fail closed everywhere (#17): stale parts, out-of-vocabulary ids, honest exit statuses,
a broken store index, bundle integrity, one-line usage errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from muser_cli.fsio import atomic_writer, sweep_stale_parts

PY = sys.executable


def _child_writer(path: Path, *, payload: int = 1 << 20) -> subprocess.Popen:
    """A real process that starts an atomic write of ``path``, says so, and waits to be killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from muser_cli.fsio import atomic_writer
        with atomic_writer({str(path)!r}) as out:
            out.write(b"x" * {payload})
            out.flush()
            print("ready", flush=True)
            time.sleep(120)
    """)
    proc = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _parts(directory: Path, name: str) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith(f".{name}.") and p.name.endswith(".part"))


# ----------------------------------------------------------------------------- 2. stale parts
def test_killed_writer_leaves_a_findable_part_that_the_next_writer_removes(tmp_path):
    final = tmp_path / "x.kvpack"
    proc = _child_writer(final)
    parts = _parts(tmp_path, final.name)
    assert len(parts) == 1 and f".{proc.pid}-" in parts[0].name  # the owner pid is in the name
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not final.exists()  # never published
    assert _parts(tmp_path, final.name) == parts  # left behind by SIGKILL

    with atomic_writer(final) as out:  # the next writer of the same path sweeps it
        assert _parts(tmp_path, final.name) != parts
        out.write(b"good")
    assert final.read_bytes() == b"good"
    assert _parts(tmp_path, final.name) == []


def test_a_live_writers_part_is_never_swept_even_when_old(tmp_path):
    final = tmp_path / "y.kvpack"
    proc = _child_writer(final)
    try:
        (part,) = _parts(tmp_path, final.name)
        old = time.time() - 10 * 24 * 3600
        os.utime(part, (old, old))  # older than any age bound: only the lock protects it
        assert sweep_stale_parts(tmp_path, final.name) == []
        assert part.exists()
        # Another path's writer does not touch it either.
        with atomic_writer(tmp_path / "other.kvpack") as out:
            out.write(b"o")
        assert part.exists()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert sweep_stale_parts(tmp_path, final.name) == [part]
    assert not final.exists()


def test_unlocked_parts_fall_to_pid_and_age_rules(tmp_path):
    name = "z.kvpack"
    sleeper = subprocess.Popen([PY, "-c", "import time; time.sleep(120)"])
    try:
        live = tmp_path / f".{name}.{sleeper.pid}-{'a' * 16}.part"  # a live pid, no lock (e.g. a receiver's spool)
        live.write_bytes(b"1")
        legacy = tmp_path / f".{name}.ab12CD_x.part"  # tempfile.mkstemp name of older versions
        legacy.write_bytes(b"2")
        unrelated = tmp_path / ".notes.txt.1-" "0123456789abcdef.part"
        unrelated.write_bytes(b"3")
        assert sweep_stale_parts(tmp_path, name) == []  # young and (for all we know) owned
        old = time.time() - 2 * 24 * 3600
        os.utime(legacy, (old, old))
        assert sweep_stale_parts(tmp_path, name) == [legacy]
        assert sweep_stale_parts(tmp_path, name, max_age_s=0, now=time.time() + 1) == [live]
        assert unrelated.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    dead = tmp_path / f".{name}.{sleeper.pid}-{'b' * 16}.part"
    dead.write_bytes(b"4")
    assert sweep_stale_parts(tmp_path, name) == [dead]  # owner gone: stale at once


# ----------------------------------------------------------------------------- CLI helpers
PROMPT = ("The committee met on a grey Tuesday to decide where the new bridge would go. "
          "After a long debate about costs, traffic and the river's spring floods, they chose")


def run(*args, input: bytes | None = None, env: dict | None = None):
    from typer.testing import CliRunner

    from muser_cli.commands import app

    return CliRunner().invoke(app, [str(a) for a in args], input=input, env=env, catch_exceptions=False)


def refused(r, status: int, *needles: str) -> None:
    """Exit ``status``, one error line (plus nothing framed), no 'internal error', each needle in it."""
    assert r.exit_code == status, (r.exit_code, r.output)
    lines = [line for line in r.stderr.splitlines() if line.startswith("muser: error:")]
    assert len(lines) == 1, r.stderr
    assert "internal error" not in r.output and "Traceback" not in r.output
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    p = tmp_path / "prompt.txt"
    p.write_text(PROMPT)
    return p


@pytest.fixture
def tiny_pack(tiny_llama, prompt_file, tmp_path) -> Path:
    out = tmp_path / "p.kvpack"
    r = run("prefill", "-m", tiny_llama.path, "--chunk", "8", prompt_file, "-o", out)
    assert r.exit_code == 0, r.output
    return out


def forge_ids(src: Path, dst: Path, edit) -> list[int]:
    """Re-sign ``src`` with its token ids edited by ``edit(ids)``: every digest right, the ids wrong."""
    from dataclasses import replace

    from muser_cli.kvpack import read_pack, write_pack

    with open(src, "rb") as f:
        pack = read_pack(f)
    ids = list(pack.header.token_ids)
    edit(ids)
    with open(dst, "wb") as f:
        write_pack(f, replace(pack.header, token_ids=tuple(ids)), pack.layers)
    return ids


# ----------------------------------------------------------------------------- 3. vocabulary
def test_model_info_carries_the_vocabulary(tiny_llama, tiny_hybrid):
    import json

    for info in (tiny_llama, tiny_hybrid):
        assert info.vocab_size == json.loads((info.path / "config.json").read_text())["vocab_size"] > 0


@pytest.mark.parametrize("where", ["last", "middle"])
def test_out_of_vocabulary_ids_fail_verify_and_decode(tiny_llama, tiny_pack, tmp_path, where):
    bad = tmp_path / "bad.kvpack"

    def edit(ids):
        if where == "last":
            ids[-1] = 2**31 - 1
        else:
            ids[len(ids) // 2] = 2**30

    forge_ids(tiny_pack, bad, edit)
    v = run("verify", "-m", tiny_llama.path, bad, "--json")
    assert v.exit_code == 65
    import json

    report = json.loads(v.stdout)
    tokens = {c["name"]: c for c in report["checks"]}["tokens"]
    assert tokens["ok"] is False and "outside the model's vocabulary" in tokens["detail"]
    refused(run("verify", "-m", tiny_llama.path, bad), 65, "tokens", "vocabulary")
    d = run("decode", "-m", tiny_llama.path, bad, "-n", "4")
    refused(d, 65, "vocabulary")
    assert d.stdout == ""  # nothing decoded
    # the honest pack passes the same check
    ok = json.loads(run("verify", "-m", tiny_llama.path, tiny_pack, "--json").stdout)
    assert {c["name"]: c["ok"] for c in ok["checks"]}["tokens"] is True


def test_reuse_put_refuses_out_of_vocabulary_ids(tiny_llama, tiny_pack, tmp_path):
    bad = tmp_path / "bad.kvpack"
    forge_ids(tiny_pack, bad, lambda ids: ids.__setitem__(3, tiny_llama.vocab_size))
    refused(run("reuse", "put", "-m", tiny_llama.path, bad), 65, "vocabulary")
    refused(run("reuse", "put", bad), 65, "vocabulary")  # the model is known here by its fingerprint
    import json

    assert json.loads(run("reuse", "ls", "--json").stdout)["entries"] == []  # nothing was stored
    assert run("reuse", "put", tiny_pack).exit_code == 0  # the honest pack is stored


def test_reuse_put_of_an_unknown_models_pack_is_refused(tmp_path):
    from kvpack_factory import make_pack

    data, _, _ = make_pack(17, layers=None)
    src = tmp_path / "synthetic.kvpack"
    src.write_bytes(data)
    refused(run("reuse", "put", src), 65, "not known on this machine")
