"""The resident producer's sockets: accept enrolled consumers, check their requests, queue,
and answer each with a Handoff V3 stream whose frames leave as the chunks are computed.

Contract of :class:`PullServer` (pull lane; the exchange is :mod:`muser_cli.handoff.wire.pull_protocol`):
  * every TCP connection gets its own thread for the TLS 1.3 handshake (ALPN
    ``muser-pull/1``, client certificate from the consumer's private CA required), bounded
    by the handshake timeout; at most ``max_pending`` connections at once;
  * the consumer's certificate serial must not be revoked and its CN must be the consumer
    whose context the handshake used (one this producer joined); then, within
    ``request_s`` of TLS up (a deadline for the whole frame, however slowly its bytes come), one ``Request``: key id known, not
    revoked and issued to this producer -> MAC (constant time) -> the request names the
    certificate's consumer -> issued-at window -> request id not in the replay ledger
    (then recorded durably: a request id is served at most once) -> the compute's own
    checks (model and tokenizer fingerprints, dtype, prompt length) -- all before any
    prefill work;
  * a producer that joined several consumers holds one TLS context per consumer (that
    consumer's CA the only trust anchor): the consumer's server name picks it, and every
    check below uses that consumer's keyring only;
  * a request with a budget (``budget_ms``, issue #39) is answered at once: ``Promise`` (when it
    is expected to start, the compute's estimate, the queue before it, the prefill rates) or,
    when it would not finish in time, that same ``Promise`` (what it expects) then
    ``Reject(late)``; its deadline orders it among the waiting
    (:class:`~muser_cli.handoff.pull.admission.Admission`), and one still waiting when its budget
    ran out is refused ``late`` then, nothing computed;
  * admission: ONE request computes at a time -- or, when the compute says it batches
    (``max_concurrent`` > 1: vLLM), up to that many, which the compute runs together --;
    up to ``max_queue`` more wait per consumer (told their place with ``Queued``), taking
    turns round-robin between consumers; a full queue answers ``Reject(busy)`` at once;
  * the admitted request gets ``Serving``, then the V3 sender side: its header goes out
    as soon as the compute has written the kvpack header, each frame as soon as its chunk
    is written, then the MAC'd trailer; a consumer that goes away costs only its request
    (the compute's pipe breaks and it stops);
  * a ``Probe`` request (``muser probe-link``, ``node check``) passes the same checks up to
    the replay ledger (its own MAC context) and the same admission, alone (no request
    computes while a probe runs); then this producer is
    the V3 receiver for the probes: ``Ready``, then ``ProbeUp``/``ProbeDown`` answered as
    ``receive --listen`` answers them (each capped at ``probe_max_s``), until the consumer
    closes; anything else on it is refused (``protocol``);
  * :meth:`serve` runs until :meth:`stop` (SIGTERM, SIGHUP): it accepts no new connection,
    the running request finishes first, the waiting ones are told ``busy`` (counted in
    ``counters["turned_away"]``).
"""

from __future__ import annotations

import contextlib
import math
import os
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from muser_cli.errors import AuthError, KVPackError, MuserError, TempFailure
from muser_cli.handoff.link import DEFAULT_IDLE_S, Link, continue_as_v3
from muser_cli.handoff.listener import EventFn, Listener, LiveConnections, reject_and_linger
from muser_cli.handoff.probes import serve_probe_down, serve_probe_up
from muser_cli.handoff.pull.admission import Admission, Turn
from muser_cli.handoff.pull.compute import Compute, ComputeDefaults, with_defaults
from muser_cli.handoff.pull.identities import Identities
from muser_cli.handoff.push.sender import PackSource, prepare_handoff, transmit_over
from muser_cli.handoff.trust.certs import peer_common_name, peer_serial_hex
from muser_cli.handoff.trust.ledger import LedgerError, Record
from muser_cli.handoff.trust.node import Identity
from muser_cli.handoff.trust.nodedir import note_peer
from muser_cli.handoff.wire.header import DEFAULT_WINDOW_S
from muser_cli.handoff.wire.protocol import (
    MAX_DATA_BYTES, PROTOCOL_VERSION, ConnectionClosed, ProbeDown, ProbeUp, Ready, Reject, Role, State,
)
from muser_cli.handoff.wire.pull_protocol import (
    ALPN_PULL, MAC_CONTEXT, PROBE_MAC_CONTEXT, Probe, ProbeRequest, Promise, PullConnection, PullRequest, PullState,
    Queued,
    Request, Serving, Side, check_fresh, verify_request_mac,
)
from muser_cli.handoff.wire.refusal import Refusal

#: How often a queued consumer is told again that its request still waits (well inside the
#: consumer's idle limit, DEFAULT_IDLE_S, so that only its own --timeout ends its wait).
QUEUED_EVERY_S = 5.0


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 0
    max_queue: int = 4
    window_s: float = DEFAULT_WINDOW_S
    handshake_s: float = 10.0
    request_s: float = 10.0  # TLS up -> the whole Request frame in (a deadline, not per read)
    idle_s: float = DEFAULT_IDLE_S
    session_s: float = 3600.0
    max_pending: int = 64
    probe_max_s: float = 10.0  # the longest one probe direction runs, whatever the consumer asks


class PullServer(Listener):
    """The pull lane's TLS listener (module doc); the accepting, the handshake and the ledgers
    are :class:`~muser_cli.handoff.listener.Listener`'s."""

    alpn, backlog, thread_name = ALPN_PULL, 64, "muser-pull"

    def __init__(self, identity: Identity, config: ServeConfig, *, ledger_dir: Path, compute: Compute,
                 on_event: EventFn | None = None, more: list[Identity] | None = None,
                 live: LiveConnections | None = None, keys_dir: Path | None = None) -> None:
        """``identity``: the (first) consumer joined; ``more``: the further ones (round-robin);
        ``live``: where its open connections are kept (a new :class:`LiveConnections` if none);
        ``keys_dir``: the node directory they came from, looked at again at each handshake (a
        consumer joined while this server runs is served; None: these identities only)."""
        self.identity = identity
        self.compute = with_defaults(compute)
        self._idents = Identities([identity, *(more or [])], keys_dir)
        super().__init__(config, ctx=self._idents.default, ledger_dir=ledger_dir, on_event=on_event,
                         counters={"connections": 0, "served": 0, "refused": 0, "failed": 0, "turned_away": 0,
                                   "tls_failed": 0},
                         live=live or LiveConnections())
        self._admit = Admission(self.compute.max_concurrent)
        self._waiting = 0
        self._waiting_by: dict[str, int] = {}  # consumer -> its requests waiting (each bounded by max_queue)

    def serve(self) -> None:
        self._listening()
        self._accept_loop()
        assert self._lsock is not None
        with contextlib.suppress(OSError):
            self._lsock.close()
        for t in self._threads:  # the running request finishes; waiting ones are told busy
            t.join(timeout=self.config.session_s)

    # -- one connection
    def _connect(self, tls: ssl.SSLSocket, start: float) -> Link:
        return Link(tls, PullConnection(Side.PRODUCER), idle_s=self.config.request_s,
                    deadline=time.monotonic() + self.config.session_s)

    def _converse(self, link: Link, peer: str, tls: ssl.SSLSocket, start: float) -> None:
        self._session(link, peer, self._idents.of(tls))

    def _turn_away(self) -> Refusal:
        """A request refused because the server is stopping (counted: the summary says how many)."""
        with self._lock:
            self.counters["turned_away"] += 1
        return Refusal("busy", "producer is shutting down")

    def _refuse(self, link: Link, who: str, refusal: Refusal, req: PullRequest | ProbeRequest | None,
                probe: bool = False) -> None:
        with self._lock:
            self.counters["refused"] += 1
        fields: dict[str, Any] = {"request_id": req.request_id if req else None,
                                  "key_id": req.key_id if req else None}
        if probe or isinstance(req, ProbeRequest):
            self._emit("probe", peer=who, outcome=refusal.code, reason=refusal.message, **fields)
        else:
            self._emit("request", peer=who, outcome=refusal.code, reason=refusal.message, **fields,
                       tokens=len(req.token_ids) if req else None)
        conn = link.conn  # the peer may be gone: the refusal is in the event above
        live = (conn.state not in (PullState.SERVING, PullState.CLOSED) if isinstance(conn, PullConnection)
                else conn.state not in (State.DONE, State.CLOSED))
        reject_and_linger(link, refusal.code, refusal.message, live=live, during="sending a refusal")

    def _check(self, event: Request | Probe, cn: str, peer: str = "",
               identity: Identity | None = None) -> PullRequest | ProbeRequest:
        identity = identity or self.identity  # the consumer whose CA the TLS handshake used
        req = event.request if isinstance(event, Request) else event.probe
        assert req is not None
        key = identity.key(req.key_id)  # exactly one lookup, in that consumer's keyring only
        if key is None:
            raise Refusal("auth", f"unknown key id {req.key_id}: this producer's keyring for consumer "
                                  f"{identity.consumer!r} does not hold it (the bundle made with it was not joined here)")
        if key.revoked:
            raise Refusal("auth", f"key id {req.key_id} is revoked")
        try:
            verify_request_mac(key.secret, event.raw, event.mac,
                               context=MAC_CONTEXT if isinstance(event, Request) else PROBE_MAC_CONTEXT)
        except AuthError as exc:
            raise Refusal("auth", str(exc)) from None
        if key.peer != identity.name or cn != identity.consumer or req.consumer != cn:
            raise Refusal("auth", f"key id {req.key_id} is not this producer's key for {cn!r} "
                                  f"(request names {req.consumer!r})")
        try:
            check_fresh(req, now_ms=int(time.time() * 1000), window_s=self.config.window_s)
        except AuthError as exc:
            raise Refusal("stale", str(exc)) from None
        try:
            ledger = self._ledger(req.key_id)
            now = int(time.time() * 1000)
            ledger.commit(Record(req.request_id, req.issued_at_ms, now, len(event.raw), ""))
        except AuthError:
            raise Refusal("replay", f"request {req.request_id} was already served") from None
        except LedgerError as exc:
            raise Refusal("storage", f"producer's replay ledger is unusable ({exc})") from None
        # The consumer authenticated (a fresh, verified, first-time request): when it was last seen.
        failed = note_peer(identity, cn, role="consumer", address=peer, key_id=req.key_id,
                           via="pull" if isinstance(req, PullRequest) else "probe")
        if failed:
            self._emit("error", peer=peer, error=f"could not record when {cn} was seen: {failed}")
        return req

    def _session(self, link: Link, peer: str, identity: Identity | None = None) -> None:
        identity = identity or self.identity
        der = link.sock.getpeercert(binary_form=True) or b""
        cn = peer_common_name(der) if der else ""
        self._note(consumer=cn)
        who = f"{peer} ({cn})" if cn else peer
        req: PullRequest | ProbeRequest | None = None
        probe = False
        try:
            if der and peer_serial_hex(der) in identity.revoked_serials():
                raise Refusal("auth", "this certificate was revoked")
            event = self._first_frame(link)
            t_read = time.monotonic()  # the request is in: a budget counts from here
            if isinstance(event, (Reject, ConnectionClosed)):
                return
            assert isinstance(event, (Request, Probe))
            probe = isinstance(event, Probe)
            req = self._check(event, cn, peer, identity)
            if isinstance(req, PullRequest):
                resolved = self.compute.check(req)
                if resolved is not None:  # text mode: the request with this producer's token ids
                    req = resolved
                if not req.token_ids:
                    raise Refusal("data", "this producer does not tokenize text prompts; send token ids")
            if self._stop.is_set():
                raise self._turn_away()
            self._admitted(link, who, req, identity, t_read)
        except Refusal as refusal:
            self._refuse(link, who, refusal, req, probe)
        except MuserError as exc:
            if not probe:  # the summary's "failed" counts requests, as the log's "failed" lines do
                with self._lock:
                    self.counters["failed"] += 1
            self._emit("probe" if probe else "request", peer=who, outcome="failed", reason=str(exc),
                       request_id=req.request_id if req else None)

    def _first_frame(self, link: Link) -> object:
        """The consumer's first frame (its Request or Probe), whole within ``request_s`` of
        TLS up: a deadline for the frame, not an idle timeout per read, so a client that
        trickles its request a byte at a time is dropped at ``request_s`` like a silent one."""
        session_end = link.deadline
        link.deadline = min(session_end or float("inf"), time.monotonic() + self.config.request_s)
        try:
            return link.next_event("waiting for the request")
        except TempFailure:
            raise TempFailure(f"no whole request within {self.config.request_s:g} s of the TLS handshake "
                              f"({link.bytes_in} bytes came)") from None
        finally:
            link.deadline = session_end

    def _promise(self, link: Link, who: str, req: PullRequest, t_read: float) -> tuple[float, float | None]:
        """The request's deadline (monotonic; inf: none) and expected compute; to a request with
        a budget, the answer at once: ``Promise``, or ``Refusal("late")`` (module doc)."""
        cost = self.compute.estimate(req)
        if req.budget_ms is None:
            return math.inf, cost
        budget = req.budget_ms / 1000
        due = t_read + budget
        start, ahead = self._admit.expected_start(req.consumer, deadline=due, cost_s=cost)
        start += time.monotonic() - t_read
        compute = cost or 0.0
        fields: dict[str, Any] = {"peer": who, "request_id": req.request_id, "consumer": req.consumer,
                                  "start_s": round(start, 6), "compute_s": round(compute, 6),
                                  "budget_s": round(budget, 6), "queued": ahead, "rates": self.compute.rates()}
        promise = Promise(round(start * 1000), round(compute * 1000), ahead, fields["rates"])
        if start + compute > budget:
            self._emit("promise", outcome="late", **fields)
            # what it expects, then that it misses the budget: the consumer learns this producer's
            # queue from a refusal too (its next prediction counts it, no second round trip)
            link.send(promise, "saying what it expects")
            raise Refusal("late", f"not in time: this producer expects to start in {start * 1000:.0f} ms "
                                  f"({ahead} request(s) before it) and to compute for {compute * 1000:.0f} ms; "
                                  f"the request's budget is {req.budget_ms} ms")
        link.send(promise, "promising a start")
        self._emit("promise", outcome="promised", **fields)
        return due, cost

    def _admitted(self, link: Link, who: str, req: PullRequest | ProbeRequest, identity: Identity,
                  t_read: float | None = None) -> None:
        probe, consumer = isinstance(req, ProbeRequest), req.consumer
        due, cost = math.inf, None
        if isinstance(req, PullRequest):
            due, cost = self._promise(link, who, req, time.monotonic() if t_read is None else t_read)
        if not self._admit.enter(probe, who=consumer, deadline=due, cost_s=cost):
            with self._lock:
                mine = self._waiting_by.get(consumer, 0)
                place = mine + 1
                if place > self.config.max_queue:
                    raise Refusal("busy", f"producer busy: {mine} request(s) already waiting from {consumer} "
                                          f"(--max-queue {self.config.max_queue} per consumer)")
                self._waiting += 1
                self._waiting_by[consumer] = place
            try:
                self._note(state="queued")
                link.send(Queued(place), "telling the consumer its place")
                admitted = self._wait_queued(link, probe, consumer, place, due=due, cost_s=cost)
                if admitted is None:  # it left while it waited: dropped before any work
                    with self._lock:
                        self.counters["failed"] += 1
                    self._emit("probe" if probe else "request", peer=who, outcome="failed",
                               reason=f"the consumer left while queued (place {place}): nothing computed",
                               request_id=req.request_id, key_id=req.key_id, consumer=consumer)
                    return
                if not admitted and not self._stop.is_set() and time.monotonic() >= due:
                    raise Refusal("late", f"not in time: the request's budget ({req.budget_ms} ms) ran out while "
                                          f"it waited (place {place}); nothing computed")
                if not admitted:
                    raise self._turn_away()
            finally:
                with self._lock:
                    self._waiting -= 1
                    self._waiting_by[consumer] -= 1
                    if not self._waiting_by[consumer]:
                        del self._waiting_by[consumer]
        try:
            self._note(state="probing" if probe else "prefilling")
            if isinstance(req, ProbeRequest):
                self._probe(link, who, req, identity)
                return
            self._emit("admitted", peer=who, request_id=req.request_id, key_id=req.key_id, tokens=len(req.token_ids),
                       consumer=consumer, queue=self._admit.waiting(),
                       **({"budget_ms": req.budget_ms} if req.budget_ms is not None else {}))
            self._stream(link, who, req, identity, self._admit.turn())
        finally:
            self._admit.leave(probe)

    def _wait_queued(self, link: Link, probe: bool, consumer: str, place: int, *, due: float = math.inf,
                     cost_s: float | None = None) -> bool | None:
        """Wait for a turn while telling the consumer, every :data:`QUEUED_EVERY_S`, that its
        request still waits (``Queued`` again: its reads never go idle, so its own ``--timeout``
        is what ends its wait). True: admitted; False: the server is stopping; None: the consumer
        left (closed, or sent anything, which a waiting consumer never does)."""
        import select

        gone, done = threading.Event(), threading.Event()

        def keep_alive() -> None:
            next_at = time.monotonic() + QUEUED_EVERY_S
            while not done.wait(0.2):
                try:
                    if select.select([link.sock], [], [], 0)[0]:
                        gone.set()
                        return
                    if time.monotonic() >= next_at:
                        link.send(Queued(place), "telling the consumer it still waits")
                        next_at += QUEUED_EVERY_S
                except (MuserError, OSError, ValueError):
                    gone.set()
                    return

        watcher = threading.Thread(target=keep_alive, name="muser-queued", daemon=True)
        watcher.start()
        try:
            admitted = self._admit.wait(probe, lambda: self._stop.is_set() or gone.is_set() or time.monotonic() >= due,
                                        who=consumer, deadline=due, cost_s=cost_s)
        finally:
            done.set()
            watcher.join()
        if gone.is_set():
            if admitted:
                self._admit.leave(probe)
            return None
        return admitted

    def _probe(self, link: Link, who: str, req: ProbeRequest, identity: Identity) -> None:
        """Answer the consumer's link probes as a V3 receiver (module doc)."""
        t0 = time.monotonic()
        link.send(Serving(), "admitting the probe")
        continue_as_v3(link, Role.RECEIVER)
        link.idle_s = self.config.idle_s
        cap = min(self.config.probe_max_s, req.probe_ms / 1000)
        info = {"v": PROTOCOL_VERSION, "node": identity.name, "max_payload": 0, "window_s": self.config.window_s,
                "max_data": MAX_DATA_BYTES, "probe_max_s": cap, "idle_s": self.config.idle_s}
        fields: dict[str, Any] = {"peer": who, "request_id": req.request_id, "key_id": req.key_id,
                                  "consumer": req.consumer}
        # The probe holds the admission: it gets one up and one down probe, and a deadline to match.
        link.deadline = min(link.deadline or float("inf"), time.monotonic() + 2 * cap + 20.0)
        outcome, reason, done = "failed", "", 0
        try:
            link.send(Ready(info), "sending Ready for the probe")
            while True:
                try:
                    event = link.next_event("waiting for a probe")
                except TempFailure:
                    if not done:
                        raise
                    event = ConnectionClosed()  # a consumer that left after probing ended it
                if isinstance(event, (ConnectionClosed, Reject)):
                    outcome = "probed" if done else "failed"
                    reason = "" if done else "the consumer left without probing"
                    break
                if done >= 2:
                    reason = "more than one up and one down probe on one probe request"
                    with contextlib.suppress(MuserError, OSError):
                        link.send(Reject("protocol", reason), "refusing")
                    break
                done += 1
                if isinstance(event, ProbeUp):
                    got = serve_probe_up(link, min(event.seconds, cap))
                    fields.update(up_bytes=got["bytes"], up_s=round(got["seconds"], 6))
                elif isinstance(event, ProbeDown):
                    got = serve_probe_down(link, min(event.seconds, cap))
                    fields.update(down_bytes=got["bytes"], down_s=round(got["seconds"], 6))
                else:
                    reason = f"a {type(event).__name__} on a connection admitted for a link probe"
                    with contextlib.suppress(MuserError, OSError):
                        link.send(Reject("protocol", reason), "refusing")
                    break
        except MuserError as exc:
            reason = str(exc)
        self._emit("probe", outcome=outcome, total_s=round(time.monotonic() - t0, 6), **fields,
                   **({"reason": reason} if reason else {}))

    def _pause_point(self, req: PullRequest, turn: Turn | None):
        """The ``pause`` a preempting compute calls between chunks (None: it may not pause):
        gives the turn to the request next in order when the admission says so, logged."""
        if turn is None or not self.compute.preempts:
            return None

        def pause() -> None:
            waited = self._admit.yield_turn(turn)
            if waited is not None:
                self._emit("paused", request_id=req.request_id, consumer=req.consumer, paused_s=round(waited, 6))

        return pause

    def _stream(self, link: Link, who: str, req: PullRequest, identity: Identity, turn: Turn | None = None) -> None:
        t0 = time.monotonic()
        pause = self._pause_point(req, turn)
        link.send(Serving(), "admitting the request")
        continue_as_v3(link, Role.SENDER)  # the rest of the connection is one V3 handoff, we are its sender
        link.idle_s = self.config.idle_s
        ready = link.next_event("waiting for the consumer's Ready")
        if not isinstance(ready, Ready):  # it hung up, or refused: nothing was computed, and the log says so
            reason = (f"the consumer refused before it was ready ({ready.code}: {ready.message})"
                      if isinstance(ready, Reject) else "the consumer left before it was ready")
            with self._lock:
                self.counters["failed"] += 1
            self._emit("request", peer=who, outcome="failed", reason=reason, request_id=req.request_id,
                       key_id=req.key_id, consumer=req.consumer, tokens=len(req.token_ids),
                       total_s=round(time.monotonic() - t0, 6))
            return
        r, w = os.pipe()
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                with open(w, "wb") as out:
                    box["stats"] = (self.compute.run(req, out) if pause is None else
                                    self.compute.run(req, out, pause=pause))
                self.compute.after_stream(box["stats"])  # the pipe is closed: the consumer does not wait on this
            except BaseException as exc:  # noqa: BLE001 - reported through the stream's end
                box["error"] = exc

        worker = threading.Thread(target=work, name="muser-prefill", daemon=True)
        worker.start()
        reader = open(r, "rb")
        outcome, result, reason, first_frame_s = "failed", None, "", None
        try:
            try:
                source = PackSource(reader)
                first_frame_s = round(time.monotonic() - t0, 6)  # the header is in: what ships first is ready
                self._note(state="streaming")
            except KVPackError as exc:
                worker.join()
                reason = f"the producer could not start the pack ({box.get('error') or exc})"
                with contextlib.suppress(MuserError, OSError):
                    link.send(Reject("aborted", reason), "refusing")
                return
            prepared = prepare_handoff(source, identity)  # signed with this consumer's key
            result = transmit_over(link, ready.info, prepared, to=who, identity=identity)
            outcome = "served"
        except MuserError as exc:
            reason = str(exc)
        finally:
            reader.close()  # a consumer that went away: the compute's next write breaks, it stops
            worker.join()
            with self._lock:
                self.counters["served" if outcome == "served" else "failed"] += 1
            stats = box.get("stats") or {}
            fields: dict[str, Any] = {
                "peer": who, "outcome": outcome, "request_id": req.request_id, "key_id": req.key_id,
                "consumer": req.consumer, "tokens": len(req.token_ids), "total_s": round(time.monotonic() - t0, 6),
                "prompt": "ids" if req.text is None else ("chat" if req.chat else "text"),
                **stats,
            }
            if first_frame_s is not None:
                fields["first_frame_s"] = first_frame_s
            if result is not None:
                fields.update(bytes=result.payload_bytes, frames=result.frames,
                              payload_rate_Bps=round(result.payload_rate_Bps, 1), handoff_id=result.handoff_id)
            if reason or box.get("error"):
                fields["reason"] = reason or f"{type(box['error']).__name__}: {box['error']}"
            self._emit("request", **fields)


__all__ = ["Compute", "ComputeDefaults", "PullServer", "ServeConfig"]
