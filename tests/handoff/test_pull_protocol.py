"""The pull lane's request/answer core (muser_cli/handoff/wire/pull_protocol.py): no sockets, bytes only."""

from __future__ import annotations

import json

import pytest

from muser_cli.errors import AuthError, ProtocolError
from muser_cli.handoff.wire.protocol import PREFIX, LocalProtocolError, NEED_DATA, Reject
from muser_cli.handoff.wire.pull_protocol import (
    MAX_REQUEST_BYTES, PullConnection, PullRequest, PullState, Queued, Request, Serving, Side, check_fresh,
    new_request_id, parse_request, sign_request, verify_request_mac,
)
from handoff_kit import refused_as_malformed

SECRET = bytes(range(32))


def make_request(**over) -> PullRequest:
    return PullRequest(**{"key_id": "k1", "request_id": new_request_id(), "issued_at_ms": 1_700_000_000_000,
                          "consumer": "consumer", "token_ids": (1, 2, 3, 4),
                          "tokenizer_fingerprint": "sha256:" + "b" * 64, "model_fingerprint": "sha256:" + "a" * 64,
                          "chunk_tokens": 8, "dtype": "float32", **over})


def signed_and_sent(body, sign, frame) -> tuple[PullConnection, PullConnection, object, bytes]:
    """``body`` signed with ``sign`` and sent as ``frame`` from a consumer's connection to a
    producer's: (consumer, producer, the first event the producer reads, the MAC)."""
    raw, mac = sign(body, SECRET)
    consumer, producer = PullConnection(Side.CONSUMER), PullConnection(Side.PRODUCER)
    producer.receive_data(consumer.send(frame(raw, mac, body)))
    return consumer, producer, producer.next_event(), mac


def test_request_round_trips_and_its_mac_binds_every_byte():
    req = make_request()
    raw, mac = sign_request(req, SECRET)
    assert parse_request(raw) == req
    verify_request_mac(SECRET, raw, mac)
    tampered = raw.replace(b'"chunk_tokens":8', b'"chunk_tokens":9')
    assert tampered != raw
    with pytest.raises(AuthError):
        verify_request_mac(SECRET, tampered, mac)
    with pytest.raises(AuthError):
        verify_request_mac(bytes(32), raw, mac)


@pytest.mark.parametrize("change", [
    lambda o: o.update(extra=1),
    lambda o: o.pop("dtype"),
    lambda o: o.update(v=2),
    lambda o: o.update(dtype="int8"),
    lambda o: o.update(token_ids=[1]),
    lambda o: o.update(token_ids=[1, -2]),
    lambda o: o.update(token_ids=[1, 2.0]),
    lambda o: o.update(request_id="XYZ"),
    lambda o: o.update(chunk_tokens=0),
    lambda o: o.update(key_id="bad key"),
    lambda o: o.update(engine="Torch!"),
    lambda o: o.update(engine=""),
    lambda o: o.update(engine=3),
])
def test_malformed_requests_are_protocol_errors(change):
    refused_as_malformed(make_request().to_json(), change, parse_request)


def test_a_request_may_name_the_consumers_engine():
    """Optional: a producer on the same engine may leave the sliding history out."""
    req = make_request(engine="mlx")
    raw, _ = sign_request(req, SECRET)
    assert b'"engine":"mlx"' in raw and parse_request(raw) == req and parse_request(raw).engine == "mlx"
    assert parse_request(sign_request(make_request(), SECRET)[0]).engine is None


def test_non_canonical_request_bytes_are_refused():
    raw, _ = sign_request(make_request(), SECRET)
    spaced = json.dumps(json.loads(raw), indent=1).encode()
    with pytest.raises(ProtocolError):
        parse_request(spaced)


def test_freshness_window():
    req = make_request(issued_at_ms=1_000_000)
    check_fresh(req, now_ms=1_000_000 + 119_000, window_s=120)
    with pytest.raises(AuthError):
        check_fresh(req, now_ms=1_000_000 + 121_000, window_s=120)
    with pytest.raises(AuthError):
        check_fresh(req, now_ms=1_000_000 - 121_000, window_s=120)


def test_exchange_request_queued_serving_then_bytes_belong_to_v3():
    req = make_request()
    consumer, producer, got, mac = signed_and_sent(req, sign_request, Request)
    assert isinstance(got, Request) and got.request == req and got.mac == mac
    consumer.receive_data(producer.send(Queued(1)) + producer.send(Serving()) + b"\x01\x00\x00\x00\x02{}")
    assert consumer.next_event() == Queued(1)
    assert isinstance(consumer.next_event(), Serving)
    assert consumer.state is PullState.SERVING
    assert consumer.next_event() is NEED_DATA  # the V3 Ready after Serving is not ours to parse
    assert consumer.leftover() == b"\x01\x00\x00\x00\x02{}"


def test_reject_closes_and_busy_is_readable():
    consumer, producer, _, _ = signed_and_sent(make_request(), sign_request, Request)
    consumer.receive_data(producer.send(Reject("busy", "one at a time")))
    ev = consumer.next_event()
    assert isinstance(ev, Reject) and ev.code == "busy" and consumer.state is PullState.CLOSED


def test_oversized_and_out_of_turn_frames_are_refused_at_the_prefix():
    producer = PullConnection(Side.PRODUCER)
    producer.receive_data(PREFIX.pack(0x50, 32 + MAX_REQUEST_BYTES + 1))  # no body byte needed to refuse
    with pytest.raises(ProtocolError, match="exceeds"):
        producer.next_event()
    producer = PullConnection(Side.PRODUCER)
    producer.receive_data(PREFIX.pack(0x52, 2))  # the consumer may not send Serving
    with pytest.raises(ProtocolError, match="may not send"):
        producer.next_event()
    consumer = PullConnection(Side.CONSUMER)
    consumer.receive_data(PREFIX.pack(0x51, 11))  # Queued before any Request
    with pytest.raises(ProtocolError, match="may not send"):
        consumer.next_event()
    with pytest.raises(LocalProtocolError):
        PullConnection(Side.PRODUCER).send(Serving())  # our own illegal send is a bug


def test_unknown_frame_type_and_cut_prefix():
    producer = PullConnection(Side.PRODUCER)
    producer.receive_data(PREFIX.pack(0x99, 0))
    with pytest.raises(ProtocolError, match="unknown"):
        producer.next_event()
    producer = PullConnection(Side.PRODUCER)
    producer.receive_data(b"\x50\x00")
    producer.receive_data(b"")
    with pytest.raises(ProtocolError):
        producer.next_event()


# ----------------------------------------------------------------------------- the link probe request
from muser_cli.handoff.wire.pull_protocol import (  # noqa: E402
    MAC_CONTEXT, PROBE_MAC_CONTEXT, Probe, ProbeRequest, parse_probe, sign_probe,
)


def make_probe(**over) -> ProbeRequest:
    return ProbeRequest(**{"key_id": "k1", "request_id": new_request_id(), "issued_at_ms": 1_700_000_000_000,
                           "consumer": "consumer", "probe_ms": 1000, **over})


def test_probe_request_round_trips_and_its_mac_is_not_a_requests():
    probe = make_probe()
    raw, mac = sign_probe(probe, SECRET)
    assert parse_probe(raw) == probe
    verify_request_mac(SECRET, raw, mac, context=PROBE_MAC_CONTEXT)
    with pytest.raises(AuthError):  # a probe's MAC never verifies as a request's (nor the other way)
        verify_request_mac(SECRET, raw, mac, context=MAC_CONTEXT)
    rraw, rmac = sign_request(make_request(), SECRET)
    with pytest.raises(AuthError):
        verify_request_mac(SECRET, rraw, rmac, context=PROBE_MAC_CONTEXT)
    with pytest.raises(AuthError):
        verify_request_mac(SECRET, raw.replace(b'"probe_ms":1000', b'"probe_ms":1001'), mac,
                           context=PROBE_MAC_CONTEXT)


@pytest.mark.parametrize("change", [
    lambda o: o.update(extra=1),
    lambda o: o.pop("probe_ms"),
    lambda o: o.update(probe_ms=0),
    lambda o: o.update(probe_ms=60_001),
    lambda o: o.update(probe_ms=1.5),
    lambda o: o.update(v=2),
    lambda o: o.update(token_ids=[1, 2]),
])
def test_malformed_probe_requests_are_protocol_errors(change):
    refused_as_malformed(make_probe().to_json(), change, parse_probe)


def test_exchange_probe_then_serving_and_limits_at_the_prefix():
    probe = make_probe()
    consumer, producer, got, mac = signed_and_sent(probe, sign_probe, Probe)
    assert isinstance(got, Probe) and got.probe == probe and got.mac == mac
    consumer.receive_data(producer.send(Queued(1)) + producer.send(Serving()) + b"\x01\x00\x00\x00\x02{}")
    assert consumer.next_event() == Queued(1) and isinstance(consumer.next_event(), Serving)
    assert consumer.leftover() == b"\x01\x00\x00\x00\x02{}"
    big = PullConnection(Side.PRODUCER)
    big.receive_data(PREFIX.pack(0x53, 32 + 1024 + 1))  # refused before one body byte
    with pytest.raises(ProtocolError, match="exceeds"):
        big.next_event()
    late = PullConnection(Side.CONSUMER)
    late.receive_data(PREFIX.pack(0x53, 40))  # a producer may not send a Probe
    with pytest.raises(ProtocolError, match="may not send"):
        late.next_event()


def test_a_request_past_the_strict_json_default_but_within_its_own_limit_parses():
    """Token ids for a long context pass 1 MiB of JSON; the request's own limit is 4 MiB."""
    req = make_request(token_ids=tuple(range(10_000, 10_000 + 200_000)))
    raw, _ = sign_request(req, SECRET)
    assert 1 << 20 < len(raw) <= MAX_REQUEST_BYTES
    assert parse_request(raw).token_ids == req.token_ids
    with pytest.raises(ProtocolError, match="exceeds"):
        parse_request(raw[:-1] + b" " * (MAX_REQUEST_BYTES - len(raw) + 2) + b"}")
