"""Where a prompt's KV rows come from on this machine: a row source that holds a prefix
(the previous request's rows, the store), then the engine for the rest, on the canonical
schedule — the one place ``prefill``, the resident producer and ``decode``'s fallback ask.

A held prefix that ends at a chunk boundary is continued (engines that declare
``resumes_prefill``); a full hit needs no compute at all. Either way the rows are byte
for byte the rows one full prefill on the same schedule would produce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from muser_cli.engines.base import ChunkFn, Engine, RowsOf
from muser_cli.errors import DataError, SpotCheckFailed
from muser_cli.gate import sampled
from muser_cli.gate.audit import spot_check_reason
from muser_cli.kvpack import KVPack, LayerKV, StateKV
from muser_cli.model.info import ProgressFn
from muser_cli.reuse import Store, find_resume
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS

MAX_REFUSED_ENTRIES = 4  # entries the gate may refuse in one look-up before prefilling from scratch


@dataclass
class LocalRows:
    """Rows for prompt[:-1] made here."""

    layers: list[LayerKV]
    chunk_tokens: int  # the schedule they were made on
    source: str  # "local" (computed), "store" (a full hit), "store+local" (a stored prefix, then computed)
    held: int = 0  # rows taken from a source instead of computed
    entry: str | None = None  # the store entry they came from
    problems: list[str] = field(default_factory=list)  # store entries found corrupt (and removed)
    origin: str | None = None  # the source of the held rows ("store", "memory"); None: all computed
    producer: dict[str, Any] | None = None  # the producer record of the prefill that made them (a batch's)
    batch: int | None = None  # computed together with batch - 1 other prompts


@dataclass
class Found:
    """A prefix a row source holds: rows [0, held) of the prompt (all of them: a full hit)."""

    held: int
    layers: list[LayerKV]
    origin: str  # the source's name
    chunk_tokens: int  # the schedule they were made on
    entry: str | None = None


class RowSource(Protocol):
    """A place that may hold a prefix of a prompt's rows (:class:`StoreRows`, the resident
    producer's memory of its previous request)."""

    def find(self, ids: list[int], *, dtype: str, chunk_tokens: int | None, ring_extra: int,
             deeper_than: int) -> Found | None:
        """The deepest exact prefix held of ``ids[:-1]`` on the schedule (``chunk_tokens``
        None: any), when deeper than ``deeper_than`` rows; a full hit holds ``ring_extra``."""


class StoreRows:
    """This machine's reuse store as a row source. Another engine's rows (a foreign pack put
    in the store) serve only once the numeric gate passed them (:func:`entry_may_serve`).
    ``spare_rows``: a full hit's full layers come with that much room after their rows."""

    name = "store"

    def __init__(self, eng: Engine, store: Store | None = None, *, spare_rows: int = 0) -> None:
        self.eng = eng
        self.store = store
        self.spare_rows = spare_rows
        self.problems: list[str] = []

    def find(self, ids: list[int], *, dtype: str, chunk_tokens: int | None, ring_extra: int,
             deeper_than: int = 0) -> Found | None:
        store = self.store or Store()  # made here: its index connection belongs to this thread
        info = self.eng.info
        if deeper_than > 0:  # nothing deeper is held: nothing is loaded
            points = [p for p in store.points(info.fingerprint, info.tokenizer_fingerprint, ids, len(ids) - 1,
                                              dtype=dtype, chunk_tokens=chunk_tokens) if p.resumable]
            if not points or max(p.held for p in points) <= deeper_than:
                return None
        resume = None
        for _ in range(MAX_REFUSED_ENTRIES + 1):
            resume = find_resume(store, info.fingerprint, info.tokenizer_fingerprint, ids, dtype=dtype,
                                 chunk_tokens=chunk_tokens, spare_rows=self.spare_rows, ring_extra=ring_extra)
            if resume is None or entry_may_serve(store, resume.entry, resume.stored, self.eng, dtype=dtype):
                break
            resume = None  # refused by the gate and removed: look again
        self.problems = list(store.problems)
        if resume is None or resume.held <= deeper_than:
            return None
        return Found(resume.held, list(resume.layers), self.name, resume.scope.chunk_tokens, resume.entry)


Compute = Callable[[list[int], int], tuple[list[LayerKV], dict[str, Any], int]]


class EngineRows:
    """The engine as the last row source: computes what no other source held, from position 0
    or continuing a held prefix. ``batched``: computes a prompt from position 0 instead (a
    batching engine's :meth:`prefill_many`, shared with other requests; rows, the batch's
    producer record and its size)."""

    name = "engine"

    def __init__(self, eng: Engine, *, progress: ProgressFn | None = None, batched: Compute | None = None) -> None:
        self.eng = eng
        self.progress = progress
        self.batched = batched

    def complete(self, ids: list[int], found: Found | None, *, chunk_tokens: int,
                 on_chunk: ChunkFn | None) -> LocalRows:
        """The rows of ``ids[:-1]`` from ``found`` on (None: from position 0). ``on_chunk``
        (engines that declare ``streams_prefill``) sees them as each chunk finishes, held ones included."""
        eng, rows = self.eng, len(ids) - 1
        kw: dict[str, Any] = {"on_chunk": on_chunk} if on_chunk is not None else {}
        if self.progress is not None:
            kw["progress"] = self.progress
        if found is None and self.batched is not None:
            layers, producer, batch = self.batched(ids[:-1], chunk_tokens)
            return LocalRows(layers, chunk_tokens, "local", producer=producer, batch=batch)
        if found is None:
            return LocalRows(eng.prefill(ids[:-1], chunk_tokens=chunk_tokens, **kw), chunk_tokens, "local")
        chunk, origin = found.chunk_tokens, found.origin
        if found.held == rows:
            if on_chunk is not None:
                on_chunk(rows, rows_of_layers(found.layers))
            return LocalRows(list(found.layers), chunk, origin, found.held, found.entry, origin=origin)
        layers = eng.prefill_from(found.layers, rows=found.held, token_ids=ids[found.held : -1], chunk_tokens=chunk,
                                  **kw)
        return LocalRows(layers, chunk, f"{origin}+local", found.held, found.entry, origin=origin)


def gather_rows(ids: Sequence[int], sources: Sequence[RowSource], engine: EngineRows, *, dtype: str,
                chunk_tokens: int | None, ring_extra: int = 0, on_chunk: ChunkFn | None = None) -> LocalRows:
    """The rows of prompt ``ids[:-1]``: the deepest prefix any of ``sources`` holds (asked in
    order, each only for a deeper one than found so far), continued by ``engine``; computed
    from position 0 on ``chunk_tokens`` (None: the default) when none holds one. A prefix
    short of a full hit serves only an engine that declares ``resumes_prefill``."""
    ids = list(ids)
    rows = len(ids) - 1
    found: Found | None = None
    for source in sources:
        if found is not None and found.held == rows:
            break  # a full hit: nothing deeper to ask for
        got = source.find(ids, dtype=dtype, chunk_tokens=chunk_tokens, ring_extra=ring_extra,
                          deeper_than=found.held if found is not None else 0)
        if got is not None:
            found = got
    if found is not None and found.held < rows and not engine.eng.resumes_prefill:
        found = None  # this engine cannot continue a prefill: only a full hit helps
    made = engine.complete(ids, found, chunk_tokens=chunk_tokens or DEFAULT_CHUNK_TOKENS, on_chunk=on_chunk)
    made.problems = [p for s in sources for p in getattr(s, "problems", ())]
    return made


def local_rows(
    eng: Engine,
    ids: Sequence[int],
    *,
    dtype: str,
    chunk_tokens: int | None,
    reuse: bool,
    store: Store | None = None,
    progress: ProgressFn | None = None,
    on_chunk: ChunkFn | None = None,
    spare_rows: int = 0,
    ring_extra: int = 0,
) -> LocalRows:
    """The rows of prompt ``ids[:-1]``: from the deepest exact point the store holds
    (``reuse``), else computed from position 0 on ``chunk_tokens`` (None: any stored
    schedule, else the default). ``on_chunk`` (engines that declare ``streams_prefill``)
    sees the rows as each chunk finishes, stored ones included. ``spare_rows``: a full
    hit's full layers come with that much room after their rows, for the engine to adopt
    (``Consumer.open(adopt=True)``). ``ring_extra``: a full hit must hold that many ring
    rows beyond ``window - 1`` (the header a producer already wrote promises them)."""
    sources = [StoreRows(eng, store or Store(), spare_rows=spare_rows)] if reuse else []
    return gather_rows(ids, sources, EngineRows(eng, progress=progress), dtype=dtype, chunk_tokens=chunk_tokens,
                       ring_extra=ring_extra, on_chunk=on_chunk)


def entry_may_serve(store: Store, entry: str, stored: KVPack | None, eng: Engine, *, dtype: str) -> bool:
    """Whether a store entry's rows may serve ``eng``: yes when they were made the way it makes
    them (:func:`muser_cli.gate.audit.spot_check_reason`) or a passed gate is recorded with the
    entry; else the sampled gate runs now, on the whole entry, and is recorded. An entry it
    refuses is removed (a line in ``store.problems``) and serves nothing."""

    if stored is None:
        return True
    reason = spot_check_reason(stored.header, engine=eng.name, dtype=dtype)
    if reason is None or store.check_of(entry, engine=eng.name, dtype=dtype) is not None:
        return True
    try:
        checked = sampled.sample_check(stored.header, list(stored.layers), eng, reason=reason)
    except SpotCheckFailed as exc:
        store.record_check(entry, engine=eng.name, dtype=dtype, result={"ok": False, "reason": str(exc)})
        store.discard(entry, f"refused by the numeric gate on first use ({exc})")
        return False
    store.record_check(entry, engine=eng.name, dtype=dtype, result=checked.to_json())
    return True


def rows_of_layers(layers: Sequence[LayerKV]) -> RowsOf:
    """:data:`RowsOf` over finished layers (a full hit from the store)."""
    def rows_of(index: int, lo: int, hi: int):
        lk = layers[index]
        if isinstance(lk, StateKV):  # a state layer: its snapshot at the frame's end
            snap = lk.at(hi)
            if snap is None:
                raise DataError(f"layer {index} holds no state snapshot at position {hi}")
            return snap, None
        return lk.keys[:, lo - lk.first_row : hi - lk.first_row], lk.values[:, lo - lk.first_row : hi - lk.first_row]
    return rows_of
