"""Issue #29, items 4 and 5: exit statuses that mean what the contract says (a port that
cannot be listened on is 78, never 75), SIGTERM and SIGHUP drain `receive --listen` and
`prefill --serve` to one summary line and exit 0, and a line saying what to do wherever a
user is stuck. Real processes, real signals, real TLS on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from handoff_kit import (  # noqa: F401 - fixtures
    HANG_S, Producer, env_for, homes, muser_cmd, nodes, pack_bytes, reaped, serving, spawn_receiver, wait_for,
)
from home_kit import hmac_secrets, readable_secrets

PROMPT = "The bridge was built in three summers by a crew of forty, and it still stands over the river. " * 2


def run(home: Path, *args, input: bytes | None = None, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    return subprocess.run(muser_cmd(*map(str, args)), env=env_for(home), input=input, capture_output=True,
                          timeout=timeout)


def one_error(r: subprocess.CompletedProcess, status: int) -> str:
    err = r.stderr.decode()
    assert r.returncode == status, err
    assert err.count("\n") == 1 and err.startswith("muser: error: "), err
    return err


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# ----------------------------------------------------------------------------- item 4: statuses
def test_a_port_that_cannot_be_listened_on_is_78_not_75(homes, busy_port, tiny_llama, tmp_path):
    c, p = homes
    err = one_error(run(c, "receive", "--listen", f"127.0.0.1:{busy_port}", "--once"), 78)
    assert "cannot listen" in err and "another port" in err
    err = one_error(run(p, "prefill", "--serve", f"127.0.0.1:{busy_port}", "-m", tiny_llama.path), 78)
    assert "cannot listen" in err  # its only line: nothing about the model was said, or loaded, first
    # Refused before the model loads (a state, not a stopwatch): a model that is not there at all
    # gets the port's refusal too, so the model was never even resolved.
    err = one_error(run(p, "prefill", "--serve", f"127.0.0.1:{busy_port}", "-m", tmp_path / "no-such-model"), 78)
    assert "cannot listen" in err


# ----------------------------------------------------------------------------- item 4: signals
def _summary(stderr: bytes) -> str:
    lines = stderr.decode().strip().splitlines()
    return lines[-1] if lines else ""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_receive_drains_on_a_signal_the_stream_in_flight_finishes(homes, pack_bytes, tmp_path, sig):
    c, p = homes
    out = tmp_path / "out"
    out.mkdir()
    src = tmp_path / "in.kvpack"
    src.write_bytes(pack_bytes)
    proc, to = spawn_receiver(c, "-o", str(out))  # no --once: a long-running receiver
    assert run(p, "send", src, "--to", to).returncode == 0  # one handoff before the signal
    rate = max(1, len(pack_bytes) // 3)  # the next one takes about three seconds on the wire
    sender = subprocess.Popen(muser_cmd("send", str(src), "--to", to, "--rate", f"{rate}B"), env=env_for(p),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert wait_for(lambda: list(out.glob(".*.part")), HANG_S)  # it is streaming now: its spool part exists
    proc.send_signal(sig)
    s_out, s_err = sender.communicate(timeout=HANG_S)
    assert sender.returncode == 0, s_err.decode()  # the handoff in flight finished and was acknowledged
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, err.decode()
    last = _summary(err)
    assert f"stopped on {sig.name}" in last and "2 handoffs accepted" in last and "none left in flight" in last
    assert len(list(out.glob("*.kvpack"))) == 2 and not list(out.glob(".*part"))
    refused = run(p, "send", src, "--to", to)  # it listens no more
    assert refused.returncode == 75 and b"nothing listens there" in refused.stderr


def test_receive_once_to_stdout_stopped_with_nothing_in_flight_prints_nothing_and_exits_0(homes, tmp_path):
    c, _ = homes
    with open(tmp_path / "x.kvpack", "wb") as f:
        proc, _to = spawn_receiver(c, "--once", stdout=f)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, err.decode()
    assert "stopped on SIGTERM: 0 handoffs accepted" in _summary(err)
    assert (tmp_path / "x.kvpack").read_bytes() == b""


def test_receive_once_to_stdout_drains_the_stream_in_flight_whole(homes, pack_bytes, tmp_path):
    c, p = homes
    src = tmp_path / "in.kvpack"
    src.write_bytes(pack_bytes)
    with open(tmp_path / "got.kvpack", "wb") as f:
        proc, to = spawn_receiver(c, "--once", stdout=f)
        sender = subprocess.Popen(muser_cmd("send", str(src), "--to", to, "--rate", f"{max(1, len(pack_bytes) // 3)}B"),
                                  env=env_for(p), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert wait_for(lambda: (tmp_path / "got.kvpack").stat().st_size > 0, HANG_S)  # frames are being forwarded
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_S)
    assert sender.wait(HANG_S) == 0
    assert proc.returncode == 0, err.decode()
    assert "stopped on SIGTERM: 1 handoff accepted" in _summary(err)
    assert (tmp_path / "got.kvpack").read_bytes() == pack_bytes  # whole, end frame included


def test_sighup_stays_ignored_under_nohup(homes):
    c, _ = homes
    proc = subprocess.Popen(muser_cmd("receive", "--listen", "127.0.0.1:0", "--once"), env=env_for(c),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert b"listening on" in proc.stderr.readline()
    proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert proc.poll() is None  # `nohup muser receive ...`: a closed terminal does not stop it
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0 and "stopped on SIGTERM" in _summary(err)


def test_a_second_signal_ends_a_draining_receiver_at_once(homes, pack_bytes, tmp_path):
    c, p = homes
    src = tmp_path / "in.kvpack"
    src.write_bytes(pack_bytes)
    proc, to = spawn_receiver(c, "-o", str(tmp_path))
    sender = subprocess.Popen(muser_cmd("send", str(src), "--to", to, "--rate", f"{max(1, len(pack_bytes) // 20)}B"),
                              env=env_for(p), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert wait_for(lambda: list(tmp_path.glob(".*.part")), HANG_S)  # streaming
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None  # draining: the slow handoff is still streaming
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(HANG_S) == -signal.SIGTERM
    assert sender.wait(HANG_S) != 0  # cut: its producer falls back
    assert not list(tmp_path.glob("*.kvpack")) or [q.name for q in tmp_path.glob("*.kvpack")] == ["in.kvpack"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_prefill_serve_drains_on_a_signal_with_one_summary_line(homes, tiny_llama, tmp_path, sig):
    c, p = homes
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    producer = Producer(p, "-m", tiny_llama.path)  # --json: its events, one JSON object a line
    try:
        r = run(c, "receive", "--from", producer.address, prompt, "-m", tiny_llama.path, "--no-reuse",
                "-o", tmp_path / "got.kvpack")
        assert r.returncode == 0, r.stderr.decode()
    finally:
        producer.proc.send_signal(sig)
        rc = producer.proc.wait(HANG_S)
    assert rc == 0, "".join(producer.lines)
    assert wait_for(lambda: producer.events("stopped"), HANG_S)
    (stopped,) = producer.events("stopped")
    assert stopped["signal"] == sig.name and stopped["served"] == 1 and stopped["turned_away"] == 0
    assert readable_secrets(c, p, secrets=hmac_secrets(c, p)) == []  # the pull lane's ledgers and sightings too


def test_prefill_serve_human_summary(homes, tiny_llama):
    _, p = homes
    proc = subprocess.Popen(muser_cmd("prefill", "--serve", "127.0.0.1:0", "-m", str(tiny_llama.path)),
                            env=env_for(p), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[str] = []

    def pump() -> None:
        for raw in proc.stderr:
            lines.append(raw.decode())

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    assert wait_for(lambda: any("listening on" in x for x in lines), HANG_S), lines
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(HANG_S) == 0
    t.join(HANG_S)
    # #28: every service line starts with its UTC time; a line says when draining starts
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "
    assert re.match(stamp + "prefill: stopped on SIGTERM: 0 served, 0 refused, 0 failed, 0 turned away", lines[-1]), lines
    assert re.match(stamp + "prefill: draining on SIGTERM", lines[-2]), lines


# ----------------------------------------------------------------------------- item 5: hints
def test_an_address_with_no_port_says_how_to_write_one(homes, tiny_llama):
    c, p = homes
    err = one_error(run(p, "prefill", "--serve", "7070", "-m", tiny_llama.path), 2)
    assert "has no port" in err and "HOST:PORT" in err and ":7070" in err
    err = one_error(run(c, "receive", "--listen", "7070", "--once"), 2)
    assert "HOST:PORT" in err and ":7070 for every address" in err
    err = one_error(run(p, "send", "-", "--to", "7070", input=b""), 2)
    assert "HOST:PORT" in err and "127.0.0.1:7070" in err


def test_a_wrong_port_says_nothing_listens_there(homes, pack_bytes, tmp_path):
    _, p = homes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    err = one_error(run(p, "send", "-", "--to", f"127.0.0.1:{free}", input=pack_bytes), 75)
    assert "nothing listens there" in err and "HOST:PORT" in err and "receive --listen" in err


def test_an_unknown_name_points_to_node_ls(homes, pack_bytes):
    _, p = homes
    err = one_error(run(p, "send", "-", "--to", "gx99.invalid:7070", input=pack_bytes), 75)
    assert "cannot resolve" in err and "muser node ls" in err


def test_a_node_that_is_not_enrolled_is_told_how_to_enroll(homes, pack_bytes, tmp_path):
    c, _ = homes
    stranger = tmp_path / "stranger"
    assert run(stranger, "node", "init", "--name", "stranger").returncode == 0
    proc, to = spawn_receiver(c, "--once", "--timeout", str(HANG_S), "-o", str(tmp_path / "x.kvpack"))
    with reaped(proc):
        err = one_error(run(stranger, "send", "-", "--to", to, input=pack_bytes), 77)
    assert "another CA" in err and "not enrolled" in err
    assert "muser node export --producer NAME" in err and "muser node join NAME.bundle" in err


def test_a_name_the_certificate_lacks_says_which_names_work(homes, pack_bytes, tmp_path):
    c, p = homes
    proc = subprocess.Popen(muser_cmd("receive", "--listen", "0.0.0.0:0", "--once", "--timeout", str(HANG_S), "-o",
                                      str(tmp_path / "x.kvpack")), env=env_for(c),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with reaped(proc):
        line = proc.stderr.readline().decode()
        port = line.strip().rsplit(":", 1)[1]
        err = one_error(run(p, "send", "-", "--to", f"127.0.0.2:{port}", input=pack_bytes), 77)
    assert "does not hold the name dialled" in err and "--host" in err and "muser node ls" in err


def test_a_revoked_key_says_to_join_a_fresh_bundle(homes, pack_bytes, tmp_path):
    c, p = homes
    listing = json.loads(run(c, "node", "ls", "--json").stdout)
    (kid,) = [k["key_id"] for k in listing["keys"] if k["peer"] == "gx10"]
    assert run(c, "node", "revoke", kid).returncode == 0
    proc, to = spawn_receiver(c, "--once", "--timeout", str(HANG_S), "-o", str(tmp_path / "x.kvpack"))
    with reaped(proc):
        err = one_error(run(p, "send", "-", "--to", to, input=pack_bytes), 77)
    assert "revoked" in err and "muser node join --force" in err and "muser node export" in err


def test_a_consumer_whose_producer_key_was_revoked_is_told_to_export_again(homes, tiny_llama, tmp_path):
    c, p = homes
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    listing = json.loads(run(c, "node", "ls", "--json").stdout)
    (kid,) = [k["key_id"] for k in listing["keys"] if k["peer"] == "gx10"]
    assert run(c, "node", "revoke", kid).returncode == 0
    with serving(p, "-m", tiny_llama.path, check_exit=False) as producer:
        err = one_error(run(c, "receive", "--from", producer.address, prompt, "-m", tiny_llama.path,
                            "-o", tmp_path / "got.kvpack"), 77)
    assert "revoked" in err and "muser node export --producer gx10" in err and "join --force" in err


def test_a_consumer_that_is_not_enrolled_falls_back_and_is_told_how_to_enroll(homes, tiny_llama, tmp_path):
    _, p = homes
    stranger = tmp_path / "stranger"
    assert run(stranger, "node", "init", "--name", "stranger").returncode == 0
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    with serving(p, "-m", tiny_llama.path, check_exit=False) as producer:
        r = run(stranger, "decode", "--producer", producer.address, "--prompt", prompt, "-m", tiny_llama.path,
                "-n", "2", "--json")
        err = one_error(run(stranger, "receive", "--from", producer.address, prompt, "-m", tiny_llama.path,
                            "-o", tmp_path / "got.kvpack"), 77)
    assert r.returncode == 0 and json.loads(r.stdout)["fallback"] is True  # the tokens come anyway
    why = r.stderr.decode()
    assert "another CA" in why and "muser node export --producer NAME" in why and "node join" in why
    assert "another CA" in err and "muser node join NAME.bundle" in err
