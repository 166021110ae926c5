"""What the two TLS listeners share: the push lane's :class:`~muser_cli.handoff.push.receiver.Receiver`
and the pull lane's :class:`~muser_cli.handoff.pull.server.PullServer`.

A :class:`Listener` binds, accepts (each TCP connection on a thread of its own, at most
``config.max_pending`` at once; the rest are closed at accept), runs the TLS handshake
(bounded by ``config.handshake_s``, its ALPN required) and hands the connection to the
subclass as a :class:`~muser_cli.handoff.link.Link`. It holds the per-key replay ledgers
(a torn one found at start refuses to run) and reports through ``on_event`` (:class:`Events`).
A connection thread never dies loudly: what escapes it is an ``error`` event.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any, Callable

from muser_cli.errors import MuserError
from muser_cli.handoff.link import Link, format_hostport, listen_socket, map_error
from muser_cli.handoff.trust.ledger import Ledger
from muser_cli.handoff.wire.protocol import Reject

EventFn = Callable[[str, dict[str, Any]], None]


class Events:
    """A listener's ``on_event(kind, fields)``, called from connection threads. The callback is the
    caller's: one that raises must not end the handoff or the thread, so the first failure is
    reported once, as a ``warning`` event (which ``receive`` prints), later ones only counted in
    :attr:`failures`; nothing is dropped silently."""

    def __init__(self, on_event: EventFn | None) -> None:
        self.on_event = on_event
        self.failures = 0
        self._lock = threading.Lock()

    @staticmethod
    def of(owner: Any) -> "Events":
        """The Events of ``owner`` (a receiver or a pull server) for its ``on_event``, made on first use."""
        events = owner.__dict__.get("_events")
        if events is None:
            events = owner.__dict__.setdefault("_events", Events(owner.on_event))
        return events

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(kind, fields)
        except Exception as exc:  # noqa: BLE001 - the caller's callback: reported below, never fatal here
            with self._lock:
                self.failures += 1
                first = self.failures == 1
            if first and kind != "warning":
                self("warning", {"warning": f"the event callback failed on a {kind!r} event "
                                            f"({type(exc).__name__}: {exc}); later failures are only counted"})


class LiveConnections:
    """Who is connected now (``prefill --serve --metrics``: ``/connections`` and the
    ``muser_producer_connections`` gauge): one entry per open connection, from accept to close.
    A listener runs each connection on a thread of its own, and only that thread makes,
    changes (:meth:`note`) and drops its entry. ``state``: ``handshake`` (TLS, then the
    request and its checks), ``queued``, ``prefilling`` (admitted; the pack's header not
    ready yet), ``streaming``, ``probing``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, dict[str, Any]] = {}

    def enter(self, peer: str) -> None:
        with self._lock:
            self._open[threading.get_ident()] = {"peer": peer, "consumer": "", "state": "handshake",
                                                 "since_unix": time.time(), "link": None}

    def note(self, **fields: Any) -> None:
        """Change the calling connection's entry: ``consumer``, ``state``, or ``link`` (whose
        bytes written are its ``bytes_sent``)."""
        with self._lock:
            entry = self._open.get(threading.get_ident())
            if entry is not None:
                entry.update(fields)

    def leave(self) -> None:
        with self._lock:
            self._open.pop(threading.get_ident(), None)

    def snapshot(self) -> list[dict[str, Any]]:
        """The open connections, oldest first: consumer (its certificate's name; empty until
        the handshake passed), peer address, since (Unix time), age, state, bytes sent."""
        with self._lock:
            entries = [dict(e) for e in self._open.values()]
        now = time.time()
        out = []
        for e in sorted(entries, key=lambda e: e["since_unix"]):
            link = e.pop("link")
            out.append({**e, "since_unix": round(e["since_unix"], 3), "age_s": round(max(0.0, now - e["since_unix"]), 3),
                        "bytes_sent": link.bytes_out if link is not None else 0})
        return out

    def by_consumer(self) -> dict[str, int]:
        """How many connections each consumer has open now ("" while their handshake runs)."""
        counts: dict[str, int] = {}
        with self._lock:
            for e in self._open.values():
                counts[e["consumer"]] = counts.get(e["consumer"], 0) + 1
        return counts


def reject_and_linger(link: Link, code: str, message: str, *, live: bool, during: str) -> None:
    """Tell the peer ``Reject(code)`` (when its exchange is still ``live``), then let it read
    that before our close turns into a reset. Best effort: the peer may be gone (the caller
    has reported the refusal already)."""
    with contextlib.suppress(MuserError, OSError):
        if live:
            link.send(Reject(code, message), during)
        end = time.monotonic() + 0.5
        link.sock.settimeout(0.1)
        while time.monotonic() < end:
            try:
                if not link.sock.recv(1 << 16):
                    break
            except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionError):
                break  # the peer has gone
            except (OSError, ssl.SSLError):
                continue


class Listener:
    """The base of a TLS listener (module doc). A subclass sets ``alpn``, ``backlog`` and
    ``thread_name``, and defines :meth:`_connect` (the link for a connection whose handshake
    passed) and :meth:`_converse` (what happens on it). ``config`` has ``host``, ``port``,
    ``handshake_s`` and ``max_pending``. ``counters`` is the subclass's: the base counts
    ``connections``, and ``dropped`` and ``tls_failed`` where the subclass keeps them.
    ``live``: where the open connections are kept (:class:`LiveConnections`), if anywhere."""

    alpn = ""
    backlog = 128
    thread_name = "muser-conn"

    def __init__(self, config: Any, *, ctx: ssl.SSLContext, ledger_dir: Path, on_event: EventFn | None,
                 counters: dict[str, int], live: LiveConnections | None = None) -> None:
        self.config = config
        self.live = live
        self.ledger_dir = ledger_dir
        self.on_event = on_event
        self.counters = counters
        self._ctx = ctx
        self._lsock: socket.socket | None = None
        self.address: tuple[str, int] | None = None
        self._ledgers: dict[str, Ledger] = {}
        self._ledger_lock = threading.Lock()
        self._lock = threading.Lock()  # the counters and the connection bookkeeping
        self._stop = threading.Event()
        self._pending = 0
        self._threads: list[threading.Thread] = []
        if ledger_dir.exists():  # a torn or corrupt ledger: refuse to run at all
            for path in sorted(ledger_dir.glob("*.ledger")):
                self._ledger(path.name[: -len(".ledger")])

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.on_event is not None:  # a callback that raises is reported once (a warning event), not dropped
            Events.of(self)(kind, fields)

    def _note(self, **fields: Any) -> None:
        """Change this connection's entry in :attr:`live` (kept only where a listener keeps one)."""
        if self.live is not None:
            self.live.note(**fields)

    def _count(self, key: str) -> None:
        """Count one ``key`` where this listener keeps that counter (call with ``_lock`` held)."""
        if key in self.counters:
            self.counters[key] += 1

    def _ledger(self, key_id: str) -> Ledger:
        with self._ledger_lock:
            led = self._ledgers.get(key_id)
            if led is None:
                led = Ledger(self.ledger_dir, key_id).open()
                self._ledgers[key_id] = led
            return led

    def bind(self) -> tuple[str, int]:
        self._lsock = listen_socket(self.config.host, self.config.port, backlog=self.backlog)
        self.address = self._lsock.getsockname()[:2]
        return self.address

    def _listening(self) -> None:
        """Bind (unless bound) and say so."""
        if self._lsock is None:
            self.bind()
        assert self.address is not None
        self._emit("listening", address=format_hostport(*self.address), port=self.address[1])

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.stop()
        for led in self._ledgers.values():
            led.close()

    def _accept_loop(self) -> None:
        """Accept until :meth:`stop`, or until the listening socket was closed (a drain)."""
        lsock = self._lsock
        assert lsock is not None
        while not self._stop.is_set():
            try:
                if not select.select([lsock], [], [], 0.2)[0]:
                    continue
                sock, addr = lsock.accept()
            except (OSError, ValueError):
                if self._stop.is_set() or lsock.fileno() < 0:
                    return
                continue
            with self._lock:
                self.counters["connections"] += 1
                if self._pending >= self.config.max_pending:
                    self._count("dropped")
                    sock.close()
                    continue
                self._pending += 1
            t = threading.Thread(target=self._handle, args=(sock, addr), name=self.thread_name, daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    # -- one connection
    def _handle(self, sock: socket.socket, addr: tuple) -> None:
        peer = format_hostport(str(addr[0]), int(addr[1]))
        start = time.monotonic()
        if self.live is not None:
            self.live.enter(peer)
        try:
            tls = self._handshake(sock, peer)
            if tls is not None:
                link = self._connect(tls, start)
                self._note(link=link)
                try:
                    self._converse(link, peer, tls, start)
                finally:
                    link.close()
        except BaseException as exc:  # noqa: BLE001 - a connection thread must never die loudly
            self._emit("error", peer=peer, error=f"{type(exc).__name__}: {exc}")
        finally:
            if self.live is not None:
                self.live.leave()
            with self._lock:
                self._pending -= 1

    def _handshake(self, sock: socket.socket, peer: str) -> ssl.SSLSocket | None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames are written whole
            sock.settimeout(self.config.handshake_s)
            if _closed_before_tls(sock):  # `node check`'s reachability test, a port check: not a refusal
                sock.close()
                self._emit("reachability", peer=peer)
                return None
            # suppress_ragged_eofs=False: a TCP stream cut without TLS close_notify is a cut (75),
            # never mistaken for a clean close.
            tls = self._ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False,
                                        suppress_ragged_eofs=False)
            tls.do_handshake()
        except BaseException as exc:  # noqa: BLE001 - reported below; an interrupt goes on
            sock.close()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            with self._lock:
                self._count("tls_failed")
            self._emit("tls_failed", peer=peer, reason=str(map_error(exc, "in the TLS handshake")))
            return None
        if tls.selected_alpn_protocol() != self.alpn:
            self._emit("tls_failed", peer=peer, reason=f"client did not offer ALPN {self.alpn}")
            tls.close()
            return None
        return tls

    def _connect(self, tls: ssl.SSLSocket, start: float) -> Link:
        """The link for a connection whose handshake passed (``start``: when it was accepted)."""
        raise NotImplementedError

    def _converse(self, link: Link, peer: str, tls: ssl.SSLSocket, start: float) -> None:
        """What this listener does on one connection; the link is closed after it."""
        raise NotImplementedError


__all__ = ["EventFn", "Events", "Listener", "LiveConnections", "reject_and_linger"]


def _closed_before_tls(sock: socket.socket) -> bool:
    """Whether the peer closed its TCP connection without sending a byte (a reachability check:
    ``socket.create_connection(...).close()``), looked at without consuming anything. A peer
    silent past the socket's timeout raises it, as the handshake would: a refused handshake."""
    return sock.recv(1, socket.MSG_PEEK) == b""
