"""muser prefill: prompt text -> kvpack of prompt[:-1] on the canonical schedule."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from muser_cli.about import STARTED_UNIX
from muser_cli.commands._common import (
    binary_output, complete_model, default_threads, drain_on_signals, emit_json, guarded, info, json_log, log_json,
    open_input, progress_callback, read_text_input, trouble_line,
)
from muser_cli.errors import UsageError
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS
from muser_cli.units import size_text, utc_stamp


def register(app: typer.Typer) -> None:
    @app.command("prefill")
    def prefill_cmd(
        prompt: str = typer.Argument("-", help="Prompt text file, or - for stdin."),
        model: Optional[str] = typer.Option(None, "--model", "-m", autocompletion=complete_model, help="Model folder, .gguf file, or 'default'."),
        engine: str = typer.Option("torch", "--engine", help="torch | mlx | vllm"),
        dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | bfloat16 (default: the engine's)"),
        chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
        chunk: Optional[int] = typer.Option(None, "--chunk", help=f"Canonical prefill chunk size (default {DEFAULT_CHUNK_TOKENS}; with --have the manifest's)."),
        threads: int = typer.Option(0, "--threads", help="Compute threads, recorded in the pack (0 = $MUSER_THREADS, else the CPUs not busy elsewhere, up to 8)."),
        zstd: Optional[int] = typer.Option(None, "--zstd", help="Compress frames at zstd LEVEL, byte-grouped first (default: uncompressed)."),
        have: Optional[str] = typer.Option(None, "--have", help="Consumer's manifest (`muser reuse have`): write a delta of only what it lacks."),
        reuse: bool = typer.Option(False, "--reuse", help="Start from the deepest prefix this machine's store holds (implied by --have)."),
        store: bool = typer.Option(False, "--store", help="Also keep the result in this machine's store (with --serve: every request's, and continue from the store's deepest prefix)."),
        output: str = typer.Option("-", "--output", "-o", help="Output kvpack file, or - for stdout."),
        as_json: bool = typer.Option(False, "--json", help="Print a JSON summary: on stdout with -o FILE; on stderr when the kvpack goes to stdout."),
        vllm_opt: Optional[List[str]] = typer.Option(None, "--vllm-opt", help="vLLM engine option KEY=VALUE (repeatable; over $MUSER_VLLM_OPTS), e.g. max_model_len=4096. docs/vllm.md"),
        serve: Optional[str] = typer.Option(None, "--serve", help="Stay resident on HOST:PORT (port 0 picks one): answer enrolled consumers' `receive --from` / `decode --producer` requests, model loaded once."),
        max_queue: int = typer.Option(4, "--max-queue", help="With --serve: requests that may wait while one computes; more are told busy at once."),
        idle_timeout: Optional[float] = typer.Option(None, "--idle-timeout", help="With --serve: longest silence tolerated from an admitted consumer (its Ready, its reads), seconds (default 30)."),
        metrics: Optional[str] = typer.Option(None, "--metrics", help="With --serve: serve Prometheus metrics (plain HTTP /metrics) on HOST:PORT, 127.0.0.1 when no host is given. docs/serve.md"),
        history: Optional[bool] = typer.Option(None, "--history/--no-history", help="Sliding-window layers carry every row computed, so another engine's numeric gate can check every layer anywhere in the prompt (default: where the engine can; --no-history: the window only, for a consumer on this same engine). docs/kvpack.md 1.3"),
        state_every: int = typer.Option(1, "--state-every", help="A model with recurrent state layers (qwen3_next, granitemoehybrid): ship their snapshot every N chunks and at the end, not every chunk (a smaller pack; a cut stream resumes from the last snapshot that arrived); with --serve, every request's pack. docs/kvpack.md 2.5"),
        max_batch: int = typer.Option(8, "--max-batch", help="With --serve --engine vllm: requests computed at once, as one vLLM batch (those waiting when the engine is free); torch and mlx compute one at a time."),
    ) -> None:
        """Prefill a prompt and write a kvpack of prompt[:-1] (the consumer runs the last token).

        The kvpack header goes out first and each chunk's frames as soon as the chunk is
        computed (torch and mlx engines), so `prefill | send` overlaps compute and the wire.
        """
        from muser_cli.produce.prefill import prefill  # lazy: kept out of `muser --help` (startup)

        with guarded():
            if serve is not None and as_json:  # the service's log: every stderr line JSON from here on
                json_log()
            options = None
            if vllm_opt:
                from muser_cli.engines.vllm.options import parse_options  # lazy: kept out of `muser --help` (startup)

                options = parse_options(vllm_opt, source="--vllm-opt")
            if serve is not None:
                _refuse_per_request_options(prompt=prompt, chat=chat, chunk=chunk, zstd=zstd, have=have, reuse=reuse,
                                            output=output)
                _serve(serve, model=model, engine=engine, dtype=dtype, threads=threads, max_queue=max_queue,
                       idle_s=idle_timeout, as_json=as_json, options=options,
                       store=store, max_batch=max_batch, metrics=metrics, history=history, state_every=state_every)
                return
            if metrics is not None or idle_timeout is not None:
                raise UsageError(f"{'--metrics' if metrics is not None else '--idle-timeout'} needs --serve HOST:PORT")
            text = read_text_input(prompt)
            manifest = None
            if have is not None:
                from muser_cli.reuse import HaveManifest  # lazy: kept out of `muser --help` (startup)

                with open_input(have) as f:
                    manifest = HaveManifest.loads(f.read(1 << 20 | 1))
            codec = "zstd+bytegroup" if zstd else "none"
            with binary_output(output) as out:
                res = prefill(text, out, model=model, engine=engine, dtype=dtype, chat=chat, chunk_tokens=chunk,
                              threads=threads or default_threads(), codec=codec, level=zstd or 1, have=manifest,
                              reuse=reuse, store=store, progress=progress_callback(), engine_options=options,
                              history=history, state_every=state_every)
            summary = {"tokens": res.token_count, "rows": res.token_count - 1, "dtype": res.header.dtype,
                       "engine": engine, "bytes": res.bytes_written, "load_s": round(res.load_s, 4),
                       "prefill_s": round(res.prefill_s, 4), "write_s": round(res.write_s, 4),
                       "held_tokens": res.held_tokens, "reused_tokens": res.reused_tokens, "stored": res.stored,
                       "started_unix": round(STARTED_UNIX, 6), "prefill_start_s": round(res.prefill_start_s, 6),
                       "first_frame_s": round(res.first_frame_s, 6) if res.first_frame_s is not None else None}
            if as_json and output not in ("-", None):
                emit_json(summary)
            elif as_json:  # the kvpack holds stdout: the one JSON object goes to stderr
                sys.stderr.write(json.dumps(summary, sort_keys=True) + "\n")
                sys.stderr.flush()
            else:
                delta = f", delta from token {res.held_tokens}" if res.held_tokens else ""
                reused = f", {res.reused_tokens} rows from the store" if res.reused_tokens else ""

                info(f"prefill: {res.token_count} tokens, {size_text(res.bytes_written)} written{delta}{reused}, "
                     f"prefill {res.prefill_s:.2f} s ({res.header.dtype}, {engine})")


_REUSED_FROM = {"memory": "reused from the previous request's prompt", "store": "from the reuse store"}


def _refuse_per_request_options(*, prompt: str, chat: bool, chunk: Optional[int], zstd: Optional[int],
                                have: Optional[str], reuse: bool, output: str) -> None:
    """``--serve`` computes what each request names: one pack's options are a usage error."""

    given = {"a prompt": prompt != "-", "--chat": chat, "--chunk": chunk is not None, "--zstd": bool(zstd),
             "--have": bool(have), "--reuse": reuse, "-o": output not in ("-", None)}
    if any(given.values()):
        raise UsageError("--serve takes no prompt, --chat, --chunk, --zstd, --have, --reuse or -o",
                         hint="each request names its prompt, chunk size and dtype; --store keeps and reuses rows")


def _serve(listen: str, *, model: Optional[str], engine: str, dtype: Optional[str], threads: int, max_queue: int,
           as_json: bool, idle_s: Optional[float] = None, options: Optional[dict], store: bool = False, max_batch: int = 8,
           metrics: Optional[str] = None, history: Optional[bool] = None, state_every: int = 1) -> None:
    """``prefill --serve``: the resident producer; SIGTERM or SIGHUP finishes the running request,
    turns the waiting ones away, prints one summary line and exits 0."""
    from muser_cli.pulllane.producer import serve  # lazy: kept out of `muser --help` (startup)

    if engine not in ("torch", "mlx", "vllm"):
        raise UsageError(f"--serve runs the torch, mlx or vllm engine, not {engine!r}")

    def say(message: str, event: str = "message", **fields) -> None:  # every service line carries its time
        if as_json:  # a JSON line like the others (its ts), the text in its message
            log_json({"event": event, "message": message, **fields})
        else:
            info(f"{utc_stamp()} {message}")

    def draining(signame: str) -> None:
        if as_json:
            log_json({"event": "draining", "signal": signame})
        else:
            say(f"prefill: draining on {signame}: the running request finishes, new ones are turned away")

    stop, got = drain_on_signals(on_signal=draining)

    observe, live = _metrics(metrics, say)

    def on_event(kind: str, f: dict) -> None:
        if observe is not None:
            observe(kind, f)
        if kind == "listening":
            # with --json the text goes on past the address (a space after it), as readers of the text line expect
            say(f"prefill: listening on {f['address']}" + (" (mutual TLS)" if as_json else ""), "listening",
                address=f["address"])
        elif kind in ("request", "probe", "tls_failed", "reachability", "admitted", "warning", "error",
                      "warmed", "promise", "paused") and as_json:
            sys.stderr.write(json.dumps({"event": kind, "ts": utc_stamp(), **f}, sort_keys=True, default=str) + "\n")
            sys.stderr.flush()
        elif kind == "request":
            what = f"{f.get('tokens')} tokens, {f.get('bytes', 0)} bytes" if f.get("outcome") == "served" else f.get("reason", "")
            if f.get("outcome") == "served" and f.get("reused_rows"):
                what += f", {f['reused_rows']} rows " + _REUSED_FROM.get(f.get("reused_from"), f"from {f.get('reused_from')}")
            if f.get("outcome") == "served" and (f.get("batch") or 1) > 1:
                what += f", computed in a batch of {f['batch']}"
            say(f"prefill: {f.get('outcome')} {f.get('request_id') or ''} from {f.get('peer')}: {what}")
        elif kind == "probe":
            rates = " ".join(f"{d} {f[d + '_bytes'] / f[d + '_s'] / 1e6:.0f} MB/s" for d in ("up", "down")
                             if f.get(d + "_s"))
            say(f"prefill: link probe {f.get('outcome')} from {f.get('peer')}: {rates or f.get('reason', '')}")
        elif kind == "paused":
            say(f"prefill: paused {f.get('request_id') or ''} at a chunk boundary for {f.get('paused_s')} s: a "
                f"shorter request with an earlier deadline went first")
        elif kind == "tls_failed":  # counted in the summary's "refused"
            say(f"prefill: refused {f.get('peer')}: {f.get('reason')}")
        elif kind == "warmed":
            cal = " ".join(f"{n} tokens {t:.2f} s," for n, t in f.get("calibration") or [])
            say(f"prefill: model loaded in {f['load_s']:.2f} s, engine warmed in {f['warm_s']:.2f} s"
                + (f" (calibrated: {cal.rstrip(',')})" if cal else ""))
        elif kind == "reachability":  # `node check`'s TCP connect: a check, not a refusal
            say(f"prefill: reachability check from {f.get('peer')} (a TCP connect, no TLS)")
        elif kind in ("warning", "error"):  # never dropped unread (issue 25 item 5)
            say(trouble_line("prefill", kind, f) or "")

    counts = serve(listen=listen, model=model, engine=engine, dtype=dtype, threads=threads or default_threads(),
                   max_queue=max_queue, idle_s=idle_s, on_event=on_event, engine_options=options, stop=stop, store=store,
                   max_batch=max_batch, live=live, history=history, state_every=state_every)
    summary = {"signal": got.get("signal"), **{k: counts[k] for k in ("served", "refused", "failed", "turned_away")},
               "tls_refused": counts.get("tls_failed", 0)}
    if as_json:
        sys.stderr.write(json.dumps({"event": "stopped", "ts": utc_stamp(), **summary}, sort_keys=True) + "\n")
        sys.stderr.flush()
    else:
        say(f"prefill: stopped on {summary['signal'] or 'request'}: {summary['served']} served, "
            f"{summary['refused'] - summary['turned_away'] + summary['tls_refused']} refused, {summary['failed']} failed, "
            f"{summary['turned_away']} turned away while draining; none left in flight")


def _metrics(listen: Optional[str], say):
    """``--metrics HOST:PORT``: the producer's Prometheus metrics (and ``/connections``) served;
    (the event observer, where the server keeps its open connections), or (None, None)."""
    if listen is None:
        return None, None
    from muser_cli.pulllane.metrics import serve_producer_metrics  # lazy: kept out of `muser --help` (startup)

    observe, (host, port), live = serve_producer_metrics(listen)
    say(f"prefill: metrics on http://{host}:{port}/metrics (plain HTTP)", "metrics", address=f"{host}:{port}")
    return observe, live
