"""The link probes (docs/handoff.md): raw TLS throughput both ways, each direction measured
at its receiving end.

Listener side (``receive --listen``, and ``prefill --serve`` once it admitted a probe
request): :func:`serve_probe_up` counts what an upload probe sends, :func:`serve_probe_down`
sends for a download probe.

Dialer side: :func:`probe_peer` (``muser probe-link HOST:PORT``) works against either
listener; the ALPN the listener selects says which it is. A receiver (``muser/3``)
answers probes right after its ``Ready``. A resident producer (``muser-pull/1``) first
wants a signed ``Probe`` request (key id, MAC, issued-at, replay ledger: as a pull
request) and admits it as it admits a request (one at a time, so a probe neither slows a
running prefill nor is measured against one); then the V3 roles are swapped for the
probe: the producer sends ``Ready`` and answers as a receiver does. ``up`` is always
from the dialer to HOST:PORT, ``down`` back.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from muser_cli.errors import ProtocolError, TempFailure
from muser_cli.handoff.link import DEFAULT_CONNECT_S, DEFAULT_IDLE_S, Link, reject_error
from muser_cli.handoff.node import Identity
from muser_cli.handoff.protocol import (
    ALPN, DEFAULT_DATA_CHUNK, Connection, ConnectionClosed, Data, ProbeDown, ProbeEnd, ProbeResult, ProbeUp, Ready,
    Reject, Role,
)

EventFn = Callable[[str, dict[str, Any]], None]


# ----------------------------------------------------------------------------- listener side
def serve_probe_up(link: Link, span: float) -> dict[str, Any]:
    """Count what arrives for ``span`` seconds after the first frame, report, then drain."""
    counted, t_first = 0, None
    while True:
        event = link.next_event("in the upload probe")
        if not isinstance(event, Data):
            raise TempFailure("the sender left during the upload probe")
        now = time.monotonic()
        if t_first is None:
            t_first = now  # the first frame starts the clock; count what follows it
            continue
        counted += len(event.data)
        if now - t_first >= span:
            break
    result = {"bytes": counted, "seconds": now - t_first}
    link.send(ProbeResult(result), "sending the probe result")
    while True:  # frames the sender wrote before it saw the result
        event = link.next_event("draining the upload probe")
        if isinstance(event, ProbeEnd):
            return result
        if not isinstance(event, Data):
            raise TempFailure("the sender left during the upload probe")


def serve_probe_down(link: Link, span: float) -> dict[str, Any]:
    """Send data frames for ``span`` seconds, then the probe's end."""
    block = os.urandom(DEFAULT_DATA_CHUNK)
    t0 = time.monotonic()
    end, sent = t0 + span, 0
    while time.monotonic() < end:
        link.send(Data(block), "in the download probe")
        sent += len(block)
    link.send(ProbeEnd(), "ending the download probe")
    return {"bytes": sent, "seconds": time.monotonic() - t0}


# ----------------------------------------------------------------------------- dialer side
def measure(link: Link, seconds: float, *, chunk: int = DEFAULT_DATA_CHUNK) -> dict[str, Any]:
    """Both probes over ``link`` (a V3 sender that has seen the listener's ``Ready``)."""
    block = os.urandom(chunk)
    # Up: we stream until the listener has counted for `seconds` and sends its result.
    link.send(ProbeUp(seconds), "starting the upload probe")
    result = None
    while result is None:
        early = link.poll_event()
        if isinstance(early, ProbeResult):
            result = early
        elif isinstance(early, Reject):
            raise reject_error(early, "listener")
        elif isinstance(early, ConnectionClosed):
            raise TempFailure("the listener closed the connection in the upload probe")
        elif early is not None:
            raise ProtocolError(f"unexpected {type(early).__name__} in the upload probe")
        else:
            link.send(Data(block), "in the upload probe")
    link.send(ProbeEnd(), "ending the upload probe")
    up_bytes = int(result.info.get("bytes", 0))
    up_s = float(result.info.get("seconds", 0.0))
    # Down: the listener streams for `seconds`; we count from the first byte to ProbeEnd.
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
            raise reject_error(event, "listener")
        else:
            raise TempFailure("the listener closed the connection in the download probe")
    down_s = time.monotonic() - t_first if t_first is not None else 0.0
    return {"up_bytes": up_bytes, "up_s": up_s, "down_bytes": down_bytes, "down_s": down_s}


def probe_peer(to: str, identity: Identity, *, seconds: float = 2.0, floor: float | None = None,
               connect_s: float = DEFAULT_CONNECT_S, idle_s: float = DEFAULT_IDLE_S,
               chunk: int = DEFAULT_DATA_CHUNK, on_event: EventFn | None = None) -> dict[str, Any]:
    """Raw TLS throughput to ``to`` and back: a ``receive --listen`` receiver or a ``prefill
    --serve`` producer (module doc). The JSON of ``probe-link``; ``listener`` says which."""
    from muser_cli.handoff.certs import peer_common_name
    from muser_cli.handoff.pull import ALPN_PULL, PullConnection, Side
    from muser_cli.handoff.pull_client import connect, request_probe
    from muser_cli.handoff.sender import ProbeResultInfo

    if not seconds > 0:
        from muser_cli.errors import UsageError

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
        from muser_cli.handoff.nodedir import note_peer

        note_peer(identity, cn, role="producer", address=where, key_id=probe_req.key_id, via="probe")
    up_rate = got["up_bytes"] / got["up_s"] if got["up_s"] > 0 else 0.0
    down_rate = got["down_bytes"] / got["down_s"] if got["down_s"] > 0 else 0.0
    passed = floor is None or min(up_rate, down_rate) >= floor
    res = ProbeResultInfo(
        ok=True, to=to, connect_s=connect_time, up_bytes=got["up_bytes"], up_s=got["up_s"], up_Bps=up_rate,
        down_bytes=got["down_bytes"], down_s=got["down_s"], down_Bps=down_rate, floor_Bps=floor, passed=passed,
        receiver={k: v for k, v in event.info.items() if isinstance(v, (str, int, float, bool))},
    ).to_json()
    res["listener"] = "producer" if pull else "receiver"
    return res


def probe_link(*, to: str, seconds: float, floor: str | None, connect_timeout: float) -> dict[str, Any]:
    """``muser probe-link``: :func:`probe_peer` with this node's identity (``MUSER_HOME``)."""
    from muser_cli import paths
    from muser_cli.handoff.link import parse_hostport
    from muser_cli.handoff.node import load_identity
    from muser_cli.strict import parse_rate

    parse_hostport(to)  # a bad address: a usage error before anything is read
    floor_bps = parse_rate(floor) if floor else None
    identity = load_identity(paths.keys_dir())
    return probe_peer(to, identity, seconds=seconds, floor=floor_bps, connect_s=connect_timeout)


__all__ = ["measure", "probe_link", "probe_peer", "serve_probe_down", "serve_probe_up"]
