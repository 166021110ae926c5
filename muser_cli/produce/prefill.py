"""``prefill``: tokenize a prompt, run the canonical schedule, write a kvpack of prompt[:-1]."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

from muser_cli.about import STARTED_AT
from muser_cli.engines.registry import get_engine
from muser_cli.errors import UsageError
from muser_cli.kvpack import PackHeader
from muser_cli.model.info import ProgressFn
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tokens import encode_prompt
from muser_cli.produce.pipeline import PackJob, PackSink, check_state_every, produce_pack, set_history
from muser_cli.reuse import Store
from muser_cli.rows import EngineRows, StoreRows
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS, check_chunk, check_prompt, default_dtype

if TYPE_CHECKING:
    from muser_cli.reuse.manifest import HaveManifest

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
    prefill_start_s: float = 0.0  # since muser started: the engine began the prefill
    first_frame_s: float | None = None  # since muser started: the first frame left (streaming engines)


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
    engine_options: dict | None = None,
    history: bool | None = None,
    state_every: int = 1,
) -> PrefillResult:
    """Prefill ``prompt`` on the canonical schedule and write its kvpack to ``out``.

    ``have`` (a consumer's manifest): write a delta pack of only the rows the consumer
    lacks, on the manifest's schedule (chunk size and dtype), refusing a manifest for
    another model or prompt. ``reuse`` (implied by ``have``): start from the deepest
    exact point this machine's store holds instead of position 0 (same bytes, less work).
    ``store``: keep the whole result in the store. ``engine_options``: vLLM's engine
    options (``--vllm-opt``; see muser_cli.engines.vllm.options). ``history``: a model with
    sliding-window layers gets them with every row computed (the sliding history,
    docs/kvpack.md 1.3), so another engine's numeric gate can check every layer at any
    position; None: where the engine can (False: the last ``window`` rows only -- a pack for
    a consumer on this same engine, which needs no gate). With the history no stored prefix
    is continued: it holds none. ``state_every``: a model with recurrent state layers ships
    their snapshot every this many chunks and at the end (default 1: every chunk), so a
    pack carries fewer superseded snapshots; a cut stream then resumes from the last one
    that arrived, and the numeric gate recomputes from the one before the end.
    """
    check_chunk(chunk_tokens)
    t0 = time.perf_counter()
    info = resolve_model(model)
    check_state_every(info, state_every)
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
    dtype = dtype or default_dtype(engine)
    eng = get_engine(engine, info, dtype=dtype, threads=threads, options=engine_options)
    set_history(eng, history)
    job = PackJob(info, ids, dtype, chunk_tokens, engine, threads,
                  have_tokens=have.held_tokens if have is not None else 0,
                  have_chain=have.chain if have is not None else None, state_every=state_every)
    # Rows from this machine's store only on an engine that can continue them (its own kernels).
    sources = [StoreRows(eng)] if (reuse or have is not None) and eng.resumes_prefill else []
    made = produce_pack(job, [*sources, EngineRows(eng, progress=progress)], PackSink(out, codec, level))
    stored = Store().put_layers(made.full, made.layers).entry.id if store else None
    return PrefillResult(header=made.header, token_count=len(ids), load_s=made.started - t0,
                         prefill_s=made.prefill_s, write_s=made.write_s, bytes_written=made.bytes_written,
                         held_tokens=made.header.rows_start, reused_tokens=made.rows.held, stored=stored,
                         prefill_start_s=made.started - STARTED_AT,
                         first_frame_s=(made.first_frame - STARTED_AT) if made.first_frame else None)
