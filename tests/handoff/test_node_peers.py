"""``node ls`` peers: each peer's role and when it last authenticated here (peers.json in the
node directory, replaced atomically, serialised between threads and processes)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import threading

import pytest
from typer.testing import CliRunner

from muser_cli.commands import app
from muser_cli.errors import ConfigError
from muser_cli.handoff.trust import node
from muser_cli.handoff.trust.nodedir import peer_table, read_peers, record_peer

from handoff_kit import HANG_S, keys_dir_of, make_nodes


def test_keyring_peers_are_listed_never_seen_then_seen(tmp_path):
    nodes = make_nodes(tmp_path)
    c, p = keys_dir_of(nodes.consumer_home), keys_dir_of(nodes.producer_home)
    assert [(r["name"], r["role"], r["last_seen"]) for r in peer_table(c, nodes.consumer)] == [("gx10", "producer", None)]
    assert [(r["name"], r["role"], r["last_seen"]) for r in peer_table(p, nodes.producer)] == [("consumer", "consumer", None)]
    rec = record_peer(c, "gx10", role="producer", address="127.0.0.1:7070", key_id=nodes.producer_key_id, via="pull")
    assert stat.S_IMODE((c / "peers.json").stat().st_mode) == 0o600
    row = peer_table(c, nodes.consumer)[0]
    assert row["last_seen"] == rec["last_seen"] and row["address"] == "127.0.0.1:7070" and row["via"] == "pull"
    later = record_peer(c, "gx10", role="producer", address="127.0.0.1:7071", via="probe")
    assert read_peers(c)["gx10"]["address"] == "127.0.0.1:7071" and later["last_seen"] >= rec["last_seen"]
    assert not list(c.glob(".peers.json.*.part"))  # nothing half-written left beside it


def test_a_damaged_record_is_a_config_error_and_a_sighting_starts_it_again(tmp_path):
    d = tmp_path / "n"
    node.init_node(d, name="consumer")
    (d / "peers.json").write_bytes(b'{"format": "muser-peers", "version": 1, "peers": {"x": {"role": "boss"}}}')
    (d / "peers.json").chmod(0o600)
    with pytest.raises(ConfigError, match="malformed"):
        read_peers(d)
    record_peer(d, "gx10", role="producer")
    assert set(read_peers(d)) == {"gx10"}
    with pytest.raises(ValueError):
        record_peer(d, "gx10", role="boss")


def test_sightings_from_threads_and_processes_are_never_lost(tmp_path):
    d = tmp_path / "n"
    node.init_node(d, name="consumer")
    script = ("import sys; from pathlib import Path; from muser_cli.handoff.trust.nodedir import record_peer\n"
              "for i in range(15): record_peer(Path(sys.argv[1]), f'{sys.argv[2]}-{i}', role='producer')\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(d), f"proc{n}"]) for n in range(2)]
    threads = [threading.Thread(target=lambda n=n: [record_peer(d, f"thread{n}-{i}", role="consumer")
                                                    for i in range(15)]) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.wait(HANG_S) for p in procs] == [0, 0]
    assert len(read_peers(d)) == 5 * 15


def test_node_ls_shows_each_peer_role_and_last_seen(tmp_path):
    nodes = make_nodes(tmp_path)
    runner = CliRunner()
    env = {"MUSER_HOME": str(nodes.consumer_home)}
    r = runner.invoke(app, ["node", "ls"], env=env)
    assert r.exit_code == 0, r.output
    assert any(ln.split()[:4] == ["peer", "gx10", "producer", "never"] for ln in r.output.splitlines()), r.output
    record_peer(keys_dir_of(nodes.consumer_home), "gx10", role="producer", address="127.0.0.1:7070", via="pull")
    r = runner.invoke(app, ["node", "ls", "--json"], env=env)
    peers = json.loads(r.output)["peers"]
    assert [(p["name"], p["role"], p["via"]) for p in peers] == [("gx10", "producer", "pull")] and peers[0]["last_seen"]
    text = runner.invoke(app, ["node", "ls"], env=env).output
    assert f"last seen {peers[0]['last_seen']} from 127.0.0.1:7070 (pull)" in text
