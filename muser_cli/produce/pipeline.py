"""One way to produce a pack: the header of a prompt's pack on its schedule (a delta's when
the consumer holds a prefix), its rows from an ordered list of row sources (the resident
producer's memory, this machine's store, then the engine for the rest), written to one
sink. ``prefill`` and the resident producer (:mod:`muser_cli.pulllane.producer`) both
produce through :func:`produce_pack`.

A streaming engine (``streams_prefill``) hands each chunk's rows to the writer as the chunk
finishes: the header leaves first, then every frame as soon as its rows are final (same
bytes as writing the finished pack, since frames go in the same order). A whole-pack engine
(vLLM) learns its backend and layout while prefilling: its pack is written once the rows
are made, with that producer record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, BinaryIO, Callable, Sequence

from muser_cli.engines.base import Engine, RowsOf
from muser_cli.errors import DataError, UsageError
from muser_cli.kvpack import LayerKV, PackHeader, PackWriter, write_pack
from muser_cli.kvpack.format import MAX_STATE_EVERY
from muser_cli.kvpack.layers import ring_extra_held
from muser_cli.model.info import LayerSpec, ModelInfo
from muser_cli.reuse.chain import resumable, scope_of_header
from muser_cli.reuse.delta import delta_header, layers_at
from muser_cli.rows import EngineRows, Found, LocalRows, RowSource, gather_rows
from muser_cli.schedule import build_header


class FrameEmitter:
    """An ``on_chunk`` callback: writes every planned frame whose rows are final, then flushes
    (so a pipe downstream — pack, send, decode — gets each chunk as it finishes)."""

    def __init__(self, writer: PackWriter, out: BinaryIO) -> None:
        self.writer = writer
        self.out = out
        self.seconds = 0.0  # time spent writing frames (not computing)
        self.first_frame_s: float | None = None
        self.cpu_s = 0.0  # of which this thread's CPU time

    def __call__(self, done: int, rows_of: RowsOf) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
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
        self.cpu_s += time.thread_time() - c0


class MemoryRows:
    """A row source: the rows of the previous prompt computed here, kept (at most one
    prompt's) to continue a prompt that shares whole chunks with it (same bytes, less compute).
    Each look-up lets go of them: the next prefill holds them as its own, and
    :meth:`remember` keeps its rows instead."""

    name = "memory"

    def __init__(self, specs: Sequence[LayerSpec]) -> None:
        self.specs = specs
        self.keep = True  # False: remember nothing
        self.at_most: int | None = None  # the deepest prefix to serve (None: any)
        self._last: tuple[list[int], tuple[int | None, str], list[LayerKV]] | None = None

    def find(self, ids: list[int], *, dtype: str, chunk_tokens: int | None, ring_extra: int,
             deeper_than: int = 0) -> Found | None:
        last, self._last = self._last, None  # dropped before the next prefill: at most one prompt's rows held
        rows = len(ids) - 1
        if last is None or chunk_tokens is None or last[1] != (chunk_tokens, dtype):
            return None
        common = 0
        for a, b in zip(last[0], ids[:rows]):
            if a != b:
                break
            common += 1
        held = min(common, len(last[0]) - 1, rows, rows if self.at_most is None else self.at_most)
        held = held // chunk_tokens * chunk_tokens
        while held > 0 and not resumable(self.specs, len(last[0]), held):
            held -= chunk_tokens
        if held <= deeper_than:
            return None
        try:
            layers = layers_at(last[2], self.specs, held, ring_extra if held == rows else 0)
        except DataError:  # the remembered rows do not reach back that far (a delta's history)
            return None
        return Found(held, layers, self.name, chunk_tokens)

    def remember(self, ids: list[int], *, dtype: str, chunk_tokens: int, layers: list[LayerKV]) -> None:
        if self.keep:
            self._last = (list(ids[:-1]), (chunk_tokens, dtype), list(layers))


@dataclass
class PackJob:
    """What to produce: the pack of ``ids[:-1]`` on this schedule, made by ``engine`` (its name
    in the header); a delta from ``have_tokens`` (chain ``have_chain``) when the consumer holds
    that prefix."""

    info: ModelInfo
    ids: list[int]
    dtype: str
    chunk_tokens: int
    engine: str
    threads: int
    have_tokens: int = 0
    have_chain: str | None = None
    state_every: int = 1  # state layers: a snapshot every this many grid chunks (and at the end)


@dataclass
class PackSink:
    """Where the pack goes, and its frames' codec."""

    out: BinaryIO
    codec: str = "none"
    level: int = 1


@dataclass
class Produced:
    header: PackHeader  # as written (a delta's from the consumer's prefix)
    full: PackHeader  # the whole prompt's (what the store keeps)
    rows: LocalRows  # the rows of the whole prompt and where they came from
    bytes_written: int
    started: float  # perf_counter: the producer began (the header)
    prefill_s: float  # making the rows, writing frames excluded
    write_s: float  # writing: frames as chunks finished, then the rest
    emit_s: float  # of which frames written while computing
    first_frame: float | None  # perf_counter: the first frame left (streaming engines)
    cpu_s: float = 0.0  # the producing thread's CPU time making the rows (frames excluded): the work, not the waits
    paused_s: float = 0.0  # given up to other requests at chunk boundaries (``between``): not in prefill_s

    @property
    def layers(self) -> list[LayerKV]:
        return self.rows.layers


class _Between:
    """An ``on_chunk`` callback: the frames of the chunk out (:class:`FrameEmitter`), then
    ``between()`` (the resident producer's preemption point), its seconds counted apart."""

    def __init__(self, emitter: FrameEmitter, between: Callable[[], None]) -> None:
        self.emitter, self.between = emitter, between
        self.seconds = 0.0

    def __call__(self, done: int, rows_of: RowsOf) -> None:
        self.emitter(done, rows_of)
        t0 = time.perf_counter()
        self.between()
        self.seconds += time.perf_counter() - t0


def produce_pack(job: PackJob, sources: Sequence[RowSource | EngineRows], sink: PackSink, *,
                 between: Callable[[], None] | None = None) -> Produced:
    """Write ``job``'s pack to ``sink``. ``sources``: the row sources to take a held prefix
    from, in order (each asked only for a deeper one), then the :class:`EngineRows` that
    computes the rest; a source with ``remember`` is told the rows made. ``between``: called
    after each chunk's frames left, on an engine that streams its prefill (it may block: the
    request pauses there; that time is ``paused_s``, not ``prefill_s``)."""
    *held, engine = sources
    assert isinstance(engine, EngineRows), "the last row source computes: EngineRows"
    eng = engine.eng
    t0, c0 = time.perf_counter(), time.thread_time()
    full = pack_header(job.info, job.ids, dtype=job.dtype, chunk_tokens=job.chunk_tokens, engine=job.engine,
                       threads=job.threads, eng=eng)
    header = full
    rows = len(job.ids) - 1
    if job.have_tokens:
        header = delta_header(full, scope_of_header(full), job.have_tokens, job.have_chain)  # its history too
    if job.state_every > 1:  # fewer superseded snapshots on the wire; the store keeps its own (``full``)
        header = replace(header, state_every=job.state_every)
    for source in held:  # set on every request: a memory serves the next one with its own bound
        if isinstance(source, MemoryRows):
            source.at_most = header.rows_start if eng.keeps_history else None
    if eng.keeps_history:
        # The sliding history: every sliding row from the consumer's prefix on. A held prefix
        # deeper than that holds only its window there, so none serves (the store's) or it is
        # taken no deeper than the consumer's own (the previous prompt's rows, memory).
        held = [s for s in held if isinstance(s, MemoryRows)]
    writer = PackWriter(sink.out, header, codec=sink.codec, level=sink.level) if eng.streams_prefill else None
    emitter = None
    if writer is not None:
        sink.out.flush()  # the header leaves before the first chunk is computed
        emitter = FrameEmitter(writer, sink.out)
    pauses = _Between(emitter, between) if emitter is not None and between is not None else None
    made = gather_rows(job.ids, held, engine, dtype=job.dtype, chunk_tokens=job.chunk_tokens,
                       ring_extra=full.ring_extra, on_chunk=pauses or emitter)
    for source in held:
        if hasattr(source, "remember") and eng.resumes_prefill:
            source.remember(job.ids, dtype=job.dtype, chunk_tokens=job.chunk_tokens, layers=made.layers)
    if eng.keeps_history:  # the store keeps what the rows hold: the history from the prefix made here
        full = replace(full, ring_extra=ring_extra_held(job.info.layers, made.layers, rows) or full.ring_extra)
    t1, c1 = time.perf_counter(), time.thread_time()
    late = made.producer if made.producer is not None else eng.producer_info()
    if late:  # the record of the prefill that made the rows (a batch's, on a batching engine)
        full = replace(full, producer={**full.producer, **late})
    if writer is None:
        header = replace(header, producer=full.producer)
        writer = write_pack(sink.out, header, made.layers, codec=sink.codec, level=sink.level)
    else:
        writer.finish()
    sink.out.flush()
    emit_s = emitter.seconds if emitter is not None else 0.0
    paused_s = pauses.seconds if pauses is not None else 0.0
    return Produced(header=writer.header, full=full, rows=made, bytes_written=writer.bytes_written, started=t0,
                    prefill_s=t1 - t0 - emit_s - paused_s, write_s=emit_s + time.perf_counter() - t1, emit_s=emit_s,
                    first_frame=emitter.first_frame_s if emitter is not None else None,
                    cpu_s=max(0.0, c1 - c0 - (emitter.cpu_s if emitter is not None else 0.0)), paused_s=paused_s)


def check_state_every(info: ModelInfo, state_every: int) -> None:
    """``--state-every``: a positive count of chunks, above 1 only for a model with state layers."""
    if isinstance(state_every, bool) or not isinstance(state_every, int) or not 1 <= state_every <= MAX_STATE_EVERY:
        raise UsageError(f"--state-every must be a whole number of chunks in [1, {MAX_STATE_EVERY}], got {state_every!r}")
    if state_every > 1 and not any(spec.kind == "state" for spec in info.layers):
        raise UsageError(f"--state-every {state_every}: {info.name} has no recurrent state layers",
                         hint="it spaces the snapshots of state layers (qwen3_next, granitemoehybrid); drop it")


def set_history(eng: Engine, history: bool | None) -> None:
    """Ask ``eng`` for the sliding history (``history`` None: where it can write it); True on an
    engine that cannot, for a model with a sliding or chunked layer, is a UsageError."""
    if history and eng.has_local_layers and not eng.writes_history:
        raise UsageError(f"the {eng.name} engine cannot write the sliding history of {eng.info.name}",
                         hint="drop --history, or prefill with --engine torch")
    eng.history = history is not False and eng.writes_history


def pack_header(info: ModelInfo, ids: list[int], *, dtype: str, chunk_tokens: int, engine: str, threads: int,
                eng: Engine | None = None) -> PackHeader:
    """The header of a full pack of ``ids`` made on this schedule by ``engine`` (its name);
    with ``eng``, the engine making the rows, its producer record and ring rows too. The
    benchmarks that time making rows and writing them apart take their header here."""
    return build_header(info, ids, dtype=dtype, chunk_tokens=chunk_tokens, engine=engine, threads=threads,
                        extra=eng.producer_info() if eng is not None else None,
                        ring_extra=eng.pack_ring_extra(len(ids) - 1) if eng is not None else 0)


def stats_of(made: Produced, job: PackJob) -> dict[str, Any]:
    """A produced pack's counts as the resident producer reports them per request."""
    rows = made.rows
    stats: dict[str, Any] = {"prefill_s": round(made.prefill_s + made.write_s - made.emit_s, 6),
                             "prefill_cpu_s": round(made.cpu_s, 6),
                             "held_rows": job.have_tokens, "shipped_rows": len(job.ids) - 1 - job.have_tokens,
                             "reused_rows": rows.held, "reused_from": rows.origin if rows.held else None}
    if rows.batch is not None:
        stats["batch"] = rows.batch  # computed together with batch - 1 other requests
    if made.paused_s:
        stats["paused_s"] = round(made.paused_s, 6)  # other requests computed meanwhile (preempted)
    return stats
