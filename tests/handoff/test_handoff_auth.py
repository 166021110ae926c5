"""docs/reliability.md C16-C23: authentication, replay, keys — over real TLS on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import hmac
import re
import signal
import time
from pathlib import Path

import pytest

from muser_cli.errors import AuthError, DataError, TempFailure
from muser_cli.handoff.wire import header as hh
from muser_cli.handoff.trust import node
from muser_cli.handoff.push import receiver as receiver_mod
from muser_cli.handoff.trust.node import load_identity
from muser_cli.handoff.push.sender import PreparedHandoff, prepare_handoff, transmit

from handoff_kit import (  # noqa: F401 - fixtures
    HANG_S, copy_home, keys_dir_of, ledger_records, make_nodes, nodes, pack_bytes, pack_file, receivers, spawn_receiver,
)


def resign(prep: PreparedHandoff, secret: bytes | None, **changes) -> PreparedHandoff:
    """The same payload under an altered header; re-MAC'd with ``secret``, or the old MAC kept."""
    h = dataclasses.replace(prep.header, **changes)
    raw = h.encode()
    mac = hh.compute_mac(secret, raw) if secret is not None else prep.mac
    return dataclasses.replace(prep, header=h, raw=raw, mac=mac)


def assert_nothing_published(run) -> None:
    assert run.published() == []
    assert not list(run.out_dir.glob(".*.part")) if run.out_dir.exists() else True


# ----------------------------------------------------------------------------- C16
def test_c16_same_handoff_twice(nodes, pack_file, receivers, tmp_path):
    run = receivers(nodes.consumer, tmp_path)
    prep = prepare_handoff(pack_file, nodes.producer)
    res = transmit(prep, to=run.to, identity=nodes.producer)
    assert res.ok and res.payload_bytes == pack_file.stat().st_size
    with pytest.raises(AuthError, match="replay") as exc:
        transmit(prep, to=run.to, identity=nodes.producer)
    assert exc.value.exit_status == 77
    assert len(ledger_records(run.ledger_dir, prep.header.key_id)) == 1
    assert [p.name for p in run.published()] == [f"{prep.header.handoff_id}.kvpack"]
    assert run.published()[0].read_bytes() == pack_file.read_bytes()


# ----------------------------------------------------------------------------- C17
def test_c17_replay_after_sigkill(nodes, pack_file, tmp_path):
    home = copy_home(nodes.consumer_home, tmp_path / "consumer")
    out = tmp_path / "out"
    out.mkdir()
    proc, to = spawn_receiver(home, "-o", str(out))
    prep = prepare_handoff(pack_file, nodes.producer)
    try:
        assert transmit(prep, to=to, identity=nodes.producer).ok
    finally:
        proc.send_signal(signal.SIGKILL)  # right after the accept: no shutdown path runs
        proc.wait(HANG_S)
    assert proc.returncode == -signal.SIGKILL
    proc2, to2 = spawn_receiver(home, "-o", str(out))
    try:
        with pytest.raises(AuthError, match="replay"):
            transmit(prep, to=to2, identity=nodes.producer)
    finally:
        proc2.send_signal(signal.SIGKILL)
        proc2.wait(HANG_S)
    assert len(ledger_records(home / "data" / "ledger", prep.header.key_id)) == 1
    assert len(list(out.glob("*.kvpack"))) == 1


# ----------------------------------------------------------------------------- C18
def test_c18_issued_at_window(nodes, pack_file, receivers, tmp_path):
    run = receivers(nodes.consumer, tmp_path, window_s=60)
    now_ms = int(time.time() * 1000)
    for skew in (-61_000, +61_000):
        stale = prepare_handoff(pack_file, nodes.producer, now_ms=now_ms + skew)
        with pytest.raises(AuthError, match="stale|window"):
            transmit(stale, to=run.to, identity=nodes.producer)
    fresh = prepare_handoff(pack_file, nodes.producer, now_ms=now_ms - 50_000)
    assert transmit(fresh, to=run.to, identity=nodes.producer).ok
    with pytest.raises(AuthError, match="replay"):
        transmit(fresh, to=run.to, identity=nodes.producer)
    assert len(ledger_records(run.ledger_dir, fresh.header.key_id)) == 1


# ----------------------------------------------------------------------------- C19
def test_c19_wrong_unknown_revoked_key(pack_file, receivers, tmp_path, monkeypatch):
    nd = make_nodes(tmp_path / "nodes")
    run = receivers(nd.consumer, tmp_path)
    prep = prepare_handoff(pack_file, nd.producer)
    calls: list[bytes] = []
    real = receiver_mod.verify_mac
    monkeypatch.setattr(receiver_mod, "verify_mac", lambda s, r, m: (calls.append(s), real(s, r, m))[1])

    with pytest.raises(AuthError, match="MAC"):  # wrong key under the right id
        transmit(resign(prep, b"w" * 32), to=run.to, identity=nd.producer)
    right = nd.consumer.key(prep.header.key_id).secret
    assert calls == [right], "exactly the named key is tried, no other"

    calls.clear()
    with pytest.raises(AuthError, match="unknown key id"):
        transmit(resign(prep, b"w" * 32, key_id="nosuchkey"), to=run.to, identity=nd.producer)
    assert calls == []

    node.revoke_key(nd.consumer.directory, prep.header.key_id)
    with pytest.raises(AuthError):  # the certificate issued with the key is refused too
        transmit(prep, to=run.to, identity=nd.producer)
    assert any("revoked" in f["reason"] for f in run.kinds("rejected"))
    assert ledger_records(run.ledger_dir, prep.header.key_id) == []
    assert_nothing_published(run)


def test_c19_key_of_another_peer_refused(pack_file, receivers, tmp_path):
    """A producer holding a valid key id of another node cannot use it (key bound to cert name)."""
    nd = make_nodes(tmp_path / "nodes")
    run = receivers(nd.consumer, tmp_path)
    consumer_key = nd.consumer.key(nd.consumer.send_key)
    prep = prepare_handoff(pack_file, nd.producer)
    forged = resign(prep, consumer_key.secret, key_id=consumer_key.key_id)
    with pytest.raises(AuthError, match="belongs to"):
        transmit(forged, to=run.to, identity=nd.producer)


# ----------------------------------------------------------------------------- C20
def test_c20_key_id_changed_mac_kept(pack_file, receivers, tmp_path):
    nd = make_nodes(tmp_path / "nodes")
    run = receivers(nd.consumer, tmp_path)
    prep = prepare_handoff(pack_file, nd.producer)
    other = nd.consumer.send_key  # a real, valid key id of this receiver
    with pytest.raises(AuthError, match="MAC"):
        transmit(resign(prep, None, key_id=other), to=run.to, identity=nd.producer)
    assert_nothing_published(run)


# ----------------------------------------------------------------------------- C21
def test_c21_mac_compared_with_compare_digest(nodes, pack_file, receivers, tmp_path, monkeypatch):
    run = receivers(nodes.consumer, tmp_path)
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hh.hmac, "compare_digest", spy)
    prep = prepare_handoff(pack_file, nodes.producer)
    transmit(prep, to=run.to, identity=nodes.producer)
    assert any(b == prep.mac for _, b in seen)
    src = Path(hh.__file__).read_text()
    assert "compare_digest(" in src and not re.search(r"\bmac\s*==|==\s*mac\b", src)


# ----------------------------------------------------------------------------- C22
@pytest.mark.parametrize(
    "change",
    [
        {"pack_header_digest": "e" * 64},
        {"size_bound": 1},
        {"model_fingerprint": "sha256:" + "d" * 64},
        {"token_digest": "sha256:" + "d" * 64},
        {"rows_start": 7},
    ],
)
def test_c22_header_altered(nodes, pack_file, receivers, tmp_path, change):
    run = receivers(nodes.consumer, tmp_path)
    prep = prepare_handoff(pack_file, nodes.producer)
    # Altered in transit (old MAC): refused at the MAC, before any payload byte.
    with pytest.raises(AuthError, match="MAC"):
        transmit(resign(prep, None, **change), to=run.to, identity=nodes.producer)
    # Altered by a key holder who re-MACs: the payload contradicts it; refused, nothing kept.
    secret = nodes.producer.key(prep.header.key_id).secret
    with pytest.raises((DataError, TempFailure)):
        transmit(resign(prep, secret, **change), to=run.to, identity=nodes.producer, idle_s=2)
    assert_nothing_published(run)
    assert ledger_records(run.ledger_dir, prep.header.key_id) == []
    assert run.error is None


# ----------------------------------------------------------------------------- C23
FORBIDDEN = [
    re.compile(r"\bimport\s+pickle\b|\bfrom\s+pickle\b|\bcPickle\b|\bdill\b|\bmarshal\.loads?\b"),
    re.compile(r"(?<![\w.])eval\s*\("),
    re.compile(r"(?<![\w.])exec\s*\("),
    re.compile(r"weights_only\s*=\s*False"),
    re.compile(r"\bshelve\b"),
    re.compile(r"yaml\.load\s*\((?![^)]*SafeLoader)"),
]


def test_c23_no_pickle_eval_or_unsafe_torch_load():
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for folder in ("muser_cli", "commands"):
        for path in sorted((root / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                code = line.split("#", 1)[0]
                if any(p.search(code) for p in FORBIDDEN):
                    offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_c23_grep_catches_what_it_should():
    samples = ["import pickle", "x = eval(s)", "torch.load(f, weights_only=False)", "from pickle import loads"]
    for s in samples:
        assert any(p.search(s) for p in FORBIDDEN), s
    for s in ["model.eval()", "literal_eval", "self.evaluate(x)"]:
        assert not any(p.search(s) for p in FORBIDDEN), s


def test_keyring_reloaded_so_revocation_takes_effect_live(pack_file, receivers, tmp_path):
    nd = make_nodes(tmp_path / "nodes")
    run = receivers(nd.consumer, tmp_path)
    assert transmit(prepare_handoff(pack_file, nd.producer), to=run.to, identity=nd.producer).ok
    node.revoke_key(keys_dir_of(nd.consumer_home), nd.producer_key_id)
    with pytest.raises(AuthError):
        transmit(prepare_handoff(pack_file, load_identity(keys_dir_of(nd.producer_home))), to=run.to,
                 identity=nd.producer)
