"""The link probes (docs/handoff.md): raw TLS throughput both ways, each direction measured
at its receiving end.

Listener side (``receive --listen``, and ``prefill --serve`` once it admitted a probe
request): :func:`serve_probe_up` counts what an upload probe sends, :func:`serve_probe_down`
sends for a download probe.

Dialer side (:mod:`muser_cli.handoff.probe_link`, apart so that the receiver, which
imports this module, never imports the pull client): ``probe_peer`` works against either
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
from muser_cli.handoff.link import Link, reject_error
from muser_cli.handoff.wire.protocol import (
    DEFAULT_DATA_CHUNK, ConnectionClosed, Data, ProbeDown, ProbeEnd, ProbeResult, ProbeUp, Reject,
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
def measure(link: Link, seconds: float, *, chunk: int = DEFAULT_DATA_CHUNK, peer: str = "listener") -> dict[str, Any]:
    """Both probes over ``link`` (a V3 sender that has seen the listener's ``Ready``); ``peer``
    names the listener in errors (``probe-link`` says "listener", ``sender.probe_link``
    "receiver")."""
    block = os.urandom(chunk)
    # Up: we stream until the listener has counted for `seconds` and sends its result.
    link.send(ProbeUp(seconds), "starting the upload probe")
    result = None
    while result is None:
        early = link.poll_event()
        if isinstance(early, ProbeResult):
            result = early
        elif isinstance(early, Reject):
            raise reject_error(early, peer)
        elif isinstance(early, ConnectionClosed):
            raise TempFailure(f"the {peer} closed the connection in the upload probe")
        elif early is not None:
            raise ProtocolError(f"unexpected {type(early).__name__} in the upload probe")
        else:
            link.send_or_reject(Data(block), "in the upload probe", peer)
    link.send_or_reject(ProbeEnd(), "ending the upload probe", peer)
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
            raise reject_error(event, peer)
        else:
            raise TempFailure(f"the {peer} closed the connection in the download probe")
    down_s = time.monotonic() - t_first if t_first is not None else 0.0
    return {"up_bytes": up_bytes, "up_s": up_s, "down_bytes": down_bytes, "down_s": down_s}


__all__ = ["measure", "serve_probe_down", "serve_probe_up"]
