"""The consumer side of the pull lane: ask a resident producer for a prompt's KV and receive it
exactly as ``receive`` does (every frame verified before it is forwarded, the end frame only
after the MAC'd trailer verified and the handoff id is recorded in this consumer's ledger).

Contract of :func:`pull`:
  * TCP connect + TLS 1.3 (ALPN ``muser-pull/1``), the producer's certificate checked
    against this consumer's CA and the name dialled; the HMAC key is the one this consumer
    issued to that certificate's name (``node export --producer NAME``);
  * one signed request (fresh issued-at, new request id); ``Queued`` answers are waited
    through; ``Reject`` ends it (busy, model, timeout -> TempFailure, 75; auth, replay,
    stale -> AuthError, 77; too_large, data -> DataError, 65);
  * ``timeout``: the deadline for the producer's first V3 frame (its handoff header),
    queueing included; after it the stream runs under the idle timeout;
  * the header must bind the model, tokenizer and token ids this consumer asked for --
    its own tokenization, also when it sent the prompt as text for the producer to
    tokenize (else DataError, 65, before ``Go``); then the V3 receiver checks of docs/handoff.md;
  * a failure before any byte was forwarded leaves ``out_stream`` untouched; a failure
    after leaves it without an end frame. Returns the :class:`Accepted` handoff.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

from muser_cli.errors import AuthError, MuserError, ProtocolError, TempFailure
from muser_cli.handoff.link import (
    DEFAULT_CONNECT_S, DEFAULT_IDLE_S, Link, OtherCAError, check_peer_host, continue_as_v3, format_hostport,
    parse_hostport, sni_client_context, tls_connect,
)
from muser_cli.handoff.push.receiver import Accepted, Destination, ReceiveConfig, Receiver
from muser_cli.handoff.trust.certs import peer_common_name
from muser_cli.handoff.trust.node import Identity, KeyEntry
from muser_cli.handoff.trust.nodedir import note_peer
from muser_cli.handoff.wire.header import DEFAULT_WINDOW_S
from muser_cli.handoff.wire.protocol import (
    MAX_DATA_BYTES, PROTOCOL_VERSION, ConnectionClosed, Header, Ready, Reject, Role, State,
)
from muser_cli.handoff.wire.pull_protocol import (
    ALPN_PULL, MAX_BUDGET_MS, MAX_PROBE_MS, Probe, ProbeRequest, Promise, PullConnection, PullRequest, Queued, Request,
    Serving, Side,
    new_request_id, sign_probe, sign_request,
)
from muser_cli.handoff.wire.refusal import NotInTime, Refusal, error_class, refusal_error
from muser_cli.kvpack.format import token_digest

EventFn = Callable[[str, dict[str, Any]], None]


def _refused(reject: Reject, who: str) -> MuserError:
    """A producer's Reject, as the consumer tells it (the class is the one table's)."""
    text = f"producer {who} refused: {reject.code}" + (f": {reject.message}" if reject.message else "")
    cls = error_class(reject.code)
    hint = None
    if cls is TempFailure:
        hint = "fall back to local prefill"
    elif cls is AuthError and "unknown key id" in reject.message:
        hint = ("the producer has not joined the bundle made with this key: run `muser node join --force "
                "NAME.bundle` there, the bundle `muser node export --producer NAME` made here (it holds the key)")
    elif cls is AuthError and "revoked" in reject.message:
        hint = ("this node's certificate or key was revoked there: enroll again (muser node export "
                "on the consumer, muser node join --force on the producer)")
    elif cls is AuthError:
        hint = "check `muser node ls` on both sides, and both clocks"
    return cls(text, hint=hint)


def not_known_there(identity: Identity, where: str, exc: OtherCAError) -> AuthError:
    """The producer answered our server name (which names this consumer) with a certificate our
    CA did not issue: it holds no bundle of this consumer (never joined, or joined before this
    node's last ``node init``). Said as that, with what to run where."""
    me = identity.consumer or identity.name
    cause = str(exc).split("(", 1)[1].rsplit(")", 1)[0] if "(" in str(exc) else str(exc)
    return AuthError(f"the producer at {where} does not know consumer {me!r}: it answered with a certificate "
                     f"from another CA, not {me}'s ({cause})",
                     hint=f"on the consumer: `muser node export --producer NAME -o NAME.bundle`; on the producer: "
                          f"`muser node join NAME.bundle` (a running `prefill --serve` serves {me} from its next "
                          f"connection on, no restart); a producer that joined {me} before its last `muser node "
                          "init` needs a fresh bundle and `node join --force`")


def key_for(identity: Identity, producer: str) -> KeyEntry:
    """The newest unrevoked key this consumer issued to ``producer``."""
    mine = [k for k in identity.keyring().values() if k.peer == producer]
    keys = [k for k in mine if not k.revoked]
    if not keys:
        enroll = (f"muser node export --producer {producer} -o {producer}.bundle here, then "
                  f"`muser node join{' --force' if mine else ''} {producer}.bundle` on the producer")
        raise AuthError(f"no {'unrevoked ' if mine else ''}HMAC key for producer {producer!r} in this node's keyring"
                        + (" (its key was revoked)" if mine else ""), hint=enroll)
    return sorted(keys, key=lambda k: k.created)[-1]


def _connect(to: str, identity: Identity, connect_s: float,
             alpns: tuple[str, ...] = (ALPN_PULL,)) -> tuple[ssl.SSLSocket, str]:
    """TCP + TLS 1.3 to ``to``, offering ``alpns``: the listener must select one of them."""
    host, port = parse_hostport(to)
    where = format_hostport(host, port)
    ctx, sni = sni_client_context(identity)
    ctx.set_alpn_protocols(list(alpns))
    try:
        sock = tls_connect(host, port, ctx, server_hostname=sni or host, connect_s=connect_s)
    except OtherCAError as exc:
        if sni is None:
            raise
        raise not_known_there(identity, where, exc) from None
    if sni is not None:
        try:
            check_peer_host(sock, host, f"in the TLS handshake with {where}")
        except AuthError:
            sock.close()
            raise
    if sock.selected_alpn_protocol() not in alpns:
        sock.close()
        if alpns == (ALPN_PULL,):
            raise ProtocolError(f"{where} does not speak {ALPN_PULL} (is it a `prefill --serve` producer?)")
        raise ProtocolError(f"{where} speaks none of {', '.join(alpns)}")
    return sock, where


def request_probe(link: Link, identity: Identity, cn: str, where: str, *, seconds: float,
                  on_event: EventFn | None = None) -> ProbeRequest:
    """Over a fresh pull connection: ask the producer ``cn`` to answer a link probe (a signed
    ``Probe`` request), wait through ``Queued`` until ``Serving``; then ``link`` is a V3
    SENDER whose next event is the producer's ``Ready`` (:mod:`muser_cli.handoff.probes`)."""
    key = key_for(identity, cn)
    probe = ProbeRequest(key_id=key.key_id, request_id=new_request_id(), issued_at_ms=int(time.time() * 1000),
                         consumer=identity.name, probe_ms=max(1, min(MAX_PROBE_MS, int(seconds * 1000) + 1)))
    raw, mac = sign_probe(probe, key.secret)
    link.send(Probe(raw, mac, probe), "sending the probe request")
    _await_serving(link, where, on_event)
    continue_as_v3(link, Role.SENDER)
    return probe


#: A producer that promised (``Promise``, a request with a budget) is held to it: the pack must
#: be in by its promised start plus compute, a quarter more and :data:`HEDGE_SLACK_S`, counted
#: from when the promise came. Past that the pull is cut (issue #39, hedging): the consumer goes
#: on with what verified (whole chunks, the rest computed there) or prefills itself, instead of
#: waiting out its timeout; it never computes what it is still waiting for.
HEDGE_MARGIN = 0.25
HEDGE_SLACK_S = 0.5


class _Hedge:
    """The deadline a promise set on a pull (None until one came), and what was promised.

    Without ``race`` the promise bounds the pull: past it the link's deadline cuts it. With
    ``race`` (a consumer that can compute the prompt itself while the pull goes on) nothing is
    cut: ``race(why)`` is called once when the promise is broken (from a timer thread), and the
    pull goes on until it ends or is cancelled (``on_socket``'s socket shut down)."""

    def __init__(self, race: Callable[[str], None] | None = None) -> None:
        self.by: float | None = None
        self.promised = ""
        self.race = race
        self._timer: threading.Timer | None = None
        self._over = threading.Event()

    def promise(self, link: Link, ev: Promise, where: str = "") -> None:
        wait_s = (ev.start_ms + ev.compute_ms) / 1000.0
        self.by = time.monotonic() + wait_s * (1 + HEDGE_MARGIN) + HEDGE_SLACK_S
        self.promised = f"start in {ev.start_ms} ms, compute {ev.compute_ms} ms"
        if self.race is None:
            self.keep(link)
            return
        if self._timer is None:
            why = (f"{where} broke its promise ({self.promised}): its pack was not in "
                   f"{HEDGE_MARGIN:.0%} and {HEDGE_SLACK_S} s past it")
            self._timer = threading.Timer(self.by - time.monotonic(), self._fire, args=(why,))
            self._timer.daemon = True
            self._timer.start()

    def _fire(self, why: str) -> None:
        if not self._over.is_set() and self.race is not None:
            self.race(why)

    def stop(self) -> None:
        """The pull ended: a promise no longer to be broken."""
        self._over.set()
        if self._timer is not None:
            self._timer.cancel()

    def keep(self, link: Link) -> None:
        """The link's total deadline no later than the promise's (when not racing)."""
        if self.by is not None and self.race is None:
            link.deadline = self.by if link.deadline is None else min(link.deadline, self.by)

    def broken(self, exc: BaseException, where: str) -> TempFailure | None:
        """``exc`` (a deadline that passed) as the promise broken, or None when it is not that."""
        if (self.by is None or self.race is not None or not isinstance(exc, TempFailure)
                or isinstance(exc, NotInTime) or time.monotonic() < self.by):  # a refusal is the producer's word
            return None
        return TempFailure(f"{where} broke its promise ({self.promised}): its pack was not in "
                           f"{HEDGE_MARGIN:.0%} and {HEDGE_SLACK_S} s past it; the pull was cut ({exc})")


def _await_serving(link: Link, where: str, on_event: EventFn | None, hedge: _Hedge | None = None) -> None:
    while True:
        ev = link.next_event(f"waiting for {where} to answer the request")
        if isinstance(ev, Reject):
            raise _refused(ev, where)
        if isinstance(ev, ConnectionClosed):
            raise TempFailure(f"{where} closed the connection before answering")
        if isinstance(ev, Queued):
            if on_event:
                on_event("queued", {"place": ev.place, "producer": where})
            continue
        if isinstance(ev, Promise):  # the answer to a request with a budget (issue #39)
            if hedge is not None:
                hedge.promise(link, ev, where)
            if on_event:
                on_event("promise", {"start_ms": ev.start_ms, "compute_ms": ev.compute_ms, "queued": ev.queued,
                                     "rates": dict(ev.rates), "producer": where})
            continue
        if not isinstance(ev, Serving):
            raise ProtocolError(f"expected Serving from {where}, got {type(ev).__name__}")
        if on_event:
            on_event("serving", {"producer": where})
        return


def pull(
    to: str, identity: Identity, *, token_ids: list[int], tokenizer_fingerprint: str, model_fingerprint: str,
    chunk_tokens: int, dtype: str, ledger_dir: Path, out_stream: BinaryIO | None = None,
    destination: Destination | None = None, timeout: float | None = None, connect_s: float = DEFAULT_CONNECT_S,
    idle_s: float = DEFAULT_IDLE_S, window_s: float = DEFAULT_WINDOW_S, on_event: EventFn | None = None,
    have_tokens: int = 0, have_chain: str | None = None, text: str | None = None, chat: bool = False,
    engine: str | None = None, budget_ms: int | None = None, race: Callable[[str], None] | None = None,
    on_socket: Callable[[socket.socket], None] | None = None,
) -> Accepted:
    """Request the KV of ``token_ids`` from the producer at ``to`` and receive it (see module doc).

    ``have_tokens``/``have_chain``: this consumer's store holds the first rows already; the
    producer answers with a delta pack from there (or, its choice, a full one).
    ``text``: send the prompt as this text (``chat``: as one user turn of the chat template)
    and let the producer tokenize it; ``engine``: the engine this consumer decodes on (a
    producer on the same one leaves the sliding history out); ``budget_ms``: the producer must
    have sent the whole pack within it, else it says ``late`` at once (NotInTime, 75: fall back
    now; a producer older than the field refuses the request, ``protocol``); ``token_ids`` is still this consumer's own tokenization
    of it, and the pack is refused (DataError, 65, before ``Go``) unless it binds exactly those.
    A promise the producer breaks cuts the pull, unless ``race`` is given: then ``race(why)`` is
    called when it is broken and the pull goes on (the consumer computes meanwhile and may
    cancel the pull by shutting down the socket ``on_socket`` was given)."""
    t_start = time.monotonic()
    first_by = None if timeout is None else t_start + timeout
    sock, where = _connect(to, identity, connect_s if timeout is None else min(connect_s, timeout))
    if on_socket is not None:
        on_socket(sock)
    link = Link(sock, PullConnection(Side.CONSUMER), idle_s=idle_s if timeout is None else min(idle_s, timeout),
                deadline=first_by)
    hedge: _Hedge | None = None
    try:
        der = sock.getpeercert(binary_form=True) or b""
        cn = peer_common_name(der) if der else ""
        key = key_for(identity, cn)
        req = PullRequest(key_id=key.key_id, request_id=new_request_id(), issued_at_ms=int(time.time() * 1000),
                          consumer=identity.name, token_ids=tuple(token_ids) if text is None else (),
                          tokenizer_fingerprint=tokenizer_fingerprint, model_fingerprint=model_fingerprint,
                          chunk_tokens=chunk_tokens, dtype=dtype, have_tokens=have_tokens,
                          have_chain=have_chain if have_tokens else None, text=text, chat=chat if text else False,
                          engine=engine,
                          budget_ms=None if budget_ms is None else max(1, min(MAX_BUDGET_MS, int(budget_ms))))
        raw, mac = sign_request(req, key.secret)
        link.send(Request(raw, mac, req), "sending the request")
        hedge = _Hedge(race)
        try:
            _await_serving(link, where, on_event, hedge)
            continue_as_v3(link, Role.RECEIVER)
            config = ReceiveConfig(once=True, timeout=timeout, idle_s=idle_s, window_s=window_s)
            receiver = Receiver(identity, config, ledger_dir=ledger_dir, destination=destination,
                                out_stream=out_stream)
            try:
                accepted = _receive(link, receiver, req, where, cn, t_start, on_event, expect_ids=list(token_ids),
                                    hedge=hedge)
            finally:
                receiver.close()
        except TempFailure as exc:
            broken = hedge.broken(exc, where)
            if broken is None:
                raise
            if on_event:
                on_event("hedged", {"producer": where, "promised": hedge.promised})
            raise broken from None
        note_peer(identity, cn, role="producer", address=where, key_id=key.key_id, via="pull")  # its pack verified
        return accepted
    finally:
        if hedge is not None:
            hedge.stop()
        link.close()


def _receive(link: Link, receiver: Receiver, req: PullRequest, where: str, cn: str, t_start: float,
             on_event: EventFn | None = None, *, expect_ids: list[int], hedge: _Hedge | None = None) -> Accepted:

    config = receiver.config
    info = {"v": PROTOCOL_VERSION, "node": receiver.identity.name, "max_payload": config.max_payload,
            "window_s": config.window_s, "max_data": MAX_DATA_BYTES, "probe_max_s": config.probe_max_s,
            "idle_s": config.idle_s}
    who = f"{where} ({cn})"
    try:
        link.send(Ready(info), "sending Ready")
        ev = link.next_event(f"waiting for {where}'s handoff header")
        if isinstance(ev, Reject):
            raise _refused(ev, where)
        if isinstance(ev, ConnectionClosed):
            raise TempFailure(f"{where} closed the connection before its handoff header")
        if not isinstance(ev, Header):
            raise ProtocolError(f"expected the handoff header, got {type(ev).__name__}")
        h = ev.header
        assert h is not None
        if on_event:  # the producer's clock as its header states it, and ours when it arrived
            on_event("header", {"issued_at_ms": h.issued_at_ms, "received_ms": int(time.time() * 1000),
                                "producer": where, "model_fingerprint": h.model_fingerprint})
        # The consumer's request is authoritative: a pack for anything else is refused before Go.
        for what, got, want in (("model", h.model_fingerprint, req.model_fingerprint),
                                ("tokenizer", h.tokenizer_fingerprint, req.tokenizer_fingerprint),
                                ("token ids", h.token_digest, token_digest(expect_ids))):
            if got != want:
                raise Refusal("model", f"the producer's pack has another {what} ({got}) than asked for ({want})")
        if not _mergeable_start(h.rows_start, req, rows=len(expect_ids) - 1):
            raise Refusal("model", f"the producer's pack starts at position {h.rows_start}: not 0 nor a point on "
                                   f"the chunk grid ({req.chunk_tokens}) within the {req.have_tokens} rows held here")
        link.deadline = t_start + config.session_s  # the first frame is in: the stream runs on idle deadlines
        if hedge is not None:
            hedge.keep(link)  # ... and by what was promised
        link.idle_s = config.idle_s
        receiver._handoff(link, ev, who, cn, t_start)
    except Refusal as exc:
        with contextlib.suppress(MuserError, OSError):
            if link.conn.state not in (State.DONE, State.CLOSED):
                link.send(Reject(exc.code, exc.message), "refusing the handoff")
        failure = receiver._stream_failure
        if failure is not None:
            raise failure from None
        raise refusal_error(exc) from None
    except MuserError as exc:
        with contextlib.suppress(MuserError, OSError):
            if link.conn.state not in (State.DONE, State.CLOSED):
                link.send(Reject("timeout" if isinstance(exc, TempFailure) else "protocol", str(exc)[:200]))
        failure = receiver._stream_failure
        if failure is not None:
            raise failure from None
        raise
    item = receiver._results.get_nowait()
    if isinstance(item, BaseException):
        raise item
    return item


def _mergeable_start(start: int, req: PullRequest, *, rows: int) -> bool:
    """A pack from 0, or a delta this consumer can merge exactly: from at most the rows it
    said it holds, on the chunk grid (the producer rounds an off-grid ``have`` down)."""
    if start == 0:
        return True
    return start <= req.have_tokens and (start % req.chunk_tokens == 0 or start == rows)


connect = _connect  # TCP + TLS 1.3 + ALPN to a producer, nothing sent (``muser node check``)

__all__ = ["connect", "key_for", "pull", "request_probe"]
