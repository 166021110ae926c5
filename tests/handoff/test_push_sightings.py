"""``node ls`` sightings from the push lane: after a real loopback ``send`` to ``receive --listen``
the sender's node records the receiver (a consumer) and the receiver's node records the sender
(a producer), each with when, from where and under which key id; a sighting that cannot be
written never fails the handoff."""

from __future__ import annotations

import json
import subprocess

from typer.testing import CliRunner

from muser_cli.commands import app
from muser_cli.handoff.trust.node import load_identity
from muser_cli.handoff.trust.nodedir import peer_table, read_peers
from muser_cli.handoff.push.receiver import ReceiveConfig, Receiver
from muser_cli.handoff.push.sender import prepare_handoff, transmit

from handoff_kit import (  # noqa: F401 - fixtures
    HANG_S, copy_home, env_for, keys_dir_of, make_nodes, muser_cmd, nodes, pack_bytes, pack_file, spawn_receiver,
)


def _ls_json(home) -> list[dict]:
    r = CliRunner().invoke(app, ["node", "ls", "--json"], env={"MUSER_HOME": str(home)})
    assert r.exit_code == 0, r.output
    return json.loads(r.output)["peers"]


def test_send_and_receive_listen_record_each_other(nodes, pack_file, tmp_path):
    consumer_home = copy_home(nodes.consumer_home, tmp_path / "consumer")
    producer_home = copy_home(nodes.producer_home, tmp_path / "producer")
    assert [p["last_seen"] for p in _ls_json(consumer_home)] == [None]
    assert [p["last_seen"] for p in _ls_json(producer_home)] == [None]
    proc, to = spawn_receiver(consumer_home, "--once", "--timeout", str(HANG_S), "-o", str(tmp_path / "got.kvpack"))
    r = subprocess.run(muser_cmd("send", str(pack_file), "--to", to), env=env_for(producer_home),
                       capture_output=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert proc.wait(HANG_S) == 0
    assert (tmp_path / "got.kvpack").read_bytes() == pack_file.read_bytes()

    # The receiver's node: the producer that sent, from its ephemeral loopback port, with its key.
    (seen_by_consumer,) = _ls_json(consumer_home)
    assert (seen_by_consumer["name"], seen_by_consumer["role"], seen_by_consumer["via"]) == ("gx10", "producer", "push")
    assert seen_by_consumer["key_id"] == nodes.producer_key_id and seen_by_consumer["last_seen"]
    assert seen_by_consumer["address"].startswith("127.0.0.1:")
    # The sender's node: the receiver it handed off to, at the address it dialled.
    (seen_by_producer,) = _ls_json(producer_home)
    assert (seen_by_producer["name"], seen_by_producer["role"], seen_by_producer["via"]) == ("consumer", "consumer",
                                                                                           "push")
    assert seen_by_producer["key_id"] == nodes.producer_key_id and seen_by_producer["address"] == to
    assert seen_by_producer["last_seen"]
    # The library's listing says the same as the CLI's.
    assert peer_table(keys_dir_of(producer_home), load_identity(keys_dir_of(producer_home))) == [seen_by_producer]
    text = CliRunner().invoke(app, ["node", "ls"], env={"MUSER_HOME": str(consumer_home)}).output
    assert f"last seen {seen_by_consumer['last_seen']} from {seen_by_consumer['address']} (push)" in text


def test_a_rejected_send_records_no_sighting(pack_file, tmp_path):
    """A producer of another CA is refused at the handshake: neither side notes a sighting."""
    ours, theirs = make_nodes(tmp_path / "ours"), make_nodes(tmp_path / "theirs")
    proc, to = spawn_receiver(ours.consumer_home, "--once", "--timeout", str(HANG_S), "-o", str(tmp_path / "x.kvpack"))
    try:
        r = subprocess.run(muser_cmd("send", str(pack_file), "--to", to), env=env_for(theirs.producer_home),
                           capture_output=True, timeout=HANG_S)
        assert r.returncode == 77, r.stderr
    finally:
        proc.kill()
        proc.wait(HANG_S)
    assert read_peers(keys_dir_of(ours.consumer_home)) == {}
    assert read_peers(keys_dir_of(theirs.producer_home)) == {}


def test_an_unwritable_record_never_fails_the_handoff(pack_file, tmp_path):
    """peers.json cannot be replaced on either side (a directory sits at its path): the handoff
    still succeeds; the receiver reports the lost sighting as an event, the sender says nothing."""
    n = make_nodes(tmp_path)
    for home in (n.consumer_home, n.producer_home):
        (keys_dir_of(home) / "peers.json").mkdir()
    consumer, producer = load_identity(keys_dir_of(n.consumer_home)), load_identity(keys_dir_of(n.producer_home))
    events: list[tuple[str, dict]] = []
    out = tmp_path / "got.kvpack"
    from muser_cli.handoff.push.spool import Destination

    rx = Receiver(consumer, ReceiveConfig(host="127.0.0.1", port=0, once=True, timeout=HANG_S),
                  ledger_dir=tmp_path / "ledger", destination=Destination(file=out),
                  on_event=lambda k, f: events.append((k, f)))
    import threading

    box: dict = {}
    rx.bind()
    t = threading.Thread(target=lambda: box.setdefault("got", rx.serve()))
    t.start()
    try:
        to = f"127.0.0.1:{rx.address[1]}"
        res = transmit(prepare_handoff(pack_file, producer), to=to, identity=producer)
        assert res.ok
        t.join(HANG_S)
    finally:
        rx.stop()
        rx.close()
    assert len(box["got"]) == 1 and out.read_bytes() == pack_file.read_bytes()
    assert any(k == "warning" and "could not record when gx10 was seen" in f["warning"] for k, f in events), events
