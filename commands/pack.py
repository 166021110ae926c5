"""muser pack: re-encode a kvpack (codec, quantization, and with --have a delta)."""

from __future__ import annotations

from typing import Optional

import typer

from muser_cli.commands._common import (
    binary_output, complete_model, emit_json, guarded, info, open_input, plural, read_text_input, size_text,
)


def register(app: typer.Typer) -> None:
    @app.command("pack")
    def pack_cmd(
        src: str = typer.Argument("-", help="Input kvpack, or - for stdin."),
        output: str = typer.Option("-", "--output", "-o", help="Output kvpack, or - for stdout."),
        zstd: int = typer.Option(1, "--zstd", help="zstd LEVEL (frames byte-grouped, then compressed)."),
        no_zstd: bool = typer.Option(False, "--no-zstd", help="Store frames uncompressed (mmap-friendly)."),
        quant: str = typer.Option("none", "--quant", help="none | int8 (lossy: scale per layer x K/V x head x token; error recorded in the header)."),
        have: Optional[str] = typer.Option(None, "--have", help="Manifest of what the consumer holds (delta)."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object: the summary (on stdout with -o FILE; with the kvpack on stdout, on stderr as one line), or with --info the description."),
        show_info: bool = typer.Option(False, "--info", help="Verify and describe the pack; write nothing."),
        export_to: Optional[str] = typer.Option(None, "--export", help="mlx-lm: write the pack as an mlx-lm prompt cache (safetensors) that mlx_lm.generate --prompt-cache-file loads; it holds prompt[:-1], so continue with the last prompt token (docs/interop.md)."),
        import_from: Optional[str] = typer.Option(None, "--import", help="mlx-lm: read an mlx-lm prompt cache (SRC) and write a kvpack bound to -m and --prompt."),
        model: Optional[str] = typer.Option(None, "--model", "-m", autocompletion=complete_model, help="With --import: the model (required); with --export: recorded as the file's model (default: the pack's, if known here)."),
        prompt: Optional[str] = typer.Option(None, "--prompt", help="With --import: the prompt file the cache was made from (required)."),
        chat: bool = typer.Option(False, "--chat", help="With --import: the prompt uses the chat template."),
    ) -> None:
        """Re-encode a kvpack frame by frame; every input frame is verified first.

        In a pipe each frame moves on as soon as it verified (`prefill | pack | send`
        streams); a cut or damaged input never ends in an end frame, and -o FILE is
        written only when the whole pack verified.
        """
        from muser_cli.produce import pack as packing  # lazy: kept out of `muser --help` (startup)

        if export_to is not None or import_from is not None:
            with guarded(as_json=as_json):
                _interop(src, output, export_to=export_to, import_from=import_from, model=model, prompt=prompt,
                         chat=chat, level=zstd, no_zstd=no_zstd, as_json=as_json)
            return
        if show_info:
            with guarded(as_json=as_json), open_input(src) as inp:
                _show_info(packing.pack_info(inp), as_json=as_json)
            return
        with guarded():
            manifest = None
            if have is not None:
                with open_input(have) as f:
                    manifest = packing.read_have(f)
            with open_input(src) as inp, binary_output(output) as out:
                res = packing.pack(inp, out, codec=packing.codec_for(no_zstd), level=zstd, quant=quant, have=manifest)
            if as_json:
                _json_summary(res.to_json(), output)
            else:
                delta = f", delta from token {res.held_tokens}" if res.held_tokens else ""
                share = f"{res.bytes_out / res.raw_bytes:.0%} of the raw KV's {size_text(res.raw_bytes)}" if res.raw_bytes else "no KV"
                info(f"pack: {plural(res.frames, 'frame')}, {size_text(res.bytes_in)} in, {size_text(res.bytes_out)} out "
                     f"({share}, codec {res.codec}{delta})")


def _interop(src: str, output: str, *, export_to: str | None, import_from: str | None, model: str | None,
             prompt: str | None, chat: bool, level: int, no_zstd: bool, as_json: bool) -> None:
    """--export / --import: a kvpack to or from another tool's cache file (docs/interop.md)."""
    from muser_cli.produce import pack as packing  # lazy: kept out of `muser --help` (startup)

    packing.interop_format(export_to, import_from)
    from muser_cli.interop import mlx_lm  # lazy: kept out of `muser --help` (startup)

    if export_to is not None:
        with open_input(src) as inp, binary_output(output) as out:
            res = mlx_lm.export_mlx_lm(inp, out, model=model)
        if as_json:
            _json_summary(packing.export_summary(res), output)
            return
        info(f"pack: exported {res.rows} rows (prompt[:-1]) as an mlx-lm prompt cache, {size_text(res.bytes_out)}; "
             f"continue with the last prompt token, id {res.next_token_ids[0]}")
        if not res.model_resolved:
            info(f"pack: the file names model {res.model_ref!r}; pass -m FOLDER so that mlx_lm.generate can load it")
        return
    packing.check_import(src, model=model, prompt=prompt)
    text = read_text_input(prompt)
    with binary_output(output) as out:
        res = mlx_lm.import_mlx_lm(src, out, model=model, prompt=text, chat=chat, codec=packing.codec_for(no_zstd),
                                   level=level)
    if as_json:
        _json_summary(packing.import_summary(res), output)
        return
    note = " (the file held the whole prompt; its last row is left to the consumer)" if res.dropped_last_row else ""
    info(f"pack: imported an mlx-lm prompt cache of {res.cached_positions} positions as a kvpack of "
         f"{res.tokens} tokens, {size_text(res.bytes_out)}{note}")


def _json_summary(obj: dict, output: str | None) -> None:
    """--json's summary object: on stdout beside ``-o FILE``; on stderr (one line) when the
    kvpack itself is on stdout, where JSON would corrupt it."""
    if output not in ("-", None):
        emit_json(obj)
        return
    import json
    import sys

    sys.stderr.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stderr.flush()


def _show_info(d: dict, *, as_json: bool) -> None:
    if as_json:
        emit_json(d)
        return
    kinds = ", ".join(f"{n} {k}" for k, n in d["layers"].items())
    by_kind = ", ".join(f"{k} {v:,}" for k, v in d["kv_bytes_by_kind"].items())
    quant = d["quant"]
    qline = quant["scheme"]
    if quant["scheme"] != "none":
        err = quant.get("error", {})
        qline += (f" (max abs error K {err.get('k_max_abs', 0):.4g}, V {err.get('v_max_abs', 0):.4g}; "
                  f"mean K {err.get('k_mean_abs', 0):.3g}, V {err.get('v_mean_abs', 0):.3g})")
    lines = [
        f"kvpack {d['version']}  verified ({d['frames']} frames, root {d['root_digest'][:16]}…)",
        f"  model      {d['model']}  {d['model_fingerprint'][:23]}…",
        f"  tokenizer  {d['tokenizer_fingerprint'][:23]}…",
        f"  tokens     {d['tokens']} (rows {d['rows'][0]}..{d['rows'][1]}{', delta' if d['delta'] else ''}), "
        f"chunk {d['chunk_tokens']}, {d['dtype']}",
        f"  layers     {kinds}",
        f"  KV bytes   {d['kv_bytes']:,} ({by_kind})",
        f"  file       {d['pack_bytes']:,} bytes, codec {d['codec']}"
        + (f" (payload {1 / d['ratio']:.0%} of the KV bytes)" if d.get("ratio") else ""),
        f"  quant      {qline}",
        "  producer   " + ", ".join(f"{k}={v}" for k, v in sorted(d["producer"].items())),
    ]
    typer.echo("\n".join(lines))
