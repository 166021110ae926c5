"""The canonical schedule: the one way every path turns a prompt into KV rows.

prompt[:-1] is prefilled in fixed chunks of ``chunk_tokens`` (recorded in the pack
header); the last prompt token is the consumer's first decode step. The producer, the
local fallback, reuse and delta all follow it, which is what makes a handed-off lane
bit-identical to a local one on the same engine, dtype and thread count.

This module holds the schedule's constants, the checks a prompt must pass before any
work, and the header that records the schedule. Where the rows come from (computed,
the store, a delta) is :mod:`muser_cli.rows`.
"""

from __future__ import annotations

import os

from muser_cli.about import __version__
from muser_cli.errors import ConfigError, PromptTooLong, PromptTooShort, UsageError
from muser_cli.kvpack import PackHeader
from muser_cli.kvpack.format import MAX_FRAME_ROWS
from muser_cli.kvpack.layers import extra_matters
from muser_cli.model.info import ModelInfo
from muser_cli.units import plural

DEFAULT_CHUNK_TOKENS = 512

# float32 on CPU: this machine has no bf16 matmul units (bf16 prefill measured ~5x slower).
DEFAULT_DTYPE = {"torch": "float32", "mlx": "float32", "vllm": "bfloat16"}


def default_dtype(engine: str) -> str:
    return DEFAULT_DTYPE.get(engine, "float32")


def check_chunk(chunk_tokens: int | None) -> None:
    if chunk_tokens is not None and not 1 <= chunk_tokens <= MAX_FRAME_ROWS:
        raise UsageError(f"--chunk must be in [1, {MAX_FRAME_ROWS}]")


def check_prompt(info: ModelInfo, ids: list[int], *, new_tokens: int = 0) -> None:
    if len(ids) < 2:
        raise PromptTooShort(
            f"prompt is {plural(len(ids), 'token')}; a handoff needs at least 2",
            hint="the consumer runs the last prompt token itself",
        )
    if len(ids) + new_tokens > info.max_positions:
        extra = f" plus {new_tokens} new tokens" if new_tokens else ""
        raise PromptTooLong(
            f"prompt is {len(ids)} tokens{extra}, longer than the model's context of {info.max_positions}",
            hint="shorten the prompt or use a long-context model",
        )


def newest_write_minor() -> int:
    """The newest kvpack minor a producer here may write: ``MUSER_KVPACK_MINOR`` (``1``:
    hybrid packs without the extra ring row, for receivers older than kvpack 1.2), else 2.
    Anything but 1 or 2 is a :class:`ConfigError` (exit 78)."""
    value = os.environ.get("MUSER_KVPACK_MINOR", "")
    if not value:
        return 2
    if value.strip() not in ("1", "2"):
        raise ConfigError(f"MUSER_KVPACK_MINOR={value!r} is not a kvpack minor this muser writes (1 or 2)",
                          hint="unset it, or set 1 for receivers that read kvpack 1.1 only")
    return int(value)


def build_header(
    info: ModelInfo, ids: list[int], *, dtype: str, chunk_tokens: int, engine: str, threads: int, extra: dict | None = None,
    ring_extra: int = 0,
) -> PackHeader:
    """The header of a full pack of ``ids`` made on this schedule by ``engine``.

    ``ring_extra``: the rows beyond ``window - 1`` the engine's sliding layers hold
    (``Engine.ring_extra``); written only when a sliding layer is past its window, so that
    a pack it changes nothing in keeps its old version (1.1)."""
    producer = {"engine": engine, "threads": threads, "muser": __version__}
    producer.update(extra or {})
    rows = len(ids) - 1
    if not any(extra_matters(s, rows, ring_extra) for s in info.layers):  # no sliding layer past its window,
        ring_extra = 0  # no chunked layer whose extra rows reach into an earlier chunk
    if ring_extra and newest_write_minor() < 2:
        ring_extra = 0  # a 1.1 pack: the extra ring row stays out (write_pack skips rows before the header's)
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
        ring_extra=ring_extra,
    )
