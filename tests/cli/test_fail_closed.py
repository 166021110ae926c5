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
from handoff_kit import HANG_S

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


def muser(*args, input: bytes | None = None, timeout: float = HANG_S):
    """``muser ARGS`` in a real child process (same MUSER_HOME as the test); stdout/stderr as text."""
    return subprocess.run([PY, "-m", "muser_cli.commands", *map(str, args)], input=input, capture_output=True,
                          timeout=timeout, env=dict(os.environ))


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


def test_known_model_finds_an_unchanged_folder_by_fingerprint(tiny_llama, tmp_path):
    import shutil

    from muser_cli.model.resolve import known_model, resolve_model

    folder = tmp_path / "copy"
    shutil.copytree(tiny_llama.path, folder, ignore=shutil.ignore_patterns(".muser-*"))
    info = resolve_model(folder)
    assert known_model(info.fingerprint).path == folder.resolve()
    assert known_model("sha256:" + "0" * 64) is None
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")  # changed since hashed
    assert known_model(info.fingerprint) is None


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


# ----------------------------------------------------------------------------- 4. honest exit statuses
MORE = " The engineers then spent the winter drawing the piers, the deck and the long approach roads."


def test_have_manifest_with_an_unknown_dtype_is_data_not_usage(tiny_llama, prompt_file, tiny_pack, tmp_path):
    import json

    m = tiny_llama.path
    assert run("reuse", "put", tiny_pack).exit_code == 0
    longer = tmp_path / "longer.txt"
    longer.write_text(PROMPT + MORE)
    have = tmp_path / "have.json"
    assert run("reuse", "have", "-m", m, longer, "-o", have).exit_code == 0
    manifest = json.loads(have.read_text())
    assert manifest["held_tokens"] > 0
    manifest["entry"]["dtype"] = "float64"
    have.write_text(json.dumps(manifest))
    out = tmp_path / "delta.kvpack"
    refused(run("prefill", "-m", m, longer, "--have", have, "-o", out), 65, "dtype", "float64")
    assert "--dtype" not in run("prefill", "-m", m, longer, "--have", have, "-o", out).stderr
    refused(run("pack", "--have", have, tiny_pack, "-o", out), 65, "float64")
    assert not out.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage-header", "huge-length", "empty"])
def test_corrupt_weights_file_is_one_line_65(tiny_llama, tiny_pack, prompt_file, tmp_path, damage):
    import shutil

    folder = tmp_path / "broken-model"
    shutil.copytree(tiny_llama.path, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "garbage-header":
        data = data[:8] + b"\x00garbage" + data[16:]
    elif damage == "huge-length":
        data = (2**63).to_bytes(8, "little") + data[8:]
    else:
        data = b""
    weights.write_bytes(data)
    refused(run("verify", "-m", folder, tiny_pack), 65, "corrupt weights file", "model.safetensors")
    refused(run("decode", "-m", folder, "--prompt", prompt_file, "-n", "2", input=b""), 65, "corrupt weights file")
    refused(run("prefill", "-m", folder, prompt_file, "-o", tmp_path / "x.kvpack"), 65, "corrupt weights file")


@pytest.mark.parametrize("kind", ["random", "magic-then-garbage", "truncated-real"])
def test_a_broken_gguf_is_one_line_65(prompt_file, tmp_path, kind):
    bad = tmp_path / f"{kind}.gguf"
    if kind == "random":
        bad.write_bytes(os.urandom(5000))
    elif kind == "magic-then-garbage":
        bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    else:
        from muser_cli.errors import MissingInput
        from muser_cli.model.resolve import default_gguf

        try:
            real = default_gguf()
        except MissingInput:
            pytest.skip("the embedded GGUF is not installed")
        with open(real, "rb") as f:
            bad.write_bytes(f.read(1 << 16))  # the header and part of the metadata, no tensors
    refused(run("decode", "-m", bad, "--prompt", prompt_file, "-n", "2", input=b""), 65, "cannot convert", str(bad))


def test_output_onto_a_directory_or_into_a_missing_folder(tiny_llama, tiny_pack, prompt_file, tmp_path):
    m = tiny_llama.path
    folder = tmp_path / "out-dir"
    folder.mkdir()
    missing = tmp_path / "no-such-folder" / "x.kvpack"
    for cmd in (["prefill", "-m", m, prompt_file], ["pack", tiny_pack], ["verify", "-m", m, tiny_pack]):
        r = run(*cmd, "-o", folder)
        refused(r, 2, str(folder), "is a directory")
        assert ".part" not in r.output and "verified" not in r.output
        r = run(*cmd, "-o", missing)
        refused(r, 66, str(missing), "does not exist")
        assert ".part" not in r.output and "verified" not in r.output
    assert list(folder.iterdir()) == [] and not missing.parent.exists()
    # a device is written in place, never replaced: /dev/null takes it, /dev/full is a one-line 1
    assert run("pack", tiny_pack, "-o", "/dev/null").exit_code == 0
    refused(run("pack", tiny_pack, "-o", "/dev/full"), 1, "/dev/full", "No space left")
    assert Path("/dev/null").is_char_device()


def test_unreadable_input_is_66(tiny_pack, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    locked = tmp_path / "locked.kvpack"
    locked.write_bytes(tiny_pack.read_bytes())
    locked.chmod(0)
    refused(run("pack", locked, "-o", tmp_path / "y.kvpack"), 66, "permission denied")


# ----------------------------------------------------------------------------- 5. broken store index
@pytest.mark.parametrize("garbage", ["random-bytes", "wrong-schema"])
def test_a_garbage_store_index_never_blocks_decode(tiny_llama, tiny_pack, prompt_file, tmp_path, garbage):
    import json
    import sqlite3

    from muser_cli.paths import store_dir

    m = tiny_llama.path
    clean = json.loads(run("decode", "-m", m, "--prompt", prompt_file, "-n", "6", "--json", "--no-reuse",
                           "--chunk", "8", input=b"").stdout)
    assert run("reuse", "put", tiny_pack).exit_code == 0
    index = store_dir() / "index.sqlite3"
    for suffix in ("-wal", "-shm"):
        Path(f"{index}{suffix}").unlink(missing_ok=True)
    if garbage == "random-bytes":
        index.write_bytes(os.urandom(4096))
    else:
        index.unlink()
        db = sqlite3.connect(index)
        db.execute("CREATE TABLE entries (x)")
        db.execute("PRAGMA user_version=7")
        db.commit()
        db.close()
    r = muser("decode", "-m", m, "--prompt", prompt_file, "-n", "6", "--json", input=b"")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == clean["token_ids"]  # the same answer
    assert b"rebuilt from 1 verified pack" in r.stderr and b"internal error" not in r.stderr
    assert out["source"] == "store"  # the rebuilt index found the stored entry again
    assert any(p.name.startswith("index.sqlite3.broken-") for p in store_dir().iterdir())  # kept for a post-mortem
    assert len(json.loads(run("reuse", "ls", "--json").stdout)["entries"]) == 1


def test_an_unrepairable_store_is_bypassed_with_a_warning(tiny_llama, prompt_file, tmp_path):
    import json

    from muser_cli.paths import store_dir

    m = tiny_llama.path
    root = store_dir()
    root.mkdir(parents=True)
    (root / "index.sqlite3").write_bytes(b"not a database at all" * 100)
    (root / "packs").write_text("a file where the packs folder should be")  # rebuilding cannot list packs
    (root / "lock").mkdir()  # nor take the store's lock
    r = muser("decode", "-m", m, "--prompt", prompt_file, "-n", "4", "--json", input=b"")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["source"] == "local" and b"bypassed" in r.stderr


# ----------------------------------------------------------------------------- 7. one-line usage errors
@pytest.mark.parametrize("args, needle, path", [
    (["decode", "--bogus"], "No such option: --bogus", "muser decode"),
    (["decode", "-n"], "'-n' requires an argument", "muser decode"),
    (["reuse", "get"], "Missing argument", "muser reuse get"),
    (["node", "join"], "Missing argument", "muser node join"),
    (["verify", "--audit", "many"], "Invalid value for '--audit'", "muser verify"),
    (["frobnicate"], "No such command 'frobnicate'", "muser"),
    (["-q", "prefill", "--chunk", "eight", "x.txt"], "Invalid value for '--chunk'", "muser prefill"),
])
def test_usage_errors_are_one_line_with_a_help_hint(args, needle, path):
    p = muser(*args, input=b"", timeout=HANG_S)
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert err.count("\n") == 1 and p.stdout == b"", err  # one line, no framed panel
    assert err.startswith("muser: error: ") and needle in err and f"(hint: {path} --help)" in err, err
    assert "╭" not in err and "Usage:" not in err and "internal error" not in err
    r = run(*args)  # the same through the in-process runner (what the other tests use)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and needle in r.stderr


def test_help_and_version_still_exit_0():
    assert muser("decode", "--help").returncode == 0
    v = muser("--version")
    assert v.returncode == 0 and v.stdout.startswith(b"muser ")


# ----------------------------------------------------------------------------- every remote exit status
def _one_line(proc, status: int, needle: str) -> None:
    err = proc.stderr.decode() if isinstance(proc.stderr, bytes) else proc.stderr
    assert proc.returncode == status, (proc.returncode, err)
    lines = [line for line in err.splitlines() if line.startswith("muser: error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert "internal error" not in err and "Traceback" not in err


def _tls12_server(identity_dir: Path):
    """A TLS server on loopback that offers only TLS 1.2 (muser speaks 1.3 only)."""
    import contextlib
    import socket
    import ssl
    import threading

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(identity_dir / "node.pem", identity_dir / "node.key")
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with contextlib.suppress(OSError, ssl.SSLError):
                with ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return srv, stop, thread


def test_remote_exit_statuses_75_76_77_78_are_one_line(tmp_path):
    import socket

    from kvpack_factory import make_pack
    from handoff_kit import env_for, keys_dir_of, make_nodes, muser_cmd, spawn_receiver
    from muser_cli.handoff.trust import node

    nodes = make_nodes(tmp_path / "nodes")
    src = tmp_path / "in.kvpack"
    src.write_bytes(make_pack(40)[0])

    def send(home, to):
        return subprocess.run(muser_cmd("send", str(src), "--to", to, "--connect-timeout", str(HANG_S), "--timeout", str(HANG_S)),
                              env=env_for(home), capture_output=True, timeout=HANG_S)

    # 78: no node identity at all
    _one_line(send(tmp_path / "empty-home", "127.0.0.1:9"), 78, "muser node init")
    # 75: nobody listens (the caller should fall back to local prefill)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
    s.close()
    _one_line(send(nodes.producer_home, f"127.0.0.1:{closed}"), 75, "refused")
    # 76: the peer speaks another protocol (TLS 1.2 only)
    srv, stop, thread = _tls12_server(keys_dir_of(nodes.consumer_home))
    try:
        _one_line(send(nodes.producer_home, f"127.0.0.1:{srv.getsockname()[1]}"), 76, "TLS")
    finally:
        stop.set()
        thread.join(HANG_S)
        srv.close()
    # 77: a producer enrolled with another consumer's CA
    stranger = tmp_path / "stranger"
    node.init_node(keys_dir_of(stranger / "ca"), name="elsewhere")
    bundle, _ = node.export_producer(keys_dir_of(stranger / "ca"), producer="gx10")
    node.join_node(keys_dir_of(stranger / "producer"), bundle)
    proc, to = spawn_receiver(nodes.consumer_home, "--once", "--timeout", str(HANG_S), "-o", str(tmp_path / "got.kvpack"))
    try:
        _one_line(send(stranger / "producer", to), 77, "certificate")
    finally:
        proc.kill()
        proc.wait()
    assert not (tmp_path / "got.kvpack").exists()
