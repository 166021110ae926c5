"""The producer side: ``send`` a kvpack to a receiver as it is produced, and ``probe_link`` a receiver.

Contract of :func:`send` (Handoff V3, docs/handoff.md):
  * the input is read incrementally (a pipe from ``muser prefill`` that writes frames as
    chunks finish, or a file), never waiting for its end: once its kvpack header is in
    and verified, the handoff header -- key id, handoff id, issued-at, the kvpack header
    digest and model binding, an upper bound on the size -- is MAC'd with the node's HMAC
    key; a bad kvpack header fails (exit 65) before any connection is made;
  * then: TCP connect, TLS 1.3 with client certificate, wait for ``Ready`` (or busy),
    ``Header``, wait for ``Go``, then stream ``Data`` frames as input arrives (paced when
    ``rate`` is given; ``Pulse`` while a slow producer writes nothing); as soon as the
    kvpack's end frame is in (the sender follows the frame layout, without hashing), a
    MAC'd ``Trailer`` with the exact size and the root digest of the end frame; wait for
    ``Ack``. Returns only after the receiver acknowledged, i.e. after it
    verified every frame against the chain and the trailer against what it computed,
    and recorded the handoff id durably (and published the file, if it writes one);
  * the sender does not re-hash what it forwards (the receiver verifies every frame, so
    a second hash would only cost the producer's core): a corrupt frame is refused by
    the receiver (``Reject(data)``, exit 65); input that ends without its end frame is
    reported to the receiver (``Reject(aborted)``) and raises DataError (65); the
    receiver then never forwards an end frame;
  * memory: one read block, whatever the pack size;
  * payload rate = payload bytes / send busy time, where busy time is the time spent
    inside socket writes of payload frames (pacing sleeps excluded);
  * unreachable, busy, reset or timed out raises TempFailure (exit 75).
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import stat
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from muser_cli.errors import DataError, KVPackError, MuserError, ProtocolError, TempFailure
from muser_cli.handoff.link import (
    DEFAULT_CONNECT_S, DEFAULT_IDLE_S, Link, client_context, format_hostport, parse_hostport, reject_error, tls_connect,
)
from muser_cli.handoff.probes import measure
from muser_cli.handoff.push.clock import since_start, unix_of
from muser_cli.handoff.push.payload import PackStart, PayloadInspector, StreamTail, read_start
from muser_cli.handoff.trust.certs import peer_common_name
from muser_cli.handoff.trust.node import Identity
from muser_cli.handoff.trust.nodedir import note_peer
from muser_cli.handoff.wire.header import (
    MAX_PAYLOAD_BYTES, HandoffHeader, HandoffTrailer, new_handoff_id, sign, sign_trailer,
)
from muser_cli.handoff.wire.protocol import (
    ALPN, DEFAULT_DATA_CHUNK, Ack, Connection, ConnectionClosed, Data, Go, Header, Pulse, Ready, Reject, Role, State,
    Trailer,
)

DEFAULT_TOTAL_S = 3600.0
DEFAULT_PULSE_S = 5.0
PACE_SLACK_S = 0.05  # a paced stream that fell this far behind (a producer pause) restarts its clock
READ_BLOCK = 1 << 20
ProgressFn = Callable[[str, int, int], None]


# ----------------------------------------------------------------------------- input
class PackSource:
    """A kvpack read as it is produced. Construction reads and verifies just its header.

    From a pipe, socket or terminal it reads the file descriptor directly (what is
    there, as soon as it is there; ``select`` so that a silent producer can be told
    apart from a slow read); otherwise ``read1``/``read`` on the stream.
    """

    def __init__(self, stream: BinaryIO, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> None:
        self._stream = stream
        self._fd: int | None = None
        try:
            fd = stream.fileno()
            mode = os.fstat(fd).st_mode
            if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode):
                self._fd = fd
        except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
            self._fd = None
        self.inspector = PayloadInspector(max_bytes=max_bytes)
        self.wait_s = 0.0  # time spent waiting for the producer
        self._used = False
        self.head = read_start(self._read, self.inspector)
        assert self.inspector.start is not None
        self.start: PackStart = self.inspector.start

    def _read(self, n: int, timeout: float | None = None) -> bytes | None:
        """Up to ``n`` bytes (b"" at EOF); None when ``timeout`` passed with nothing to read."""
        t0 = time.monotonic()
        try:
            if self._fd is not None:
                if timeout is not None and not select.select([self._fd], [], [], timeout)[0]:
                    return None
                return os.read(self._fd, n)
            read1 = getattr(self._stream, "read1", None)
            return read1(n) if read1 is not None else self._stream.read(n)
        finally:
            self.wait_s += time.monotonic() - t0

    def blocks(self, size: int, pulse_s: float | None) -> Iterator[bytes | None]:
        """The header bytes already read, then input as it arrives (``None``: nothing for
        ``pulse_s`` seconds). Once only: a stream cannot be rewound."""
        if self._used:
            raise RuntimeError("a PackSource is read once")
        self._used = True
        yield self.head
        while True:
            data = self._read(size, pulse_s if self._fd is not None else None)
            if data is None:
                yield None
                continue
            if not data:
                return
            yield data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.close()


@dataclass(frozen=True)
class PreparedHandoff:
    """A signed V3 header and the payload it opens. With ``path`` it can be sent more than
    once (tests use that to replay); a real sender prepares a fresh one, with a fresh id,
    per handoff, and streams its one-shot ``source``."""

    header: HandoffHeader
    raw: bytes
    mac: bytes
    path: Path | None
    start: PackStart
    source: PackSource | None = None


@dataclass
class SendResult:
    ok: bool
    to: str
    handoff_id: str
    key_id: str
    payload_bytes: int
    root_digest: str
    frames: int  # kvpack data frames sent
    connect_s: float
    busy_s: float  # inside socket writes of payload frames
    paced_s: float  # sleeping to honour --rate
    input_wait_s: float  # waiting for the producer (the input) after Go
    stream_s: float  # first to last payload write
    ack_wait_s: float  # last write to Ack (trailer, receiver's verify + ledger fsync + publish)
    total_s: float
    payload_rate_Bps: float  # payload bytes / busy time
    rate_limit_Bps: float | None
    first_byte_s: float | None  # first payload byte written, seconds since process start
    last_byte_s: float | None  # last payload byte written
    first_byte_unix: float | None  # the same instants as Unix times
    last_byte_unix: float | None
    receiver: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- prepare
def prepare_handoff(
    src: Path | PackSource, identity: Identity, *, key_id: str | None = None, now_ms: int | None = None,
    handoff_id: str | None = None,
) -> PreparedHandoff:
    """Sign a V3 header for the kvpack at ``src`` (a path, or a source already past its header)."""
    key = identity.signing_key(key_id)
    if isinstance(src, PackSource):
        source, path, start = src, None, src.start
    else:
        path = Path(src)
        with open(path, "rb") as f:
            start = PackSource(f).start
        source = None
    header = HandoffHeader(
        key_id=key.key_id,
        handoff_id=handoff_id or new_handoff_id(),
        issued_at_ms=int(time.time() * 1000) if now_ms is None else now_ms,
        size_bound=start.size_bound,
        pack_header_digest=start.header_digest,
        model_fingerprint=start.model_fingerprint,
        tokenizer_fingerprint=start.tokenizer_fingerprint,
        token_digest=start.token_digest,
        rows_start=start.rows_start,
        sender=identity.name,
    )
    raw, mac = sign(header, key.secret)
    return PreparedHandoff(header, raw, mac, path, start, source)


# ----------------------------------------------------------------------------- connect
def open_link(
    to: str, identity: Identity, *, connect_s: float = DEFAULT_CONNECT_S, idle_s: float = DEFAULT_IDLE_S,
    total_s: float = DEFAULT_TOTAL_S, server_name: str | None = None,
) -> tuple[Link, dict[str, Any], float]:
    """Connect, handshake, and wait for Ready. Returns (link, ready info, seconds taken).

    The receiver's certificate must name ``server_name`` (default: the host dialled).
    """
    host, port = parse_hostport(to)
    where = format_hostport(host, port)
    t0 = time.monotonic()
    ctx = client_context(identity)
    sock = tls_connect(host, port, ctx, server_hostname=server_name or host, connect_s=connect_s, started=t0)
    link = Link(sock, Connection(Role.SENDER), idle_s=idle_s, deadline=t0 + total_s)
    try:
        if sock.selected_alpn_protocol() != ALPN:
            raise ProtocolError(f"{where} does not speak {ALPN}")
        event = link.next_event(f"waiting for {where} to be ready")
        if isinstance(event, Reject):
            raise reject_error(event)
        if isinstance(event, ConnectionClosed):
            raise TempFailure(f"{where} closed the connection before it was ready")
        assert isinstance(event, Ready)
    except BaseException:
        link.close()
        raise
    return link, event.info, time.monotonic() - t0


def _expect(link: Link, cls: type, during: str) -> Any:
    event = link.next_event(during)
    if isinstance(event, Reject):
        raise reject_error(event)
    if isinstance(event, ConnectionClosed):
        raise TempFailure(f"the receiver closed the connection {during}")
    if not isinstance(event, cls):  # the state table makes this unreachable
        raise ProtocolError(f"expected {cls.__name__}, got {type(event).__name__}")
    return event


# ----------------------------------------------------------------------------- send
def _abort(link: Link, code: str, message: str, linger_s: float = 1.0) -> None:
    """Tell the receiver we give up (best effort), so it rejects at once instead of waiting,
    then give it up to ``linger_s`` to clean up and close (its spool is gone when we return)."""
    with contextlib.suppress(MuserError, OSError):
        if link.conn.state not in (State.DONE, State.CLOSED):
            link.send(Reject(code, message), "aborting the handoff")
    with contextlib.suppress(MuserError, OSError, ValueError):
        link.sock.settimeout(linger_s)
        end = time.monotonic() + linger_s
        while time.monotonic() < end and link.sock.recv(1 << 16):
            pass


def transmit(
    prepared: PreparedHandoff, *, to: str, identity: Identity, rate: float | None = None,
    connect_s: float = DEFAULT_CONNECT_S, idle_s: float = DEFAULT_IDLE_S, total_s: float = DEFAULT_TOTAL_S,
    chunk: int = DEFAULT_DATA_CHUNK, progress: ProgressFn | None = None, server_name: str | None = None,
    pulse_s: float | None = None,
) -> SendResult:
    """Send one prepared handoff, streaming its input as it arrives; return after the receiver's Ack."""
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        if prepared.source is None:
            assert prepared.path is not None
            prepared = replace(prepared, source=PackSource(stack.enter_context(open(prepared.path, "rb"))))
        link, ready, connect_time = open_link(
            to, identity, connect_s=connect_s, idle_s=idle_s, total_s=total_s, server_name=server_name
        )
        stack.callback(link.close)
        result = transmit_over(link, ready, prepared, to=to, identity=identity, rate=rate, chunk=chunk,
                               progress=progress, pulse_s=pulse_s, connect_time=connect_time, t_start=t_start)
        # The receiver authenticated (its certificate, its Ack of what it verified): when it was
        # last seen, for `node ls`. Bookkeeping: a record that cannot be written never fails a send.
        der = link.sock.getpeercert(binary_form=True) or b""
        if der:
            note_peer(identity, peer_common_name(der), role="consumer", address=format_hostport(*parse_hostport(to)),
                      key_id=prepared.header.key_id, via="push")
        return result


def transmit_over(
    link: Link, ready: dict[str, Any], prepared: PreparedHandoff, *, to: str, identity: Identity,
    rate: float | None = None, chunk: int = DEFAULT_DATA_CHUNK, progress: ProgressFn | None = None,
    pulse_s: float | None = None, connect_time: float = 0.0, t_start: float | None = None,
) -> SendResult:
    """Run one handoff on a link already past ``Ready`` (``send``'s own connection, or a pull
    lane's after ``Serving``), streaming ``prepared.source``; return after the receiver's Ack."""
    if t_start is None:
        t_start = time.monotonic()
    key = identity.key(prepared.header.key_id)  # signs the trailer (the header is signed already)
    source = prepared.source
    assert source is not None
    bound = prepared.header.size_bound
    max_data = ready.get("max_data")
    if isinstance(max_data, int) and max_data > 0:
        chunk = min(chunk, max_data)
    if rate:
        chunk = max(4096, min(chunk, int(rate / 50)))  # ~20 ms of data per frame when paced
    peer_idle = ready.get("idle_s")
    if pulse_s is None:
        pulse_s = DEFAULT_PULSE_S
        if isinstance(peer_idle, (int, float)) and peer_idle > 0:
            pulse_s = min(pulse_s, peer_idle / 3)
    link.send(Header(prepared.raw, prepared.mac, prepared.header), "sending the handoff header")
    _expect(link, Go, "waiting for the receiver to accept the header")
    busy = paced = 0.0
    sent = 0
    t_first = t_last = None
    pace_t0: float | None = None  # the pacing clock: bytes since pace_t0 may not pass rate
    pace_sent = 0
    wait_before = source.wait_s
    tail = StreamTail(source.start, source.head)
    for block in source.blocks(max(chunk, READ_BLOCK if not rate else chunk), pulse_s):
        if block is None:
            link.send(Pulse(), "keeping the link alive while the producer computes")
            continue
        if block is not source.head:  # the head was accounted for when the source opened
            try:
                tail.feed(block)  # layout only, no hashing: knows when the end frame is in
            except KVPackError as exc:
                _abort(link, "data", f"the sender's input is not a valid kvpack: {exc}")
                raise
        view = memoryview(block)
        for i in range(0, len(view), chunk):
            piece = view[i : i + chunk]
            early = link.poll_event()
            if isinstance(early, Reject):
                raise reject_error(early)
            if early is not None:
                raise ProtocolError(f"unexpected {type(early).__name__} while streaming")
            if sent + len(piece) > bound:
                _abort(link, "data", f"payload exceeds its declared bound of {bound} bytes")
                raise DataError(f"the kvpack is longer than the {bound} bytes its header allows")
            if rate:
                now = time.monotonic()
                if pace_t0 is None or pace_t0 + pace_sent / rate < now - PACE_SLACK_S:
                    pace_t0, pace_sent = now, 0  # start, or the producer paused: no catch-up burst
                wait = pace_t0 + pace_sent / rate - now
                if wait > 0:
                    time.sleep(wait)
                    paced += wait
                pace_sent += len(piece)
            t0 = time.perf_counter()
            link.send_or_reject(Data(piece), f"streaming the payload ({sent} bytes sent)")
            busy += time.perf_counter() - t0
            t_last = time.monotonic()
            if t_first is None:
                t_first = t_last
            sent += len(piece)
        if progress:
            progress("send", sent, bound)
        if tail.complete:
            break  # the end frame is in: the trailer goes now, not when the producer exits
    try:
        size, root = tail.finish()
    except KVPackError as exc:
        _abort(link, "aborted", f"the sender's input ended early: {exc}")
        raise DataError(f"input ended before the kvpack was complete ({exc})") from None
    if key is None:
        raise DataError(f"no HMAC key {prepared.header.key_id!r} to sign the trailer")
    trailer = HandoffTrailer(prepared.header.handoff_id, size, root)
    traw, tmac = sign_trailer(trailer, key.secret, prepared.mac)
    link.send(Trailer(traw, tmac, trailer), "sending the handoff trailer")
    t_end = time.monotonic()
    ack = _expect(link, Ack, "waiting for the receiver's acknowledgement")
    t_ack = time.monotonic()
    if ack.info.get("handoff_id") != prepared.header.handoff_id:
        raise ProtocolError("the receiver acknowledged a different handoff id")
    assert t_first is not None and t_last is not None
    return SendResult(
        ok=True, to=to, handoff_id=prepared.header.handoff_id, key_id=prepared.header.key_id,
        payload_bytes=size, root_digest=root, frames=source.start.frames, connect_s=connect_time,
        busy_s=busy, paced_s=paced, input_wait_s=source.wait_s - wait_before, stream_s=t_last - t_first,
        ack_wait_s=t_ack - t_end, total_s=t_ack - t_start,
        payload_rate_Bps=size / busy if busy > 0 else 0.0, rate_limit_Bps=rate,
        first_byte_s=since_start(t_first), last_byte_s=since_start(t_last),
        first_byte_unix=unix_of(t_first), last_byte_unix=unix_of(t_last),
        receiver={k: v for k, v in ack.info.items() if isinstance(v, (str, int, float, bool))},
    )


def send(
    stream: BinaryIO, *, to: str, identity: Identity, rate: float | None = None,
    key_id: str | None = None, connect_s: float = DEFAULT_CONNECT_S, idle_s: float = DEFAULT_IDLE_S,
    total_s: float = DEFAULT_TOTAL_S, progress: ProgressFn | None = None, spool_dir: Path | None = None,
) -> SendResult:
    """Stream the kvpack on ``stream`` to ``to`` (``HOST:PORT``) as it is produced.

    ``spool_dir`` is accepted for compatibility and unused: V3 never spools its input.
    """
    parse_hostport(to)  # usage errors before reading stdin
    identity.signing_key(key_id)  # no key: exit 78 before reading
    source = PackSource(stream)  # a bad kvpack header: exit 65 before connecting
    prepared = prepare_handoff(source, identity, key_id=key_id)
    return transmit(
        prepared, to=to, identity=identity, rate=rate, connect_s=connect_s, idle_s=idle_s,
        total_s=total_s, progress=progress,
    )


# ----------------------------------------------------------------------------- probe
@dataclass
class ProbeResultInfo:
    ok: bool
    to: str
    connect_s: float
    up_bytes: int
    up_s: float
    up_Bps: float
    down_bytes: int
    down_s: float
    down_Bps: float
    floor_Bps: float | None
    passed: bool
    receiver: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def measured(cls, to: str, connect_s: float, got: dict[str, Any], floor: float | None,
                 info: dict[str, Any]) -> "ProbeResultInfo":
        """The result of :func:`~muser_cli.handoff.probes.measure`'s counts; ``info``: what the
        listener said in its ``Ready`` (its scalar fields are kept)."""
        up_rate = got["up_bytes"] / got["up_s"] if got["up_s"] > 0 else 0.0
        down_rate = got["down_bytes"] / got["down_s"] if got["down_s"] > 0 else 0.0
        return cls(
            ok=True, to=to, connect_s=connect_s, up_bytes=got["up_bytes"], up_s=got["up_s"], up_Bps=up_rate,
            down_bytes=got["down_bytes"], down_s=got["down_s"], down_Bps=down_rate, floor_Bps=floor,
            passed=floor is None or min(up_rate, down_rate) >= floor,
            receiver={k: v for k, v in info.items() if isinstance(v, (str, int, float, bool))},
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["up_Mbit"] = self.up_Bps * 8 / 1e6
        out["down_Mbit"] = self.down_Bps * 8 / 1e6
        return out


def probe_link(
    to: str, identity: Identity, *, seconds: float = 2.0, floor: float | None = None,
    connect_s: float = DEFAULT_CONNECT_S, idle_s: float = DEFAULT_IDLE_S, chunk: int = DEFAULT_DATA_CHUNK,
) -> ProbeResultInfo:
    """Raw TLS throughput to the receiver and back, each measured at its receiving end
    (:func:`muser_cli.handoff.probes.measure`; ``probe-link`` also reaches a serving producer,
    :mod:`muser_cli.handoff.probe_link`)."""
    link, ready, connect_time = open_link(to, identity, connect_s=connect_s, idle_s=idle_s, total_s=4 * seconds + 60)
    try:
        got = measure(link, seconds, chunk=chunk, peer="receiver")
    finally:
        link.close()
    return ProbeResultInfo.measured(to, connect_time, got, floor, ready)
