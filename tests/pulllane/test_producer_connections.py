"""Issue 28 part 5, "a view of who is connected now": a live resident producer
(``prefill --serve --metrics``) on loopback, a consumer connected to it and held at each step of
one request, and what the producer shows meanwhile -- ``/connections`` (JSON) and the
``muser_producer_connections`` gauge on its metrics port, and ``muser node ls --connected``."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time

import pytest

from handoff_kit import HANG_S, env_for, muser_cmd, pull_lane, wait_for

httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

PROMPT = "The committee met on a grey Tuesday to decide where the new bridge would go, and chose the north."
CHUNK = 8
_METRICS = re.compile(r"metrics on http://(\S+)/metrics")


@pytest.fixture(scope="module")
def lane(tmp_path_factory, tiny_llama):
    with pull_lane(tmp_path_factory.mktemp("connected"), tiny_llama.path, "--metrics", "127.0.0.1:0") as lane:
        producer = lane["producer"]
        assert wait_for(lambda: any(_METRICS.search(line) for line in producer.lines), HANG_S), producer.lines
        lane["metrics"] = next(m.group(1) for line in producer.lines if (m := _METRICS.search(line)))
        yield lane


def connections(lane) -> list[dict]:
    answer = httpx.get(f"http://{lane['metrics']}/connections", timeout=HANG_S)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    return answer.json()["connections"]


def gauge(lane) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{lane['metrics']}/metrics", timeout=HANG_S).text
    family = {f.name: f for f in text_string_to_metric_families(text)}["muser_producer_connections"]
    return {s.labels["consumer"]: s.value for s in family.samples}


def settle(lane, pred, timeout: float = HANG_S) -> list[dict]:
    """``/connections`` once ``pred`` holds for it (the producer's thread moves on its own)."""
    end = time.monotonic() + timeout
    while True:
        seen = connections(lane)
        if pred(seen) or time.monotonic() > end:
            return seen
        time.sleep(0.05)


def next_event(tls, conn) -> object:
    while True:
        ev = conn.next_event()
        if type(ev).__name__ != "_NeedData":
            return ev
        conn.receive_data(tls.recv(65536))


def test_a_consumer_held_mid_request_is_seen_at_each_step_then_gone(lane):
    from muser_cli.handoff.link import client_context, format_hostport
    from muser_cli.handoff.pull.client import key_for
    from muser_cli.handoff.wire.header import DEFAULT_WINDOW_S
    from muser_cli.handoff.wire.protocol import MAX_DATA_BYTES, PROTOCOL_VERSION, Connection, Header, Ready, Role
    from muser_cli.handoff.wire.pull_protocol import (
        ALPN_PULL, PullConnection, PullRequest, Request, Serving, Side, new_request_id, sign_request,
    )
    from muser_cli.consumer.pull import ask_for

    assert settle(lane, lambda c: c == []) == []
    ident = lane["nodes"].consumer  # its certificate's name is the consumer the producer shows
    ask = ask_for(PROMPT, model=lane["model"], chat=False, chunk_tokens=CHUNK, dtype="float32", engine="torch")
    key = key_for(ident, "gx10")
    req = PullRequest(key.key_id, new_request_id(), int(time.time() * 1000), ident.name, tuple(ask.token_ids),
                      ask.tokenizer_fingerprint, ask.model_fingerprint, CHUNK, "float32")
    host, port = lane["producer"].address.rsplit(":", 1)
    ctx = client_context(ident)
    ctx.set_alpn_protocols([ALPN_PULL])
    t0 = time.time()
    with socket.create_connection((host, int(port)), timeout=HANG_S) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        me = format_hostport(*tls.getsockname()[:2])

        # TLS up, no request yet: the consumer is named (its certificate), the request not in
        [c] = settle(lane, lambda c: len(c) == 1 and c[0]["consumer"] == ident.name)
        assert c["consumer"] == ident.name and c["peer"] == me and c["state"] == "handshake", c
        assert t0 - 1 <= c["since_unix"] <= time.time() and c["age_s"] >= 0 and c["bytes_sent"] == 0, c
        assert gauge(lane)[ident.name] == 1

        # the request is admitted (Serving): the producer computes, its header not out yet
        pc = PullConnection(Side.CONSUMER)
        tls.sendall(pc.send(Request(*sign_request(req, key.secret), req)))
        assert isinstance(next_event(tls, pc), Serving)
        [c] = settle(lane, lambda c: len(c) == 1 and c[0]["state"] == "prefilling")
        assert c["state"] == "prefilling" and c["peer"] == me and c["bytes_sent"] > 0, c

        # our Ready: the pack's header comes; we never say Go, so it stays in flight, streaming
        v3 = Connection(Role.RECEIVER)
        left = pc.leftover()
        if left:  # (b"" would be the end of the stream)
            v3.receive_data(left)
        info = {"v": PROTOCOL_VERSION, "node": ident.name, "max_payload": 1 << 30, "window_s": DEFAULT_WINDOW_S,
                "max_data": MAX_DATA_BYTES, "probe_max_s": 10.0, "idle_s": 60.0}
        tls.sendall(v3.send(Ready(info)))
        assert isinstance(next_event(tls, v3), Header)
        [streaming] = settle(lane, lambda c: len(c) == 1 and c[0]["state"] == "streaming")
        assert streaming["state"] == "streaming" and streaming["bytes_sent"] > c["bytes_sent"], (c, streaming)
        assert streaming["since_unix"] == c["since_unix"]  # one connection, from accept on
        assert gauge(lane)[ident.name] == 1

        # the CLI reads the same view
        ls = subprocess.run(muser_cmd("node", "ls", "--connected", lane["metrics"], "--json"),
                            env=env_for(lane["nodes"].consumer_home), capture_output=True, timeout=HANG_S)
        assert ls.returncode == 0, ls.stderr
        [row] = json.loads(ls.stdout)["connections"]
        assert (row["consumer"], row["peer"], row["state"]) == (ident.name, me, "streaming")
        text = subprocess.run(muser_cmd("node", "ls", "--connected", lane["metrics"]),
                              env=env_for(lane["nodes"].consumer_home), capture_output=True, timeout=HANG_S)
        assert text.returncode == 0, text.stderr
        assert re.search(rf"connected {ident.name}\s+streaming\s+from {re.escape(me)} ", text.stdout.decode())

    # the consumer hung up: gone from the view; its series reads 0, not vanished
    assert settle(lane, lambda c: c == []) == []
    assert gauge(lane)[ident.name] == 0


def test_node_ls_connected_says_75_when_nothing_answers_and_76_for_what_is_not_a_producer(lane):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        free = f"127.0.0.1:{s.getsockname()[1]}"
    gone = subprocess.run(muser_cmd("node", "ls", "--connected", free), env=env_for(lane["nodes"].consumer_home),
                          capture_output=True, timeout=HANG_S)
    assert gone.returncode == 75, gone.stderr
    assert gone.stderr.decode().count("\n") <= 2 and "cannot reach" in gone.stderr.decode()
    # an HTTP server that is not a producer's metrics endpoint: 76, one line
    import http.server
    import threading

    class NotAProducer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html>hello</html>" if self.path == "/connections" else b""
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotAProducer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        stranger = subprocess.run(muser_cmd("node", "ls", "--connected", f"127.0.0.1:{server.server_address[1]}"),
                                  env=env_for(lane["nodes"].consumer_home), capture_output=True, timeout=HANG_S)
    finally:
        server.shutdown()
    assert stranger.returncode == 76, stranger.stderr
    assert stranger.stderr.decode().count("\n") <= 2 and "connections" in stranger.stderr.decode()
