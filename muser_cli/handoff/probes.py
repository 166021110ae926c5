"""The receiver's side of the link probes: count what an upload probe sends, or send for a
download probe (the producer measures; docs/handoff.md).
"""

from __future__ import annotations

import os
import time

from muser_cli.errors import TempFailure
from muser_cli.handoff.link import Link
from muser_cli.handoff.protocol import DEFAULT_DATA_CHUNK, Data, ProbeEnd, ProbeResult


def serve_probe_up(link: Link, span: float) -> None:
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
    link.send(ProbeResult({"bytes": counted, "seconds": now - t_first}), "sending the probe result")
    while True:  # frames the sender wrote before it saw the result
        event = link.next_event("draining the upload probe")
        if isinstance(event, ProbeEnd):
            return
        if not isinstance(event, Data):
            raise TempFailure("the sender left during the upload probe")


def serve_probe_down(link: Link, span: float) -> None:
    """Send data frames for ``span`` seconds, then the probe's end."""
    block = os.urandom(DEFAULT_DATA_CHUNK)
    end = time.monotonic() + span
    while time.monotonic() < end:
        link.send(Data(block), "in the download probe")
    link.send(ProbeEnd(), "ending the download probe")
