"""``prefill``: tokenize a prompt, run the canonical schedule, write a kvpack of prompt[:-1]."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

from muser_cli import __version__
from muser_cli.engines.base import DEFAULT_CHUNK_TOKENS, ModelInfo, ProgressFn
from muser_cli.errors import DataError, UsageError
from muser_cli.kvpack import PackHeader, write_pack
from muser_cli.kvpack.format import MAX_FRAME_ROWS

if TYPE_CHECKING:
    from muser_cli.reuse.manifest import HaveManifest

# float32 on CPU: this machine has no bf16 matmul units (bf16 prefill measured ~5x slower).
DEFAULT_DTYPE = {"torch": "float32", "mlx": "float32", "vllm": "bfloat16"}


@dataclass
class PrefillResult:
    header: PackHeader
    token_count: int
    load_s: float
    prefill_s: float
    write_s: float
    bytes_written: int
    stats: dict = field(default_factory=dict)
    held_tokens: int = 0  # the pack is a delta from here (the consumer's manifest)
    reused_tokens: int = 0  # rows taken from this machine's store instead of computed
    stored: str | None = None  # store entry id, with store=True


def check_prompt(info: ModelInfo, ids: list[int], *, new_tokens: int = 0) -> None:
    if len(ids) < 2:
        raise DataError(
            f"prompt is {len(ids)} token(s); a handoff needs at least 2",
            hint="the consumer runs the last prompt token itself",
        )
    if len(ids) + new_tokens > info.max_positions:
        extra = f" plus {new_tokens} new tokens" if new_tokens else ""
        raise DataError(
            f"prompt is {len(ids)} tokens{extra}, longer than the model's context of {info.max_positions}",
            hint="shorten the prompt or use a long-context model",
        )


def build_header(
    info: ModelInfo, ids: list[int], *, dtype: str, chunk_tokens: int, engine: str, threads: int, extra: dict | None = None
) -> PackHeader:
    producer = {"engine": engine, "threads": threads, "muser": __version__}
    producer.update(extra or {})
    return PackHeader(
        model_fingerprint=info.fingerprint,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        token_ids=tuple(ids),
        layers=info.layers,
        dtype=dtype,
        chunk_tokens=chunk_tokens,
        model_name=info.name,
        architecture=info.architecture,
        producer=producer,
    )


def prefill(
    prompt: str,
    out: BinaryIO,
    *,
    model: str | None = None,
    engine: str = "torch",
    dtype: str | None = None,
    chat: bool = False,
    chunk_tokens: int | None = None,
    threads: int = 1,
    codec: str = "none",
    level: int = 1,
    have: "HaveManifest | None" = None,
    reuse: bool = False,
    store: bool = False,
    progress: ProgressFn | None = None,
) -> PrefillResult:
    """Prefill ``prompt`` on the canonical schedule and write its kvpack to ``out``.

    ``have`` (a consumer's manifest): write a delta pack of only the rows the consumer
    lacks, on the manifest's schedule (chunk size and dtype), refusing a manifest for
    another model or prompt. ``reuse`` (implied by ``have``): start from the deepest
    exact point this machine's store holds instead of position 0 (same bytes, less work).
    ``store``: keep the whole result in the store.
    """
    from muser_cli.engines.base import get_engine
    from muser_cli.models import resolve_model
    from muser_cli.tokens import encode_prompt

    if chunk_tokens is not None and not 1 <= chunk_tokens <= MAX_FRAME_ROWS:
        raise UsageError(f"--chunk must be in [1, {MAX_FRAME_ROWS}]")
    t0 = time.perf_counter()
    info = resolve_model(model)
    ids = encode_prompt(info, prompt, chat=chat)
    check_prompt(info, ids)
    if have is not None:
        have.check_model(info.fingerprint, info.tokenizer_fingerprint)
        have.check_prompt(ids)
        if have.held_tokens:
            assert have.scope is not None
            for name, mine, theirs in (("--chunk", chunk_tokens, have.scope.chunk_tokens),
                                       ("--dtype", dtype, have.scope.dtype)):
                if mine is not None and mine != theirs:
                    raise UsageError(f"{name} {mine} differs from the manifest's {theirs}",
                                     hint=f"drop {name}: a delta is exact only on the schedule of the consumer's prefix")
            chunk_tokens, dtype = have.scope.chunk_tokens, have.scope.dtype
    chunk_tokens = chunk_tokens or DEFAULT_CHUNK_TOKENS
    dtype = dtype or DEFAULT_DTYPE.get(engine, "float32")
    eng = get_engine(engine, info, dtype=dtype, threads=threads)
    t1 = time.perf_counter()
    resume = None
    if (reuse or have is not None) and hasattr(eng, "prefill_from"):
        from muser_cli.reuse import Store, find_resume

        resume = find_resume(Store(), info.fingerprint, info.tokenizer_fingerprint, ids, dtype=dtype,
                             chunk_tokens=chunk_tokens)
    if resume is not None:
        layers = eng.prefill_from(resume.layers, rows=resume.held, token_ids=ids[resume.held : -1],
                                  chunk_tokens=chunk_tokens, progress=progress)
    else:
        layers = eng.prefill(ids[:-1], chunk_tokens=chunk_tokens, progress=progress)
    t2 = time.perf_counter()
    header = build_header(info, ids, dtype=dtype, chunk_tokens=chunk_tokens, engine=engine, threads=threads,
                          extra=getattr(eng, "producer_info", lambda: {})())
    full_header = header
    if have is not None and have.held_tokens:
        from muser_cli.reuse.chain import scope_of_header
        from muser_cli.reuse.delta import delta_header

        header = delta_header(header, scope_of_header(header), have.held_tokens, have.chain)
    writer = write_pack(out, header, layers, codec=codec, level=level)
    t3 = time.perf_counter()
    stored = None
    if store:
        from muser_cli.reuse import Store

        stored = Store().put_layers(full_header, layers).entry.id
    return PrefillResult(header=writer.header, token_count=len(ids), load_s=t1 - t0, prefill_s=t2 - t1,
                         write_s=t3 - t2, bytes_written=writer.bytes_written,
                         held_tokens=header.rows_start, reused_tokens=resume.held if resume else 0, stored=stored)
