"""The pull lane (issue 12, first cut) as a user runs it: real processes, mutual TLS on 127.0.0.1.

    producer$ muser prefill --serve 127.0.0.1:0 -m MODEL --json
    consumer$ muser receive --from HOST:PORT doc.txt -m MODEL | muser decode --prompt doc.txt
    consumer$ muser decode --producer HOST:PORT --prompt doc.txt     # falls back by itself

One resident producer serves most tests of this module (its model loaded once, as in use).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from muser_cli.handoff.trust import node
from handoff_kit import (LANE_CHUNK as CHUNK, LANE_PROMPT as PROMPT, Producer, Relay, env_for, first_pull_answer,
                         held_pull, keys_dir_of, local_decode, make_nodes, HANG_S, muser_cmd, prefill_stored,
                         pull_lane, serving, signed_request, wait_for, without_store)


@pytest.fixture(scope="module")
def lane(tmp_path_factory, tiny_llama):
    with pull_lane(tmp_path_factory.mktemp("pull"), tiny_llama.path, prompt=PROMPT) as lane:
        lane["local"] = local_decode(lane["nodes"].consumer_home, *lane["common"], "--chunk", str(CHUNK), "--prompt",
                                     str(lane["prompt"]), "-n", "8", "--no-reuse", "--json")
        yield lane


def decode_pull(lane, to: str, *extra: str, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    return subprocess.run(muser_cmd("decode", *lane["common"], "--chunk", str(CHUNK), "--prompt", str(lane["prompt"]),
                                    "-n", "8", "--no-reuse", "--json", "--producer", to, *extra),
                          env=env_for(lane["nodes"].consumer_home), capture_output=True, timeout=timeout)


def receive_from(lane, to: str, home: Path | None = None, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(muser_cmd("receive", "--from", to, str(lane["prompt"]), "-m", lane["model"],
                                      "--chunk", str(CHUNK), *extra),
                            env=env_for(home or lane["nodes"].consumer_home), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_pull_lane_tokens_equal_the_local_fallback(lane):
    p = lane["producer"]
    before = len(p.events())
    r = decode_pull(lane, p.address)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["source"] == "handoff" and not got["fallback"], got
    assert got["token_ids"] == lane["local"]["token_ids"]
    served = p.wait_events(before + 1)[before:]
    assert [e["outcome"] for e in served] == ["served"]
    assert served[0]["tokens"] == got["prompt_tokens"] and served[0]["bytes"] > 0


def test_receive_from_pipes_a_verified_pack_into_decode(lane):
    p = lane["producer"]
    recv = receive_from(lane, p.address)
    dec = subprocess.Popen(muser_cmd("decode", *lane["common"], "--prompt", str(lane["prompt"]), "-n", "8", "--json"),
                           env=env_for(lane["nodes"].consumer_home), stdin=recv.stdout, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    recv.stdout.close()
    out, err = dec.communicate(timeout=HANG_S)
    _, rerr = recv.communicate(timeout=HANG_S)
    assert recv.returncode == 0 and dec.returncode == 0, (rerr, err)
    got = json.loads(out)
    assert got["source"] == "handoff" and got["token_ids"] == lane["local"]["token_ids"]


def test_a_stranger_is_refused_77_before_any_prefill(lane):
    p = lane["producer"]
    before = len(p.events())
    stranger = lane["root"] / "stranger"
    node.init_node(keys_dir_of(stranger), name="consumer")  # same name, another CA
    recv = receive_from(lane, p.address, stranger)
    out, err = recv.communicate(timeout=HANG_S)
    assert recv.returncode == 77, err
    assert out == b""
    time.sleep(0.3)
    assert len(p.events()) == before  # no request was even read, let alone computed
    assert p.wait_events(1, "tls_failed")


def test_a_replayed_request_is_refused(lane):
    """The same signed request bytes sent twice: the second is refused (replay) before any work."""
    from muser_cli.handoff.wire.protocol import Reject

    ident, request = signed_request(lane)
    p = lane["producer"]
    before = len(p.events())
    first = first_pull_answer(ident, p.address, request)  # Serving (then we hang up: given up)
    assert type(first).__name__ == "Serving"
    second = first_pull_answer(ident, p.address, request)
    assert isinstance(second, Reject) and second.code == "replay", second
    events = p.wait_events(before + 2)[before:]
    assert any(e["outcome"] == "replay" for e in events)
    left = [e for e in events if e["outcome"] == "failed"]  # the first: it hung up before it was ready
    assert len(left) == 1 and "ready" in left[0]["reason"].lower(), events


def test_another_model_is_refused_naming_both(lane, tiny_hybrid):
    p = lane["producer"]
    recv = subprocess.Popen(muser_cmd("receive", "--from", p.address, str(lane["prompt"]), "-m", str(tiny_hybrid.path)),
                            env=env_for(lane["nodes"].consumer_home), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = recv.communicate(timeout=HANG_S)
    assert recv.returncode == 65, err  # issue 25: another model is mismatched data on both lanes (was 75 here)
    assert out == b""
    text = err.decode()
    assert "model" in text and tiny_hybrid.fingerprint in text and lane["local"] is not None


def test_two_consumers_with_no_queue_one_is_told_busy_at_once(lane, tmp_path):
    """--max-queue 0: while one request holds the producer's turn, a second is refused busy at
    once (75). The first is admitted (Serving) and holds its turn without saying it is ready,
    so the producer is busy for as long as the test needs, whatever the machine's load; once it
    hangs up (logged: it left before it was ready), the next consumer is served."""
    with serving(lane["nodes"].producer_home, *lane["common"], "--max-queue", "0",
                 "--idle-timeout", str(HANG_S)) as prod:
        env = env_for(lane["nodes"].consumer_home)
        args = ["receive", "--from", prod.address, str(lane["prompt"]), "-m", lane["model"], "--chunk", str(CHUNK)]
        ident, request = signed_request(lane)
        with held_pull(ident, prod.address, request) as answer:
            assert type(answer).__name__ == "Serving"
            b = subprocess.run(muser_cmd(*args, "-o", str(tmp_path / "b.kvpack")), env=env, capture_output=True,
                               timeout=HANG_S)
            # Told at once, not after a deadline (a state, not a stopwatch): its "busy" is the
            # producer's only outcome while the first still holds its turn, admitted and silent.
            assert [e["outcome"] for e in prod.wait_events(1)] == ["busy"], prod.events()
        assert b.returncode == 75 and b"busy" in b.stderr, b.stderr
        assert not (tmp_path / "b.kvpack").exists()
        assert sorted(e["outcome"] for e in prod.wait_events(2)) == ["busy", "failed"]  # the turn is free again
        a = subprocess.run(muser_cmd(*args, "-o", str(tmp_path / "a.kvpack")), env=env, capture_output=True,
                           timeout=HANG_S)
        assert a.returncode == 0, a.stderr
        assert (tmp_path / "a.kvpack").stat().st_size > 0
        events = prod.wait_events(3)
        assert sorted(e["outcome"] for e in events) == ["busy", "failed", "served"], events
        assert all("ready" in e["reason"].lower() for e in events if e["outcome"] == "failed"), events


def test_producer_down_receive_75_and_decode_falls_back(lane):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    to = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()  # nothing listens there now
    recv = receive_from(lane, to)
    out, err = recv.communicate(timeout=HANG_S)
    assert recv.returncode == 75 and out == b"", err
    r = decode_pull(lane, to)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["fallback"] and "refused" in got["reason"], got
    assert got["token_ids"] == lane["local"]["token_ids"]


def test_producer_killed_once_admitted_decode_falls_back_with_the_same_tokens(lane):
    """SIGKILL of the producer after it admitted the request: decode falls back by itself.
    The consumer reaches the producer through a relay that holds each of its bursts 2 s, so
    its Ready is still on the way when the producer is killed: killed surely before a row
    left it, however loaded the machine."""
    prod = Producer(lane["nodes"].producer_home, *lane["common"])
    relay = Relay(int(prod.address.rsplit(":", 1)[1]), up_delay=2.0)
    try:
        proc = subprocess.Popen(muser_cmd("decode", *lane["common"], "--chunk", str(CHUNK), "--prompt",
                                          str(lane["prompt"]), "-n", "8", "--no-reuse", "--json", "--producer",
                                          relay.to),
                                env=env_for(lane["nodes"].consumer_home), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert prod.wait_events(1, "admitted", timeout=HANG_S)
        prod.proc.kill()
        out, err = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 0, err
        got = json.loads(out)
        assert got["fallback"] and got["reason"], got
        assert got["token_ids"] == lane["local"]["token_ids"]
        assert not prod.events(), "the producer logged an outcome: it was not killed while the request was admitted"
    finally:
        relay.close()
        prod.proc.kill()
        prod.proc.wait()


def test_producer_killed_mid_stream_keeps_verified_chunks_and_the_tokens(lane, tmp_path):
    """SIGKILL while frames flow: receive --from exits 75 with no end frame; what it forwarded
    decodes (verified chunks kept, the rest prefilled) to the local fallback's tokens."""
    prod = Producer(lane["nodes"].producer_home, *lane["common"])
    try:
        recv = subprocess.Popen(muser_cmd("receive", "--from", prod.address, str(lane["prompt"]), "-m", lane["model"],
                                          "--chunk", "1"),
                                env=env_for(lane["nodes"].consumer_home), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        got = b""
        end = time.monotonic() + HANG_S
        while len(got) < 4 * 4096 and time.monotonic() < end:
            if select.select([recv.stdout], [], [], 0.5)[0]:
                block = os.read(recv.stdout.fileno(), 4096)
                if not block:
                    break
                got += block
        prod.proc.kill()
        rest, err = recv.communicate(timeout=HANG_S)
        got += rest
        assert recv.returncode == 75, err
        cut = tmp_path / "cut.kvpack"
        cut.write_bytes(got)
        dec = subprocess.run(muser_cmd("decode", *lane["common"], str(cut), "--prompt", str(lane["prompt"]), "-n", "8",
                                       "--no-reuse", "--json"), env=env_for(lane["nodes"].consumer_home),
                             capture_output=True, timeout=HANG_S)
        assert dec.returncode == 0, dec.stderr
        out = json.loads(dec.stdout)
        assert out["source"] == "partial+local" and out["handoff_rows"] > 0, out
        local = subprocess.run(muser_cmd("decode", *lane["common"], "--chunk", "1", "--prompt", str(lane["prompt"]),
                                         "-n", "8", "--no-reuse", "--json"), env=env_for(lane["nodes"].consumer_home),
                               input=b"", capture_output=True, timeout=HANG_S)
        assert out["token_ids"] == json.loads(local.stdout)["token_ids"]
    finally:
        prod.proc.kill()
        prod.proc.wait()


@pytest.fixture(scope="module")
def follow(lane):
    """A follow-up question on the lane's document, and its local tokens (no store)."""
    path = lane["root"] / "follow.txt"
    path.write_text(PROMPT + "\n\nWhere did they put the bridge?")
    common = [*lane["common"], "--chunk", str(CHUNK), "--prompt", str(path), "-n", "8", "--json"]
    local = subprocess.run(muser_cmd("decode", *common, "--no-reuse"), env=env_for(lane["nodes"].consumer_home),
                           input=b"", capture_output=True, timeout=HANG_S)
    assert local.returncode == 0, local.stderr
    return {"path": path, "decode": common, "tokens": json.loads(local.stdout)["token_ids"]}


def test_receive_from_asks_only_for_what_the_store_lacks(lane, follow, tmp_path):
    """A stored document: ``receive --from`` for a follow-up question on it ships a delta pack
    (positions from the stored prefix) that ``decode --prompt`` merges to the local tokens;
    ``--no-reuse`` asks for the whole pack."""
    from muser_cli.kvpack import read_pack

    env = env_for(without_store(lane["nodes"].consumer_home, tmp_path / "consumer"))
    prefill_stored(env, lane["prompt"], tmp_path / "doc.kvpack", *lane["common"], "--chunk", str(CHUNK))
    ask = ["receive", "--from", lane["producer"].address, str(follow["path"]), "-m", lane["model"],
           "--chunk", str(CHUNK)]
    delta = subprocess.run(muser_cmd(*ask, "-o", str(tmp_path / "delta.kvpack"), "--json"), env=env,
                           capture_output=True, timeout=HANG_S)
    assert delta.returncode == 0, delta.stderr
    got = json.loads(delta.stdout)
    full = subprocess.run(muser_cmd(*ask, "--no-reuse", "-o", str(tmp_path / "full.kvpack"), "--json"), env=env,
                          capture_output=True, timeout=HANG_S)
    assert full.returncode == 0, full.stderr
    def header_of(path: Path):
        with open(path, "rb") as f:
            return read_pack(f).header

    head = header_of(tmp_path / "delta.kvpack")
    assert got["held_tokens"] >= CHUNK and head.rows_start == got["held_tokens"], (got, head.rows_start)
    assert header_of(tmp_path / "full.kvpack").rows_start == 0
    assert json.loads(full.stdout)["held_tokens"] == 0
    assert got["payload_bytes"] < json.loads(full.stdout)["payload_bytes"]
    merged = subprocess.run(muser_cmd("decode", str(tmp_path / "delta.kvpack"), *follow["decode"]), env=env,
                            capture_output=True, timeout=HANG_S)
    assert merged.returncode == 0, merged.stderr
    out = json.loads(merged.stdout)
    assert out["source"] == "delta" and out["token_ids"] == follow["tokens"], out


OFF_GRID = ("The committee met on a grey ", "The committee met on a grey T")  # 18 and 19 tokens, sharing 18


def test_a_have_off_the_chunk_grid_gets_a_delta_that_verifies(lane, tmp_path, monkeypatch):
    """#30 item 3. The consumer's store holds an 18-token prompt: its rows end at 17, off the
    chunk-8 grid. For a 19-token prompt that starts with it, ``receive --from`` asks for the
    grid point below (16), and a consumer that claims 17 anyway is answered from 16 by the
    producer: either way exit 0 and a delta pack that ``muser verify`` accepts (before: a
    delta from 17, published with exit 0, that verify refused), and ``decode`` merges it to
    the local tokens."""
    from muser_cli.kvpack import read_pack
    from muser_cli.model.resolve import resolve_model
    from muser_cli.reuse.chain import Scope, chain_at
    from muser_cli.consumer.pull import ask_for, pull_prompt
    from muser_cli.model.tokens import encode_prompt

    info = resolve_model(lane["model"])
    short, long = (encode_prompt(info, t, chat=False) for t in OFF_GRID)
    assert len(short) == 18 and len(long) == 19 and long[:18] == short  # the store's rows end at 17 = 2 * 8 + 1
    home = without_store(lane["nodes"].consumer_home, tmp_path / "consumer")
    env = env_for(home)
    paths = []
    for i, text in enumerate(OFF_GRID):
        paths.append(tmp_path / f"p{i}.txt")
        paths[-1].write_text(text)
    prefill_stored(env, paths[0], tmp_path / "short.kvpack", *lane["common"], "--chunk", str(CHUNK))
    local = subprocess.run(muser_cmd("decode", *lane["common"], "--chunk", str(CHUNK), "--prompt", str(paths[1]),
                                     "-n", "8", "--no-reuse", "--json"), env=env, input=b"", capture_output=True,
                           timeout=HANG_S)
    assert local.returncode == 0, local.stderr

    def verified_and_decoded(pack: Path) -> None:
        ok = subprocess.run(muser_cmd("verify", str(pack), "-m", lane["model"], "--prompt", str(paths[1])), env=env,
                            capture_output=True, timeout=HANG_S)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        dec = subprocess.run(muser_cmd("decode", str(pack), *lane["common"], "--chunk", str(CHUNK), "--prompt",
                                       str(paths[1]), "-n", "8", "--json"), env=env, capture_output=True, timeout=HANG_S)
        assert dec.returncode == 0, dec.stderr
        got = json.loads(dec.stdout)
        assert got["source"] == "delta" and got["token_ids"] == json.loads(local.stdout)["token_ids"], got

    def rows_start(pack: Path) -> int:
        with open(pack, "rb") as f:
            return read_pack(f).header.rows_start

    p = lane["producer"]
    before = len(p.events())
    asked = subprocess.run(muser_cmd("receive", "--from", p.address, str(paths[1]), "-m", lane["model"], "--chunk",
                                     str(CHUNK), "-o", str(tmp_path / "asked.kvpack"), "--json"),
                           env=env, capture_output=True, timeout=HANG_S)
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["held_tokens"] == 16 and rows_start(tmp_path / "asked.kvpack") == 16
    verified_and_decoded(tmp_path / "asked.kvpack")

    monkeypatch.setenv("MUSER_HOME", str(home))  # a consumer that claims the 17 rows its store ends at
    ask = ask_for(OFF_GRID[1], model=lane["model"], chat=False, chunk_tokens=CHUNK, dtype="float32", engine="torch")
    scope = Scope(info.fingerprint, info.tokenizer_fingerprint, "float32", CHUNK)
    ask.have_tokens, ask.have_chain = 17, chain_at(scope, long, 17)
    pull_prompt(p.address, ask, output=tmp_path / "claimed.kvpack", timeout=HANG_S)
    assert rows_start(tmp_path / "claimed.kvpack") == 16
    verified_and_decoded(tmp_path / "claimed.kvpack")
    served = p.wait_events(before + 2)[before:]
    assert [(e["outcome"], e["held_rows"]) for e in served] == [("served", 16)] * 2, served


def test_a_consumer_refuses_an_off_grid_delta_before_go(lane, tmp_path, monkeypatch):
    """A producer that answers a have of 17 (chunk 8) with a delta from 17 -- one without
    the rounding above -- is refused by the consumer before ``Go`` (65): nothing written,
    so nothing ``verify`` would refuse is ever published."""
    import muser_cli.pulllane.producer as serve_mod
    from muser_cli.errors import DataError
    from muser_cli.handoff.pull.client import pull
    from muser_cli.handoff.pull.server import PullServer, ServeConfig
    from muser_cli.handoff.push.receiver import Destination
    from muser_cli.reuse.chain import Scope, chain_at
    from muser_cli.model.tokens import encode_prompt

    monkeypatch.setattr(serve_mod, "have_on_grid", lambda req, scope: req)  # a producer without the rounding
    monkeypatch.setattr("muser_cli.reuse.delta.delta_point", lambda scope, ids, held, chain: (held, chain))
    prod = serve_mod.ResidentProducer(lane["model"], dtype="float32")
    info = prod.info
    ids = encode_prompt(info, OFF_GRID[1], chat=False)
    nodes = make_nodes(tmp_path / "nodes")
    server = PullServer(nodes.producer, ServeConfig(port=0), ledger_dir=tmp_path / "serve-ledger", compute=prod)
    server.bind()
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    out = tmp_path / "claimed.kvpack"
    try:
        with pytest.raises(DataError, match="starts at position 17"):
            pull(f"127.0.0.1:{server.address[1]}", nodes.consumer, token_ids=ids,
                 tokenizer_fingerprint=info.tokenizer_fingerprint, model_fingerprint=info.fingerprint,
                 chunk_tokens=CHUNK, dtype="float32", ledger_dir=tmp_path / "ledger",
                 destination=Destination(file=out), timeout=HANG_S, have_tokens=17,
                 have_chain=chain_at(Scope(info.fingerprint, info.tokenizer_fingerprint, "float32", CHUNK), ids, 17))
    finally:
        server.stop()
        serving.join(HANG_S)
        server.close()
    assert not out.exists() and not list(tmp_path.glob("*.part"))


def test_a_producer_with_store_answers_from_it_after_a_restart(lane, follow, tmp_path):
    """``prefill --serve --store``: the document's rows outlive the producer; restarted, it
    continues the follow-up from its store (``reused_from`` store) and the pack decodes to
    the local tokens."""
    home = without_store(lane["nodes"].producer_home, tmp_path / "producer")
    env = env_for(lane["nodes"].consumer_home)

    def pull(prod: Producer, prompt: Path, out: Path) -> dict:
        r = subprocess.run(muser_cmd("receive", "--from", prod.address, str(prompt), "-m", lane["model"], "--chunk",
                                     str(CHUNK), "--no-reuse", "-o", str(out)), env=env, capture_output=True,
                           timeout=HANG_S)
        assert r.returncode == 0, r.stderr
        served = prod.wait_events(1)
        assert [e["outcome"] for e in served] == ["served"], served
        return served[0]

    with serving(home, *lane["common"], "--store") as prod:
        first = pull(prod, lane["prompt"], tmp_path / "doc.kvpack")
    assert first["stored"] and first["reused_rows"] == 0, first
    with serving(home, *lane["common"], "--store") as prod:
        second = pull(prod, follow["path"], tmp_path / "follow.kvpack")
    assert second["reused_from"] == "store" and second["reused_rows"] >= CHUNK, second
    assert second["held_rows"] == 0 and second["stored"] != first["stored"], second
    dec = subprocess.run(muser_cmd("decode", str(tmp_path / "follow.kvpack"), *follow["decode"]), env=env,
                         capture_output=True, timeout=HANG_S)
    assert dec.returncode == 0, dec.stderr
    assert json.loads(dec.stdout)["token_ids"] == follow["tokens"]


def test_a_revoked_key_is_refused_77_before_any_prefill(lane, tmp_path):
    """``muser node revoke KEY`` on a running producer: the consumer's next request is refused
    (auth, 77) before admission, nothing on stdout, no output file."""
    nodes = make_nodes(tmp_path / "nodes")
    with serving(nodes.producer_home, *lane["common"]) as prod:
        ask = ["receive", "--from", prod.address, str(lane["prompt"]), "-m", lane["model"], "--chunk", str(CHUNK)]
        ok = subprocess.run(muser_cmd(*ask, "-o", str(tmp_path / "ok.kvpack")), env=env_for(nodes.consumer_home),
                            capture_output=True, timeout=HANG_S)
        assert ok.returncode == 0, ok.stderr
        rv = subprocess.run(muser_cmd("node", "revoke", nodes.producer_key_id), env=env_for(nodes.producer_home),
                            capture_output=True, timeout=HANG_S)
        assert rv.returncode == 0, rv.stderr
        refused = subprocess.run(muser_cmd(*ask), env=env_for(nodes.consumer_home), capture_output=True, timeout=HANG_S)
        assert refused.returncode == 77, refused.stderr
        assert refused.stdout == b"" and b"revoked" in refused.stderr, refused.stderr
        assert len(refused.stderr.decode().strip().splitlines()) <= 2  # one line (and its hint)
        events = prod.wait_events(2)
        assert [e["outcome"] for e in events] == ["served", "auth"], events
        assert "revoked" in events[1]["reason"]
        assert len(prod.events("admitted")) == 1  # the refused one never reached the engine


def test_silent_and_half_open_clients_are_dropped_without_delaying_others(lane):
    """A TCP connection that never starts TLS, and a TLS one that never sends its request:
    another consumer is served meanwhile at once, and both are closed by the producer's
    deadlines (handshake, request: 10 s each)."""
    import socket
    import ssl

    from muser_cli.handoff.link import client_context
    from muser_cli.handoff.trust.node import load_identity
    from muser_cli.handoff.wire.pull_protocol import ALPN_PULL

    p = lane["producer"]
    host, port = p.address.rsplit(":", 1)
    before, tls_before = len(p.events()), len(p.events("tls_failed"))
    half_open = socket.create_connection((host, int(port)), timeout=HANG_S)
    ctx = client_context(load_identity(keys_dir_of(lane["nodes"].consumer_home)))
    ctx.set_alpn_protocols([ALPN_PULL])
    silent = ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=HANG_S), server_hostname=host)
    try:
        r = decode_pull(lane, p.address)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["source"] == "handoff" and got["token_ids"] == lane["local"]["token_ids"], got
        for s in (half_open, silent):  # the producer hangs up on both by its deadlines
            s.settimeout(HANG_S)
            try:
                while s.recv(4096):
                    pass
            except (ssl.SSLError, ConnectionError):
                pass
    finally:
        half_open.close()
        silent.close()
    # Both closed by the producer's deadlines (states its events name, not a stopwatch of ours):
    # the silent TLS client for no request within request_s, the half-open one in the handshake.
    events = p.wait_events(before + 2)[before:]
    outcomes = sorted(e["outcome"] for e in events)
    assert outcomes == ["failed", "served"], events
    assert [e for e in events if e["outcome"] == "failed" and "no whole request within 10 s" in e["reason"]], events
    assert p.wait_events(tls_before + 1, "tls_failed")[tls_before:], "the half-open client was not dropped"


def test_four_consumers_at_once_on_a_queue_of_one_all_succeed_or_fall_back(lane, tmp_path, monkeypatch):
    """--max-queue 1 while a request holds the producer's turn (admitted, never ready): four
    consumers ask at the same instant (threads of this process, each its own TLS connection,
    what ``receive --from`` runs): one waits its turn and is served once the holder hangs up,
    three are told busy at once (75); a ``decode --producer`` asking meanwhile is told busy
    too and prefills locally, with the local tokens. None hangs, none is lost."""
    from muser_cli.errors import TempFailure
    from muser_cli.kvpack import read_pack
    from muser_cli.consumer.pull import ask_for, pull_prompt

    monkeypatch.setenv("MUSER_HOME", str(lane["nodes"].consumer_home))
    ask = ask_for(PROMPT, model=lane["model"], chat=False, chunk_tokens=CHUNK, dtype="float32", engine="torch")
    env = env_for(lane["nodes"].consumer_home)
    results: dict[int, object] = {}
    gate = threading.Barrier(4)

    def consumer(i: int) -> None:
        gate.wait()
        try:
            results[i] = pull_prompt(prod.address, ask, output=tmp_path / f"c{i}.kvpack", timeout=HANG_S)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            results[i] = exc

    threads = [threading.Thread(target=consumer, args=(i,), daemon=True) for i in range(4)]
    with serving(lane["nodes"].producer_home, *lane["common"], "--max-queue", "1",
                 "--idle-timeout", str(HANG_S)) as prod:
        ident, request = signed_request(lane)
        with held_pull(ident, prod.address, request) as answer:  # it holds the producer's turn until it hangs up
            assert type(answer).__name__ == "Serving"
            for t in threads:
                t.start()
            busy = [e for e in prod.wait_events(3, timeout=HANG_S) if e["outcome"] == "busy"]
            assert len(busy) == 3, prod.events()  # the fourth waits in the queue: the holder has the turn
            # Told at once, not after a deadline (a state, not a stopwatch): three consumers have
            # their "busy" answer while the holder still holds the turn.
            assert wait_for(lambda: sum(isinstance(r, TempFailure) for r in list(results.values())) == 3, HANG_S), \
                results
            dec = subprocess.run(muser_cmd("decode", *lane["common"], "--chunk", str(CHUNK), "--prompt",
                                           str(lane["prompt"]), "-n", "8", "--no-reuse", "--json", "--producer",
                                           prod.address, "--timeout", str(HANG_S)),
                                 env=env, capture_output=True, timeout=HANG_S)
        for t in threads:
            t.join(HANG_S)
        assert not any(t.is_alive() for t in threads), "a consumer hangs"
        events = prod.wait_events(6)
    refused = [i for i, r in results.items() if isinstance(r, TempFailure) and "busy" in str(r)]
    served = [i for i, r in results.items() if isinstance(r, dict)]
    assert len(refused) == 3 and len(served) == 1, results
    assert not any((tmp_path / f"c{i}.kvpack").exists() for i in refused)
    assert dec.returncode == 0, dec.stderr
    out = json.loads(dec.stdout)
    assert out["fallback"] and "busy" in out["reason"], out
    assert out["token_ids"] == lane["local"]["token_ids"]
    assert sorted(e["outcome"] for e in events) == ["busy"] * 4 + ["failed", "served"], events
    ref = subprocess.run(muser_cmd("prefill", str(lane["prompt"]), *lane["common"], "--chunk", str(CHUNK),
                                   "-o", str(tmp_path / "ref.kvpack")), env=env, capture_output=True, timeout=HANG_S)
    assert ref.returncode == 0, ref.stderr

    def layers(path: Path) -> list[bytes]:
        with open(path, "rb") as f:
            return [lk.keys.tobytes() + lk.values.tobytes() for lk in read_pack(f).layers]

    assert layers(tmp_path / f"c{served[0]}.kvpack") == layers(tmp_path / "ref.kvpack")  # the queued one: local rows


def node_check(lane, to: str, *extra: str, home: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(muser_cmd("node", "check", to, "-m", lane["model"], "--threads", "1", *extra),
                          env=env_for(home or lane["nodes"].consumer_home), capture_output=True, timeout=HANG_S)


def test_node_check_says_the_producer_is_ready(lane, tiny_llama):
    """``muser node check HOST:PORT``: one table, every check ok, exit 0; --json: the same as
    one object (clock skew measured from the producer's handoff header, the KV spot-checked)."""
    p = lane["producer"]
    before = len(p.events())
    r = node_check(lane, p.address)
    assert r.returncode == 0, (r.stdout, r.stderr)
    lines = r.stdout.decode().splitlines()
    assert lines[0] == f"node check {p.address}"
    assert [ln.split()[0] for ln in lines[1:]] == ["reachable", "mutual", "request", "clock", "model", "link", "audit"]
    assert "consumer->producer" in lines[6] and "MB/s" in lines[6], lines[6]
    assert all("  ok  " in ln for ln in lines[1:]), lines
    t0 = time.monotonic()
    j = node_check(lane, p.address, "--json")
    check_s = time.monotonic() - t0
    assert j.returncode == 0, j.stderr
    got = json.loads(j.stdout)
    assert got["ok"] and got["exit_status"] == 0 and all(c["ok"] for c in got["checks"]), got
    checks = {c["check"]: c for c in got["checks"]}
    assert abs(checks["clock"]["skew_s"]) < 5 and checks["clock"]["window_s"] == 120
    assert checks["model"]["model_fingerprint"] == tiny_llama.fingerprint
    assert checks["link"]["consumer_to_producer_MBps"] > 0 and checks["link"]["producer_to_consumer_MBps"] > 0
    probes = p.wait_events(2, "probe")
    assert [e["outcome"] for e in probes[-2:]] == ["probed", "probed"], probes  # one per check run
    assert checks["audit"]["spot_check"]["ok"] and checks["audit"]["spot_check"]["layers_checked"] > 0
    served = p.wait_events(before + 2)[before:]
    assert [e["outcome"] for e in served] == ["served", "served"], served  # the two test prefills, nothing else
    print(f"node check --json took {check_s:.1f} s (process start and model load included)")


def test_node_check_names_the_first_failure_and_its_status(lane, tiny_hybrid, tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    down = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    r = node_check(lane, down)
    assert r.returncode == 75, r.stderr
    rows = r.stdout.decode().splitlines()[1:]
    assert "FAIL" in rows[0] and all(ln.split()[-2:] == ["-", "not"] or "not run" in ln for ln in rows[1:]), rows
    assert len(r.stderr.decode().strip().splitlines()) == 1  # one line: the first failure
    stranger = tmp_path / "stranger"
    node.init_node(keys_dir_of(stranger), name="consumer")  # another CA
    r = node_check(lane, lane["producer"].address, home=stranger)
    assert r.returncode == 77, r.stderr
    assert "mutual auth" in r.stdout.decode().splitlines()[2] and "FAIL" in r.stdout.decode().splitlines()[2]
    other = subprocess.run(muser_cmd("node", "check", lane["producer"].address, "-m", str(tiny_hybrid.path), "--json"),
                           env=env_for(lane["nodes"].consumer_home), capture_output=True, timeout=HANG_S)
    assert other.returncode == 65, other.stderr
    got = json.loads(other.stdout)
    failed = [c for c in got["checks"] if c["ok"] is False]
    assert [c["check"] for c in failed] == ["model"] and tiny_hybrid.fingerprint in failed[0]["detail"], got


def test_idle_timeout_drops_an_admitted_consumer_that_never_gets_ready(lane, tmp_path):
    """``prefill --serve --idle-timeout 1``: a consumer admitted (Serving) that then says
    nothing holds the turn only that long: it is logged failed (timed out) and the next
    consumer is served while the silent one still holds its socket open. Without --serve, or
    not positive, the flag is a usage error (2)."""
    with serving(lane["nodes"].producer_home, *lane["common"], "--idle-timeout", "1") as prod:
        ident, request = signed_request(lane)
        with held_pull(ident, prod.address, request) as answer:
            assert type(answer).__name__ == "Serving"
            dropped = prod.wait_events(1, timeout=HANG_S)
            assert [e["outcome"] for e in dropped] == ["failed"] and "timed out" in dropped[0]["reason"], dropped
            r = subprocess.run(muser_cmd("receive", "--from", prod.address, str(lane["prompt"]), "-m", lane["model"],
                                         "--chunk", str(CHUNK), "-o", str(tmp_path / "next.kvpack")),
                               env=env_for(lane["nodes"].consumer_home), capture_output=True, timeout=HANG_S)
            assert r.returncode == 0, r.stderr
        assert [e["outcome"] for e in prod.wait_events(2)] == ["failed", "served"]
    env = env_for(lane["nodes"].producer_home)
    for args in (["prefill", str(lane["prompt"]), *lane["common"], "--idle-timeout", "5"],
                 ["prefill", "--serve", "127.0.0.1:0", *lane["common"], "--idle-timeout", "0"]):
        bad = subprocess.run(muser_cmd(*args), env=env, capture_output=True, timeout=HANG_S)
        assert bad.returncode == 2 and b"--idle-timeout" in bad.stderr, (args, bad.stderr)
        assert len(bad.stderr.decode().strip().splitlines()) <= 2, bad.stderr  # the error and, at most, its hint
