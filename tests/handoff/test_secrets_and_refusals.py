"""Issue #29, items 1 and 2: no secret muser writes is readable by group or others (under a
permissive umask), and a refused command leaves the home byte-identical. Real processes:
`muser` as a user runs it, with stdout a file, a pipe or a terminal (a pty)."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from handoff_kit import HANG_S, env_for, homes, muser_cmd, nodes, pack_bytes, spawn_receiver  # noqa: F401 - fixtures
from home_kit import hmac_secrets, home_tree, readable_secrets

UMASK = 0o022  # what most shells have: files 0644, folders 0755 unless muser says otherwise


@pytest.fixture(autouse=True)
def permissive_umask():
    old = os.umask(UMASK)  # inherited by every process the test starts
    yield
    os.umask(old)


def run(home: Path, *args, stdout=subprocess.PIPE, input: bytes | None = None, cwd: Path | None = None,
        timeout: float = HANG_S) -> subprocess.CompletedProcess:
    return subprocess.run(muser_cmd(*map(str, args)), env=env_for(home), stdout=stdout, stderr=subprocess.PIPE,
                          input=input, cwd=cwd, timeout=timeout)


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, r.stderr.decode()
    return r


def key_id_of(home: Path, peer: str) -> str:
    listing = json.loads(ok(run(home, "node", "ls", "--json")).stdout)
    return [k["key_id"] for k in listing["keys"] if k["peer"] == peer][-1]


# ----------------------------------------------------------------------------- item 1
def test_no_secret_is_readable_by_others_after_any_node_or_handoff_command(tmp_path, pack_bytes):
    c, p, out = tmp_path / "consumer", tmp_path / "producer", tmp_path / "out"
    out.mkdir()
    bundles: list[Path] = []

    def check(step: str) -> None:
        bad = readable_secrets(c, p, *bundles, secrets=hmac_secrets(c, p))
        assert bad == [], f"after {step}: {bad}"

    ok(run(c, "node", "init", "--name", "consumer"))
    check("node init")
    ok(run(c, "node", "export", "--producer", "gx10", "-o", tmp_path / "gx10.bundle"))
    bundles.append(tmp_path / "gx10.bundle")
    check("node export -o")
    with open(tmp_path / "gx11.bundle", "wb") as f:  # the README's old line: `> gx11.bundle`
        ok(run(c, "node", "export", "--producer", "gx11", stdout=f))
    bundles.append(tmp_path / "gx11.bundle")
    assert stat.S_IMODE((tmp_path / "gx11.bundle").stat().st_mode) == 0o600
    assert json.loads((tmp_path / "gx11.bundle").read_text())["producer"] == "gx11"
    check("node export > file")
    piped = ok(run(c, "node", "export", "--producer", "gx12")).stdout  # stdout a pipe: left as it is
    assert json.loads(piped)["producer"] == "gx12"
    check("node export | ...")
    ok(run(p, "node", "join", tmp_path / "gx10.bundle"))
    check("node join")
    ok(run(p, "node", "ls"))
    src = tmp_path / "in.kvpack"
    src.write_bytes(pack_bytes)
    proc, to = spawn_receiver(c, "--once", "--timeout", str(HANG_S), "-o", str(out))
    ok(run(p, "send", src, "--to", to))
    assert proc.wait(HANG_S) == 0
    assert list((c / "data" / "ledger").glob("*.ledger")), "the receive wrote no ledger"
    check("send / receive")
    ok(run(c, "node", "revoke", key_id_of(c, "gx11")))
    check("node revoke")
    ok(run(c, "node", "init", "--name", "consumer2", "--force"))
    check("node init --force")


def test_export_to_a_file_on_stdout_is_made_private_before_the_bundle_is_written(tmp_path):
    c = tmp_path / "consumer"
    ok(run(c, "node", "init", "--name", "consumer"))
    target = tmp_path / "gx10.bundle"
    target.write_bytes(b"")
    target.chmod(0o666)  # even a file the shell made world-writable
    with open(target, "ab") as f:
        ok(run(c, "node", "export", "--producer", "gx10", stdout=f))
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" in target.read_bytes()


# ----------------------------------------------------------------------------- item 2
def _on_a_terminal(home: Path, *args) -> subprocess.CompletedProcess:
    master, slave = os.openpty()
    try:
        return subprocess.run(muser_cmd(*map(str, args)), env=env_for(home), stdout=slave, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, timeout=HANG_S)
    finally:
        os.close(slave)
        os.close(master)


def refused_unchanged(home: Path, status: int, act, *also: Path) -> str:
    """Run ``act()`` (a refused command); its exit status is ``status`` and ``home`` (and
    ``also``) are byte-identical afterwards. Returns its stderr."""
    before = [home_tree(home), *[home_tree(a) for a in also]]
    r = act()
    err = r.stderr.decode()
    assert r.returncode == status, err
    assert err.count("\n") == 1 and err.startswith("muser: error: "), err
    assert [home_tree(home), *[home_tree(a) for a in also]] == before, err
    return err


def test_node_export_on_a_terminal_issues_nothing(homes):
    c, _ = homes
    err = refused_unchanged(c, 2, lambda: _on_a_terminal(c, "node", "export", "--producer", "gx20"))
    assert "bundle" in err and "terminal" in err and "binary" not in err
    assert "-o gx20.bundle" in err  # the hint names the way that works
    assert "gx20" not in ok(run(c, "node", "ls")).stdout.decode()


def test_node_export_refusals_leave_the_home_byte_identical(homes, tmp_path):
    c, p = homes
    (tmp_path / "a-folder").mkdir()
    refused_unchanged(c, 66, lambda: run(c, "node", "export", "--producer", "gx21", "-o", tmp_path / "no" / "x"),
                      tmp_path)
    refused_unchanged(c, 2, lambda: run(c, "node", "export", "--producer", "gx21", "-o", tmp_path / "a-folder"),
                      tmp_path)
    refused_unchanged(c, 2, lambda: run(c, "node", "export", "--producer", "not a name", "-o", tmp_path / "x"),
                      tmp_path)
    refused_unchanged(c, 2, lambda: run(c, "node", "export", "--producer", "gx21", "--host", "bad host",
                                        "-o", tmp_path / "x"), tmp_path)
    refused_unchanged(p, 78, lambda: run(p, "node", "export", "--producer", "gx21", "-o", tmp_path / "x"),
                      tmp_path)  # a producer holds no CA key
    refused_unchanged(tmp_path / "none", 78, lambda: run(tmp_path / "none", "node", "export", "--producer", "gx21",
                                                         "-o", tmp_path / "x"), tmp_path)


def test_node_init_join_revoke_repair_refusals_leave_the_home_byte_identical(homes, tmp_path):
    c, p = homes
    fresh = tmp_path / "fresh"
    refused_unchanged(c, 2, lambda: run(c, "node", "init", "--name", "again"))
    refused_unchanged(fresh, 2, lambda: run(fresh, "node", "init", "--name", "not a name"))
    refused_unchanged(fresh, 2, lambda: run(fresh, "node", "init", "--name", "ok", "--host", "bad host"))
    assert not fresh.exists()
    bundle = ok(run(c, "node", "export", "--producer", "gx22")).stdout
    refused_unchanged(p, 2, lambda: run(p, "node", "join", "-", input=bundle))  # an identity exists already
    damaged = bundle.replace(b'"producer": "gx22"', b'"producer": "gx23"')
    refused_unchanged(fresh, 65, lambda: run(fresh, "node", "join", "-", input=damaged))
    refused_unchanged(fresh, 66, lambda: run(fresh, "node", "join", tmp_path / "missing.bundle"))
    refused_unchanged(c, 2, lambda: run(c, "node", "revoke", "nope"))
    refused_unchanged(c, 78, lambda: run(c, "node", "repair-ledger", "nope"))
    assert not fresh.exists()


def test_receive_refusals_leave_the_home_and_the_output_folder_byte_identical(homes, tmp_path):
    c, _ = homes
    out = tmp_path / "out"
    out.mkdir()
    refused_unchanged(c, 2, lambda: run(c, "receive", "--listen", "127.0.0.1:0", "-o", out / "x.kvpack"), out)
    refused_unchanged(c, 2, lambda: run(c, "receive", "--listen", "127.0.0.1:0", "--once", "--json"), out)
    refused_unchanged(c, 66, lambda: run(c, "receive", "--listen", "127.0.0.1:0", "--once", "--timeout", "30",
                                         "-o", out / "missing" / "x.kvpack"), out)
    refused_unchanged(c, 2, lambda: run(c, "receive", "--listen", "7070", "--once", "-o", out / "x.kvpack"), out)
    fresh = tmp_path / "fresh"  # no identity: 78, and no home made for it
    refused_unchanged(fresh, 78, lambda: run(fresh, "receive", "--listen", "127.0.0.1:0", "--once", "-o",
                                             out / "x.kvpack"), out)
    assert not fresh.exists()
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        refused_unchanged(c, 78, lambda: run(c, "receive", "--listen", f"127.0.0.1:{port}", "--once", "-o",
                                             out / "x.kvpack"), out)


def test_reuse_put_refusals_leave_the_home_byte_identical(tiny_llama, tmp_path):
    from kvpack_factory import make_pack
    from muser_cli.produce.prefill import prefill

    home = tmp_path / "home"
    home.mkdir()  # resolving the model fills its fingerprint memo under home/cache (home_kit.MEMO_DIRS)
    good = tmp_path / "p.kvpack"
    with open(good, "wb") as f:
        prefill("The bridge was built in three summers by a crew of forty. " * 3, f, model=tiny_llama.path,
                chunk_tokens=8, threads=1)
    data = good.read_bytes()
    cut = tmp_path / "cut.kvpack"
    cut.write_bytes(data[: len(data) * 2 // 3])  # the header verifies, the frames stop midway
    synthetic = tmp_path / "synthetic.kvpack"
    synthetic.write_bytes(make_pack(17, layers=None)[0])
    for store_exists in (False, True):
        refused_unchanged(home, 65, lambda: run(home, "reuse", "put", "-m", tiny_llama.path, cut))
        refused_unchanged(home, 65, lambda: run(home, "reuse", "put", synthetic))
        refused_unchanged(home, 66, lambda: run(home, "reuse", "put", tmp_path / "missing.kvpack"))
        if not store_exists:
            assert not (home / "data" / "store").exists()
            ok(run(home, "reuse", "put", "-m", tiny_llama.path, good))  # now the store exists: refused again
