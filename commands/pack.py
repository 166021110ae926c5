"""muser pack: re-encode a kvpack (codec, quantization, and with --have a delta)."""

from __future__ import annotations

from typing import Optional

import typer

from muser_cli.commands._common import binary_output, emit_json, guarded, info, open_input


def register(app: typer.Typer) -> None:
    @app.command("pack")
    def pack_cmd(
        src: str = typer.Argument("-", help="Input kvpack, or - for stdin."),
        output: str = typer.Option("-", "--output", "-o", help="Output kvpack, or - for stdout."),
        zstd: int = typer.Option(1, "--zstd", help="zstd LEVEL (frames byte-grouped, then compressed)."),
        no_zstd: bool = typer.Option(False, "--no-zstd", help="Store frames uncompressed (mmap-friendly)."),
        quant: str = typer.Option("none", "--quant", help="none | int8 (lossy: scale per layer x K/V x head x token; error recorded in the header)."),
        have: Optional[str] = typer.Option(None, "--have", help="Manifest of what the consumer holds (delta)."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout: the summary (needs -o FILE; with the kvpack on stdout, a one-line note goes to stderr instead), or with --info the description."),
        show_info: bool = typer.Option(False, "--info", help="Verify and describe the pack; write nothing."),
    ) -> None:
        """Re-encode a kvpack frame by frame; every input frame is verified first.

        In a pipe each frame moves on as soon as it verified (`prefill | pack | send`
        streams); a cut or damaged input never ends in an end frame, and -o FILE is
        written only when the whole pack verified.
        """
        from muser_cli.pack import pack

        if show_info:
            with guarded(as_json=as_json), open_input(src) as inp:
                _show_info(inp, as_json=as_json)
            return
        with guarded():
            manifest = None
            if have is not None:
                from muser_cli.reuse import HaveManifest

                with open_input(have) as f:
                    manifest = HaveManifest.loads(f.read(1 << 20 | 1))
            codec = "none" if no_zstd else "zstd+bytegroup"
            with open_input(src) as inp, binary_output(output) as out:
                res = pack(inp, out, codec=codec, level=zstd, quant=quant, have=manifest)
            summary = {"frames": res.frames, "bytes_in": res.bytes_in, "bytes_out": res.bytes_out,
                       "kv_bytes": res.raw_bytes, "ratio": round(res.ratio, 4), "codec": res.codec,
                       "seconds": round(res.seconds, 4), "held_tokens": res.held_tokens}
            if as_json and output not in ("-", None):
                emit_json(summary)
            else:
                delta = f", delta from token {res.held_tokens}" if res.held_tokens else ""
                info(f"pack: {res.frames} frames, {res.bytes_in} -> {res.bytes_out} bytes "
                     f"({res.ratio:.2f}x of raw KV, {res.codec}{delta})")


def _show_info(inp, *, as_json: bool) -> None:
    from muser_cli.pack import pack_info

    d = pack_info(inp)
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
        f"  file       {d['pack_bytes']:,} bytes, codec {d['codec']}, ratio {d['ratio']}x",
        f"  quant      {qline}",
        "  producer   " + ", ".join(f"{k}={v}" for k, v in sorted(d["producer"].items())),
    ]
    typer.echo("\n".join(lines))
