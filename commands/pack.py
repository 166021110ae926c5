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
        as_json: bool = typer.Option(False, "--json", help="Print a JSON summary (stderr when data goes to stdout)."),
    ) -> None:
        """Re-encode a kvpack frame by frame; every input frame is verified first."""
        from muser_cli.pack import pack

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
