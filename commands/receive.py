"""muser receive: accept handoffs over mutual TLS; forward or publish only verified kvpack bytes (exit 75 on timeout)."""

from __future__ import annotations

from typing import Optional

import typer

from muser_cli.commands._common import (
    binary_stdout, complete_model, drain_on_signals, emit_json, guarded, info, plural, quiet, read_text_input,
    trouble_line,
)
from muser_cli.errors import UsageError


def _n(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def _render(kind: str, f: dict) -> None:
    if kind == "listening":
        info(f"receive: listening on {f['address']}")
    elif kind == "stale_removed":
        info(f"receive: removed {plural(f['count'], 'stale spool file')} left by a receiver that was killed")
    elif kind == "accepted":
        span = ""
        if f.get("first_byte_s") is not None:
            span = f", payload {f['first_byte_s']:.3f}-{f['last_byte_s']:.3f} s after start"
        info(f"receive: accepted {f['handoff_id']} from {f['sender']} ({f['payload_bytes']} bytes, "
             f"{f['frames']} frames, ledger commit {f['ledger_commit_ms']:.2f} ms{span})")
    elif kind in ("warning", "error") and not quiet():  # bookkeeping, a callback or a connection that failed
        info(trouble_line("receive", kind, f) or "")
    elif kind in ("rejected", "tls_failed", "aborted", "ack_failed") and not quiet():
        reason = f.get("reason", "")
        code = f" {f['code']}:" if "code" in f else ""
        info(f"receive: {kind.replace('_', ' ')} {f.get('peer', '')}:{code} {reason}")


def register(app: typer.Typer) -> None:
    @app.command("receive")
    def receive_cmd(
        prompt: Optional[str] = typer.Argument(None, help="With --from: the prompt file to ask the producer for (- for stdin)."),
        listen: Optional[str] = typer.Option(None, "--listen", help="HOST:PORT to listen on (:PORT for all addresses)."),
        pull_from: Optional[str] = typer.Option(None, "--from", help="Pull instead: ask the resident producer at HOST:PORT (`prefill --serve`) for PROMPT's KV."),
        model: Optional[str] = typer.Option(None, "--model", "-m", autocompletion=complete_model, help="With --from: this consumer's model (its tokenization and fingerprints are authoritative)."),
        chat: bool = typer.Option(False, "--chat", help="With --from: the prompt uses the chat template."),
        chunk: Optional[int] = typer.Option(None, "--chunk", help="With --from: canonical chunk size to ask for (default 512)."),
        dtype: Optional[str] = typer.Option(None, "--dtype", help="With --from: KV dtype to ask for (default float32)."),
        once: bool = typer.Option(False, "--once", help="Exit after the first accepted handoff."),
        timeout: Optional[float] = typer.Option(None, "--timeout", help="Give up when no handoff started streaming within S seconds (exit 75)."),
        output: str = typer.Option("-", "--output", "-o", help="Output file (or a folder), - for stdout."),
        as_json: bool = typer.Option(False, "--json", help="One JSON object per accepted handoff, with first/last byte times (needs -o)."),
        max_size: str = typer.Option("64G", "--max-size", help="Largest payload accepted (refused before reading)."),
        window: float = typer.Option(120.0, "--window", help="Issued-at window, ± seconds."),
        idle_timeout: float = typer.Option(30.0, "--idle-timeout", help="Longest silence tolerated, seconds."),
        handshake_timeout: float = typer.Option(10.0, "--handshake-timeout", help="TLS handshake deadline."),
        queue: int = typer.Option(16, "--queue", help="Producers that may wait while one is admitted."),
        no_reuse: bool = typer.Option(False, "--no-reuse", help="With --from: ask for the whole pack, not only the suffix this machine's store lacks (default: a delta when the store holds a prefix)."),
        send_text: bool = typer.Option(False, "--send-text", help="With --from: send the prompt as text (and --chat) for the producer to tokenize; the pack must still bind this machine's own token ids (else exit 65)."),
    ) -> None:
        """Receive kvpacks as they stream: TLS 1.3 with client certificates, HMAC header and trailer, replay ledger.

        To stdout (needs --once) each frame is forwarded once it verified against the digest
        chain, the end frame only after the trailer verified and the handoff id was recorded
        durably; a failed or cut handoff ends the stream without an end frame (exit 65, 75
        or 77). To a file or folder the payload is published atomically, then acknowledged.
        """
        from muser_cli.handoff.api import receive  # lazy: kept out of `muser --help` (startup)

        with guarded(as_json=as_json):
            if (listen is None) == (pull_from is None):
                raise UsageError("give exactly one of --listen HOST:PORT or --from HOST:PORT PROMPT")
            if pull_from is not None:
                _pull(pull_from, prompt, model=model, chat=chat, chunk=chunk, dtype=dtype, timeout=timeout,
                      output=output, as_json=as_json, have=not no_reuse, send_text=send_text)
                return
            if prompt is not None:
                raise UsageError("a PROMPT argument needs --from HOST:PORT")
            if send_text:
                raise UsageError("--send-text needs --from HOST:PORT PROMPT")
            to_stdout = output in ("-", None)
            if as_json and to_stdout:
                raise UsageError("--json needs -o FILE or -o DIR (stdout carries the kvpack)")
            out_stream = binary_stdout() if to_stdout else None
            stop, got = drain_on_signals()

            def on_event(kind: str, f: dict) -> None:
                if kind == "drained":
                    info(f"receive: stopped on {got.get('signal', 'request')}: {_n(f['accepted'], 'handoff')} "
                         f"accepted ({f['payload_bytes']} bytes), {f['rejected'] - f['turned_away']} refused, "
                         f"{f['turned_away']} turned away while draining; none left in flight")
                else:
                    _render(kind, f)

            receive(listen=listen, once=once, timeout=timeout, output=output, out_stream=out_stream,
                    max_size=max_size, window=window, idle_timeout=idle_timeout,
                    handshake_timeout=handshake_timeout, queue=queue, on_event=on_event,
                    on_accept=emit_json if as_json else None, drain=stop)


def _pull(producer: str, prompt: Optional[str], *, model: Optional[str], chat: bool, chunk: Optional[int],
          dtype: Optional[str], timeout: Optional[float], output: str, as_json: bool, have: bool,
          send_text: bool = False) -> None:
    """``receive --from``: one request to a resident producer; the verified pack to stdout or -o.
    ``have``: ask only for what this machine's store lacks (a delta pack that `decode --prompt`
    merges with the stored prefix)."""
    from pathlib import Path

    from muser_cli.consumer.pull import ask_for, pull_prompt, with_have  # lazy: kept out of `muser --help` (startup)
    from muser_cli.handoff.link import parse_hostport  # lazy: kept out of `muser --help` (startup)

    if prompt is None:
        raise UsageError("--from needs a PROMPT file (or - for stdin)")
    parse_hostport(producer)
    to_stdout = output in ("-", None)
    if as_json and to_stdout:
        raise UsageError("--json needs -o FILE (stdout carries the kvpack)")
    ask = ask_for(read_text_input(prompt), model=model, chat=chat, chunk_tokens=chunk, dtype=dtype, engine="torch",
                  send_text=send_text)
    if have:
        ask = with_have(ask)

    def on_event(kind: str, f: dict) -> None:
        if kind == "queued":
            info(f"receive: queued at {f['producer']}, place {f['place']}")

    got = pull_prompt(producer, ask, out_stream=binary_stdout() if to_stdout else None,
                      output=None if to_stdout else Path(output), timeout=timeout, on_event=on_event)
    if as_json:
        emit_json(got)
    else:
        delta = f", a delta from token {got['held_tokens']} (this store holds the rest)" if got["held_tokens"] else ""
        info(f"receive: pulled {got['handoff_id']} from {got['sender']} ({got['payload_bytes']} bytes, "
             f"{got['frames']} frames{delta})")
