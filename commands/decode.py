"""muser decode: kvpack -> text (or local fallback prefill with --prompt)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from muser_cli.commands._common import (
    default_threads, emit_json, err, guarded, info, open_input, progress_callback, read_text_input,
)
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS


def register(app: typer.Typer) -> None:
    @app.command("decode")
    def decode_cmd(
        src: str = typer.Argument("-", help="Input kvpack, or - for stdin (empty input + --prompt = fallback)."),
        model: Optional[str] = typer.Option(None, "--model", "-m", help="Model folder, .gguf file, or 'default'."),
        n: int = typer.Option(64, "-n", "--max-tokens", help="New tokens to generate."),
        engine: str = typer.Option("torch", "--engine", help="torch | mlx"),
        dtype: Optional[str] = typer.Option(None, "--dtype", help="Default: the pack's dtype."),
        prompt: Optional[str] = typer.Option(None, "--prompt", help="Prompt file: checks the pack, or prefills locally."),
        chat: bool = typer.Option(False, "--chat", help="The prompt uses the chat template."),
        chunk: Optional[int] = typer.Option(None, "--chunk", help=f"Chunk size for a local prefill (default {DEFAULT_CHUNK_TOKENS}, or a stored prefix's)."),
        no_reuse: bool = typer.Option(False, "--no-reuse", help="Do not look in the store before a local prefill."),
        store: bool = typer.Option(False, "--store", help="Keep the prompt's whole KV in the store afterwards."),
        temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
        top_p: float = typer.Option(1.0, "--top-p"),
        seed: Optional[int] = typer.Option(None, "--seed"),
        threads: int = typer.Option(0, "--threads", help="Compute threads (0 = default)."),
        audit: Optional[int] = typer.Option(None, "--audit", help="Spot-check the last N positions before the first token, besides 32 sampled across the whole prompt in every layer (default: 1, only for a pack from another engine, dtype or codec)."),
        no_audit: bool = typer.Option(False, "--no-audit", help="Skip the spot-check of a foreign pack (said so in --json)."),
        strict: bool = typer.Option(False, "--strict", help="With --prompt: refuse (65) a pack that does not match (another prompt, model or tokenizer, damaged, or refused by the spot-check) instead of setting it aside for a local prefill."),
        as_json: bool = typer.Option(False, "--json", help="One JSON object: text, token_ids, fallback, timings."),
        producer: Optional[str] = typer.Option(None, "--producer", help="Pull the prompt's KV from the resident producer at HOST:PORT (`prefill --serve`); needs --prompt; asks only for what the store lacks (a delta; not with --no-reuse); falls back to local prefill by itself."),
        timeout: Optional[float] = typer.Option(None, "--timeout", help="With --producer: seconds to wait for the producer's first frame before falling back."),
        send_text: bool = typer.Option(False, "--send-text", help="With --producer: send the prompt as text (and --chat) for the producer to tokenize; a pack with other token ids than this machine's is refused (fallback)."),
    ) -> None:
        """Decode from a kvpack; with no kvpack and --prompt, prefill locally on the same schedule."""
        from muser_cli.decode import decode
        from muser_cli.engines.base import Sampling

        with guarded(as_json=as_json):
            prompt_text = read_text_input(prompt) if prompt is not None else None
            reason = ""
            pulling = None
            if send_text and producer is None:
                from muser_cli.errors import UsageError

                raise UsageError("--send-text needs --producer HOST:PORT")
            if producer is not None:
                from muser_cli.errors import UsageError
                from muser_cli.serve import start_pull_pipe

                if prompt_text is None or src != "-":
                    raise UsageError("--producer needs --prompt FILE and no kvpack argument")
                pulling = start_pull_pipe(producer, prompt=prompt_text, model=model, chat=chat, chunk_tokens=chunk,
                                          dtype=dtype, engine=engine, timeout=timeout, have=not no_reuse,
                                          send_text=send_text)
                inp = pulling.reader
                reason = f"nothing from {producer}"
            elif src != "-" and not Path(src).exists() and prompt_text is not None:
                inp = None
                reason = f"no kvpack at {src}"
            else:
                inp = open_input(src)
                if src == "-" and sys.stdin.isatty():
                    inp = None
                    reason = "stdin is a terminal"
            sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
            out = decode(inp, model=model, prompt=prompt_text, chat=chat, max_new_tokens=n, engine=engine,
                         dtype=dtype, threads=threads or default_threads(), sampling=sampling, chunk_tokens=chunk,
                         fallback_reason=reason or "empty input", reuse=not no_reuse, store=store,
                         progress=progress_callback(), audit=0 if no_audit else audit, strict=strict)
            if out.set_aside:
                err(f"decode: warning: {out.set_aside}; the tokens come from a local prefill (--strict refuses it)")
            if pulling is not None:
                pulling.join(timeout=5)
                why = pulling.reason()
                if why and out.source == "partial+local":
                    out.reason = f"{out.reason}; {why}"
                elif why and out.fallback:
                    out.reason = why
            for line in out.store_problems:
                err(f"decode: store: {line}")
            held = out.held_tokens
            source = out.source
            if source == "store":
                info(f"decode: warm: all {held} rows of the prompt held in the store; no prefill")
            elif source == "store+local":
                info(f"decode: no handoff ({out.reason}); {held} rows from the store, prefilled "
                     f"{out.prompt_tokens - 1 - held} locally in {out.prefill_s:.2f}s")
            elif source == "partial+local":
                info(f"decode: the stream was cut ({out.reason}); kept {out.handoff_rows} verified rows, "
                     f"prefilled {out.local_rows} locally in {out.prefill_s:.2f}s")
            elif source == "delta":
                info(f"decode: delta merged with the stored prefix of {held} tokens")
            elif out.fallback and not out.set_aside:
                info(f"decode: fallback: no handoff ({out.reason}); prefilled {out.prompt_tokens} tokens locally "
                     f"in {out.prefill_s:.2f}s")
            spot = out.spot_check or {}
            if spot.get("skipped") and spot.get("reason"):
                err(f"decode: spot-check skipped (--no-audit) on a pack {spot['reason']}")
            elif spot.get("ran") and "worst_layer" in spot:
                info(f"decode: spot-check passed ({spot['reason']}): worst layer {spot['worst_layer']} rel "
                     f"{spot['worst_rel']:.3g} <= {spot['tolerance']:.3g}, {spot['ms']:.0f} ms")
            if spot.get("sampled"):
                s = spot["sampled"]
                info(f"decode: spot-check of {len(s['positions'])} positions across the prompt (seed {s['seed']}) "
                     f"passed: worst layer {s['worst_layer']} at position {s['worst_position']}, rel "
                     f"{s['worst_rel']:.3g} <= {s['tolerance']:.3g}, {s['ms']:.0f} ms")
            if as_json:
                emit_json(out.to_json())
            else:
                sys.stdout.write(out.text)
                if not out.text.endswith("\n"):
                    sys.stdout.write("\n")
                sys.stdout.flush()
                info(f"decode: {len(out.token_ids)} tokens, ttft {out.ttft_s * 1000:.0f} ms, "
                     f"{out.decode_tok_s:.1f} tok/s ({out.engine}, {out.dtype})")
