"""docs/reliability.md D24-D28: mutual TLS 1.3 with the private CA only — real sockets on loopback."""

from __future__ import annotations

import datetime as dt
import shutil
import socket
import ssl

import pytest

from muser_cli.errors import AuthError, MuserError, ProtocolError, TempFailure
from muser_cli.handoff.trust import node
from muser_cli.handoff.link import Link, client_context
from muser_cli.handoff.trust.node import load_identity
from muser_cli.handoff.wire.protocol import ALPN, Connection, Role
from muser_cli.handoff.push.sender import prepare_handoff, transmit

from handoff_kit import HANG_S
from handoff_kit import port_of, wait_for, keys_dir_of, make_nodes, nodes, pack_bytes, pack_file, receivers  # noqa: F401

LOOP = ("127.0.0.1",)


def raw_tls_client(ctx: ssl.SSLContext, port: int, *, host: str = "127.0.0.1", server_name: str | None = "localhost"):
    sock = socket.create_connection((host, port), timeout=HANG_S)
    tls = ctx.wrap_socket(sock, server_hostname=server_name, do_handshake_on_connect=False)
    tls.do_handshake()
    return tls


# ----------------------------------------------------------------------------- D24
def test_d24_client_without_certificate(nodes, receivers, tmp_path):
    run = receivers(nodes.consumer, tmp_path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cafile=str(nodes.producer.ca_path))  # trusts the CA, presents no cert
    ctx.set_alpn_protocols([ALPN])
    tls = raw_tls_client(ctx, port_of(run))  # TLS 1.3: the client's side of the handshake completes
    link = Link(tls, Connection(Role.SENDER), idle_s=3, deadline=None)
    with pytest.raises(AuthError) as exc:  # ...and it fails at the ready frame
        link.next_event("waiting for Ready")
    assert exc.value.exit_status == 77
    link.close()
    assert wait_for(lambda: run.kinds("tls_failed"), HANG_S)
    assert run.kinds("streaming") == [] and run.kinds("rejected") == []  # no payload byte was read


# ----------------------------------------------------------------------------- D25
def _identity_with(tmp, ca_from, cert_from, name: str):
    """A node directory trusting ``ca_from``'s CA but presenting ``cert_from``'s certificate."""
    d = tmp / name
    d.mkdir(mode=0o700)
    shutil.copy(ca_from.ca_path, d / "ca.pem")
    for f in ("node.pem", "node.key", "keys.json", "node.json"):
        shutil.copy(cert_from.directory / f, d / f)
    for f in d.iterdir():
        f.chmod(0o600)
    return load_identity(d)


def test_d25_certificate_from_another_ca(nodes, pack_file, receivers, tmp_path):
    run = receivers(nodes.consumer, tmp_path)
    rogue_dir = tmp_path / "rogue"
    node.init_node(rogue_dir, name="gx10")  # same name, its own CA
    rogue = _identity_with(tmp_path, nodes.producer, load_identity(rogue_dir), "mixed")
    with pytest.raises(AuthError):
        transmit(prepare_handoff(pack_file, rogue), to=run.to, identity=rogue)
    # And the other way round: a client that only trusts its own CA refuses the receiver.
    with pytest.raises(AuthError, match="certificate"):
        transmit(prepare_handoff(pack_file, load_identity(rogue_dir)), to=run.to, identity=load_identity(rogue_dir))
    assert wait_for(lambda: run.kinds("tls_failed"), HANG_S)
    assert run.published() == []


@pytest.mark.parametrize("when", ["expired", "not_yet_valid"])
def test_d25_expired_or_not_yet_valid(pack_file, receivers, tmp_path, when):
    nd = make_nodes(tmp_path / "nodes")
    now = dt.datetime.now(dt.timezone.utc)
    if when == "expired":
        nb, na = now - dt.timedelta(days=30), now - dt.timedelta(days=1)
    else:
        nb, na = now + dt.timedelta(days=1), now + dt.timedelta(days=30)
    bundle, _ = node.export_producer(nd.consumer.directory, producer="late", not_before=nb, not_after=na)
    late_dir = tmp_path / "late"
    node.join_node(late_dir, bundle)
    late = load_identity(late_dir)
    run = receivers(nd.consumer, tmp_path)
    with pytest.raises(AuthError):
        transmit(prepare_handoff(pack_file, late), to=run.to, identity=late)
    assert wait_for(lambda: run.kinds("tls_failed"), HANG_S)
    reasons = " ".join(f["reason"] for f in run.kinds("tls_failed"))
    assert "certificate" in reasons.lower()
    assert run.published() == []


# ----------------------------------------------------------------------------- D26
def test_d26_server_name_mismatch(nodes, pack_file, receivers, tmp_path):
    run = receivers(nodes.consumer, tmp_path)
    prep = prepare_handoff(pack_file, nodes.producer)
    with pytest.raises(AuthError, match="certificate|hostname|mismatch"):
        transmit(prep, to=run.to, identity=nodes.producer, server_name="not-the-consumer.example")
    assert run.kinds("streaming") == []
    # The right name works (the certificate names localhost and the loopback addresses).
    assert transmit(prep, to=run.to, identity=nodes.producer, server_name="localhost").ok


# ----------------------------------------------------------------------------- D27
def test_d27_tls12_client_refused(nodes, receivers, tmp_path):
    run = receivers(nodes.consumer, tmp_path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cafile=str(nodes.producer.ca_path))
    ctx.load_cert_chain(str(nodes.producer.cert_path), str(nodes.producer.key_path))
    with pytest.raises(ssl.SSLError):
        raw_tls_client(ctx, port_of(run))
    assert wait_for(lambda: run.kinds("tls_failed"), HANG_S)
    assert "TLS" in run.kinds("tls_failed")[0]["reason"]


def test_d27_our_contexts_are_tls13_only(nodes):
    ctx = client_context(nodes.producer)
    assert ctx.minimum_version == ctx.maximum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert len(ctx.get_ca_certs()) == 1  # the private CA, no system roots


# ----------------------------------------------------------------------------- D28
def test_d28_plain_tcp_client(nodes, pack_file, receivers, tmp_path):
    run = receivers(nodes.consumer, tmp_path, handshake_s=1.0)
    talker = socket.create_connection(("127.0.0.1", port_of(run)), timeout=HANG_S)
    talker.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    silent = socket.create_connection(("127.0.0.1", port_of(run)), timeout=HANG_S)
    for s in (talker, silent):
        try:
            while s.recv(4096):
                pass
        except ConnectionResetError:
            pass
        s.close()
    assert wait_for(lambda: len(run.kinds("tls_failed")) >= 2, HANG_S)
    # A clean close by the handshake timeout (a state the receiver reports, not a stopwatch):
    # the silent client is dropped for timing out in the TLS handshake.
    assert any("timed out" in f["reason"] for f in run.kinds("tls_failed")), run.kinds("tls_failed")
    assert transmit(prepare_handoff(pack_file, nodes.producer), to=run.to, identity=nodes.producer).ok


def test_ipv6_loopback(nodes, pack_file, receivers, tmp_path):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("::1 is not configured here")
    run = receivers(nodes.consumer, tmp_path, host="::1")
    assert run.to.startswith("[::1]:")
    assert transmit(prepare_handoff(pack_file, nodes.producer), to=run.to, identity=nodes.producer).ok


def test_unreachable_is_tempfailure(nodes, pack_file):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(TempFailure) as exc:
        transmit(prepare_handoff(pack_file, nodes.producer), to=f"127.0.0.1:{port}", identity=nodes.producer)
    assert exc.value.exit_status == 75
    assert issubclass(ProtocolError, MuserError)
