"""muser probe-link: raw TLS throughput to a receiver and back, pass/fail against a floor."""

from __future__ import annotations

from typing import Optional

import typer

from muser_cli.commands._common import emit_json, fail, guarded, info, rate_text
from muser_cli.errors import TempFailure


def register(app: typer.Typer) -> None:
    @app.command("probe-link")
    def probe_link_cmd(
        to: str = typer.Argument(..., help="A receiver (`receive --listen`) or a resident producer (`prefill --serve`) as HOST:PORT."),
        seconds: float = typer.Option(2.0, "--seconds", help="Seconds per direction."),
        floor: Optional[str] = typer.Option(None, "--floor", help="Fail (exit 75) below this rate: 100M, 800Mbit."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
        connect_timeout: float = typer.Option(10.0, "--connect-timeout", help="TCP + TLS handshake deadline."),
    ) -> None:
        """Measure the link both ways over the handoff's own TLS; exit 75 below --floor.

        Up is from this node to HOST:PORT, down back. Against a resident producer the probe is
        a signed request, admitted as a pull request is (it waits for a running prefill), and
        the rate down is kept for this node's cost model (<data dir>/links.json): the link rate
        it predicts pulls from that producer with until pulls have measured it.
        """
        from muser_cli.consumer.links import note_link  # lazy: kept out of `muser --help` (startup)
        from muser_cli.handoff.probe_link import probe_link  # lazy: as above

        with guarded(as_json=as_json):
            res = probe_link(to=to, seconds=seconds, floor=floor, connect_timeout=connect_timeout)
            if res["listener"] == "producer":  # its rate to us: the cost model's link until pulls measure it
                note_link(to, down_Bps=float(res.get("down_Bps") or 0), up_Bps=res.get("up_Bps"))
            if as_json:
                emit_json(res)
            else:
                who = " (producer)" if res["listener"] == "producer" else ""
                info(f"probe-link {to}{who}: up {rate_text(res['up_Bps'])}, "
                     f"down {rate_text(res['down_Bps'])}, "
                     f"connect {res['connect_s'] * 1000:.1f} ms")
            if not res["passed"]:  # after the report (and its one JSON object): the line and 75
                raise fail(TempFailure(f"link below the floor of {floor}", hint="fall back to local prefill"))
