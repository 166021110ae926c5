"""The consumer side: listen, authenticate, verify as it streams, record, publish, acknowledge.

Contract of :class:`Receiver` (one per listening socket; Handoff V3, docs/handoff.md):
  * every TCP connection gets its own thread for the TLS handshake, bounded by the
    handshake timeout, so idle or half-open clients cannot starve a real producer;
    at most ``max_pending`` connections exist at once, the rest are closed at accept;
  * after the handshake, the peer certificate must not be revoked; then the connection
    waits for admission: ONE session runs at a time, up to ``queue`` wait (each at most
    ``queue_s``), others get ``Reject(busy)`` in place of ``Ready``;
  * a handoff header is checked in this order, before any payload byte is read: key id
    known and not revoked and bound to the certificate's name -> MAC (constant time) ->
    issued-at window -> declared size bound within ``max_payload`` -> not in the replay
    ledger;
  * payload bytes are verified as they arrive (kvpack header digest and model binding
    against the MAC'd header, every frame against the digest chain, the size bound) and
    go to a sink: a spool file next to the final path, or -- with ``out_stream`` -- the
    stream itself, each frame once it verified; at the Trailer: its MAC (chained to the
    header's) -> end frame verified, size and root digest equal to the trailer's ->
    ledger commit (durable) -> publish (file: fsync, rename, fsync dir; stream: forward
    the end frame) -> ``Ack``. A failure at any step rejects the handoff and leaves
    nothing at the final path, and nothing decodable downstream;
  * on a stream, a handoff that fails after forwarding bytes ends the receiver (the
    stream downstream cannot be continued): :meth:`serve` raises the failure;
  * at start, spool parts that dead receivers left in the destination are removed;
  * :meth:`Receiver.serve` returns the accepted handoffs (one with ``once``), raises
    TempFailure when ``timeout`` passes before a handoff started streaming, and raises
    LedgerError (fatal) when the ledger cannot be trusted;
  * :meth:`Receiver.drain` (SIGTERM, SIGHUP): accept no new connection, refuse every
    handoff not yet streaming (``busy``: its producer falls back or retries), let the one
    streaming finish (published and acknowledged, or refused as ever); then :meth:`serve`
    returns what was accepted and emits ``drained`` with the counts.

The probes' receiving side lives in :mod:`~muser_cli.handoff.probes`; the settings and the
record of an accepted handoff in :mod:`~muser_cli.handoff.push.receipt` (importable from here).
"""

from __future__ import annotations

import contextlib
import queue
import ssl
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

from muser_cli.errors import AuthError, MuserError, TempFailure, UsageError
from muser_cli.handoff.trust.certs import peer_common_name, peer_serial_hex
from muser_cli.handoff.push.clock import since_start, unix_of
from muser_cli.handoff.wire.header import check_window, verify_mac, verify_trailer_mac
from muser_cli.handoff.trust.ledger import Ledger, LedgerError, LedgerFull, Record
from muser_cli.handoff.link import Link, reject_error, server_context
from muser_cli.handoff.listener import EventFn, Listener, reject_and_linger
from muser_cli.handoff.trust.node import Identity
from muser_cli.handoff.trust.nodedir import note_peer
from muser_cli.handoff.push.payload import PayloadInspector
from muser_cli.handoff.probes import serve_probe_down, serve_probe_up
from muser_cli.handoff.wire.protocol import (
    ALPN, MAX_DATA_BYTES, PROTOCOL_VERSION, Ack, Connection, ConnectionClosed, Data, Go, Header, ProbeDown, ProbeUp,
    Ready, Reject, Role, State, Trailer,
)
from muser_cli.handoff.push.receipt import DEFAULT_MAX_PAYLOAD, Accepted, ReceiveConfig, stream_failure
from muser_cli.handoff.push.spool import (
    Destination, DownstreamGone, FileSink, Refusal, SpoolWorker, StreamSink, remove_stale_parts,
)


class Receiver(Listener):
    """The push lane's TLS listener (module doc); the accepting, the handshake and the ledgers
    are :class:`~muser_cli.handoff.listener.Listener`'s."""

    alpn, backlog, thread_name = ALPN, 128, "muser-conn"

    def __init__(
        self, identity: Identity, config: ReceiveConfig, *, ledger_dir: Path, destination: Destination | None = None,
        on_event: EventFn | None = None, out_stream: BinaryIO | None = None,
    ) -> None:
        if out_stream is None and destination is None:
            raise UsageError("a receiver needs a destination or an output stream")
        if out_stream is not None and not config.once:
            raise UsageError("a receiver that streams to its output accepts one handoff (--once)")
        self.identity = identity
        self.destination = destination or Destination()
        self.out_stream = out_stream
        super().__init__(config, ctx=server_context(identity), ledger_dir=ledger_dir, on_event=on_event,
                         counters={"connections": 0, "tls_failed": 0, "rejected": 0, "accepted": 0, "dropped": 0,
                                   "turned_away": 0})
        self._stream_failure: BaseException | None = None
        self._streaming = 0  # sessions past Go
        self._admit = threading.Lock()
        self._finish_lock = threading.Lock()
        self._results: queue.Queue[Any] = queue.Queue()
        self._waiting = 0
        self._committed = 0  # accepted but not yet reported (ack in flight)
        self._closed_for_new = False  # once: a handoff was accepted; timeout: gave up
        self._draining = threading.Event()  # drain(): finish what streams, start nothing new
        self.stale_removed = self._remove_stale_parts()

    # -- setup
    def _remove_stale_parts(self) -> list[Path]:
        """Spool parts that receivers killed mid-handoff left in our destination: removed, never published."""
        scope = self.destination.spool_scope() if self.out_stream is None else None
        if scope is None:
            return []
        directory, names = scope
        # No live session holds a spool part longer than a session may last.
        return remove_stale_parts(directory, names, max_age_s=self.config.session_s + 60)

    # -- main loop
    def serve(self, *, on_accept: Callable[[Accepted], None] | None = None,
              drain: threading.Event | None = None) -> list[Accepted]:
        """Run until done (module doc); once ``drain`` is set, :meth:`drain`."""
        if self._lsock is None:
            self.bind()
        if self.stale_removed:
            self._emit("stale_removed", count=len(self.stale_removed), paths=[str(p) for p in self.stale_removed])
        self._listening()
        acceptor = threading.Thread(target=self._accept_loop, name="muser-accept", daemon=True)
        acceptor.start()
        deadline = None if self.config.timeout is None else time.monotonic() + self.config.timeout
        accepted: list[Accepted] = []
        try:
            while not self._stop.is_set():
                wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
                if drain is not None and drain.is_set() and not self._draining.is_set():
                    self.drain()
                if self._draining.is_set() and self._drained():
                    return self._report_drained(accepted)
                try:
                    item = self._results.get(timeout=wait)
                except queue.Empty:
                    if deadline is not None and time.monotonic() >= deadline:
                        with self._finish_lock:
                            if self._committed == 0 and self._streaming == 0 and self._results.empty():
                                self._closed_for_new = True
                                if accepted:  # serving: the time is up, and it was not wasted
                                    return accepted
                                n = self.counters["rejected"]
                                extra = f" ({n} handoff(s) refused)" if n else ""
                                raise TempFailure(
                                    f"no handoff accepted within {self.config.timeout:g} s{extra}",
                                    hint="fall back to local prefill",
                                )
                    continue
                if isinstance(item, BaseException):
                    raise item
                accepted.append(item)
                if on_accept is not None:
                    on_accept(item)
                if self.config.once:
                    return self._report_drained(accepted) if self._draining.is_set() else accepted
            return accepted
        finally:
            self.stop()
            acceptor.join(timeout=1.0)

    def drain(self) -> None:
        """Stop listening and admitting; what streams now finishes (module doc)."""
        self._draining.set()
        if self._lsock is not None:
            with contextlib.suppress(OSError):
                self._lsock.close()

    def _report_drained(self, accepted: list[Accepted]) -> list[Accepted]:
        self._emit("drained", accepted=len(accepted), payload_bytes=sum(a.payload_bytes for a in accepted),
                   **{k: self.counters[k] for k in ("rejected", "turned_away", "tls_failed")})
        return accepted

    def _drained(self) -> bool:
        with self._finish_lock, self._lock:
            return self._streaming == 0 and self._committed == 0 and self._results.empty()

    def stop(self) -> None:
        super().stop()
        if self._lsock is not None:
            with contextlib.suppress(OSError):
                self._lsock.close()

    # -- one connection
    def _connect(self, tls: ssl.SSLSocket, start: float) -> Link:
        return Link(tls, Connection(Role.RECEIVER), idle_s=self.config.idle_s, deadline=start + self.config.session_s)

    def _converse(self, link: Link, peer: str, tls: ssl.SSLSocket, start: float) -> None:
        der = link.sock.getpeercert(binary_form=True) or b""
        cn = peer_common_name(der) if der else ""
        who = f"{peer} ({cn})" if cn else peer
        if der and peer_serial_hex(der) in self.identity.revoked_serials():
            self._refuse(link, who, Refusal("auth", "this certificate was revoked"))
            return
        with self._lock:
            if self._waiting >= self.config.queue:
                busy = True
            else:
                busy = False
                self._waiting += 1
        if busy:
            self._refuse(link, who, Refusal("busy", "receiver busy: too many producers waiting"))
            return
        admitted = False
        try:
            until = time.monotonic() + self.config.queue_s
            while (not self._stop.is_set() and not self._closed_for_new and not self._draining.is_set()
                   and time.monotonic() < until):
                if self._admit.acquire(timeout=0.1):
                    admitted = True
                    break
        finally:
            with self._lock:
                self._waiting -= 1
        if not admitted or self._closed_for_new or self._draining.is_set():
            if admitted:
                self._admit.release()
            why = "receiver finished (it accepted its one handoff)" if self._closed_for_new else "receiver busy with another producer"
            if self._draining.is_set():
                why = self._turn_away()
            self._refuse(link, who, Refusal("busy", why))
            return
        try:
            self._session(link, who, cn, start, address=peer)
        finally:
            self._admit.release()
            if self._stream_failure is not None:
                failure, self._stream_failure = self._stream_failure, None
                self._results.put(failure)

    def _session(self, link: Link, who: str, cn: str, start: float, *, address: str | None = None) -> None:
        info = {
            "v": PROTOCOL_VERSION, "node": self.identity.name, "max_payload": self.config.max_payload,
            "window_s": self.config.window_s, "max_data": MAX_DATA_BYTES, "probe_max_s": self.config.probe_max_s,
            "idle_s": self.config.idle_s,
        }
        try:
            link.send(Ready(info), "sending Ready")
            while True:
                event = link.next_event("waiting for a request")
                if isinstance(event, (ConnectionClosed, Reject)):
                    return
                if isinstance(event, Header):
                    self._handoff(link, event, who, cn, start, seen_from=address)
                    return
                if isinstance(event, ProbeUp):
                    self._probe_up(link, event.seconds)
                elif isinstance(event, ProbeDown):
                    self._probe_down(link, event.seconds)
        except Refusal as refusal:
            self._refuse(link, who, refusal)
        except MuserError as exc:
            self._emit("aborted", peer=who, reason=str(exc))
            with contextlib.suppress(MuserError, OSError):
                if link.conn.state not in (State.DONE, State.CLOSED):
                    code = "timeout" if isinstance(exc, TempFailure) else "protocol"
                    link.send(Reject(code, str(exc)))

    def _turn_away(self, *, locked: bool = False) -> str:
        """Count a handoff refused because the receiver is draining; the reason it is told."""
        if locked:
            self.counters["turned_away"] += 1
        else:
            with self._lock:
                self.counters["turned_away"] += 1
        return "receiver is shutting down"

    def _refuse(self, link: Link, who: str, refusal: Refusal) -> None:
        with self._lock:
            self.counters["rejected"] += 1
        self._emit("rejected", peer=who, code=refusal.code, reason=refusal.message)
        reject_and_linger(link, refusal.code, refusal.message, live=link.conn.state not in (State.DONE, State.CLOSED),
                          during="sending a rejection")
        if refusal.fatal is not None:
            self._results.put(refusal.fatal)

    # -- the handoff proper
    def _check_header(self, event: Header, cn: str) -> tuple[Ledger, bytes]:
        h = event.header
        assert h is not None
        key = self.identity.key(h.key_id)  # exactly one lookup: no other key is tried
        if key is None:
            raise Refusal("auth", f"unknown key id {h.key_id}")
        if key.revoked:
            raise Refusal("auth", f"key id {h.key_id} is revoked")
        try:
            verify_mac(key.secret, event.raw, event.mac)
        except AuthError as exc:
            raise Refusal("auth", str(exc)) from None
        if key.peer != cn or h.sender != cn:
            raise Refusal("auth", f"key id {h.key_id} belongs to {key.peer!r}; certificate is {cn!r}, header says {h.sender!r}")
        try:
            check_window(h, now_ms=int(time.time() * 1000), window_s=self.config.window_s)
        except AuthError as exc:
            raise Refusal("stale", str(exc)) from None
        if h.size_bound > self.config.max_payload:
            raise Refusal("too_large", f"declared size bound {h.size_bound} bytes exceeds this receiver's maximum {self.config.max_payload}")
        try:
            ledger = self._ledger(h.key_id)
            if ledger.seen(h.handoff_id):
                raise Refusal("replay", f"handoff {h.handoff_id} was already accepted")
        except LedgerError as exc:
            raise Refusal("storage", "receiver's replay ledger is unusable", fatal=exc) from None
        return ledger, key.secret

    def _handoff(self, link: Link, event: Header, who: str, cn: str, start: float, *,
                 seen_from: str | None = None) -> None:
        """One handoff after its header arrived. ``seen_from`` (the push lane: the sender's
        address): once it is accepted, the sender is recorded as seen (``node ls``) -- before
        the record is reported, so a ``--once`` receiver that exits on it has written it."""
        h = event.header
        assert h is not None
        ledger, secret = self._check_header(event, cn)
        if self._closed_for_new:
            raise Refusal("busy", "receiver finished")
        if self._draining.is_set():
            raise Refusal("busy", self._turn_away())
        final = None if self.out_stream is not None else self.destination.final_path(h.handoff_id)
        try:
            sink: FileSink | StreamSink = StreamSink(self.out_stream) if final is None else FileSink(final)
        except OSError as exc:
            raise Refusal("storage", f"cannot open a spool file ({exc.strerror or exc})") from None
        try:
            worker = SpoolWorker(PayloadInspector(expect=h), sink, stall_s=self.config.idle_s)
        except BaseException:
            sink.discard()  # no part is left behind by a receiver that could not start its worker
            raise
        published = False
        t_first = t_last = None
        commit_s = 0.0
        with self._lock:
            if self._draining.is_set():  # nothing new starts streaming once drain() was called
                worker.stop()
                sink.discard()
                raise Refusal("busy", self._turn_away(locked=True))
            self._streaming += 1
        try:
            link.send(Go(), "sending Go")
            self._emit("streaming", peer=who, handoff_id=h.handoff_id, size_bound=h.size_bound)
            while True:
                ev = link.next_event(f"receiving the payload ({link.conn.payload_seen} bytes so far)")
                if isinstance(ev, Data):
                    t_last = time.monotonic()
                    if t_first is None:
                        t_first = t_last
                    worker.put(ev.data)
                elif isinstance(ev, Trailer):
                    break
                elif isinstance(ev, Reject):
                    raise reject_error(ev, "sender")
                elif isinstance(ev, ConnectionClosed):
                    raise TempFailure(f"sender went away after {link.conn.payload_seen} payload bytes "
                                      f"({worker.inspector.frames} frames verified)")
                # Pulse: the producer is alive; the link's idle timer was reset by reading it
            try:
                verify_trailer_mac(secret, event.mac, ev.raw, ev.mac)
            except AuthError as exc:
                raise Refusal("auth", str(exc)) from None
            payload = worker.finish()
            t = ev.trailer
            assert t is not None
            if t.handoff_id != h.handoff_id:
                raise Refusal("data", "the trailer names another handoff id")
            if t.payload_size != payload.size or t.root_digest != payload.root_digest:
                raise Refusal("data", f"trailer declares {t.payload_size} bytes with root {t.root_digest[:16]}…; "
                                      f"received {payload.size} bytes with root {payload.root_digest[:16]}…")
            with self._finish_lock:
                if self._closed_for_new:
                    raise Refusal("timeout", "receiver stopped waiting")
                record = Record(h.handoff_id, h.issued_at_ms, int(time.time() * 1000), payload.size, payload.root_digest)
                try:
                    commit_s = ledger.commit(record)
                except AuthError as exc:
                    raise Refusal("replay", str(exc)) from None
                except LedgerFull as exc:
                    raise Refusal("storage", str(exc)) from None
                except LedgerError as exc:
                    raise Refusal("storage", "receiver's replay ledger failed", fatal=exc) from None
                try:
                    sink.publish()  # file: fsync, rename, fsync dir; stream: forward the end frame
                except DownstreamGone as exc:
                    raise Refusal("aborted", exc.strerror or "the reader of the forwarded stream went away") from None
                except OSError as exc:
                    raise Refusal("storage", f"cannot publish the payload ({exc.strerror or exc})") from None
                published = True
                self._committed += 1
                if self.config.once:
                    self._closed_for_new = True
        except BaseException as exc:
            worker.stop()  # let it finish forwarding what verified, then judge what downstream holds
            if sink.forwarded and not published:  # downstream holds a stream without an end frame: final
                self._closed_for_new = True
                self._stream_failure = stream_failure(exc, worker.inspector.frames)
            raise
        finally:
            worker.stop()  # nothing writes after this
            if not published:
                sink.discard()
            with self._lock:
                self._streaming -= 1
        accepted = Accepted(
            handoff_id=h.handoff_id, key_id=h.key_id, sender=h.sender, peer=who, payload_bytes=payload.size,
            root_digest=payload.root_digest, model_fingerprint=h.model_fingerprint,
            path=str(final) if final is not None else "-", ledger_commit_ms=commit_s * 1000,
            elapsed_s=time.monotonic() - start, frames=worker.inspector.frames,
            first_byte_s=since_start(t_first), last_byte_s=since_start(t_last),
            first_byte_unix=unix_of(t_first), last_byte_unix=unix_of(t_last),
        )
        try:
            link.send(Ack({"handoff_id": h.handoff_id, "bytes": payload.size, "root_digest": payload.root_digest,
                           "ledger_commit_ms": round(commit_s * 1000, 3), "node": self.identity.name}), "sending Ack")
        except MuserError as exc:
            accepted.acked = False
            self._emit("ack_failed", peer=who, handoff_id=h.handoff_id, reason=str(exc))
        with self._lock:
            self.counters["accepted"] += 1
        if seen_from is not None:  # the sender authenticated: its certificate, header and trailer MACs
            failed = note_peer(self.identity, cn, role="producer", address=seen_from, key_id=h.key_id, via="push")
            if failed:  # bookkeeping only: the handoff stands
                self._emit("warning", peer=who, warning=f"could not record when {cn} was seen: {failed}")
        self._emit("accepted", peer=who, **{k: v for k, v in accepted.to_json().items() if k != "peer"})
        with self._finish_lock:
            self._committed -= 1
            self._results.put(accepted)

    # -- probes
    def _probe_up(self, link: Link, seconds: float) -> None:
        serve_probe_up(link, min(seconds, self.config.probe_max_s))

    def _probe_down(self, link: Link, seconds: float) -> None:
        serve_probe_down(link, min(seconds, self.config.probe_max_s))


def receive(
    identity: Identity, config: ReceiveConfig, *, ledger_dir: Path, destination: Destination | None = None,
    out_stream: BinaryIO | None = None, on_event: EventFn | None = None,
    on_accept: Callable[[Accepted], None] | None = None, drain: threading.Event | None = None,
) -> list[Accepted]:
    """Run a receiver. With ``out_stream`` (stdout; needs ``once``) the payload streams
    there, each frame once it verified and the end frame only after the trailer verified
    and the ledger record is durable; nothing is written to disk but the ledger. Once
    ``drain`` is set it drains (:meth:`Receiver.drain`) and returns what it accepted."""
    if destination is not None and not config.once and destination.file is not None:
        raise UsageError("without --once, -o must be a directory")
    receiver = Receiver(identity, config, ledger_dir=ledger_dir, destination=destination, on_event=on_event,
                        out_stream=out_stream)
    try:
        return receiver.serve(on_accept=on_accept, drain=drain)
    finally:
        receiver.close()


__all__ = ["DEFAULT_MAX_PAYLOAD", "Accepted", "Destination", "EventFn", "ReceiveConfig", "Receiver", "receive"]
