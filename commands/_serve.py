"""``muser decode --serve HOST:PORT``: the command layer of the OpenAI-compatible service
(muser_cli/service). It checks the options, then hands over; the exit status is the drain's."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from muser_cli.commands._common import err, info


def serve_decode(listen: str, *, model: Optional[str], engine: str, dtype: Optional[str], threads: int,
                 producers: list[str], api_key: Optional[str], max_queue: int, deadline: Optional[float],
                 chunk: Optional[int], reuse: bool, store: bool, audit: Optional[int], n: int, others: tuple) -> None:
    from muser_cli.errors import UsageError
    from muser_cli.service.app import ServeOptions, serve_openai, utc_stamp
    from muser_cli.service.worker import Config

    src, prompt, chat, as_json, send_text = others
    if src != "-" or prompt is not None or chat or as_json or send_text:
        raise UsageError("--serve takes no kvpack, --prompt, --chat, --json or --send-text",
                         hint="each request brings its prompt or messages")
    if max_queue < 0:
        raise UsageError("--max-queue must be >= 0")
    if deadline is not None and deadline < 0:
        raise UsageError("--prefill-deadline must be >= 0")
    if n < 1:
        raise UsageError("-n must be at least 1")
    if engine not in ("torch", "mlx"):
        raise UsageError(f"--serve decodes on the torch or mlx engine, not {engine!r}")
    from muser_cli.batch.pool import ProducerPool

    ProducerPool(producers)  # a bad or repeated address: a usage error before the model loads
    config = Config(model=model, engine=engine, dtype=dtype, threads=threads, producers=tuple(producers),
                    prefill_deadline=deadline, max_queue=max_queue, chunk_tokens=chunk, reuse=reuse, store=store,
                    audit=audit)
    model_id = Path(model).name if model and "/" in model else (model or "default")
    options = ServeOptions(listen=listen, api_key=api_key or None, model_id=model_id,
                           default_max_tokens=n)
    rc = serve_openai(config, options, log=_json_line,
                      on_listening=lambda a: info(f"{utc_stamp()} decode: listening on http://{a}/v1"))
    if rc:
        raise typer.Exit(rc)


def _json_line(record: dict) -> None:
    """One JSON line on stderr per request, start, drain and stop (its ``ts`` first)."""
    import json

    err(json.dumps(record, sort_keys=True, default=str))
