"""The consumers a resident producer joined, as TLS contexts: one per consumer (its CA the only
trust anchor), picked by the consumer's server name, reloaded when a consumer joins while the
producer runs (:class:`Identities`)."""

from __future__ import annotations

import ssl
import threading
from pathlib import Path

from muser_cli.errors import MuserError
from muser_cli.handoff.link import consumer_sni, server_context
from muser_cli.handoff.trust.node import Identity
from muser_cli.handoff.trust.nodedir import identities_stamp, load_identities
from muser_cli.handoff.wire.pull_protocol import ALPN_PULL


def pull_context(identity: Identity) -> ssl.SSLContext:
    ctx = server_context(identity)
    ctx.set_alpn_protocols([ALPN_PULL])
    return ctx


class Identities:
    """The consumers this producer joined, one TLS context each (its CA the only trust
    anchor, its certificate the one presented). The consumer's server name
    (:func:`~muser_cli.handoff.link.consumer_sni`) picks the context; a client that names
    none gets the first consumer's.

    ``directory`` (the node directory they were loaded from): every handshake first looks
    whether its identities changed on disk (:func:`~muser_cli.handoff.trust.nodedir.identities_stamp`:
    a consumer joined, or re-joined with ``--force``, since the producer started) and if so
    loads them again, so a consumer joined on a running producer is served without a restart.
    What a handshake checks is unchanged: the context picked holds that consumer's CA alone,
    and the keyring is read per request as before. A join caught half-written is retried at
    the next handshake (the contexts loaded before stay in use)."""

    def __init__(self, identities: list[Identity], directory: Path | None = None) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._known: dict[ssl.SSLContext, Identity] = {}  # every context made: a handshake may end on an older one
        self._stamp = identities_stamp(directory) if directory is not None else None
        self._use(identities)
        self.default = self.pairs[0][0]  # every handshake starts on it; its SNI callback picks the one to use
        if len(self.pairs) > 1 or directory is not None:
            self.default.sni_callback = self._pick

    def _use(self, identities: list[Identity]) -> None:
        pairs = [(pull_context(i), i) for i in identities]
        self._known.update({ctx: i for ctx, i in pairs})
        by_sni = {sni: ctx for ctx, i in pairs if (sni := consumer_sni(i.consumer)) is not None}
        self.pairs, self.by_sni = pairs, by_sni

    def refresh(self) -> None:
        """Load the identities again if their files changed since they were last loaded."""
        if self.directory is None:
            return
        with self._lock:
            stamp = identities_stamp(self.directory)
            if stamp == self._stamp:
                return
            try:
                identities = load_identities(self.directory)
                self._use(identities)
            except (MuserError, OSError, ssl.SSLError):  # caught mid-join: keep what works, look again next time
                return
            self._stamp = stamp

    def _pick(self, sock: ssl.SSLObject, server_name: str | None, _ctx: ssl.SSLContext) -> None:
        self.refresh()
        chosen = self.by_sni.get((server_name or "").lower(), self.pairs[0][0])
        if chosen is not sock.context:
            sock.context = chosen
        return None

    def of(self, tls: ssl.SSLSocket) -> Identity:
        """The identity whose context this connection's handshake used."""
        return self._known.get(tls.context, self.pairs[0][1])


__all__ = ["Identities", "pull_context"]
