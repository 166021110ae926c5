"""send / receive / probe-link as a user runs them: real processes, real pipes, exit statuses."""

from __future__ import annotations

import json
import subprocess

import pytest
from typer.testing import CliRunner

from muser_cli.commands import app

from kvpack_factory import make_pack
from handoff_kit import (  # noqa: F401 - fixtures
    HANG_S, copy_home, env_for, muser_cmd, nodes, pack_bytes, pack_file, spawn_receiver,
)


def run(home, *args, input=None, timeout=HANG_S):
    return subprocess.run(muser_cmd(*args), env=env_for(home), input=input, capture_output=True, timeout=timeout)


@pytest.fixture
def consumer_home(nodes, tmp_path):
    return copy_home(nodes.consumer_home, tmp_path / "consumer")


def test_pipeline_receive_stdout_send_json(nodes, consumer_home, pack_file, tmp_path):
    out = open(tmp_path / "got.kvpack", "wb")
    proc, to = spawn_receiver(consumer_home, "--once", "--timeout", str(HANG_S), stdout=out)
    with open(pack_file, "rb") as f:  # from a pipe: `muser pack | muser send`
        r = run(nodes.producer_home, "send", "-", "--to", to, "--json", input=f.read())
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["ok"] and res["payload_bytes"] == pack_file.stat().st_size
    assert res["payload_rate_Bps"] > 0 and res["busy_s"] > 0 and res["receiver"]["ledger_commit_ms"] >= 0
    assert proc.wait(HANG_S) == 0
    out.close()
    assert (tmp_path / "got.kvpack").read_bytes() == pack_file.read_bytes()
    assert list((consumer_home / "data" / "inbox").glob("*")) == []  # streamed to stdout: nothing spooled


def test_receive_timeout_exits_75_for_fallback(consumer_home, tmp_path):
    out = tmp_path / "x.kvpack"
    with open(out, "wb") as f:  # `muser receive ... > x.kvpack || muser decode --prompt ...`
        r = subprocess.run(muser_cmd("receive", "--listen", "127.0.0.1:0", "--once", "--timeout", "1"),
                           env=env_for(consumer_home), stdout=f, stderr=subprocess.PIPE, timeout=HANG_S)
    assert r.returncode == 75
    assert out.read_bytes() == b""
    last = r.stderr.decode().strip().splitlines()[-1]
    # It gave up on its own --timeout (a state its last line reports), not on a stopwatch of ours.
    assert "no handoff accepted within 1 s" in last and "fall back" in last


def test_receive_to_file_json(nodes, consumer_home, pack_file, tmp_path):
    dest = tmp_path / "dest.kvpack"
    proc = subprocess.Popen(muser_cmd("receive", "--listen", "127.0.0.1:0", "--once", "--timeout", str(HANG_S), "-o",
                                      str(dest), "--json"), env=env_for(consumer_home),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = b""
    while b"listening on" not in line:
        line = proc.stderr.readline()
        assert line, proc.stdout.read()
    to = line.decode().split("listening on ")[1].strip()
    r = run(nodes.producer_home, "send", str(pack_file), "--to", to)
    assert r.returncode == 0, r.stderr
    assert b"accepted as" in r.stderr and r.stdout == b""
    stdout, _ = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0
    obj = json.loads(stdout)
    assert obj["path"] == str(dest) and obj["payload_bytes"] == pack_file.stat().st_size
    assert dest.read_bytes() == pack_file.read_bytes()


def test_send_rate_paces(nodes, consumer_home, tmp_path):
    data, _, _ = make_pack(800, seed=5)
    src = tmp_path / "mid.kvpack"
    src.write_bytes(data)
    out = tmp_path / "outdir"
    out.mkdir()
    proc, to = spawn_receiver(consumer_home, "--once", "--timeout", str(HANG_S), "-o", str(out))
    r = run(nodes.producer_home, "send", str(src), "--to", to, "--rate", "500K", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    expected = len(data) / 500e3
    assert res["stream_s"] >= 0.8 * expected - 0.05, res
    assert res["paced_s"] > 0 and res["rate_limit_Bps"] == 500e3
    assert res["payload_rate_Bps"] > 500e3  # bytes over busy time: the link, not the cap
    proc.wait(HANG_S)


def test_send_unreachable_exits_75(nodes, pack_file):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    r = run(nodes.producer_home, "send", str(pack_file), "--to", f"127.0.0.1:{port}", "--json")
    assert r.returncode == 75
    assert json.loads(r.stdout)["exit_status"] == 75
    assert r.stderr.decode().count("\n") == 1


def test_probe_link_json_and_floor(nodes, consumer_home):
    proc, to = spawn_receiver(consumer_home, "-o", str(consumer_home))
    try:
        r = run(nodes.producer_home, "probe-link", to, "--seconds", "0.3", "--json")
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert res["up_Bps"] > 0 and res["down_Bps"] > 0 and res["passed"]
        r = run(nodes.producer_home, "probe-link", to, "--seconds", "0.2", "--floor", "1000T", "--json")
        assert r.returncode == 75
        assert json.loads(r.stdout)["passed"] is False
        assert "below the floor" in r.stderr.decode()
    finally:
        proc.kill()
        proc.wait(HANG_S)


# ----------------------------------------------------------------------------- in-process (CliRunner)
@pytest.fixture
def runner():
    return CliRunner()


def test_send_without_identity_is_78(runner, pack_file, tmp_path):
    r = runner.invoke(app, ["send", str(pack_file), "--to", "127.0.0.1:9"], env={"MUSER_HOME": str(tmp_path)})
    assert r.exit_code == 78 and "muser node init" in r.stderr


def test_send_refuses_a_bad_kvpack_before_connecting(runner, nodes, tmp_path):
    bad = tmp_path / "bad.kvpack"
    bad.write_bytes(b"\x89KVPACK\nnot really")
    r = runner.invoke(app, ["send", str(bad), "--to", "127.0.0.1:9"], env={"MUSER_HOME": str(nodes.producer_home)})
    assert r.exit_code == 65, r.output


def test_usage_errors(runner, nodes, tmp_path):
    env = {"MUSER_HOME": str(nodes.consumer_home)}
    r = runner.invoke(app, ["receive", "--listen", "127.0.0.1:0", "--once", "--json"], env=env)
    assert r.exit_code == 2 and "--json needs -o" in r.stderr
    r = runner.invoke(app, ["send", "-", "--to", "nohostport"], env=env, input=b"")
    assert r.exit_code == 2
    r = runner.invoke(app, ["send", "-", "--to", "127.0.0.1:1", "--rate", "fast"], env=env, input=b"")
    assert r.exit_code == 2
    r = runner.invoke(app, ["receive", "--listen", "127.0.0.1:0", "-o", str(tmp_path / "f.kvpack")], env=env)
    assert r.exit_code == 2 and "--once" in r.stderr
