"""A producer serves many consumers (issue 28 part 4): one producer home joins two consumers'
bundles (one bundle each: its own certificate, CA, HMAC key and replay ledger), tells them
apart by the TLS server name the consumer sends, admits their requests round-robin with a
queue bound per consumer, and ``node ls`` lists both. Real TLS 1.3 on 127.0.0.1, real files,
the tiny llama for the token checks.
"""

from __future__ import annotations

import io
import json
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from handoff_kit import HANG_S
from handoff_kit import (  # noqa: F401 - fixtures
    env_for, keys_dir_of, lane_flags, muser_cmd, pack_bytes, pack_file, receivers, serving,
)
from muser_cli.errors import AuthError, UsageError
from muser_cli.handoff.trust import node
from muser_cli.handoff.pull.admission import Admission as _Admission
from muser_cli.handoff.pull.server import PullServer, ServeConfig

PROMPT = ("The committee met on a grey Tuesday to decide where the new bridge would go. "
          "After a long debate about costs, traffic and the river's spring floods, they chose "
          "the northern site, close to the old mill and the school.")


def two_consumers(root: Path, producer: str = "gx10") -> dict:
    """Consumers ``mac-a`` and ``mac-b`` (each its own CA), one producer home joined to both."""
    out: dict = {"producer_home": root / "producer"}
    pdir = keys_dir_of(out["producer_home"])
    for name in ("mac-a", "mac-b"):
        home = root / name
        node.init_node(keys_dir_of(home), name=name)
        bundle, summary = node.export_producer(keys_dir_of(home), producer=producer)
        node.join_node(pdir, bundle)
        out[name] = {"home": home, "key_id": summary["key_id"], "bundle": bundle,
                     "identity": node.load_identity(keys_dir_of(home))}
    return out


# ----------------------------------------------------------------------------- enrolment
def test_joining_a_second_consumer_adds_it_and_force_replaces_only_its_own(tmp_path):
    c = two_consumers(tmp_path)
    pdir = keys_dir_of(c["producer_home"])
    first, *more = node.load_identities(pdir)
    assert first.consumer == "mac-a" and [i.consumer for i in more] == ["mac-b"]
    assert (pdir / "consumers" / "mac-b" / "node.key").exists()
    for path in [pdir, *pdir.rglob("*")]:  # every directory 0700, every file 0600
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    with pytest.raises(UsageError, match="for consumer 'mac-b' already exists"):
        node.join_node(pdir, c["mac-b"]["bundle"])
    with pytest.raises(UsageError, match="for consumer 'mac-a' already exists"):
        node.join_node(pdir, c["mac-a"]["bundle"])
    bundle, summary = node.export_producer(keys_dir_of(c["mac-b"]["home"]), producer="gx10")
    node.join_node(pdir, bundle, force=True)  # replaces mac-b's identity, mac-a's stays
    first, second = node.load_identities(pdir)
    assert first.send_key == c["mac-a"]["key_id"] and second.send_key == summary["key_id"]
    with pytest.raises(UsageError, match="already exists"):  # a consumer's own home takes no bundle
        node.join_node(keys_dir_of(c["mac-a"]["home"]), c["mac-b"]["bundle"])


def test_node_ls_lists_every_consumer_and_its_key(tmp_path):
    c = two_consumers(tmp_path)
    r = subprocess.run(muser_cmd("node", "ls", "--json"), env=env_for(c["producer_home"]), capture_output=True,
                       timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert [x["consumer"] for x in got["consumers"]] == ["mac-a", "mac-b"]
    assert {k["key_id"] for k in got["keys"]} == {c["mac-a"]["key_id"], c["mac-b"]["key_id"]}
    assert {p["name"] for p in got["peers"]} >= {"mac-a", "mac-b"}
    assert "secret" not in r.stdout.decode()
    human = subprocess.run(muser_cmd("node", "ls"), env=env_for(c["producer_home"]), capture_output=True,
                           timeout=HANG_S).stdout.decode()
    assert "consumer mac-a" in human and "consumer mac-b" in human, human


# ----------------------------------------------------------------------------- fairness
def test_admission_takes_turns_between_consumers():
    """A floods (three waiting), then B queues two: turns go A, B, A, B, A -- not A, A, A, B, B."""
    adm = _Admission(1)
    assert adm.enter(False, who="a")
    order: list[str] = []
    threads = []
    for who in ("a", "a", "a", "b", "b"):
        n = sum(len(q) for q in adm._queues.values())
        t = threading.Thread(target=lambda w=who: (adm.wait(False, lambda: False, poll=0.01, who=w),
                                                    order.append(w)))
        t.start()
        threads.append(t)
        end = time.monotonic() + HANG_S
        while sum(len(q) for q in adm._queues.values()) == n and time.monotonic() < end:
            time.sleep(0.005)
    for i in range(5):
        adm.leave(False)
        end = time.monotonic() + HANG_S
        while len(order) < i + 1 and time.monotonic() < end:
            time.sleep(0.005)
    for t in threads:
        t.join(HANG_S)
    assert order == ["a", "b", "a", "b", "a"]


class _GatedCompute:
    """Each request's prefill waits for a turn of the gate, then fails (the order of
    admission is what these tests read, from the producer's events)."""

    def __init__(self) -> None:
        self.gate = threading.Semaphore(0)

    def check(self, request):
        return None

    def run(self, request, out):
        self.gate.acquire(timeout=HANG_S)
        raise RuntimeError("gated compute: no pack")


@pytest.fixture
def inproc(tmp_path):
    c = two_consumers(tmp_path)
    events: list[tuple[str, dict]] = []
    compute = _GatedCompute()
    first, *more = node.load_identities(keys_dir_of(c["producer_home"]))
    server = PullServer(first, ServeConfig(port=0, max_queue=3), ledger_dir=tmp_path / "serve-ledger",
                        compute=compute, on_event=lambda kind, f: events.append((kind, f)), more=more)
    server.bind()
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    yield {"c": c, "server": server, "events": events, "compute": compute, "tmp": tmp_path,
           "to": f"127.0.0.1:{server.address[1]}"}
    server.stop()
    for _ in range(20):
        compute.gate.release()
    serving.join(HANG_S)
    server.close()


def _pull_thread(env: dict, who: str, results: dict, i: int) -> threading.Thread:
    from muser_cli.handoff.pull.client import pull

    def go() -> None:
        try:
            pull(env["to"], env["c"][who]["identity"], token_ids=list(range(1, 41)),
                 tokenizer_fingerprint="sha256:" + "a" * 64, model_fingerprint="sha256:" + "b" * 64,
                 chunk_tokens=8, dtype="float32", ledger_dir=env["tmp"] / f"ledger-{who}", timeout=HANG_S,
                 out_stream=io.BytesIO())
            results[i] = (who, "ok")
        except Exception as exc:  # noqa: BLE001 - the gated compute fails every request on purpose
            results[i] = (who, type(exc).__name__ + ": " + str(exc))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _admitted(env) -> list[str]:
    return [f["consumer"] for kind, f in list(env["events"]) if kind == "admitted"]


def _waiting(env) -> int:
    return sum(len(q) for q in env["server"]._admit._queues.values())


def test_a_flooding_consumer_does_not_starve_the_other_over_tls(inproc):
    env, results = inproc, {}
    threads = [_pull_thread(env, "mac-a", results, 0)]
    end = time.monotonic() + HANG_S
    while not _admitted(env) and time.monotonic() < end:
        time.sleep(0.01)
    for i, who in enumerate(["mac-a", "mac-a", "mac-a", "mac-b", "mac-b"], start=1):
        threads.append(_pull_thread(env, who, results, i))
        end = time.monotonic() + HANG_S
        while _waiting(env) < i and time.monotonic() < end:
            time.sleep(0.01)
        assert _waiting(env) == i, (i, results, env["events"])
    busy: dict = {}
    threads.append(_pull_thread(env, "mac-a", busy, 0))  # a fourth waiting from mac-a: over its bound
    threads[-1].join(HANG_S)
    assert "busy" in busy[0][1], busy
    for n in range(2, 7):
        env["compute"].gate.release()
        end = time.monotonic() + HANG_S
        while len(_admitted(env)) < n and time.monotonic() < end:
            time.sleep(0.01)
    env["compute"].gate.release()
    for t in threads:
        t.join(HANG_S)
    assert _admitted(env) == ["mac-a", "mac-a", "mac-b", "mac-a", "mac-b", "mac-a"], env["events"]


def test_each_consumer_is_checked_against_its_own_ca_and_keyring(inproc):
    """B's request over a handshake that named A: refused in TLS (A's CA did not issue B's
    certificate); revoking A's key on the producer refuses A and leaves B admitted."""
    import socket
    import ssl

    from muser_cli.handoff import link
    from muser_cli.handoff.pull.client import connect

    env = inproc
    b = env["c"]["mac-b"]["identity"]
    ctx = link.client_context(b)
    ctx.check_hostname = False
    ctx.set_alpn_protocols(["muser-pull/1"])

    raw = socket.create_connection(("127.0.0.1", env["server"].address[1]), timeout=HANG_S)
    with pytest.raises((ssl.SSLError, OSError)):
        with ctx.wrap_socket(raw, server_hostname=link.consumer_sni("mac-a")) as s:
            s.recv(1)
    raw.close()
    sock, _ = connect(env["to"], b, HANG_S)  # B naming itself: its own CA on both sides
    sock.close()
    node.revoke_key(keys_dir_of(env["c"]["producer_home"]), env["c"]["mac-a"]["key_id"])
    results: dict = {}
    _pull_thread(env, "mac-a", results, 0).join(HANG_S)  # refused before admission
    t = _pull_thread(env, "mac-b", results, 1)
    end = time.monotonic() + HANG_S
    while not _admitted(env) and time.monotonic() < end:
        time.sleep(0.01)
    env["compute"].gate.release()
    t.join(HANG_S)
    assert "revoked" in results[0][1], results
    assert _admitted(env) == ["mac-b"]
    refused = [f for kind, f in env["events"] if kind == "request" and f.get("outcome") == "auth"]
    assert refused and "revoked" in refused[0]["reason"]


def test_a_consumer_still_checks_the_dialled_name_against_the_producers_certificate(tmp_path):
    """The consumer's server name names the consumer, so the host dialled is checked by muser
    (``link.check_peer_host``): 127.0.0.2 is not in the producer's certificate -> 77 after the
    handshake, before any request is sent."""
    from muser_cli.handoff.pull.client import connect

    c = two_consumers(tmp_path)
    first, *more = node.load_identities(keys_dir_of(c["producer_home"]))
    events: list = []
    server = PullServer(first, ServeConfig(host="127.0.0.2", port=0), ledger_dir=tmp_path / "serve-ledger",
                        compute=_GatedCompute(), on_event=lambda k, f: events.append((k, f)), more=more)
    server.bind()
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    try:
        for who in ("mac-a", "mac-b"):
            with pytest.raises(AuthError, match="does not hold the name dialled"):
                connect(f"127.0.0.2:{server.address[1]}", c[who]["identity"], HANG_S)
    finally:
        server.stop()
        serving.join(HANG_S)
        server.close()
    assert not [f for k, f in events if k == "admitted" or f.get("request_id")]  # no request was sent


# ----------------------------------------------------------------------------- push
def test_send_to_a_consumer_signs_and_dials_as_that_consumers_producer(tmp_path, receivers, pack_file, monkeypatch):
    """``send --to`` from a producer of two consumers: ``--key-id`` (or the consumer's name as
    the host) picks that consumer's certificate and key; B's receiver accepts. Dialled by
    address without either, the first consumer's identity is used: B's receiver refuses it."""
    from muser_cli.handoff import api

    c = two_consumers(tmp_path)
    monkeypatch.setenv("MUSER_HOME", str(c["producer_home"]))
    rb = receivers(c["mac-b"]["identity"], tmp_path / "rb", once=True)
    with open(pack_file, "rb") as f:
        res = api.send(f, to=rb.to, rate=None, key_id=c["mac-b"]["key_id"], timeout=HANG_S, connect_timeout=HANG_S,
                       idle_timeout=10)
    rb.wait_done()
    assert len(rb.accepted) == 1 and res["key_id"] == c["mac-b"]["key_id"], res
    other = receivers(c["mac-b"]["identity"], tmp_path / "rb2", once=True)
    with open(pack_file, "rb") as f, pytest.raises(AuthError):
        api.send(f, to=other.to, rate=None, key_id=None, timeout=HANG_S, connect_timeout=HANG_S, idle_timeout=10)
    assert not other.accepted
    from muser_cli.handoff.trust.nodedir import identity_for

    pdir = keys_dir_of(c["producer_home"])
    assert identity_for(pdir, host="mac-b").consumer == "mac-b"
    assert identity_for(pdir, host="127.0.0.1").consumer == "mac-a"


# ----------------------------------------------------------------------------- the lane
def test_both_consumers_pull_from_one_resident_producer_and_decode_the_local_tokens(tmp_path, tiny_llama):
    c = two_consumers(tmp_path)
    prompt = tmp_path / "doc.txt"
    prompt.write_text(PROMPT)
    common = lane_flags(tiny_llama.path)
    ask = ["decode", *common, "--chunk", "8", "--prompt", str(prompt), "-n", "8", "--no-reuse", "--json"]
    local = subprocess.run(muser_cmd(*ask), env=env_for(c["mac-a"]["home"]), input=b"", capture_output=True,
                           timeout=HANG_S)
    assert local.returncode == 0, local.stderr
    want = json.loads(local.stdout)["token_ids"]
    with serving(c["producer_home"], *common) as prod:
        for who in ("mac-a", "mac-b"):
            r = subprocess.run(muser_cmd(*ask, "--producer", prod.address), env=env_for(c[who]["home"]),
                               capture_output=True, timeout=HANG_S)
            assert r.returncode == 0, r.stderr
            got = json.loads(r.stdout)
            assert got["source"] == "handoff" and not got["fallback"] and got["token_ids"] == want, (who, got)
        served = prod.wait_events(2)
        assert [(e["outcome"], e["consumer"]) for e in served] == [("served", "mac-a"), ("served", "mac-b")]
        assert {e["key_id"] for e in served} == {c["mac-a"]["key_id"], c["mac-b"]["key_id"]}
        rv = subprocess.run(muser_cmd("node", "revoke", c["mac-a"]["key_id"]), env=env_for(c["producer_home"]),
                            capture_output=True, timeout=HANG_S)
        assert rv.returncode == 0, rv.stderr
        refused = subprocess.run(muser_cmd("receive", "--from", prod.address, str(prompt), *common[:2],
                                           "--chunk", "8"), env=env_for(c["mac-a"]["home"]), capture_output=True,
                                 timeout=HANG_S)
        assert refused.returncode == 77 and refused.stdout == b"", refused.stderr
        again = subprocess.run(muser_cmd(*ask, "--producer", prod.address), env=env_for(c["mac-b"]["home"]),
                               capture_output=True, timeout=HANG_S)
        assert again.returncode == 0 and json.loads(again.stdout)["source"] == "handoff", again.stderr


def test_a_second_consumer_with_the_same_host_name_is_told_to_take_a_name_of_its_own(tmp_path):
    """Issue #49: two consumers on one host, each `muser node init` with no --name (both take the
    host name); the producer joins the first, and the second's bundle is refused naming the
    collision and `node init --name`, not with a bare 'pass --force' (which would replace the
    first consumer's identity). Real commands, real files."""
    def muser(home: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(muser_cmd(*args), env=env_for(home), capture_output=True, timeout=HANG_S)

    producer = tmp_path / "producer"
    bundles = []
    for name in ("first", "second"):
        home = tmp_path / name
        assert muser(home, "node", "init").returncode == 0
        bundle = tmp_path / f"{name}.bundle"
        r = muser(home, "node", "export", "--producer", "gx10", "-o", str(bundle))
        assert r.returncode == 0, r.stderr
        bundles.append(bundle)
    assert muser(producer, "node", "join", str(bundles[0])).returncode == 0
    again = muser(producer, "node", "join", str(bundles[0]))  # the same consumer again: --force is the way
    assert again.returncode == 2 and "pass --force" in again.stderr.decode(), again.stderr
    r = muser(producer, "node", "join", str(bundles[1]))
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert "already joined this producer" in err and "second consumer of the same name" in err, err
    assert "muser node init --name" in err and "pass --force" not in err, err
    [first] = node.load_identities(keys_dir_of(producer))  # nothing replaced, nothing added
    assert first.consumer == node.load_identity(keys_dir_of(tmp_path / "first")).name
