"""muser decode: kvpack -> text (or local fallback prefill with --prompt)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import BinaryIO, List, Optional

import typer

from muser_cli.commands._common import (
    complete_model, default_threads, emit_json, err, guarded, info, json_log, log_json, open_input,
    progress_callback, read_text_input,
)
from muser_cli.consumer.source import RowsFrom
from muser_cli.errors import UsageError
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS


def register(app: typer.Typer) -> None:
    @app.command("decode")
    def decode_cmd(
        src: str = typer.Argument("-", help="Input kvpack, or - for stdin (empty input + --prompt = fallback)."),
        model: Optional[str] = typer.Option(None, "--model", "-m", autocompletion=complete_model, help="Model folder, .gguf file, or 'default'."),
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
        as_json: bool = typer.Option(False, "--json", help="One JSON object: text, token_ids, fallback, timings (docs/cli-contract.md). With --serve: every stderr line a JSON object (the log: notes, warnings and errors too)."),
        producer: Optional[List[str]] = typer.Option(None, "--producer", help="Pull the prompt's KV from the resident producer at HOST:PORT (`prefill --serve`); needs --prompt; asks only for what the store lacks (a delta; not with --no-reuse); falls back to local prefill by itself."),
        timeout: Optional[float] = typer.Option(None, "--timeout", help="With --producer: seconds to wait for the producer's first frame before falling back."),
        send_text: bool = typer.Option(False, "--send-text", help="With --producer: send the prompt as text (and --chat) for the producer to tokenize; a pack with other token ids than this machine's is refused (fallback)."),
        serve: Optional[str] = typer.Option(None, "--serve", help="Stay resident on HOST:PORT (127.0.0.1 unless --api-key; port 0 picks one) and answer OpenAI-compatible requests (/v1/chat/completions, /v1/completions), Anthropic's /v1/messages and /metrics; --producer may repeat (the least busy is asked). docs/serve.md"),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MUSER_API_KEY", help="With --serve: clients must send Authorization: Bearer KEY or x-api-key: KEY (needed to listen beyond loopback)."),
        max_queue: int = typer.Option(8, "--max-queue", help="With --serve: requests that may wait for the engine; more are answered 429."),
        max_batch: int = typer.Option(4, "--max-batch", help="With --serve: requests running at once, taking the engine's turns; their decode steps are computed together as one batch (see --exact), a prefill chunk between two steps; more wait in the queue."),
        exact: bool = typer.Option(False, "--exact", help="With --serve: each request decodes alone, one sequence per engine call, so its tokens are exactly its tokens alone (default: concurrent requests step together in one batched call, whose rounding can change a greedy token; docs/serve.md)."),
        turn_memory: float = typer.Option(1024.0, "--turn-memory", metavar="MB", help="With --serve: keep each answered conversation's rows, its prompt and the answer, in memory (most recently used first, up to MB megabytes), so the next turn computes only its new tokens and never pulls a held prompt again; 0: off, every prompt's rows on the canonical schedule (equal to a cold prefill). docs/serve.md"),
        drain: float = typer.Option(25.0, "--drain", metavar="S", help="With --serve: seconds SIGTERM (or Ctrl-C) waits for the queued and running requests to finish, new ones refused (503); past it, or at a second signal, the server ends each one left itself (a 503, or an error event that ends its stream; a log line each) and exits 1."),
        prefill_deadline: Optional[float] = typer.Option(None, "--prefill-deadline", help="With --serve: seconds to wait for a producer's first frame before prefilling locally (a request may set muser_prefill_deadline). Default: --timeout, else no deadline of its own (a silent producer is dropped after the link's 30 s idle limit)."),
    ) -> None:
        """Decode from a kvpack; with no kvpack and --prompt, prefill locally on the same schedule."""
        from muser_cli.consumer.decode import decode  # lazy: kept out of `muser --help` (startup)
        from muser_cli.consumer.lane import Source, answer  # lazy: kept out of `muser --help` (startup)
        from muser_cli.engines.base import Sampling  # lazy: kept out of `muser --help` (startup)

        with guarded(as_json=as_json):
            if serve is not None:
                _serve_decode(serve, model=model, engine=engine, dtype=dtype, threads=threads or default_threads(),
                              producers=producer or [], api_key=api_key, max_queue=max_queue, max_batch=max_batch, exact=exact,
                              turn_memory=turn_memory, deadline=prefill_deadline if prefill_deadline is not None else timeout, chunk=chunk,
                              reuse=not no_reuse, store=store, audit=0 if no_audit else audit, n=n, drain=drain,
                              others=(src, prompt, chat, as_json, send_text))
                return
            if producer is not None and len(producer) > 1:
                raise UsageError("--producer is given more than once", hint="several producers: with --serve")
            producer = producer[0] if producer else None
            prompt_text = read_text_input(prompt) if prompt is not None else None
            if send_text and producer is None:
                raise UsageError("--send-text needs --producer HOST:PORT")
            pulling = None
            if producer is not None:
                from muser_cli.consumer.pull import start_pull_pipe  # lazy: kept out of `muser --help` (startup)

                if prompt_text is None or src != "-":
                    raise UsageError("--producer needs --prompt FILE and no kvpack argument")
                pulling = start_pull_pipe(producer, prompt=prompt_text, model=model, chat=chat, chunk_tokens=chunk,
                                          dtype=dtype, engine=engine, timeout=timeout, have=not no_reuse,
                                          send_text=send_text, threads=threads or default_threads(), race=True)
                inp, reason = pulling.reader, pulling.empty_reason
            else:
                inp, reason = _pack_input(src, prompt_text)
            sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
            printer = None if as_json else _Printer(model)
            given: list[int] = []  # tokens given out: after one, a refusal is the answer

            def on_token(token: int) -> None:
                given.append(token)
                if printer is not None:
                    printer.push(token)

            def run(inp: BinaryIO | None, why: str):
                return decode(inp, model=model, prompt=prompt_text, chat=chat, max_new_tokens=n, engine=engine,
                              dtype=dtype, threads=threads or default_threads(), sampling=sampling, chunk_tokens=chunk,
                              fallback_reason=why or "empty input", reuse=not no_reuse, store=store,
                              progress=progress_callback(), audit=0 if no_audit else audit, strict=strict,
                              on_token=on_token, hedge=pulling if inp is not None else None)

            source = Source(inp, producer if pulling is not None else None, reason, live=pulling, pooled=False)
            out = answer(source, run, recompute=lambda exc: not strict and not given).out
            if printer is not None:  # the text is whole, and its line ended, before any note: never inside it
                printer.finish(out.text)
                if not out.text.endswith("\n"):
                    sys.stdout.write("\n")
                sys.stdout.flush()
            if out.set_aside:
                err(f"decode: warning: {out.set_aside}; the tokens come from a local prefill (--strict refuses it)")
            if pulling is not None:
                pulling.explain(out)  # why the pull gave nothing, or not all, in decode's reason
                pulling.learn(out)  # what this run measured: the next run's route predicts from it (issue #39)
            _report(out, pulling, as_json=as_json)


def _pack_input(src: str, prompt_text: Optional[str]) -> tuple[Optional[BinaryIO], str]:
    """The kvpack to decode from (None: none, the prompt is prefilled here) and the reason an
    answer prefilled here gives."""
    if src != "-" and not Path(src).exists() and prompt_text is not None:
        return None, f"no kvpack at {src}"
    inp = open_input(src)
    if src == "-" and sys.stdin.isatty():
        return None, "stdin is a terminal"
    return inp, ""


def _report(out, pulling, *, as_json: bool) -> None:
    """What became of the request, on stderr (where its rows came from, the gate's result) and,
    with --json, the answer on stdout with its route."""
    for line in out.store_problems:
        err(f"decode: store: {line}")
    held = out.held_tokens
    source = out.source
    if source == RowsFrom.STORE:
        info(f"decode: warm: all {held} rows of the prompt held in the store; no prefill")
    elif source == RowsFrom.STORE_LOCAL:
        info(f"decode: no handoff ({out.reason}); {held} rows from the store, prefilled "
             f"{out.prompt_tokens - 1 - held} locally in {out.prefill_s:.2f}s")
    elif source == RowsFrom.PARTIAL_LOCAL:
        info(f"decode: the stream was cut ({out.reason}); kept {out.handoff_rows} verified rows, "
             f"prefilled {out.local_rows} locally in {out.prefill_s:.2f}s")
    elif source == RowsFrom.DELTA:
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
        shown = out.to_json()
        if pulling is not None and pulling.plan is not None:  # the route: every path's predicted TTFT, the choice
            shown["route"] = pulling.plan.to_json(out.source)
            if pulling.promise is not None:
                shown["route"]["promise"] = pulling.promise
        emit_json(shown)
    else:  # ttft counts from the pack's first byte (or the start) and leaves the model load out: say both
        info(f"decode: {len(out.token_ids)} tokens, ttft {out.ttft_s * 1000:.0f} ms (not counting the "
             f"model load, {out.load_s:.1f} s), {out.decode_tok_s:.1f} tok/s ({out.engine}, {out.dtype})")


class _Printer:
    """The text on stdout as tokens are decided, flushed per piece (a terminal and a pipe alike)."""

    def __init__(self, model: Optional[str]) -> None:
        self.model = model
        self.stream = None

    def push(self, token: int) -> None:
        if self.stream is None:
            from muser_cli.model.resolve import resolve_model  # lazy: kept out of `muser --help` (startup)
            from muser_cli.service.textstream import TextStream  # lazy: kept out of `muser --help` (startup)

            self.stream = TextStream(resolve_model(self.model))
        piece = self.stream.push(token)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    def finish(self, text: str) -> None:
        """The rest of ``text`` (all of it if no token was streamed)."""
        sent = self.stream.text if self.stream is not None else ""
        if text.startswith(sent):
            sys.stdout.write(text[len(sent):])
        else:  # the tokenizer joined the pieces otherwise: the whole text, on a line of its own
            sys.stdout.write("\n" + text)


def _serve_decode(listen: str, *, model: Optional[str], engine: str, dtype: Optional[str], threads: int,
                  producers: list[str], api_key: Optional[str], max_queue: int, max_batch: int, exact: bool,
                  turn_memory: float, deadline: Optional[float],
                  chunk: Optional[int], reuse: bool, store: bool, audit: Optional[int], n: int, drain: float,
                  others: tuple) -> None:
    """``decode --serve HOST:PORT``: the options checked, then the OpenAI-compatible service
    (muser_cli/service, docs/serve.md); the exit status is the drain's."""
    from muser_cli.service.app import (  # lazy: kept out of `muser --help` (startup)
        ServeOptions,
        serve_openai,
        utc_stamp,
    )
    from muser_cli.service.worker import Config  # lazy: kept out of `muser --help` (startup)

    src, prompt, chat, as_json, send_text = others
    if as_json:  # every stderr line JSON: the notes, warnings and errors too, no "listening on" text line
        json_log()
    if src != "-" or prompt is not None or chat or send_text:
        raise UsageError("--serve takes no kvpack, --prompt, --chat or --send-text",
                         hint="each request brings its prompt or messages")
    if max_queue < 0:
        raise UsageError("--max-queue must be >= 0")
    if max_batch < 1:
        raise UsageError("--max-batch must be at least 1")
    if deadline is not None and deadline < 0:
        raise UsageError("--prefill-deadline must be >= 0")
    if not turn_memory >= 0:
        raise UsageError("--turn-memory must be >= 0 (megabytes; 0: off)")
    if n < 1:
        raise UsageError("-n must be at least 1")
    if not drain >= 0:
        raise UsageError("--drain must be >= 0 (seconds)")
    if engine not in ("torch", "mlx"):
        raise UsageError(f"--serve decodes on the torch or mlx engine, not {engine!r}")
    from muser_cli.consumer.pool import ProducerPool  # lazy: kept out of `muser --help` (startup)

    ProducerPool(producers)  # a bad or repeated address: a usage error before the model loads
    config = Config(model=model, engine=engine, dtype=dtype, threads=threads, producers=tuple(producers),
                    prefill_deadline=deadline, max_queue=max_queue, chunk_tokens=chunk, reuse=reuse, store=store,
                    audit=audit, max_batch=max_batch, exact=exact, turn_memory_mb=turn_memory)
    model_id = Path(model).name if model and "/" in model else (model or "default")
    options = ServeOptions(listen=listen, api_key=api_key or None, model_id=model_id,
                           default_max_tokens=n, drain_s=drain)
    rc = serve_openai(config, options, log=log_json,  # its JSON log lines, each with its ts
                      on_listening=None if as_json else lambda a: info(f"{utc_stamp()} decode: listening on http://{a}/v1"))
    if rc:
        raise typer.Exit(rc)
