"""muser verify: integrity + identity + structure; passes the verified pack through a pipe."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from muser_cli.commands._common import (
    binary_output, complete_model, default_threads, emit_json, err, fail, guarded, open_input, plural,
    read_text_input, size_text,
)
from muser_cli.errors import DAMAGED_PACK_HINT, TRUNCATED_PACK_HINT, DataError
from muser_cli.fsio import check_output_path


class _Refused(Exception):
    """Raised inside the output block so a refused stream is never published."""


def _failed(report) -> typer.Exit:
    """The one error line of a pack that failed a check (after its report), and its exit status (65)."""

    bad = report.first_failure()
    hint = None
    if bad.name == "integrity":  # the pack's bytes themselves: say what to do, as decode does
        hint = TRUNCATED_PACK_HINT if "truncated" in bad.detail else DAMAGED_PACK_HINT if "corrupt" in bad.detail else None
    return fail(DataError(f"verify failed: {bad.name}: {bad.detail}", hint=hint))


def _render(report) -> str:
    lines = []
    for c in report.checks:
        lines.append(f"  {'ok  ' if c.ok else 'FAIL'} {c.name:<10} {c.detail}")
    s = report.summary
    if s:
        kinds = ", ".join(f"{n} {k}" for k, n in s["layers"].items())
        lines.append(f"  pack: {plural(s['tokens'], 'token')} ({plural(s['rows'][1] - s['rows'][0], 'row')}), "
                     f"{kinds} layers, {s['dtype']}, {size_text(s['kv_bytes'])} of KV in a "
                     f"{size_text(s['pack_bytes'])} pack, codec {s['codec']}")
    verdict = "verified" if report.ok else "REJECTED"
    return f"verify: {verdict}\n" + "\n".join(lines)


def register(app: typer.Typer) -> None:
    @app.command("verify")
    def verify_cmd(
        src: str = typer.Argument("-", help="Input kvpack, or - for stdin."),
        model: Optional[str] = typer.Option(None, "--model", "-m", autocompletion=complete_model, help="Model folder, .gguf file, or 'default'."),
        prompt: Optional[str] = typer.Option(None, "--prompt", help="Check the pack is for this prompt file."),
        chat: bool = typer.Option(False, "--chat", help="The prompt was wrapped in the chat template."),
        audit: int = typer.Option(0, "--audit", help="Recompute the last N positions locally and compare K/V per layer."),
        engine: str = typer.Option("torch", "--engine", help="Engine for --audit: torch | mlx"),
        threads: int = typer.Option(0, "--threads", help="Compute threads for --audit (0 = default)."),
        output: Optional[str] = typer.Option(None, "--output", "-o", help="Write the verified pack here."),
        as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object on stdout."),
    ) -> None:
        """Check a kvpack before anything decodes it. Exit 0 only if every check passes.

        Reading stdin and writing to a pipe (without --json), verify passes the exact
        verified bytes on, so `receive | verify | decode` works; the report then goes to
        stderr. With -o FILE the verified pack is written there.
        """
        from muser_cli.gate.verify import verify, verify_only, verify_stream  # lazy: kept out of `muser --help` (startup)

        with guarded(as_json=as_json):
            if output not in (None, "-"):
                check_output_path(output)  # before any verdict is printed
            prompt_text = read_text_input(prompt) if prompt is not None else None
            # In the middle of a pipe (reading stdin, writing a pipe) verify passes the pack on.
            passthrough = output is not None or (src == "-" and not as_json and not sys.stdout.isatty())
            if passthrough and not audit:
                # Streaming: each frame moves on once verified; a bad one ends the output
                # before it (no end frame, and -o FILE is never published).
                with open_input(src) as inp:
                    try:
                        with binary_output(output) as out:
                            report = verify_stream(inp, out, model=model, prompt=prompt_text, chat=chat)
                            if not report.ok:
                                raise _Refused()
                    except _Refused:
                        pass
                if as_json:
                    emit_json(report.to_json())
                else:
                    err(_render(report))
                if not report.ok:
                    raise _failed(report)
                return
            with open_input(src) as inp:
                if audit or passthrough:  # the rows are needed (recomputed, or passed on after the verdict)
                    report = verify(inp, model=model, prompt=prompt_text, chat=chat, audit=audit, engine=engine,
                                    threads=threads or default_threads(), keep_bytes=passthrough)
                else:  # a verdict only: frame by frame, memory bounded whatever the pack's size
                    report = verify_only(inp, model=model, prompt=prompt_text, chat=chat)
            if as_json:
                emit_json(report.to_json())
            elif passthrough:
                err(_render(report))
            else:
                typer.echo(_render(report))
            if not report.ok:
                raise _failed(report)
            if passthrough:
                with binary_output(output) as out:
                    report.copy_verified(out)
