"""Handoff V3 protocol core: events, framing and the state table. No I/O whatsoever.

Rules (docs/handoff.md is the normative text):
  * After the TLS 1.3 handshake (ALPN ``muser-handoff/3``) both sides exchange frames:
    ``type u8 | length u32 big-endian | body``. Each type has a maximum body length,
    checked as soon as the 5-byte prefix is in: an oversized frame is refused before
    one body byte is buffered.
  * The RECEIVER (TLS server) speaks first: ``Ready`` (or ``Reject(busy)``). The SENDER
    (TLS client) then sends ``Header`` -- before its payload exists: it declares an upper
    bound on the payload size, not the size; the receiver answers ``Go`` or ``Reject``;
    the sender streams ``Data`` frames as the payload is produced (``Pulse`` keeps a
    slow producer's link alive), never past the declared bound, then one ``Trailer``
    (exact size and root digest, MAC'd); the receiver answers ``Ack`` (only once the
    trailer verified and the handoff is recorded durably) or ``Reject``. One handoff per
    connection.
  * Probes (link measurement, no payload semantics) run from ``Idle``. Up: ``ProbeUp``,
    sender ``Data``… until the receiver, having counted for the agreed seconds, sends
    ``ProbeResult``; the sender stops, Data already in flight is discarded, and its
    ``ProbeEnd`` returns both to ``Idle`` (the receiver ends the measurement, so deep
    socket buffers cannot stretch it). Down: ``ProbeDown`` answered by receiver
    ``Data``… ``ProbeEnd``.
  * ``Reject`` may be sent by either side in any live state; the connection is then
    ``Closed``. Anything not in :data:`TRANSITIONS` is a protocol error.
  * Both sides run the same table; each checks its own sends (a bug here raises
    :class:`LocalProtocolError`) and the peer's frames (:class:`ProtocolError`, exit 76).

Use: ``conn.send(event) -> bytes`` to write; ``conn.receive_data(bytes)`` (``b""`` at
EOF) then ``conn.next_event()`` until it returns :data:`NEED_DATA`.
"""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Union

from muser_cli.errors import ProtocolError
from muser_cli.handoff.wire.header import (
    MAC_BYTES, MAX_HEADER_BYTES, MAX_TRAILER_BYTES, HandoffHeader, HandoffTrailer, canonical, parse_header,
    parse_trailer, strict_json,
)

ALPN = "muser-handoff/3"
PROTOCOL_VERSION = 3
PREFIX = struct.Struct(">BI")  # type, body length
MAX_DATA_BYTES = 1 << 20  # one Data frame's body
DEFAULT_DATA_CHUNK = 256 * 1024
DIRECT_BODY_MIN = 64 * 1024  # a Data body this large is read straight into a buffer of its own
MAX_CONTROL_BYTES = 4096
MAX_MESSAGE_CHARS = 512


class LocalProtocolError(RuntimeError):
    """Our own code tried an illegal send: a bug, never caused by the peer."""


class Role(enum.Enum):
    SENDER = "sender"  # the TLS client; ships the kvpack
    RECEIVER = "receiver"  # the TLS server; verifies, records, publishes


class State(enum.Enum):
    START = "start"  # TLS up, waiting for Ready
    IDLE = "idle"  # Ready seen: sender may start a handoff or a probe
    HEADER_SENT = "header_sent"  # waiting for Go / Reject
    STREAMING = "streaming"  # payload bytes flowing (at most size_bound in all), until the Trailer
    PAYLOAD_DONE = "payload_done"  # Trailer in; waiting for Ack / Reject
    PROBE_UP = "probe_up"  # sender streaming, receiver counting
    PROBE_UP_DONE = "probe_up_done"  # result sent; draining until the sender's ProbeEnd
    PROBE_DOWN = "probe_down"
    DONE = "done"  # handoff acknowledged
    CLOSED = "closed"  # rejected, or the peer went away


# ----------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Ready:
    info: dict[str, Any] = field(default_factory=dict)  # {"v", "node", "max_payload", "window_s", ...}


@dataclass(frozen=True)
class Header:
    raw: bytes  # canonical header JSON, exactly as MAC'd
    mac: bytes
    header: HandoffHeader | None = None  # parsed (set on receipt, and by make_header_event)


@dataclass(frozen=True)
class Go:
    pass


@dataclass(frozen=True)
class Data:
    data: bytes | bytearray | memoryview  # a received large body is a bytearray handed over


@dataclass(frozen=True)
class Pulse:
    """Sender is alive, its producer has not written for a while (resets the idle timeout)."""


@dataclass(frozen=True)
class Trailer:
    raw: bytes  # canonical trailer JSON, exactly as MAC'd
    mac: bytes
    trailer: HandoffTrailer | None = None


@dataclass(frozen=True)
class Ack:
    info: dict[str, Any] = field(default_factory=dict)


REJECT_CODES = (
    "busy", "auth", "replay", "stale", "too_large", "data", "model", "protocol", "timeout", "storage", "aborted",
    "late",  # pull lane: the producer cannot finish within the request's budget_ms (sent only to a request with one)
)


@dataclass(frozen=True)
class Reject:
    code: str
    message: str = ""


@dataclass(frozen=True)
class ProbeUp:
    seconds: float


@dataclass(frozen=True)
class ProbeDown:
    seconds: float


@dataclass(frozen=True)
class ProbeEnd:
    pass


@dataclass(frozen=True)
class ProbeResult:
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ConnectionClosed:
    """The peer closed cleanly at a frame boundary."""


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()
NeedData = _NeedData  # its type's public name (the class keeps its own: tests and the fuzzer match on it)

Event = Union[Ready, Header, Go, Data, Pulse, Trailer, Ack, Reject, ProbeUp, ProbeDown, ProbeEnd, ProbeResult]

# Frame type codes and maximum body lengths. A closed table: nothing is dispatched by name.
FRAME_TYPES: dict[type, int] = {
    Ready: 0x01, Header: 0x10, Go: 0x11, Data: 0x20, Pulse: 0x21, Trailer: 0x22, Ack: 0x30, Reject: 0x3F,
    ProbeUp: 0x40, ProbeDown: 0x41, ProbeEnd: 0x42, ProbeResult: 0x43,
}
_BY_CODE = {code: cls for cls, code in FRAME_TYPES.items()}
MAX_BODY: dict[type, int] = {
    Ready: MAX_CONTROL_BYTES, Header: MAC_BYTES + MAX_HEADER_BYTES, Go: 0, Data: MAX_DATA_BYTES, Pulse: 0,
    Trailer: MAC_BYTES + MAX_TRAILER_BYTES,
    Ack: MAX_CONTROL_BYTES, Reject: MAX_CONTROL_BYTES, ProbeUp: 64, ProbeDown: 64, ProbeEnd: 0,
    ProbeResult: MAX_CONTROL_BYTES,
}

S, R = Role.SENDER, Role.RECEIVER
# (state, who sends, event type) -> next state. Reject is handled separately (any live state).
TRANSITIONS: dict[tuple[State, Role, type], State] = {
    (State.START, R, Ready): State.IDLE,
    (State.IDLE, S, Header): State.HEADER_SENT,
    (State.HEADER_SENT, R, Go): State.STREAMING,
    (State.STREAMING, S, Data): State.STREAMING,  # never past the header's size_bound
    (State.STREAMING, S, Pulse): State.STREAMING,
    (State.STREAMING, S, Trailer): State.PAYLOAD_DONE,
    (State.PAYLOAD_DONE, R, Ack): State.DONE,
    (State.IDLE, S, ProbeUp): State.PROBE_UP,
    (State.PROBE_UP, S, Data): State.PROBE_UP,
    (State.PROBE_UP, R, ProbeResult): State.PROBE_UP_DONE,
    (State.PROBE_UP_DONE, S, Data): State.PROBE_UP_DONE,  # in flight when the result was sent
    (State.PROBE_UP_DONE, S, ProbeEnd): State.IDLE,
    (State.IDLE, S, ProbeDown): State.PROBE_DOWN,
    (State.PROBE_DOWN, R, Data): State.PROBE_DOWN,
    (State.PROBE_DOWN, R, ProbeEnd): State.IDLE,
}
TERMINAL = (State.DONE, State.CLOSED)
_PRINTABLE = re.compile(r"[^\x20-\x7e]")


# ----------------------------------------------------------------------------- encoding
def _json_body(obj: dict[str, Any]) -> bytes:
    return canonical(obj)


def encode_event(event: Event) -> bytes:
    """One frame's bytes. Raises :class:`LocalProtocolError` on an oversized body."""
    cls = type(event)
    if cls not in FRAME_TYPES:
        raise LocalProtocolError(f"not a protocol event: {event!r}")
    if isinstance(event, (Ready, Ack, ProbeResult)):
        body = _json_body(event.info)
    elif isinstance(event, (Header, Trailer)):
        if len(event.mac) != MAC_BYTES:
            raise LocalProtocolError("MAC must be 32 bytes")
        body = event.mac + event.raw
    elif isinstance(event, Data):
        body = bytes(event.data)
    elif isinstance(event, Reject):
        if event.code not in REJECT_CODES:
            raise LocalProtocolError(f"unknown reject code {event.code!r}")
        body = _json_body({"code": event.code, "message": event.message[:MAX_MESSAGE_CHARS]})
    elif isinstance(event, (ProbeUp, ProbeDown)):
        body = _json_body({"seconds": float(event.seconds)})
    else:
        body = b""
    if len(body) > MAX_BODY[cls]:
        raise LocalProtocolError(f"{cls.__name__} body of {len(body)} bytes exceeds {MAX_BODY[cls]}")
    return PREFIX.pack(FRAME_TYPES[cls], len(body)) + body


def _json_obj(body: bytes, what: str) -> dict[str, Any]:
    obj = strict_json(body, what)
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} body is not a JSON object")
    return obj


def decode_body(cls: type, body: bytes) -> Event:
    """Parse one frame body of a known type. Every malformation is a :class:`ProtocolError`."""
    if cls in (Ready, Ack, ProbeResult):
        return cls(_json_obj(body, cls.__name__))
    if cls is Header:
        if len(body) <= MAC_BYTES:
            raise ProtocolError("Header frame too short")
        raw = body[MAC_BYTES:]
        return Header(raw=raw, mac=body[:MAC_BYTES], header=parse_header(raw))
    if cls is Trailer:
        if len(body) <= MAC_BYTES:
            raise ProtocolError("Trailer frame too short")
        raw = body[MAC_BYTES:]
        return Trailer(raw=raw, mac=body[:MAC_BYTES], trailer=parse_trailer(raw))
    if cls is Data:
        if not body:
            raise ProtocolError("empty Data frame")
        return Data(body)
    if cls is Reject:
        obj = _json_obj(body, "Reject")
        code, message = obj.get("code"), obj.get("message", "")
        if code not in REJECT_CODES or not isinstance(message, str) or set(obj) - {"code", "message"}:
            raise ProtocolError("malformed Reject frame")
        return Reject(code, _PRINTABLE.sub("?", message)[:MAX_MESSAGE_CHARS])
    if cls in (ProbeUp, ProbeDown):
        obj = _json_obj(body, cls.__name__)
        seconds = obj.get("seconds")
        if type(seconds) not in (int, float) or not 0 < seconds <= 3600 or set(obj) != {"seconds"}:
            raise ProtocolError(f"malformed {cls.__name__} frame")
        return cls(float(seconds))
    if body:
        raise ProtocolError(f"{cls.__name__} frame must be empty")
    return cls()


# ----------------------------------------------------------------------------- connection
def take_frame(buf: bytearray, eof: bool, by_code: dict[int, type], max_body: dict[type, int], what: str,
               admit: Callable[[type, int], None]) -> "tuple[type, bytes] | ConnectionClosed | _NeedData":
    """The next whole frame of ``buf`` as (class, body), removed from it; NEED_DATA; or
    ConnectionClosed at a clean end. ``admit(cls, length)`` may refuse a frame as soon as
    its prefix is in, before its body is read. Shared by every sans-IO core here."""
    if len(buf) < PREFIX.size:
        if eof:
            if buf:
                raise ProtocolError("connection closed in the middle of a frame prefix")
            return ConnectionClosed()
        return NEED_DATA
    code, length = PREFIX.unpack_from(buf)
    cls = by_code.get(code)
    if cls is None:
        raise ProtocolError(f"unknown {what} type 0x{code:02x}")
    if length > max_body[cls]:
        raise ProtocolError(f"{cls.__name__} frame of {length} bytes exceeds the {max_body[cls]}-byte limit")
    admit(cls, length)
    end = PREFIX.size + length
    if len(buf) < end:
        if eof:
            raise ProtocolError(f"connection closed in the middle of a {cls.__name__} frame")
        return NEED_DATA
    with memoryview(buf) as view:
        body = bytes(view[PREFIX.size : end])  # one copy, even for a 1 MiB Data frame
    del buf[:end]
    return cls, body


class FrameMachine:
    """One side of a framed exchange, pure state: what both sans-IO cores share (this V3
    :class:`Connection` and the pull lane's ``PullConnection``). A subclass names its closed
    table (``table``: (state, who sends, event type) -> next state), the states after which
    no frame may follow (``ended``), the state a Reject leads to (``closed``) and what the
    exchange is called in its errors (``noun``); :meth:`_step` is its own bookkeeping for a
    legal event. A Reject is legal in any state not ended; anything not in the table is a
    protocol error, raised as ``error`` (ours: a bug; the peer's: :class:`ProtocolError`)."""

    table: dict[tuple[Any, Any, type], Any]
    ended: tuple[Any, ...]
    closed: Any
    noun = "connection"

    def __init__(self, our_role: Any, their_role: Any, state: Any) -> None:
        self.our_role = our_role
        self.their_role = their_role
        self.state = state
        self.reject: Reject | None = None
        self._buf = bytearray()
        self._eof = False

    def _advance(self, who: Any, event: Any, error: type[Exception]) -> None:
        if self.state in self.ended:
            raise error(f"{type(event).__name__} after the {self.noun} is {self.state.value}")
        if isinstance(event, Reject):
            self.reject = event
            self.state = self.closed
            return
        nxt = self.table.get((self.state, who, type(event)))
        if nxt is None:
            raise error(f"{who.value} may not send {type(event).__name__} in state {self.state.value}")
        self._step(event, error)
        self.state = nxt

    def _step(self, event: Any, error: type[Exception]) -> None:
        """A legal event's own bookkeeping, before the state moves (none here)."""

    def _admit(self, cls: type, length: int) -> None:
        # Refuse a frame the state forbids as soon as its prefix is in, before its body
        # (an ended state has no entry in the table: everything but Reject is refused there).
        if cls is not Reject and (self.state, self.their_role, cls) not in self.table:
            raise ProtocolError(f"{self.their_role.value} may not send {cls.__name__} in state {self.state.value}")


class Connection(FrameMachine):
    """One side of one handoff connection. Pure state: bytes in, events out, bytes out."""

    table, ended, closed = TRANSITIONS, TERMINAL, State.CLOSED

    def __init__(self, our_role: Role) -> None:
        super().__init__(our_role, Role.RECEIVER if our_role is Role.SENDER else Role.SENDER, State.START)
        self.size_bound = 0  # declared by the Header
        self.payload_seen = 0  # Data bytes of the handoff so far
        self.header: HandoffHeader | None = None
        self._body: bytearray | None = None  # a large Data body being read in place
        self._body_have = 0

    # -- transitions
    def _step(self, event: Event, error: type[Exception]) -> None:
        if isinstance(event, Header):
            header = event.header or parse_header(event.raw)
            self.header = header
            self.size_bound = header.size_bound
            self.payload_seen = 0
        if isinstance(event, Data) and self.state is State.STREAMING:
            if self.payload_seen + len(event.data) > self.size_bound:
                raise error(f"payload exceeds the declared bound of {self.size_bound} bytes")
            self.payload_seen += len(event.data)
        if isinstance(event, Trailer) and event.trailer is None:
            parse_trailer(event.raw)  # our own send: a malformed trailer is a bug (raises ProtocolError)

    def send(self, event: Event) -> bytes:
        if isinstance(event, Data) and len(event.data) > MAX_DATA_BYTES:
            raise LocalProtocolError("Data frame too large; split it")
        data = encode_event(event)
        self._advance(self.our_role, event, LocalProtocolError)
        return data

    def send_parts(self, event: Event) -> list[bytes | memoryview]:
        """As :meth:`send`, as the buffers to write in order: a Data frame is its 5-byte
        prefix and a view of its body (no copy of the payload is made here)."""
        if not isinstance(event, Data):
            return [self.send(event)]
        view = memoryview(event.data).cast("B")  # bytes, whatever the caller's view's shape or format
        n = view.nbytes
        if n > MAX_DATA_BYTES:
            raise LocalProtocolError("Data frame too large; split it")
        if n < DIRECT_BODY_MIN:
            return [self.send(Data(bytes(view)))]
        self._advance(self.our_role, Data(view), LocalProtocolError)
        return [PREFIX.pack(FRAME_TYPES[Data], n), view]

    def send_data(self, payload: bytes | memoryview, chunk: int = DEFAULT_DATA_CHUNK) -> list[bytes]:
        """Split ``payload`` into Data frames (each at most ``chunk`` bytes)."""
        view = memoryview(payload)
        return [self.send(Data(bytes(view[i : i + chunk]))) for i in range(0, len(view), chunk)]

    # -- input
    def receive_data(self, data: bytes) -> None:
        if self._eof and data:
            raise LocalProtocolError("data after EOF")
        if not data:
            self._eof = True
            return
        if self._body is not None and self._body_have < len(self._body):  # the body comes first
            take = min(len(self._body) - self._body_have, len(data))
            self._body[self._body_have : self._body_have + take] = memoryview(data)[:take]
            self._body_have += take
            data = memoryview(data)[take:]
            if not len(data):
                return
        self._buf += data

    def body_view(self) -> memoryview | None:
        """Where the rest of a large Data frame's body goes, when one is being read: the
        caller fills it (``recv_into``) and reports with :meth:`body_received`, so the
        payload reaches its own buffer with no intermediate copy. None otherwise."""
        if self._body is None or self._body_have >= len(self._body):
            return None
        return memoryview(self._body)[self._body_have :]

    def body_received(self, n: int) -> None:
        """``n`` bytes were written into :meth:`body_view`; 0 means the peer closed."""
        if self._body is None or not 0 <= n <= len(self._body) - self._body_have:
            raise LocalProtocolError("body_received without a body being read")
        if n == 0:
            self._eof = True
        self._body_have += n

    def _direct_body(self) -> bool:
        """Start reading a large Data frame's body in place once its prefix is in (and
        admitted: a frame the state forbids is refused before its body is read)."""
        buf = self._buf
        if self._eof or len(buf) < PREFIX.size or buf[0] != FRAME_TYPES[Data]:
            return False
        length = PREFIX.unpack_from(buf)[1]
        if length < DIRECT_BODY_MIN or length > MAX_BODY[Data] or len(buf) >= PREFIX.size + length:
            return False
        self._admit(Data, length)
        body = bytearray(length)
        have = len(buf) - PREFIX.size
        body[:have] = memoryview(buf)[PREFIX.size :]
        buf.clear()
        self._body, self._body_have = body, have
        return True

    def next_event(self) -> Event | ConnectionClosed | _NeedData:
        if self._body is None and self._direct_body():
            return NEED_DATA
        if self._body is not None:
            if self._body_have < len(self._body):
                if self._eof:
                    raise ProtocolError("connection closed in the middle of a Data frame")
                return NEED_DATA
            event = Data(self._body)  # handed over: this connection never writes to it again
            self._body = None
            self._advance(self.their_role, event, ProtocolError)
            return event
        frame = take_frame(self._buf, self._eof, _BY_CODE, MAX_BODY, "frame", self._admit)
        if not isinstance(frame, tuple):
            return frame
        event = decode_body(*frame)
        self._advance(self.their_role, event, ProtocolError)
        return event

    def _admit(self, cls: type, length: int) -> None:
        super()._admit(cls, length)
        if cls is Data and self.state is State.STREAMING and self.payload_seen + length > self.size_bound:
            raise ProtocolError(f"payload exceeds the declared bound of {self.size_bound} bytes")

    @property
    def buffered(self) -> int:
        return len(self._buf) + (self._body_have if self._body is not None else 0)
