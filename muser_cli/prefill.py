"""``prefill``: tokenize a prompt, run the canonical schedule, write a kvpack of prompt[:-1]."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import BinaryIO

from muser_cli import __version__
from muser_cli.engines.base import DEFAULT_CHUNK_TOKENS, ModelInfo, ProgressFn
from muser_cli.errors import DataError, UsageError
from muser_cli.kvpack import PackHeader, write_pack
from muser_cli.kvpack.format import MAX_FRAME_ROWS

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
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    threads: int = 1,
    codec: str = "none",
    level: int = 1,
    progress: ProgressFn | None = None,
) -> PrefillResult:
    from muser_cli.engines.base import get_engine
    from muser_cli.models import resolve_model
    from muser_cli.tokens import encode_prompt

    if not 1 <= chunk_tokens <= MAX_FRAME_ROWS:
        raise UsageError(f"--chunk must be in [1, {MAX_FRAME_ROWS}]")
    dtype = dtype or DEFAULT_DTYPE.get(engine, "float32")
    t0 = time.perf_counter()
    info = resolve_model(model)
    ids = encode_prompt(info, prompt, chat=chat)
    check_prompt(info, ids)
    eng = get_engine(engine, info, dtype=dtype, threads=threads)
    t1 = time.perf_counter()
    layers = eng.prefill(ids[:-1], chunk_tokens=chunk_tokens, progress=progress)
    t2 = time.perf_counter()
    header = build_header(info, ids, dtype=dtype, chunk_tokens=chunk_tokens, engine=engine, threads=threads,
                          extra=getattr(eng, "producer_info", lambda: {})())
    writer = write_pack(out, header, layers, codec=codec, level=level)
    t3 = time.perf_counter()
    return PrefillResult(header=writer.header, token_count=len(ids), load_s=t1 - t0, prefill_s=t2 - t1,
                         write_s=t3 - t2, bytes_written=writer.bytes_written)
