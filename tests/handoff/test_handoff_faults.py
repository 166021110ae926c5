"""docs/reliability.md F34-F37: network faults on loopback (a misbehaving relay), netem when available."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
import uuid

import pytest

from muser_cli.errors import TempFailure
from muser_cli.handoff.link import DEFAULT_CONNECT_S
from muser_cli.handoff.push.sender import prepare_handoff, transmit

from kvpack_factory import make_pack
from handoff_kit import (  # noqa: F401 - fixtures
    HANG_S, port_of,
    wait_for,
    Relay, copy_home, env_for, ledger_records, muser_cmd, nodes, pack_bytes, pack_file, receivers,
)


@pytest.fixture(scope="module")
def big_pack(tmp_path_factory):
    data, _, _ = make_pack(1500, seed=3)  # ~220 KB: the handshake is a small part of it
    p = tmp_path_factory.mktemp("big") / "big.kvpack"
    p.write_bytes(data)
    return p


# ----------------------------------------------------------------------------- F34
@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_f34_cut_at_half_payload(nodes, big_pack, receivers, tmp_path, reset):
    run = receivers(nodes.consumer, tmp_path)
    relay = Relay(port_of(run), cut_after=big_pack.stat().st_size // 2, reset=reset)
    prep = prepare_handoff(big_pack, nodes.producer)
    try:
        with pytest.raises(TempFailure) as exc:
            transmit(prep, to=relay.to, identity=nodes.producer, server_name="localhost", idle_s=3)
        assert exc.value.exit_status == 75  # the consumer's script falls back to local prefill
    finally:
        relay.close()
    assert wait_for(lambda: run.kinds("aborted"), HANG_S)
    assert run.published() == [] and not list(run.out_dir.glob(".*.part"))
    assert ledger_records(run.ledger_dir, prep.header.key_id) == []
    # The receiver is unharmed: the same handoff, sent directly, is accepted (never accepted before).
    assert transmit(prep, to=run.to, identity=nodes.producer).ok


# ----------------------------------------------------------------------------- F35
def test_f35_blackholed_peer_deadline_fires(nodes, big_pack, receivers, tmp_path):
    run = receivers(nodes.consumer, tmp_path, idle_s=1.5)
    relay = Relay(port_of(run), hole_after=big_pack.stat().st_size // 2)
    prep = prepare_handoff(big_pack, nodes.producer)
    try:
        # The deadline fired: the raise is the state. (No stopwatch: streaming half of a big pack
        # takes what a loaded machine makes it take; total_s bounds the wait.)
        with pytest.raises(TempFailure, match="timed out|deadline"):
            transmit(prep, to=relay.to, identity=nodes.producer, server_name="localhost", idle_s=1.5, total_s=8)
    finally:
        relay.close()
    assert wait_for(lambda: run.kinds("aborted"), timeout=HANG_S)
    assert run.published() == []


def test_f35_blackholed_before_ready(nodes, pack_file, receivers, tmp_path):
    """A peer that accepts TCP and then says nothing: the connect deadline fires."""
    import socket

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(1)
    prep = prepare_handoff(pack_file, nodes.producer)
    t0 = time.monotonic()
    with pytest.raises(TempFailure, match="timed out in the TLS handshake"):  # the connect phase's deadline
        transmit(prep, to=f"127.0.0.1:{hole.getsockname()[1]}", identity=nodes.producer, connect_s=1.0)
    # connect_s was the deadline, not the default one: it fired before DEFAULT_CONNECT_S (10 s)
    # would have, a bound ten times connect_s, not a budget for a loaded machine's speed.
    assert time.monotonic() - t0 < DEFAULT_CONNECT_S
    hole.close()


# ----------------------------------------------------------------------------- F37
def test_f37_one_byte_segments_and_slow_close(nodes, pack_file, receivers, tmp_path):
    run = receivers(nodes.consumer, tmp_path)
    relay = Relay(port_of(run), chunk=1, close_delay=0.5)
    prep = prepare_handoff(pack_file, nodes.producer)
    try:
        res = transmit(prep, to=relay.to, identity=nodes.producer, server_name="localhost")
    finally:
        relay.close()
    assert res.ok
    out = run.out_dir / f"{prep.header.handoff_id}.kvpack"
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(pack_file.read_bytes()).digest()


def test_f37_probe_through_small_segment_relay(nodes, receivers, tmp_path):
    from muser_cli.handoff.push.sender import probe_link

    run = receivers(nodes.consumer, tmp_path)
    relay = Relay(port_of(run), chunk=512)
    try:
        res = probe_link(relay.to, nodes.producer, seconds=0.3, chunk=4096)
    finally:
        relay.close()
    assert res.up_bytes > 0 and res.down_bytes > 0


# ----------------------------------------------------------------------------- F36
def test_f36_userspace_delay_jitter_rate(nodes, pack_file, receivers, tmp_path):
    """What userspace can shape on loopback: 100±20 ms per burst and 100 Mbit/s. (Loss and
    reordering happen below TCP; they need netem, in the test below.)"""
    run = receivers(nodes.consumer, tmp_path)
    relay = Relay(port_of(run), delay=0.1, jitter=0.02, rate=100e6 / 8)
    prep = prepare_handoff(pack_file, nodes.producer)
    try:
        res = transmit(prep, to=relay.to, identity=nodes.producer, server_name="localhost", idle_s=3)
    finally:
        relay.close()
    assert res.ok and res.connect_s > 0.1
    out = run.out_dir / f"{prep.header.handoff_id}.kvpack"
    assert out.read_bytes() == pack_file.read_bytes()


def _netem_reason() -> str | None:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return "needs root with ip and tc"
    ns = f"muser-probe-{uuid.uuid4().hex[:8]}"
    try:
        if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
            return "cannot create a network namespace (ip netns add failed)"
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"], capture_output=True, text=True)
        if r.returncode != 0:
            return f"netem is not available in this kernel (tc: {r.stderr.strip()})"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.skipif(bool(_netem_reason()), reason=f"F36 needs netem: {_netem_reason()}")
def test_f36_netem_loss_delay_reorder_rate(nodes, pack_file, tmp_path):
    """Inside a private network namespace, on its own loopback, shaped by netem."""
    ns = f"muser-f36-{uuid.uuid4().hex[:8]}"
    home = copy_home(nodes.consumer_home, tmp_path / "consumer")
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        ex = ["ip", "netns", "exec", ns]
        subprocess.run(ex + ["ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(ex + ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "loss", "5%", "delay", "100ms",
                             "20ms", "reorder", "25%", "rate", "100mbit"], check=True)
        out = tmp_path / "out.kvpack"
        recv = subprocess.Popen(ex + muser_cmd("receive", "--listen", "127.0.0.1:7070", "--once", "--timeout", str(HANG_S),
                                               "-o", str(out)), env=env_for(home), stderr=subprocess.PIPE)
        time.sleep(2)
        send = subprocess.run(ex + muser_cmd("send", str(pack_file), "--to", "127.0.0.1:7070", "--timeout", str(HANG_S)),
                              env=env_for(nodes.producer_home), capture_output=True, text=True, timeout=HANG_S)
        recv.wait(HANG_S)
        if send.returncode == 0:
            assert recv.returncode == 0
            assert out.read_bytes() == pack_file.read_bytes()  # exact digest
        else:
            assert send.returncode in (75, 76), send.stderr  # or a clean reject, never a bad decode
            assert not out.exists()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
