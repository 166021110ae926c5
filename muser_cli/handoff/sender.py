"""The producer side: ``send`` a kvpack to a receiver, and ``probe_link`` a receiver.

Contract of :func:`send`:
  * the whole kvpack is read (and spooled when it comes from a pipe) and checked by the
    kvpack reader before any connection is made: its size, SHA-256, root digest and model
    binding go into the handoff header, which is MAC'd with the node's HMAC key;
  * then: TCP connect, TLS 1.3 with client certificate, wait for ``Ready`` (or busy),
    ``Header``, wait for ``Go``, stream ``Data`` frames (paced when ``rate`` is given),
    wait for ``Ack``. Returns only after the receiver acknowledged, i.e. after it verified
    the payload, recorded the handoff id durably and published the file;
  * payload rate = payload bytes / send busy time, where busy time is the time spent
    inside socket writes of payload frames (pacing sleeps excluded);
  * unreachable, busy, reset or timed out raises TempFailure (exit 75).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from muser_cli.errors import MuserError, ProtocolError, TempFailure
from muser_cli.handoff.header import HandoffHeader, new_handoff_id, sign
from muser_cli.handoff.link import (
    DEFAULT_CONNECT_S, DEFAULT_IDLE_S, Link, client_context, format_hostport, map_error, parse_hostport,
    reject_error,
)
from muser_cli.handoff.node import Identity
from muser_cli.handoff.payload import PayloadInfo, inspect_stream
from muser_cli.handoff.protocol import (
    ALPN, DEFAULT_DATA_CHUNK, Ack, Connection, ConnectionClosed, Data, Go, Header, ProbeDown, ProbeEnd,
    ProbeResult, ProbeUp, Ready, Reject, Role,
)

DEFAULT_TOTAL_S = 3600.0
ProgressFn = Callable[[str, int, int], None]


@dataclass(frozen=True)
class PreparedHandoff:
    """A signed header and the payload file it describes. Sendable more than once (tests use
    that to replay); a real sender prepares a fresh one, with a fresh id, per handoff."""

    header: HandoffHeader
    raw: bytes
    mac: bytes
    path: Path
    info: PayloadInfo


@dataclass
class SendResult:
    ok: bool
    to: str
    handoff_id: str
    key_id: str
    payload_bytes: int
    root_digest: str
    connect_s: float
    busy_s: float  # inside socket writes of payload frames
    paced_s: float  # sleeping to honour --rate
    stream_s: float  # first to last payload write
    ack_wait_s: float  # last write to Ack (receiver verify + ledger fsync + publish)
    total_s: float
    payload_rate_Bps: float  # payload bytes / busy time
    rate_limit_Bps: float | None
    receiver: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- payload
@contextlib.contextmanager
def payload_file(stream: BinaryIO, spool_dir: Path) -> Iterator[Path]:
    """A path holding the whole payload: the file itself, or a spooled copy of a pipe."""
    name = getattr(stream, "name", None)
    if isinstance(name, str) and os.path.exists(name):
        try:
            if stat.S_ISREG(os.stat(name).st_mode) and stream.seekable() and stream.tell() == 0:
                yield Path(name)
                return
        except OSError:
            pass
    spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=".send.", suffix=".kvpack", dir=spool_dir)
    try:
        with os.fdopen(fd, "wb") as out:
            while True:
                data = stream.read(1 << 20)
                if not data:
                    break
                out.write(data)
        yield Path(tmp)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def prepare_handoff(
    path: Path, identity: Identity, *, key_id: str | None = None, now_ms: int | None = None,
    handoff_id: str | None = None,
) -> PreparedHandoff:
    """Check the kvpack at ``path`` and sign a header for it."""
    key = identity.signing_key(key_id)
    with open(path, "rb") as f:
        info = inspect_stream(f)
    header = HandoffHeader(
        key_id=key.key_id,
        handoff_id=handoff_id or new_handoff_id(),
        issued_at_ms=int(time.time() * 1000) if now_ms is None else now_ms,
        payload_size=info.size,
        root_digest=info.root_digest,
        model_fingerprint=info.model_fingerprint,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        token_digest=info.token_digest,
        rows_start=info.rows_start,
        sender=identity.name,
    )
    raw, mac = sign(header, key.secret)
    return PreparedHandoff(header, raw, mac, path, info)


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
    try:
        raw = socket.create_connection((host, port), timeout=connect_s)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames are written whole
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(exc, socket.gaierror):
            raise TempFailure(f"cannot resolve {host!r}") from None
        raise map_error(exc, f"connecting to {where}") from None
    try:
        raw.settimeout(max(0.01, connect_s - (time.monotonic() - t0)))
        sock = ctx.wrap_socket(raw, server_hostname=server_name or host, do_handshake_on_connect=False)
        sock.do_handshake()
    except BaseException as exc:  # noqa: BLE001
        raw.close()
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise map_error(exc, f"in the TLS handshake with {where}") from None
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
def transmit(
    prepared: PreparedHandoff, *, to: str, identity: Identity, rate: float | None = None,
    connect_s: float = DEFAULT_CONNECT_S, idle_s: float = DEFAULT_IDLE_S, total_s: float = DEFAULT_TOTAL_S,
    chunk: int = DEFAULT_DATA_CHUNK, progress: ProgressFn | None = None, server_name: str | None = None,
) -> SendResult:
    """Send one prepared handoff; return after the receiver's Ack."""
    t_start = time.monotonic()
    link, ready, connect_time = open_link(
        to, identity, connect_s=connect_s, idle_s=idle_s, total_s=total_s, server_name=server_name
    )
    size = prepared.header.payload_size
    try:
        max_data = ready.get("max_data")
        if isinstance(max_data, int) and max_data > 0:
            chunk = min(chunk, max_data)
        if rate:
            chunk = max(4096, min(chunk, int(rate / 50)))  # ~20 ms of data per frame when paced
        link.send(Header(prepared.raw, prepared.mac, prepared.header), "sending the handoff header")
        _expect(link, Go, "waiting for the receiver to accept the header")
        busy = paced = 0.0
        sent = 0
        t_first = time.monotonic()
        with open(prepared.path, "rb") as f:
            while sent < size:
                data = f.read(min(chunk, size - sent))
                if not data:
                    raise TempFailure(f"payload file shrank while sending ({sent} of {size} bytes)")
                early = link.poll_event()
                if isinstance(early, Reject):
                    raise reject_error(early)
                if early is not None:
                    raise ProtocolError(f"unexpected {type(early).__name__} while streaming")
                if rate:
                    wait = t_first + sent / rate - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                        paced += wait
                t0 = time.perf_counter()
                try:
                    link.send(Data(data), f"streaming the payload ({sent} of {size} bytes sent)")
                except TempFailure as exc:
                    reject = link.drain_for_reject()
                    if reject is not None:
                        raise reject_error(reject) from None
                    raise exc from None
                busy += time.perf_counter() - t0
                sent += len(data)
                if progress:
                    progress("send", sent, size)
        t_last = time.monotonic()
        ack = _expect(link, Ack, "waiting for the receiver's acknowledgement")
        t_ack = time.monotonic()
    finally:
        link.close()
    if ack.info.get("handoff_id") != prepared.header.handoff_id:
        raise ProtocolError("the receiver acknowledged a different handoff id")
    return SendResult(
        ok=True, to=to, handoff_id=prepared.header.handoff_id, key_id=prepared.header.key_id,
        payload_bytes=size, root_digest=prepared.header.root_digest, connect_s=connect_time,
        busy_s=busy, paced_s=paced, stream_s=t_last - t_first, ack_wait_s=t_ack - t_last,
        total_s=t_ack - t_start, payload_rate_Bps=size / busy if busy > 0 else 0.0, rate_limit_Bps=rate,
        receiver={k: v for k, v in ack.info.items() if isinstance(v, (str, int, float, bool))},
    )


def send(
    stream: BinaryIO, *, to: str, identity: Identity, spool_dir: Path, rate: float | None = None,
    key_id: str | None = None, connect_s: float = DEFAULT_CONNECT_S, idle_s: float = DEFAULT_IDLE_S,
    total_s: float = DEFAULT_TOTAL_S, progress: ProgressFn | None = None,
) -> SendResult:
    """Read a kvpack from ``stream`` and hand it off to ``to`` (``HOST:PORT``)."""
    parse_hostport(to)  # usage errors before reading stdin
    with payload_file(stream, spool_dir) as path:
        prepared = prepare_handoff(path, identity, key_id=key_id)
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

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["up_Mbit"] = self.up_Bps * 8 / 1e6
        out["down_Mbit"] = self.down_Bps * 8 / 1e6
        return out


def probe_link(
    to: str, identity: Identity, *, seconds: float = 2.0, floor: float | None = None,
    connect_s: float = DEFAULT_CONNECT_S, idle_s: float = DEFAULT_IDLE_S, chunk: int = DEFAULT_DATA_CHUNK,
) -> ProbeResultInfo:
    """Raw TLS throughput to the receiver and back, each measured at its receiving end."""
    link, ready, connect_time = open_link(to, identity, connect_s=connect_s, idle_s=idle_s, total_s=4 * seconds + 60)
    block = os.urandom(chunk)
    try:
        # Up: we stream until the receiver has counted for `seconds` and sends its result.
        link.send(ProbeUp(seconds), "starting the upload probe")
        result = None
        while result is None:
            early = link.poll_event()
            if isinstance(early, ProbeResult):
                result = early
            elif isinstance(early, Reject):
                raise reject_error(early)
            elif early is not None:
                raise ProtocolError(f"unexpected {type(early).__name__} in the upload probe")
            else:
                link.send(Data(block), "in the upload probe")
        link.send(ProbeEnd(), "ending the upload probe")
        up_bytes = int(result.info.get("bytes", 0))
        up_s = float(result.info.get("seconds", 0.0))
        # Down: the receiver streams for `seconds`; we count from the first byte to ProbeEnd.
        link.send(ProbeDown(seconds), "starting the download probe")
        down_bytes, t_first = 0, None
        while True:
            event = link.next_event("in the download probe")
            if isinstance(event, Data):
                if t_first is None:
                    t_first = time.monotonic()
                down_bytes += len(event.data)
            elif isinstance(event, ProbeEnd):
                break
            elif isinstance(event, Reject):
                raise reject_error(event)
            else:
                raise TempFailure("the receiver closed the connection in the download probe")
        down_s = time.monotonic() - t_first if t_first is not None else 0.0
    except MuserError:
        raise
    finally:
        link.close()
    up_rate = up_bytes / up_s if up_s > 0 else 0.0
    down_rate = down_bytes / down_s if down_s > 0 else 0.0
    passed = floor is None or min(up_rate, down_rate) >= floor
    return ProbeResultInfo(
        ok=True, to=to, connect_s=connect_time, up_bytes=up_bytes, up_s=up_s, up_Bps=up_rate,
        down_bytes=down_bytes, down_s=down_s, down_Bps=down_rate, floor_Bps=floor, passed=passed,
        receiver={k: v for k, v in ready.items() if isinstance(v, (str, int, float, bool))},
    )
