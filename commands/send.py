"""muser send: stream a kvpack to a receiver over mutual TLS as it is produced (exit 75: fall back)."""

from __future__ import annotations

from typing import Optional

import typer

from muser_cli.commands._common import (
    emit_json, guarded, info, open_input, plural, progress_callback, rate_text, size_text,
)


def register(app: typer.Typer) -> None:
    @app.command("send")
    def send_cmd(
        src: str = typer.Argument("-", help="kvpack to send, or - for stdin."),
        to: str = typer.Option(..., "--to", help="Receiver as HOST:PORT ([v6]:PORT for IPv6)."),
        rate: Optional[str] = typer.Option(None, "--rate", help="Pace the payload: 100M (bytes/s), 800Mbit."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON summary (payload rate, first/last byte times)."),
        timeout: float = typer.Option(3600.0, "--timeout", help="Total deadline in seconds."),
        connect_timeout: float = typer.Option(10.0, "--connect-timeout", help="TCP + TLS handshake deadline."),
        idle_timeout: float = typer.Option(30.0, "--idle-timeout", help="Longest silence tolerated, seconds."),
        key_id: Optional[str] = typer.Option(None, "--key-id", help="HMAC key id (default: this node's)."),
    ) -> None:
        """Stream a kvpack as it is produced; returns once the receiver verified and recorded it.

        Connects as soon as the kvpack header is in (a pipe from `muser prefill` streams
        frames as chunks finish). Exit 75 when the receiver is unreachable, busy or times
        out, 77 when it refuses authentication or a replay, 65 when it refuses the data or
        the input is not a complete kvpack, 78 with no node identity.
        """
        from muser_cli.handoff.api import send  # lazy: kept out of `muser --help` (startup)

        with guarded(as_json=as_json):
            with open_input(src) as inp:
                res = send(inp, to=to, rate=rate, key_id=key_id, timeout=timeout, connect_timeout=connect_timeout,
                           idle_timeout=idle_timeout, progress=progress_callback())
            if as_json:
                emit_json(res)
            else:
                info(f"send: {size_text(res['payload_bytes'])} ({plural(res['frames'], 'frame')}) to {res['to']} "
                     f"accepted as {res['handoff_id']} in {res['total_s']:.3f} s (payload rate "
                     f"{rate_text(res['payload_rate_Bps'])}, waited {res['input_wait_s']:.3f} s for input)")
