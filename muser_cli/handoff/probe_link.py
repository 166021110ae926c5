"""The dialer side of the link probes: ``muser probe-link HOST:PORT`` against a
``receive --listen`` receiver or a ``prefill --serve`` producer (the ALPN the listener
selects says which; :mod:`muser_cli.handoff.probes` has the listener side and the
measuring both sides share)."""

from __future__ import annotations

import time
from typing import Any

from muser_cli import paths
from muser_cli.errors import ProtocolError, TempFailure, UsageError
from muser_cli.handoff.link import DEFAULT_CONNECT_S, DEFAULT_IDLE_S, Link, parse_hostport, reject_error
from muser_cli.handoff.probes import EventFn, measure
from muser_cli.handoff.pull.client import connect, request_probe
from muser_cli.handoff.push.sender import ProbeResultInfo
from muser_cli.handoff.trust.certs import peer_common_name
from muser_cli.handoff.trust.node import Identity
from muser_cli.handoff.trust.nodedir import identity_for, note_peer
from muser_cli.handoff.wire.protocol import ALPN, DEFAULT_DATA_CHUNK, Connection, ConnectionClosed, Ready, Reject, Role
from muser_cli.handoff.wire.pull_protocol import ALPN_PULL, PullConnection, Side
from muser_cli.strict import parse_rate


def probe_peer(to: str, identity: Identity, *, seconds: float = 2.0, floor: float | None = None,
               connect_s: float = DEFAULT_CONNECT_S, idle_s: float = DEFAULT_IDLE_S,
               chunk: int = DEFAULT_DATA_CHUNK, on_event: EventFn | None = None) -> dict[str, Any]:
    """Raw TLS throughput to ``to`` and back: a ``receive --listen`` receiver or a ``prefill
    --serve`` producer (module doc). The JSON of ``probe-link``; ``listener`` says which."""

    if not seconds > 0:
        raise UsageError("--seconds must be > 0")
    t0 = time.monotonic()
    sock, where = connect(to, identity, connect_s, alpns=(ALPN_PULL, ALPN))
    pull = sock.selected_alpn_protocol() == ALPN_PULL
    deadline = t0 + 4 * seconds + 60
    link = Link(sock, PullConnection(Side.CONSUMER) if pull else Connection(Role.SENDER), idle_s=idle_s,
                deadline=deadline)
    der = sock.getpeercert(binary_form=True) or b""
    cn = peer_common_name(der) if der else ""
    probe_req = None
    try:
        if pull:
            probe_req = request_probe(link, identity, cn, where, seconds=seconds, on_event=on_event)
        event = link.next_event(f"waiting for {where} to be ready")
        if isinstance(event, Reject):
            raise reject_error(event, "producer" if pull else "receiver")
        if isinstance(event, ConnectionClosed):
            raise TempFailure(f"{where} closed the connection before it was ready")
        if not isinstance(event, Ready):
            raise ProtocolError(f"expected Ready from {where}, got {type(event).__name__}")
        connect_time = time.monotonic() - t0
        got = measure(link, seconds, chunk=chunk)
        try:  # close_notify: the listener sees the probes end cleanly, not a cut
            sock.settimeout(2.0)
            sock.unwrap()
        except (OSError, ValueError):
            pass
    finally:
        link.close()
    if probe_req is not None:  # the producer admitted our signed probe and answered it
        note_peer(identity, cn, role="producer", address=where, key_id=probe_req.key_id, via="probe")
    res = ProbeResultInfo.measured(to, connect_time, got, floor, event.info).to_json()
    res["listener"] = "producer" if pull else "receiver"
    return res


def probe_link(*, to: str, seconds: float, floor: str | None, connect_timeout: float) -> dict[str, Any]:
    """``muser probe-link``: :func:`probe_peer` with this node's identity (``MUSER_HOME``)."""

    host, _ = parse_hostport(to)  # a bad address: a usage error before anything is read
    floor_bps = parse_rate(floor) if floor else None
    identity = identity_for(paths.keys_dir(), host=host)  # on a producer of several consumers: which one
    return probe_peer(to, identity, seconds=seconds, floor=floor_bps, connect_s=connect_timeout)


__all__ = ["probe_link", "probe_peer"]
