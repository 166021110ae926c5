"""muser model: what a model's KV looks like before any prefill (``check``), and which families move (``ls``)."""

from __future__ import annotations

from typing import Optional

import typer

from muser_cli.commands._common import complete_model, emit_json, guarded
from muser_cli.units import size_text


def _size(n: int) -> str:
    """Human lines use decimal units (docs/cli-contract.md): ``27.0 MB``."""

    return size_text(n)


def _render(report: dict) -> str:
    lines = [f"{report['model']}: {report['model_type']}, {report['layers']} layers, KV in {report['dtype']}"]
    lines.append(f"  {'class':<22} {'layers':>6}  {'kv heads x dims':<16} {'rope':<40} {'B/token/layer':>13}"
                 + (f" {'rows':>9} {'payload':>12}" if "tokens" in report else ""))
    for c in report["classes"]:
        kind = c["kind"] + (f" (window {c['window']})" if c["window"] else f" (chunk {c['chunk']})" if c.get("chunk")
                            else "")
        row = f"  {kind:<22} {c['layers']:>6}  {c['shape']:<16} {c['rope']:<40} {c['bytes_per_token_per_layer']:>13}"
        if "tokens" in report:
            row += f" {c['rows']:>9} {c['payload_bytes']:>12}"
        lines.append(row)
        if "expanded_bytes_per_token_per_layer" in c:  # latent (MLA): what expanded K/V would cost
            lines.append(f"    expanded to per-head K and V: {c['expanded_bytes_per_token_per_layer']} B/token/layer, "
                         f"{c['expanded_over_latent']}x the latent"
                         + (f"; {c['expanded_payload_bytes']} bytes ({_size(c['expanded_payload_bytes'])}) at "
                            f"{report['tokens']} tokens" if "expanded_payload_bytes" in c else ""))
        if "state_bytes_per_layer" in c:  # recurrent state: one snapshot a layer, whatever the prompt
            lines.append(f"    {c['mixer']} state: {c['state_bytes_per_layer']} bytes a snapshot a layer "
                         f"({_size(c['state_bytes_per_layer'] * c['layers'])} for {c['layers']} layers)")
    lines.append(f"  KV bytes per token (all layers, below any window): {report['kv_bytes_per_token']}")
    if "tokens" in report:
        if "payload_history_bytes" in report:  # what prefill ships by default comes first
            lines.append(f"  payload at {report['tokens']} tokens, as prefill ships it (with the sliding history, "
                         f"for another engine's gate): {report['payload_history_bytes']} bytes "
                         f"({_size(report['payload_history_bytes'])}, raw)")
            lines.append(f"  with --no-history (the window only): {report['payload_bytes']} bytes "
                         f"({_size(report['payload_bytes'])}, raw); zstd, estimated: "
                         f"{_size(report['payload_zstd_estimate_bytes'])}")
        else:
            lines.append(f"  payload at {report['tokens']} tokens: {report['payload_bytes']} bytes "
                         f"({_size(report['payload_bytes'])}, raw); zstd, estimated: "
                         f"{_size(report['payload_zstd_estimate_bytes'])}")
    if report.get("chat_template") is not None:
        from muser_cli.model.resolve import NO_CHAT_TEMPLATE_HINT  # lazy: kept out of `muser --help` (startup)

        lines.append("  chat template: yes (chat requests are rendered with it)" if report["chat_template"] else
                     f"  chat template: none, so chat requests are refused: {NO_CHAT_TEMPLATE_HINT}")
    for name, e in report["engines"].items():
        can = "produce + consume" if e["produce"] and e["consume"] else "produce" if e["produce"] else "no"
        lines.append(f"  engine {name:<6} {can}" + (f" ({e['reason']})" if e["reason"] else ""))
    lines.extend(f"  note: {n}" for n in report["notes"])
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Check a model before onboarding it: layer plan, KV bytes, engines.", no_args_is_help=True)
    app.add_typer(group, name="model")

    @group.command("check")
    def check_cmd(
        model: str = typer.Argument(..., autocompletion=complete_model, help="Model folder (config.json is enough), config.json, .gguf file, or a name (`muser model ls`: default, gemma3-270m)."),
        tokens: Optional[int] = typer.Option(None, "--tokens", help="Also print the payload a pack of an N-token prompt carries."),
        dtype: Optional[str] = typer.Option(None, "--dtype", help="KV dtype for the byte counts (default: the config's, else bfloat16)."),
        as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
    ) -> None:
        """Will this model move? Its layer plan, KV bytes per token by layer class, payload at N tokens, engines."""
        from muser_cli.model.check import check  # lazy: kept out of `muser --help` (startup)

        with guarded(as_json=as_json):
            report = check(model, tokens=tokens, dtype=dtype)
            if as_json:
                emit_json(report)
            else:
                typer.echo(_render(report))

    @group.command("ls")
    def ls_cmd(as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout.")) -> None:
        """List the supported model families and the engines their tiny models were tested on."""
        from muser_cli.model.check import families  # lazy: kept out of `muser --help` (startup)
        from muser_cli.model.resolve import named_models  # lazy: kept out of `muser --help` (startup)

        with guarded(as_json=as_json):
            rows = families()
            names = named_models()
            if as_json:
                emit_json({"ok": True, "families": rows, "names": names})
                return
            typer.echo("Names -m takes (besides a model folder or a .gguf file):")
            for n in names:
                state = "installed" if n["installed"] else f"not installed: {n['install']}"
                chat = "" if n["chat_template"] else "; no chat template"
                typer.echo(f"  {n['name']:<14} {n['about']} ({state}{chat})")
            typer.echo("")
            import shutil
            import textwrap

            typer.echo(f"{'model_type':<20} {'rope':<12} {'NoPE layers':<18} {'torch':<6} {'mlx':<6} {'vllm':<6}")
            width = max(40, min(shutil.get_terminal_size((100, 24)).columns, 120) - 4)
            for r in rows:
                typer.echo(f"{r['model_type']:<20} {r['style']:<12} {r['nope']:<18} {'yes' if r['torch'] else '-':<6} "
                           f"{'yes' if r['mlx'] else '-':<6} {'yes' if r['vllm'] else '-':<6}".rstrip())
                for note in r["notes"]:  # each note wrapped under its family, not one line of hundreds
                    typer.echo(textwrap.fill(note, width=width, initial_indent="    ", subsequent_indent="      "))
