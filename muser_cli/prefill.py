"""``prefill``: tokenize a prompt, run the canonical schedule, write a kvpack of prompt[:-1]."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, BinaryIO

from muser_cli.engines.registry import get_engine
from muser_cli.errors import UsageError
from muser_cli import STARTED_AT
from muser_cli.engines.base import RowsOf
from muser_cli.kvpack import PackHeader, PackWriter, write_pack
from muser_cli.modelinfo import ProgressFn
from muser_cli.models import resolve_model
from muser_cli.reuse import Store
from muser_cli.reuse.chain import scope_of_header
from muser_cli.reuse.delta import delta_header
from muser_cli.rows import local_rows
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS, build_header, check_chunk, check_prompt, default_dtype
from muser_cli.tokens import encode_prompt

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


class FrameEmitter:
    """An ``on_chunk`` callback: writes every planned frame whose rows are final, then flushes
    (so a pipe downstream — pack, send, decode — gets each chunk as it finishes)."""

    def __init__(self, writer: PackWriter, out: BinaryIO) -> None:
        self.writer = writer
        self.out = out
        self.seconds = 0.0  # time spent writing frames (not computing)
        self.first_frame_s: float | None = None

    def __call__(self, done: int, rows_of: RowsOf) -> None:
        t0 = time.perf_counter()
        wrote = False
        while (exp := self.writer.expected()) is not None and exp[1] + exp[2] <= done:
            layer, start, count = exp
            self.writer.write_frame(layer, start, *rows_of(layer, start, start + count))
            wrote = True
        if wrote:
            self.out.flush()
            if self.first_frame_s is None:
                self.first_frame_s = time.perf_counter()
        self.seconds += time.perf_counter() - t0


def set_history(eng, history: bool | None) -> None:
    """Ask ``eng`` for the sliding history (``history`` None: where it can write it); True on an
    engine that cannot, for a model with a sliding layer, is a UsageError."""
    sliding = any(s.kind in ("sliding", "chunked") for s in eng.info.layers)
    if history and sliding and not eng.writes_history:
        raise UsageError(f"the {eng.name} engine cannot write the sliding history of {eng.info.name}",
                         hint="drop --history, or prefill with --engine torch")
    eng.history = history is not False and eng.writes_history


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
    is continued: it holds none.
    """
    check_chunk(chunk_tokens)
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
    dtype = dtype or default_dtype(engine)
    eng = get_engine(engine, info, dtype=dtype, threads=threads, options=engine_options)
    set_history(eng, history)
    t1 = time.perf_counter()
    rows = len(ids) - 1
    header = build_header(info, ids, dtype=dtype, chunk_tokens=chunk_tokens, engine=engine, threads=threads,
                          extra=eng.producer_info(), ring_extra=eng.pack_ring_extra(rows))
    full_header = header
    if have is not None and have.held_tokens:
        header = delta_header(header, scope_of_header(header), have.held_tokens, have.chain)
        header = replace(header, ring_extra=eng.pack_ring_extra(rows, header.rows_start))
    # A stored prefix holds no sliding history: with it, every row is computed here.
    may_reuse = (reuse or have is not None) and eng.resumes_prefill and not eng.keeps_history
    # A streaming engine hands each chunk's rows to the writer as the chunk finishes: the
    # header leaves first, then every frame as soon as its rows are final (same bytes as
    # writing the finished pack, since frames go in the same order).
    writer = PackWriter(out, header, codec=codec, level=level) if eng.streams_prefill else None
    emitter = FrameEmitter(writer, out) if writer is not None else None
    # Rows from this machine's store only on an engine that can continue them (its own kernels).
    made = local_rows(eng, ids, dtype=dtype, chunk_tokens=chunk_tokens,
                      reuse=may_reuse, progress=progress,
                      on_chunk=emitter, ring_extra=header.ring_extra)
    t2 = time.perf_counter()
    if writer is None:
        late = eng.producer_info()  # a non-streaming engine (vLLM) learns its backend and layout while prefilling
        if late:
            header = replace(header, producer={**header.producer, **late})
        writer = write_pack(out, header, made.layers, codec=codec, level=level)
    else:
        writer.finish()
    t3 = time.perf_counter()
    stored = Store().put_layers(full_header, made.layers).entry.id if store else None
    write_s = (emitter.seconds if emitter is not None else 0.0) + (t3 - t2)
    return PrefillResult(header=writer.header, token_count=len(ids), load_s=t1 - t0,
                         prefill_s=t2 - t1 - (emitter.seconds if emitter is not None else 0.0),
                         write_s=write_s, bytes_written=writer.bytes_written,
                         held_tokens=header.rows_start, reused_tokens=made.held, stored=stored,
                         prefill_start_s=t1 - STARTED_AT,
                         first_frame_s=(emitter.first_frame_s - STARTED_AT) if emitter and emitter.first_frame_s else None)
