"""``muser probe-link`` against a resident producer, and ``node ls`` last-seen (issue 12): real
processes, mutual TLS on 127.0.0.1.

    producer$ muser prefill --serve 127.0.0.1:0 -m MODEL
    consumer$ muser probe-link HOST:PORT [--json]     # up = consumer->producer, down = back

The producer answers a signed probe request (key id, MAC, issued-at, replay ledger) over its
own ``muser-pull/1`` listener; each direction is counted at its receiving end.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from muser_cli.handoff.trust import node
from handoff_kit import HANG_S, env_for, first_pull_answer, keys_dir_of, muser_cmd, pull_lane


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama):
    with pull_lane(tmp_path_factory.mktemp("probe"), tiny_llama.path) as lane:
        lane["producer"].model = lane["model"]
        yield lane


def probe(home, to: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(muser_cmd("probe-link", to, *extra), env=env_for(home), capture_output=True, timeout=HANG_S)


def test_probe_link_measures_a_serving_producer_both_ways(served):
    p = served["producer"]
    before = len(p.events("probe"))
    r = probe(served["nodes"].consumer_home, p.address, "--seconds", "0.3", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["listener"] == "producer" and got["passed"]
    assert got["up_bytes"] > 0 and got["down_bytes"] > 0 and got["up_Bps"] > 0 and got["down_Bps"] > 0
    assert got["receiver"]["node"] == "gx10"  # the producer's Ready: its node name
    events = p.wait_events(before + 1, "probe")[before:]
    ev = events[0] if events else {}
    assert [e["outcome"] for e in events] == ["probed"], ev.get("reason")
    # Each direction is counted at its receiving end: the consumer's up figure is the producer's
    # count, and the consumer counted exactly the bytes the producer sent down.
    assert ev["up_bytes"] == got["up_bytes"] and ev["down_bytes"] == got["down_bytes"], (ev, got)
    assert ev["consumer"] == "consumer" and ev["key_id"]
    assert p.events("request") == [] or all(e["outcome"] != "probed" for e in p.events("request"))
    text = probe(served["nodes"].consumer_home, p.address, "--seconds", "0.2")
    assert text.returncode == 0, text.stderr
    assert "(producer): up" in text.stderr.decode() and "MB/s" in text.stderr.decode()  # one unit (#29)
    floor = probe(served["nodes"].consumer_home, p.address, "--seconds", "0.2", "--floor", "1000T")
    assert floor.returncode == 75 and "below the floor" in floor.stderr.decode()


def test_a_stranger_cannot_probe_the_producer(served, tmp_path):
    p = served["producer"]
    stranger = tmp_path / "stranger"
    node.init_node(keys_dir_of(stranger), name="consumer")  # another CA
    before = len(p.events("probe"))
    r = probe(stranger, p.address, "--seconds", "0.2")
    assert r.returncode == 77, r.stderr
    assert len(r.stderr.decode().strip().splitlines()) == 1
    time.sleep(0.3)
    assert len(p.events("probe")) == before  # refused in the handshake: no probe request was read


def test_a_replayed_probe_request_is_refused(served):
    """The same signed probe bytes twice: the first is answered, the second refused (replay)."""
    from muser_cli.handoff.trust.node import load_identity
    from muser_cli.handoff.wire.protocol import Reject
    from muser_cli.handoff.wire.pull_protocol import Probe, ProbeRequest, new_request_id, sign_probe
    from muser_cli.handoff.pull.client import key_for

    ident = load_identity(keys_dir_of(served["nodes"].consumer_home))
    key = key_for(ident, "gx10")
    req = ProbeRequest(key.key_id, new_request_id(), int(time.time() * 1000), ident.name, 200)
    raw, mac = sign_probe(req, key.secret)
    p = served["producer"]
    before = len(p.events("probe"))
    assert type(first_pull_answer(ident, p.address, Probe(raw, mac, req))).__name__ == "Serving"
    second = first_pull_answer(ident, p.address, Probe(raw, mac, req))
    assert isinstance(second, Reject) and second.code == "replay", second
    events = p.wait_events(before + 2, "probe")[before:]
    # the first was admitted (then we left without probing), the second refused before admission
    assert sorted(e["outcome"] for e in events) == ["failed", "replay"], events
    assert next(e for e in events if e["outcome"] == "replay")["request_id"] is None  # refused as it was read


def node_ls(home) -> dict:
    r = subprocess.run(muser_cmd("node", "ls", "--json"), env=env_for(home), capture_output=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    return {p["name"]: p for p in json.loads(r.stdout)["peers"]}


def test_node_ls_shows_when_each_side_last_saw_the_other(served, tmp_path):
    """Producer side: recorded when the consumer's request verified; consumer side: when the
    producer's answer verified (a pulled pack, an answered probe). A stranger is not recorded."""
    nodes, p = served["nodes"], served["producer"]
    r = probe(nodes.consumer_home, p.address, "--seconds", "0.1")
    assert r.returncode == 0, r.stderr
    mine, theirs = node_ls(nodes.consumer_home)["gx10"], node_ls(nodes.producer_home)["consumer"]
    assert (mine["role"], mine["via"], mine["address"]) == ("producer", "probe", p.address) and mine["last_seen"]
    assert (theirs["role"], theirs["via"], theirs["key_id"]) == ("consumer", "probe", nodes.producer_key_id)
    prompt = tmp_path / "doc.txt"
    prompt.write_text("The committee met on a grey Tuesday to decide where the new bridge would go.")
    out = tmp_path / "got.kvpack"
    pulled = subprocess.run(muser_cmd("receive", "--from", p.address, str(prompt), "-m", p.model, "--chunk", "8",
                                      "--dtype", "float32", "--no-reuse", "-o", str(out)),
                            env=env_for(nodes.consumer_home), capture_output=True, timeout=HANG_S)
    assert pulled.returncode == 0, pulled.stderr
    mine2, theirs2 = node_ls(nodes.consumer_home)["gx10"], node_ls(nodes.producer_home)["consumer"]
    assert mine2["via"] == "pull" and mine2["last_seen"] > mine["last_seen"]
    assert theirs2["via"] == "pull" and theirs2["last_seen"] > theirs["last_seen"]
    stranger = tmp_path / "stranger"
    node.init_node(keys_dir_of(stranger), name="consumer")  # same name, another CA
    assert probe(stranger, p.address, "--seconds", "0.1").returncode == 77
    assert node_ls(nodes.producer_home)["consumer"] == theirs2  # the stranger never authenticated
    text = subprocess.run(muser_cmd("node", "ls"), env=env_for(nodes.producer_home), capture_output=True, timeout=HANG_S)
    assert "peer consumer" in text.stdout.decode() and f"last seen {theirs2['last_seen']}" in text.stdout.decode()


def test_a_probe_request_buys_one_up_and_one_down_probe(served):
    """The probe holds the producer's admission: a third probe on it is refused (protocol)."""
    from muser_cli.errors import ProtocolError
    from muser_cli.handoff.trust.certs import peer_common_name
    from muser_cli.handoff.link import Link
    from muser_cli.handoff.trust.node import load_identity
    from muser_cli.handoff.probes import measure
    from muser_cli.handoff.wire.protocol import Ready
    from muser_cli.handoff.wire.pull_protocol import PullConnection, Side
    from muser_cli.handoff.pull.client import connect, request_probe

    p = served["producer"]
    ident = load_identity(keys_dir_of(served["nodes"].consumer_home))
    before = len(p.events("probe"))
    sock, where = connect(p.address, ident, HANG_S)
    link = Link(sock, PullConnection(Side.CONSUMER), idle_s=10.0, deadline=None)
    try:
        request_probe(link, ident, peer_common_name(sock.getpeercert(binary_form=True)), where, seconds=0.1)
        assert isinstance(link.next_event("ready"), Ready)
        first = measure(link, 0.1)
        assert first["up_bytes"] > 0 and first["down_bytes"] > 0
        with pytest.raises(ProtocolError, match="more than one up and one down"):
            measure(link, 0.1)
    finally:
        link.close()
    events = p.wait_events(before + 1, "probe")[before:]
    assert [e["outcome"] for e in events] == ["failed"] and "more than one" in events[0]["reason"], events
