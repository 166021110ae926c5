"""Sockets under the protocol core: TLS 1.3 contexts, addresses, deadlines, error mapping.

A :class:`Link` drives a :class:`~muser_cli.handoff.wire.protocol.Connection` over a blocking
TLS socket. Every read and write is bounded by ``min(idle, time left to the deadline)``,
so nothing can hang: a silent peer costs at most the idle timeout, a slow one at most
the total deadline. Socket and TLS failures become muser errors here, in one place:
unreachable, reset, timed out -> TempFailure (75); certificate refused -> AuthError (77);
anything else the peer does wrong -> ProtocolError (76).
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from typing import Any

from muser_cli.errors import AuthError, ConfigError, MuserError, ProtocolError, TempFailure, UsageError
from muser_cli.handoff.trust.node import Identity
from muser_cli.handoff.wire.protocol import ALPN, NEED_DATA, Connection, ConnectionClosed, Reject, Role
from muser_cli.handoff.wire.pull_protocol import PullConnection
from muser_cli.handoff.wire.refusal import error_class

RECV_BYTES = 256 * 1024
DEFAULT_CONNECT_S = 10.0
DEFAULT_IDLE_S = 30.0

_CERT_REASONS = (
    "CERTIFICATE", "UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "CERTIFICATE_EXPIRED",
    "CERTIFICATE_UNKNOWN", "DECRYPT_ERROR", "ACCESS_DENIED",
)


# ----------------------------------------------------------------------------- TLS
def _base_context(purpose: int, identity: Identity) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=str(identity.ca_path))  # the private CA only; no system roots
    ctx.load_cert_chain(str(identity.cert_path), str(identity.key_path))
    ctx.set_alpn_protocols([ALPN])
    ctx.options |= ssl.OP_NO_COMPRESSION
    return ctx


def server_context(identity: Identity) -> ssl.SSLContext:
    ctx = _base_context(ssl.PROTOCOL_TLS_SERVER, identity)
    ctx.num_tickets = 0  # no session tickets: nothing but frames is ever readable on the client
    return ctx


def client_context(identity: Identity) -> ssl.SSLContext:
    ctx = _base_context(ssl.PROTOCOL_TLS_CLIENT, identity)
    ctx.check_hostname = True
    return ctx


SNI_SUFFIX = ".consumer.muser.invalid"


def consumer_sni(consumer: str | None) -> str | None:
    """The TLS server name a consumer sends a producer: it names the consumer, so a producer
    that joined several consumers answers with the certificate that consumer's CA issued
    (and checks the client's certificate against that CA only). None when it cannot be one."""
    if not consumer:
        return None
    name = f"{consumer}{SNI_SUFFIX}".lower()
    if len(name) > 253 or any(not 0 < len(label) < 64 for label in name.split(".")):
        return None
    return name


def sni_client_context(identity: Identity) -> tuple[ssl.SSLContext, str | None]:
    """A client context that sends :func:`consumer_sni` as its server name, and that name (None:
    a plain :func:`client_context`). The dialled host is then checked by :func:`check_peer_host`."""
    ctx = client_context(identity)
    sni = consumer_sni(identity.consumer)
    if sni is not None:
        ctx.check_hostname = False  # verify_mode stays CERT_REQUIRED: the chain to our CA is still checked
    return ctx, sni


def check_peer_host(sock: ssl.SSLSocket, host: str, during: str) -> None:
    """The verified peer certificate holds ``host`` (a DNS name, exactly; or an IP address):
    what ``check_hostname`` checks, for a connection whose server name named the consumer."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for kind, value in (sock.getpeercert() or {}).get("subjectAltName", ()):
        value = str(value).strip()
        if ip is None and kind == "DNS" and value.lower() == host.lower().rstrip("."):
            return
        if ip is not None and kind == "IP Address":
            try:
                if ipaddress.ip_address(value) == ip:
                    return
            except ValueError:
                continue
    raise AuthError(f"the peer's certificate does not hold the name dialled {during} ({host})",
                    hint="dial a name its certificate holds (`muser node ls` on that node lists them), or "
                         "export its bundle again with --host NAME")


def tls_connect(host: str, port: int, ctx: ssl.SSLContext, *, server_hostname: str, connect_s: float,
                started: float | None = None) -> ssl.SSLSocket:
    """TCP (no Nagle: frames are written whole) and the TLS handshake with ``host:port`` under
    ``ctx``, sending ``server_hostname``; both within ``connect_s`` of ``started`` (default: now).
    A cut TCP stream reads as a cut (75), not a clean close. Failures are mapped here
    (:func:`map_error`; a name that does not resolve: :func:`unresolved`)."""
    where = format_hostport(host, port)
    t0 = time.monotonic() if started is None else started
    try:
        raw = socket.create_connection((host, port), timeout=connect_s)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(exc, socket.gaierror):
            raise unresolved(host) from None
        raise map_error(exc, f"connecting to {where}") from None
    try:
        raw.settimeout(max(0.01, connect_s - (time.monotonic() - t0)))
        sock = ctx.wrap_socket(raw, server_hostname=server_hostname, do_handshake_on_connect=False,
                               suppress_ragged_eofs=False)
        sock.do_handshake()
    except BaseException as exc:  # noqa: BLE001
        raw.close()
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise map_error(exc, f"in the TLS handshake with {where}") from None
    return sock


# ----------------------------------------------------------------------------- addresses
def parse_hostport(text: str, *, default_port: int | None = None, listen: bool = False) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, ``:port`` (listen on all addresses)."""
    text = text.strip()
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise UsageError(f"bad address {text!r}: unclosed '['")
        host, rest = text[1:close], text[close + 1 :]
        port_s = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise UsageError(f"bad address {text!r}")
    elif text.count(":") == 1:
        host, port_s = text.split(":")
    elif text.count(":") == 0:
        host, port_s = text, ""
    else:
        raise UsageError(f"bad address {text!r}", hint="write IPv6 addresses in brackets: [::1]:7070")
    if not port_s:
        if default_port is None:
            raise _no_port(text, host, listen=listen)
        port_s = str(default_port)
    if not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise UsageError(f"bad port in {text!r}")
    if not host and not listen:
        raise UsageError(f"address {text!r} has no host")
    return host, int(port_s)


def _no_port(text: str, host: str, *, listen: bool) -> UsageError:
    """``7070`` alone reads as a host name: say so, and how to write the address."""
    message = f"address {text!r} has no port" + (f" ({host} reads as a host name)" if host.isdigit() else "")
    port = host if host.isdigit() else "7070"
    if listen:
        return UsageError(message, hint=f"write HOST:PORT: :{port} for every address, 127.0.0.1:{port} for this "
                                        "machine only")
    return UsageError(message, hint=f"write HOST:PORT, e.g. gx10:{port} or 127.0.0.1:{port}")


def listen_socket(host: str, port: int, *, backlog: int | None) -> socket.socket:
    """A listening TCP socket on ``host:port`` ("" or "*": every address, IPv6 and IPv4
    where the system allows); :class:`ConfigError` (78) when the address is taken.
    ``backlog`` None: bound only, not listening (a check that the port is free)."""
    if host in ("", "*"):
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            bind_to: tuple = ("::", port)
        except OSError:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            bind_to = ("0.0.0.0", port)
    else:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror:
            raise UsageError(f"cannot resolve listen address {host!r}") from None
        family, _, _, _, bind_to = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(bind_to)
        if backlog is not None:
            sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise listen_error(exc, format_hostport(host, port), port) from None
    return sock


def listen_error(exc: OSError, where: str, port: int) -> ConfigError:
    """A port this node cannot listen on is configuration (78), never temporary (75): a
    supervisor that restarts on 75 would retry a taken port for ever."""
    import errno

    hint = {
        errno.EADDRINUSE: f"another process listens there (`ss -ltnp | grep :{port}`): stop it, or pick another port",
        errno.EACCES: "ports below 1024 need privileges: pick a port of 1024 or more",
        errno.EADDRNOTAVAIL: "that is not an address of this machine: use one it has, or :PORT for all",
    }.get(exc.errno or 0, "check the address, or pick another port")
    return ConfigError(f"cannot listen on {where} ({exc.strerror or exc})", hint=hint)


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ----------------------------------------------------------------------------- errors
HINT_ENROLL = ("enroll the producer with this consumer: `muser node export --producer NAME -o NAME.bundle` on the "
               "consumer, then `muser node join NAME.bundle` on the producer (`muser node ls` shows each side)")
HINT_REFUSED = "check HOST:PORT: is `muser receive --listen` or `muser prefill --serve` running there, on that port?"
_OTHER_CA = {2, 18, 19, 20, 21}  # X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT(_LOCALLY), SELF_SIGNED ..., UNABLE_TO_VERIFY_LEAF
_NAME_MISMATCH = {62, 64}  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
_OUT_OF_DATE = {9, 10}  # X509_V_ERR_CERT_NOT_YET_VALID, X509_V_ERR_CERT_HAS_EXPIRED


def unresolved(host: str) -> TempFailure:
    return TempFailure(f"cannot resolve {host!r}", hint="check the name (`muser node ls` lists this node's peers), "
                                                       "or dial an address, HOST:PORT")


class OtherCAError(AuthError):
    """The peer's certificate is not from this node's CA (an :class:`AuthError`, 77): the two
    nodes are not enrolled with each other, as far as this side can see. The pull lane's
    consumer says which side lacks what (:func:`muser_cli.handoff.pull.client`)."""


def _verify_error(exc: ssl.SSLCertVerificationError, during: str) -> AuthError:
    """This side refused the peer's certificate: why, in the operator's words."""
    what = exc.verify_message or exc.reason
    code = exc.verify_code
    if code in _OTHER_CA:
        return OtherCAError(f"the peer's certificate is from another CA {during} ({what}): the two nodes are not "
                         "enrolled with each other", hint=HINT_ENROLL)
    if code in _NAME_MISMATCH:
        return AuthError(f"the peer's certificate does not hold the name dialled {during} ({what})",
                         hint="dial a name its certificate holds (`muser node ls` on that node lists them), or "
                              "export its bundle again with --host NAME")
    if code in _OUT_OF_DATE:
        return AuthError(f"the peer's certificate is out of date {during} ({what})",
                         hint="check both clocks; an expired certificate needs a fresh bundle (muser node export)")
    return AuthError(f"TLS certificate check failed {during}: {what}", hint=HINT_ENROLL)


def map_error(exc: BaseException, during: str) -> MuserError:
    """One mapping from socket/TLS exceptions to muser errors."""
    if isinstance(exc, MuserError):
        return exc
    if isinstance(exc, ssl.SSLCertVerificationError):
        return _verify_error(exc, during)
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return TempFailure(f"timed out {during}")
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return TempFailure(f"the peer closed the connection {during}")
    if isinstance(exc, ssl.SSLError):
        reason = (exc.reason or "").upper()
        if any(r in reason for r in _CERT_REASONS):
            return AuthError(f"TLS peer refused the certificate {during} ({exc.reason})",
                             hint="this node is not enrolled there, or its certificate was revoked: " + HINT_ENROLL)
        if "VERSION" in reason or "PROTOCOL" in reason:
            return ProtocolError(f"TLS protocol mismatch {during} ({exc.reason}); muser speaks TLS 1.3 only")
        return TempFailure(f"TLS failure {during} ({exc.reason or exc})")
    if isinstance(exc, ConnectionRefusedError):
        return TempFailure(f"connection refused {during}: nothing listens there", hint=HINT_REFUSED)
    if isinstance(exc, (ConnectionError, OSError)):
        return TempFailure(f"network error {during} ({exc.strerror or exc})")
    return ProtocolError(f"unexpected failure {during}: {type(exc).__name__}")


def reject_error(reject: Reject, who: str = "receiver") -> MuserError:
    """What a received Reject means for the side that got it."""
    text = f"{who} refused: {reject.code}" + (f": {reject.message}" if reject.message else "")
    cls = error_class(reject.code)  # the one table; the hints are this side's
    hint = None
    if cls is TempFailure:
        hint = "retry later, or fall back to local prefill"
    elif reject.code == "auth" and ("revoked" in reject.message or "unknown key id" in reject.message):
        hint = ("the consumer revoked or no longer knows this node's key: ask it for a fresh "
                "bundle (`muser node export --producer NAME -o NAME.bundle` there), then "
                "`muser node join --force NAME.bundle` here")
    elif cls is AuthError:
        hint = "check `muser node ls` on both sides, and both clocks"
    return cls(text, hint=hint)


# ----------------------------------------------------------------------------- link
class Link:
    """A Connection over a TLS socket, with an idle timeout and a total deadline."""

    def __init__(self, sock: ssl.SSLSocket, conn: Connection, *, idle_s: float, deadline: float | None) -> None:
        self.sock = sock
        self.conn = conn
        self.idle_s = idle_s
        self.deadline = deadline
        self.bytes_in = 0
        self.bytes_out = 0
        self._armed: float | None = None
        self._rbuf: bytearray | None = None

    def _timeout(self, during: str) -> float:
        if self.deadline is None:
            return self.idle_s
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TempFailure(f"total deadline passed {during}")
        return min(self.idle_s, left)

    def _arm(self, during: str, timeout: float | None = None) -> None:
        """Set the socket timeout; skip the system calls when it has not changed."""
        value = self._timeout(during) if timeout is None else timeout
        if value != self._armed:
            self.sock.settimeout(value)
            self._armed = value

    def write(self, data: bytes, during: str = "writing") -> None:
        try:
            self._arm(during)
            self.sock.sendall(data)
        except BaseException as exc:  # noqa: BLE001 - mapped in one place
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise map_error(exc, during) from None
        self.bytes_out += len(data)

    def send(self, event: Any, during: str = "writing") -> None:
        for part in self.conn.send_parts(event):  # a Data body goes out as a view: no copy
            self.write(part, during)

    def send_or_reject(self, event: Any, during: str, peer: str = "receiver") -> None:
        """:meth:`send`; when the write fails because the peer closed, raise the Reject it
        sent before closing (if it did) instead of "closed"."""
        try:
            self.send(event, during)
        except TempFailure:
            reject = self.drain_for_reject()
            if reject is not None:
                raise reject_error(reject, peer) from None
            raise

    def _fill(self, during: str, timeout: float | None = None) -> None:
        body = self.conn.body_view()  # a large Data body: decrypted straight into its buffer
        if body is None:  # anything else: into this link's own read buffer (no allocation per read)
            if self._rbuf is None:
                self._rbuf = bytearray(RECV_BYTES)
            into = memoryview(self._rbuf)
        else:
            into = body
        try:
            self._arm(during, timeout)
            n = self.sock.recv_into(into)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise map_error(exc, during) from None
        self.bytes_in += n
        if body is not None:
            self.conn.body_received(n)
        else:
            self.conn.receive_data(into[:n])  # copied into the connection's buffer (b"": EOF)

    def next_event(self, during: str = "reading") -> Any:
        while True:
            event = self.conn.next_event()
            if event is not NEED_DATA:
                return event
            self._fill(during)

    def poll_event(self) -> Any | None:
        """An event if one is already readable, else None. Never blocks for long."""
        event = self.conn.next_event()
        if event is not NEED_DATA:
            return event
        try:
            ready = self.sock.pending() > 0 or bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return None
        if not ready:
            return None
        self._fill("reading", timeout=0.05)
        event = self.conn.next_event()
        return None if event is NEED_DATA else event

    def drain_for_reject(self, seconds: float = 0.5) -> Reject | None:
        """After a write failed: look for the Reject the peer may have sent before closing."""
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                event = self.conn.next_event()
                if isinstance(event, Reject):
                    return event
                if isinstance(event, ConnectionClosed):
                    return None
                if event is NEED_DATA:
                    self._fill("reading", timeout=max(0.01, end - time.monotonic()))
        except (MuserError, OSError):
            return None
        return None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def continue_as_v3(link: Link, role: Role) -> None:
    """The pull exchange on ``link`` is over (``Serving`` sent or received): the rest of the
    connection is one V3 handoff, this side its ``role``; the bytes already read past the
    exchange are the V3 connection's first."""
    pc = link.conn
    assert isinstance(pc, PullConnection)
    v3 = Connection(role)
    left = pc.leftover()
    if left:
        v3.receive_data(left)
    link.conn = v3
