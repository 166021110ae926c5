"""The resident producer's deadlines hold against a client that trickles (#30 item 4).

``request_s`` ("TLS up -> the whole Request frame in") is a deadline for the frame, not an
idle timeout per read: a client that completes TLS and then sends its Request one byte
every 0.5 s loses its connection slot at ``request_s``. The TLS handshake's
``handshake_s`` holds the same way against a ClientHello sent a byte at a time. Real
sockets and TLS 1.3 on 127.0.0.1; the producer is a :class:`PullServer` in this process
(its compute is never reached).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest

from handoff_kit import HANG_S, make_nodes
from muser_cli.handoff.pull.server import PullServer, ServeConfig

TRICKLE_S = 0.5


class _NeverCompute:
    """The compute behind a producer whose requests never complete: never asked."""

    def check(self, request):
        raise AssertionError("a trickled request reached the compute")

    def run(self, request, out):
        raise AssertionError("a trickled request reached the compute")


@pytest.fixture
def producer(tmp_path):
    nodes = make_nodes(tmp_path / "nodes")
    events: list[tuple[str, dict]] = []
    config = ServeConfig(port=0, request_s=2.0, handshake_s=2.0)
    server = PullServer(nodes.producer, config, ledger_dir=tmp_path / "serve-ledger", compute=_NeverCompute(),
                        on_event=lambda kind, f: events.append((kind, f)))
    server.bind()
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    yield {"server": server, "nodes": nodes, "events": events, "config": config}
    server.stop()
    serving.join(HANG_S)
    server.close()


def _request_frame(nodes) -> bytes:
    """A well-formed, signed Request frame's bytes, as a consumer would send it."""
    from muser_cli.handoff.wire.pull_protocol import PullConnection, PullRequest, Request, Side, new_request_id, sign_request
    from muser_cli.handoff.pull.client import key_for

    key = key_for(nodes.consumer, nodes.producer.name)
    req = PullRequest(key_id=key.key_id, request_id=new_request_id(), issued_at_ms=int(time.time() * 1000),
                      consumer=nodes.consumer.name, token_ids=tuple(range(1, 41)),
                      tokenizer_fingerprint="sha256:" + "a" * 64, model_fingerprint="sha256:" + "b" * 64,
                      chunk_tokens=8, dtype="float32")
    raw, mac = sign_request(req, key.secret)
    return b"".join(bytes(p) for p in PullConnection(Side.CONSUMER).send_parts(Request(raw, mac, req)))


def _hung_up(sock: socket.socket, wait: float) -> bool:
    """Whether the peer closed ``sock`` (a plain or a TLS socket) within ``wait`` seconds: an
    end of stream, or an error reading it; False when ``wait`` passed with nothing to read."""
    sock.settimeout(wait)
    try:
        return sock.recv(4096) == b""
    except (socket.timeout, TimeoutError):
        return False
    except OSError:  # ssl.SSLError among them
        return True


def _trickle_until_closed(sock: socket.socket, *, data: bytes) -> tuple[float, int]:
    """Send ``data`` over ``sock`` one byte every TRICKLE_S until the peer closed it (or all of
    it is sent); (seconds from the start to when the close was seen, bytes of ``data`` sent by then)."""
    t0 = time.monotonic()
    for i, b in enumerate(data):
        try:
            sock.sendall(bytes([b]))
        except (OSError, ssl.SSLError):
            return time.monotonic() - t0, i
        if _hung_up(sock, TRICKLE_S):
            return time.monotonic() - t0, i + 1
    return time.monotonic() - t0, len(data)


def _wait_pending_zero(server: PullServer, timeout: float = HANG_S) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with server._lock:
            if server._pending == 0:
                return time.monotonic() - t0
        time.sleep(0.02)
    return None


def test_a_trickled_request_loses_its_slot_at_request_s(producer):
    from muser_cli.handoff.link import client_context
    from muser_cli.handoff.wire.pull_protocol import ALPN_PULL

    server, nodes, request_s = producer["server"], producer["nodes"], producer["config"].request_s
    frame = _request_frame(nodes)
    assert len(frame) * TRICKLE_S > 5 * request_s  # whole, it would take far longer than the deadline
    ctx = client_context(nodes.consumer)
    ctx.set_alpn_protocols([ALPN_PULL])
    raw = socket.create_connection(("127.0.0.1", server.address[1]), timeout=HANG_S)
    tls = ctx.wrap_socket(raw, server_hostname=nodes.producer.name)  # TLS up: the request deadline starts
    try:
        held, sent = _trickle_until_closed(tls, data=frame)
    finally:
        tls.close()
    freed = _wait_pending_zero(server)
    print(f"request_s {request_s} s: connection closed {held:.2f} s after TLS up; slot free {freed} s after")
    # A deadline for the frame, not an idle timeout per read (states, not a stopwatch): the
    # producer hung up while bytes kept coming, long before the frame was whole (whole, it
    # takes over 5 x request_s), and its reason names request_s.
    assert sent < len(frame), (sent, len(frame))  # before: held as long as bytes kept coming
    assert held >= request_s - 0.6, held
    assert freed is not None
    failed = [f for kind, f in producer["events"] if kind == "request" and f.get("outcome") == "failed"]
    assert failed and f"no whole request within {request_s:g} s" in failed[0]["reason"], producer["events"]


def test_a_trickled_tls_handshake_is_dropped_at_handshake_s(producer):
    """A ClientHello sent one byte every 0.5 s: the producer gives up at ``handshake_s``."""
    server, nodes, handshake_s = producer["server"], producer["nodes"], producer["config"].handshake_s
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="gx10")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    hello = outgoing.read()
    assert len(hello) * TRICKLE_S > 5 * handshake_s
    sock = socket.create_connection(("127.0.0.1", server.address[1]), timeout=HANG_S)
    try:
        _, sent = _trickle_until_closed(sock, data=hello)
    finally:
        sock.close()
    # Given up at the deadline, not per read (states, not a stopwatch): closed while the hello
    # was still coming, long before it was whole, and logged as a handshake that timed out.
    assert sent < len(hello), (sent, len(hello))
    assert _wait_pending_zero(server) is not None
    failed = [f for kind, f in producer["events"] if kind == "tls_failed"]
    assert failed and "timed out" in failed[0]["reason"], producer["events"]
