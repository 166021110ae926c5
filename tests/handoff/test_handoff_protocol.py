"""The sans-IO protocol core on an in-memory link: byte by byte, illegal moves, fuzzing."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muser_cli.errors import AuthError, ProtocolError
from muser_cli.handoff.wire import header as hh
from muser_cli.handoff.wire.protocol import (
    MAX_BODY, MAX_DATA_BYTES, NEED_DATA, PREFIX, Ack, Connection, ConnectionClosed, Data, Go, Header,
    LocalProtocolError, ProbeDown, ProbeEnd, ProbeResult, ProbeUp, Pulse, Ready, Reject, Role, State, Trailer,
    TRANSITIONS, encode_event,
)

SECRET = b"s" * 32


def make_header(size: int = 10, **kw) -> hh.HandoffHeader:
    fields = dict(
        key_id="k1", handoff_id="ab" * 16, issued_at_ms=1_700_000_000_000, size_bound=size,
        pack_header_digest="1" * 64, model_fingerprint="sha256:" + "a" * 64,
        tokenizer_fingerprint="sha256:" + "b" * 64, token_digest="sha256:" + "c" * 64, rows_start=0, sender="gx10",
    )
    fields.update(kw)
    return hh.HandoffHeader(**fields)


def header_event(size: int = 10, **kw) -> Header:
    h = make_header(size, **kw)
    raw, mac = hh.sign(h, SECRET)
    return Header(raw, mac, h)


def trailer_event(header: Header, size: int = 10, root: str = "2" * 64) -> Trailer:
    t = hh.HandoffTrailer(header.header.handoff_id, size, root)
    raw, mac = hh.sign_trailer(t, SECRET, header.mac)
    return Trailer(raw, mac, t)


class MemoryLink:
    """Two Connections joined by in-memory pipes that deliver ``step`` bytes at a time."""

    def __init__(self, step: int = 1) -> None:
        self.sender = Connection(Role.SENDER)
        self.receiver = Connection(Role.RECEIVER)
        self.step = step

    def deliver(self, data: bytes, to: Connection) -> list:
        events = []
        for i in range(0, len(data), self.step):
            to.receive_data(data[i : i + self.step])
            while True:
                ev = to.next_event()
                if ev is NEED_DATA:
                    break
                events.append(ev)
        return events

    def s2r(self, event) -> list:
        return self.deliver(self.sender.send(event), self.receiver)

    def r2s(self, event) -> list:
        return self.deliver(self.receiver.send(event), self.sender)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_full_handoff_byte_by_byte(step):
    link = MemoryLink(step)
    assert link.r2s(Ready({"v": 3, "max_payload": 100})) == [Ready({"max_payload": 100, "v": 3})]
    hdr = header_event(size=10)
    got = link.s2r(hdr)
    assert len(got) == 1 and got[0].raw == hdr.raw and got[0].mac == hdr.mac
    assert got[0].header == hdr.header
    assert link.receiver.state is State.HEADER_SENT
    assert link.r2s(Go()) == [Go()]
    assert link.s2r(Data(b"abcd")) == [Data(b"abcd")]
    assert link.receiver.state is State.STREAMING
    assert link.s2r(Pulse()) == [Pulse()]  # a slow producer: the link stays alive
    assert link.s2r(Data(b"efghij")) == [Data(b"efghij")]
    assert link.receiver.state is State.STREAMING  # the bound is reached, the trailer ends the payload
    tr = trailer_event(hdr, size=10)
    got = link.s2r(tr)
    assert len(got) == 1 and got[0].raw == tr.raw and got[0].mac == tr.mac and got[0].trailer == tr.trailer
    assert link.receiver.state is State.PAYLOAD_DONE and link.sender.state is State.PAYLOAD_DONE
    assert link.r2s(Ack({"handoff_id": "x"})) == [Ack({"handoff_id": "x"})]
    assert link.sender.state is State.DONE and link.receiver.state is State.DONE
    link.receiver.receive_data(b"")
    assert isinstance(link.receiver.next_event(), ConnectionClosed)


def test_probe_round_trip_byte_by_byte():
    link = MemoryLink(1)
    link.r2s(Ready())
    assert link.s2r(ProbeUp(0.5)) == [ProbeUp(0.5)]
    link.s2r(Data(b"x" * 50))
    assert link.r2s(ProbeResult({"bytes": 50, "seconds": 0.5})) == [ProbeResult({"bytes": 50, "seconds": 0.5})]
    assert link.receiver.state is State.PROBE_UP_DONE
    link.s2r(Data(b"x" * 9))  # was in flight when the result went out
    link.s2r(ProbeEnd())
    assert link.s2r(ProbeDown(1.5)) == [ProbeDown(1.5)]
    link.r2s(Data(b"y" * 7))
    link.r2s(ProbeEnd())
    assert link.sender.state is State.IDLE and link.receiver.state is State.IDLE


def test_reject_anywhere_closes():
    for setup in ([], [Ready()]):
        link = MemoryLink()
        for ev in setup:
            link.r2s(ev)
        got = link.r2s(Reject("busy", "later"))
        assert got == [Reject("busy", "later")] and link.sender.state is State.CLOSED


def test_payload_beyond_declared_size_is_refused_at_the_prefix():
    link = MemoryLink()
    link.r2s(Ready())
    link.s2r(header_event(size=4))
    link.r2s(Go())
    frame = PREFIX.pack(0x20, 5) + b"12345"  # a lying sender: 5 bytes where at most 4 were declared
    link.receiver.receive_data(frame[:5])  # the prefix alone is enough to refuse
    with pytest.raises(ProtocolError, match="exceeds the declared"):
        link.receiver.next_event()


def test_oversized_frame_refused_before_its_body():
    conn = Connection(Role.SENDER)
    conn.receive_data(PREFIX.pack(0x01, 0xFFFFFFFF))  # Ready claiming 4 GiB: no body sent at all
    with pytest.raises(ProtocolError, match="exceeds"):
        conn.next_event()


def test_unknown_frame_type():
    conn = Connection(Role.SENDER)
    conn.receive_data(PREFIX.pack(0x99, 0))
    with pytest.raises(ProtocolError, match="unknown frame type"):
        conn.next_event()


@pytest.mark.parametrize("event", [Go(), Data(b"x"), Ack(), ProbeResult(), ProbeEnd()])
def test_out_of_order_frames_refused(event):
    conn = Connection(Role.SENDER)  # still waiting for Ready
    conn.receive_data(encode_event(event))
    with pytest.raises(ProtocolError, match="may not send"):
        conn.next_event()


def test_data_before_go_refused_and_local_misuse_is_a_bug():
    link = MemoryLink()
    link.r2s(Ready())
    link.s2r(header_event())
    link.receiver.receive_data(encode_event(Data(b"early")))
    with pytest.raises(ProtocolError):
        link.receiver.next_event()
    with pytest.raises(LocalProtocolError):
        Connection(Role.SENDER).send(Header(b"{}", b"x" * 32, make_header()))


def test_trailer_only_while_streaming_and_no_data_after_it():
    link = MemoryLink()
    link.r2s(Ready())
    hdr = header_event(size=100)
    link.s2r(hdr)
    link.receiver.receive_data(encode_event(trailer_event(hdr)))  # before Go: refused at the prefix
    with pytest.raises(ProtocolError, match="may not send Trailer"):
        link.receiver.next_event()
    link = MemoryLink()
    link.r2s(Ready())
    link.s2r(hdr)
    link.r2s(Go())
    link.s2r(Data(b"x" * 10))
    link.s2r(trailer_event(hdr))
    link.receiver.receive_data(encode_event(Data(b"late")))
    with pytest.raises(ProtocolError, match="may not send Data"):
        link.receiver.next_event()


def test_trailer_strictness():
    t = hh.HandoffTrailer("ab" * 16, 10, "2" * 64)
    assert hh.parse_trailer(t.encode()) == t
    for mutate in (lambda o: o.update(extra=1), lambda o: o.pop("root_digest"), lambda o: o.update(v=2),
                   lambda o: o.update(payload_size=0), lambda o: o.update(handoff_id="X" * 32)):
        obj = t.to_json()
        mutate(obj)
        with pytest.raises(ProtocolError):
            hh.parse_trailer(hh.canonical(obj))
    with pytest.raises(ProtocolError, match="canonical"):
        hh.parse_trailer(json.dumps(t.to_json(), indent=1).encode())


def test_trailer_mac_is_chained_to_the_header_mac():
    h1, h2 = header_event(), header_event(handoff_id="cd" * 16)
    tr = trailer_event(h1)
    hh.verify_trailer_mac(SECRET, h1.mac, tr.raw, tr.mac)
    with pytest.raises(AuthError, match="trailer MAC"):
        hh.verify_trailer_mac(SECRET, h2.mac, tr.raw, tr.mac)  # the same trailer under another header
    with pytest.raises(AuthError):
        hh.verify_trailer_mac(b"t" * 32, h1.mac, tr.raw, tr.mac)
    with pytest.raises(AuthError):  # a header MAC is no trailer MAC: the contexts differ
        hh.verify_trailer_mac(SECRET, h1.mac, h1.raw, h1.mac)


def test_eof_mid_frame_is_a_protocol_error():
    conn = Connection(Role.SENDER)
    data = encode_event(Ready({"v": 3}))
    conn.receive_data(data[:-1])
    conn.receive_data(b"")
    with pytest.raises(ProtocolError, match="middle"):
        conn.next_event()


def test_every_transition_target_is_a_state():
    for (state, role, cls), nxt in TRANSITIONS.items():
        assert isinstance(state, State) and isinstance(role, Role) and isinstance(nxt, State)
        assert cls in MAX_BODY
    assert MAX_BODY[Data] == MAX_DATA_BYTES


def test_reject_message_is_sanitized_and_codes_closed():
    conn = Connection(Role.SENDER)
    body = json.dumps({"code": "auth", "message": "bad\x1b[31m\nkey"}).encode()
    conn.receive_data(PREFIX.pack(0x3F, len(body)) + body)
    ev = conn.next_event()
    assert ev.message == "bad?[31m?key"
    conn = Connection(Role.SENDER)
    body = json.dumps({"code": "rm -rf", "message": ""}).encode()
    conn.receive_data(PREFIX.pack(0x3F, len(body)) + body)
    with pytest.raises(ProtocolError):
        conn.next_event()


# ----------------------------------------------------------------------------- header
def test_header_round_trip_and_mac():
    h = make_header()
    raw, mac = hh.sign(h, SECRET)
    assert hh.parse_header(raw) == h
    hh.verify_mac(SECRET, raw, mac)
    with pytest.raises(AuthError):
        hh.verify_mac(b"t" * 32, raw, mac)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.update(extra=1),
        lambda o: o.pop("sender"),
        lambda o: o.update(size_bound=-1),
        lambda o: o.update(size_bound=True),
        lambda o: o.update(handoff_id="XYZ"),
        lambda o: o.update(v=2),
        lambda o: o.update(pack_header_digest="zz"),
        lambda o: o.update(payload_size=10),  # a V2 key
    ],
)
def test_header_strictness(mutate):
    obj = make_header().to_json()
    mutate(obj)
    with pytest.raises(ProtocolError):
        hh.parse_header(hh.canonical(obj))


def test_header_duplicate_keys_and_non_canonical_refused():
    raw = make_header().encode()
    with pytest.raises(ProtocolError, match="duplicate"):
        hh.parse_header(raw[:-1] + b',"v":3}')
    with pytest.raises(ProtocolError, match="canonical"):
        hh.parse_header(json.dumps(make_header().to_json(), indent=1).encode())
    with pytest.raises(ProtocolError):
        hh.parse_header(b"[" * 5000 + b"]" * 5000)


def test_window():
    h = make_header(issued_at_ms=1_000_000)
    hh.check_window(h, now_ms=1_000_000 + 119_000, window_s=120)
    with pytest.raises(AuthError, match="window"):
        hh.check_window(h, now_ms=1_000_000 + 121_000, window_s=120)
    with pytest.raises(AuthError):
        hh.check_window(h, now_ms=1_000_000 - 121_000, window_s=120)


# ----------------------------------------------------------------------------- fuzz
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=17))
def test_fuzz_receiver_only_protocol_errors(data, step):
    """Any bytes a sender may send: events or ProtocolError, never anything else, never a hang."""
    conn = Connection(Role.RECEIVER)
    conn.send(Ready())
    for i in range(0, len(data), step):
        conn.receive_data(data[i : i + step])
        try:
            while conn.next_event() is not NEED_DATA:
                pass
        except ProtocolError:
            return


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 0xFF), st.binary(max_size=64)), max_size=6))
def test_fuzz_framed_garbage(frames):
    """Well-framed bodies of any type and content, at the sender's side."""
    conn = Connection(Role.SENDER)
    conn.receive_data(b"".join(struct.pack(">BI", t, len(b)) + b for t, b in frames))
    try:
        while True:
            ev = conn.next_event()
            if ev is NEED_DATA or isinstance(ev, ConnectionClosed):
                break
    except ProtocolError:
        pass


def test_spec_test_vectors_match_docs():
    """docs/handoff.md's V3 header and trailer MAC vectors and byte examples are what the code produces."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "handoff.md").read_text()
    h = make_header(
        65536, handoff_id="00112233445566778899aabbccddeeff", pack_header_digest="22" * 32,
        model_fingerprint="sha256:" + "aa" * 32, tokenizer_fingerprint="sha256:" + "bb" * 32,
        token_digest="sha256:" + "cc" * 32,
    )
    secret = bytes(range(32))
    raw, mac = hh.sign(h, secret)
    assert raw.decode() in doc
    assert mac.hex() in doc
    frame = encode_event(Header(raw, mac, h))
    assert f"{frame[0]:02x} {frame[1:5].hex()}" in doc
    t = hh.HandoffTrailer("00112233445566778899aabbccddeeff", 4096, "33" * 32)
    traw, tmac = hh.sign_trailer(t, secret, mac)
    assert traw.decode() in doc
    assert tmac.hex() in doc
    tframe = encode_event(Trailer(traw, tmac, t))
    assert f"{tframe[0]:02x} {tframe[1:5].hex()}" in doc
    assert encode_event(Ready({"v": 3})).hex() == "01000000077b2276223a337d" and "01 00000007 7b2276223a337d" in doc
    assert encode_event(Go()).hex() == "1100000000" and "11 00000000" in doc
    assert encode_event(Pulse()).hex() == "2100000000" and "21 00000000" in doc


# ---------------------------------------------------------------- large Data bodies read in place
def _streaming_pair(size: int) -> MemoryLink:
    link = MemoryLink(1 << 20)
    link.r2s(Ready())
    link.s2r(header_event(size=size))
    link.r2s(Go())
    return link


@pytest.mark.parametrize("how", ["body_view", "receive_data", "mixed"])
def test_large_data_body_is_read_into_its_own_buffer(how):
    from muser_cli.handoff.wire.protocol import DIRECT_BODY_MIN

    n = DIRECT_BODY_MIN + 12345
    payload = bytes(range(256)) * (n // 256) + b"z" * (n % 256)
    link = _streaming_pair(n + 10)
    parts = link.sender.send_parts(Data(memoryview(payload)))
    assert len(parts) == 2 and len(parts[0]) == PREFIX.size and parts[1].obj is payload  # a view, no copy
    rx = link.receiver
    wire = b"".join(bytes(p) for p in parts) + link.sender.send(Data(b"tail!!!!!!"))
    rx.receive_data(wire[:PREFIX.size + 100])  # the prefix and a little of the body
    assert rx.next_event() is NEED_DATA
    pos = PREFIX.size + 100
    while (view := rx.body_view()) is not None:
        step = min(len(view), 16384)
        if how == "receive_data" or (how == "mixed" and pos % 2):
            rx.receive_data(wire[pos : pos + step + 7])  # overflow past the body is kept for the next frame
            pos += step + 7
        else:
            view[:step] = wire[pos : pos + step]
            rx.body_received(step)
            pos += step
        if rx.body_view() is not None:
            assert rx.next_event() is NEED_DATA
    ev = rx.next_event()
    assert isinstance(ev, Data) and isinstance(ev.data, bytearray) and ev.data == payload
    rx.receive_data(wire[pos:])
    assert rx.next_event() == Data(b"tail!!!!!!")
    assert rx.payload_seen == n + 10 and rx.next_event() is NEED_DATA


def test_large_data_body_refused_at_its_prefix_and_eof_in_it():
    from muser_cli.handoff.wire.protocol import DIRECT_BODY_MIN

    n = DIRECT_BODY_MIN * 2
    link = _streaming_pair(n - 1)  # one byte less declared than the frame claims
    link.receiver.receive_data(PREFIX.pack(0x20, n))
    with pytest.raises(ProtocolError, match="exceeds the declared"):
        link.receiver.next_event()
    assert link.receiver.body_view() is None  # refused before any body buffer was made

    before_go = MemoryLink()
    before_go.r2s(Ready())
    before_go.receiver.receive_data(PREFIX.pack(0x20, n))
    with pytest.raises(ProtocolError, match="may not send Data"):
        before_go.receiver.next_event()

    cut = _streaming_pair(n)
    cut.receiver.receive_data(PREFIX.pack(0x20, n) + b"x" * 1000)
    assert cut.receiver.next_event() is NEED_DATA and len(cut.receiver.body_view()) == n - 1000
    cut.receiver.body_received(0)  # the peer closed in the middle of the body
    with pytest.raises(ProtocolError, match="middle of a Data frame"):
        cut.receiver.next_event()


def test_send_parts_counts_bytes_of_any_view():
    """A Data payload given as a view of wider elements (or several dimensions) is framed
    by its byte length, never its element count."""
    import array

    from muser_cli.handoff.wire.protocol import DIRECT_BODY_MIN

    words = array.array("H", range(DIRECT_BODY_MIN))  # 2 bytes each: 2 x DIRECT_BODY_MIN bytes
    link = _streaming_pair(2 * DIRECT_BODY_MIN)
    parts = link.sender.send_parts(Data(memoryview(words)))
    assert PREFIX.unpack(parts[0])[1] == 2 * DIRECT_BODY_MIN == len(parts[1])
    rx = link.receiver
    rx.receive_data(b"".join(bytes(p) for p in parts))
    ev = rx.next_event()
    assert isinstance(ev, Data) and bytes(ev.data) == words.tobytes()
