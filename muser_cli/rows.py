"""Where a prompt's KV rows come from on this machine: the store, or computed on the
canonical schedule — the one place both ``prefill`` and ``decode``'s fallback ask.

A stored prefix that ends at a chunk boundary is continued (engines that declare
``resumes_prefill``); a full hit needs no compute at all. Either way the rows are byte
for byte the rows one full prefill on the same schedule would produce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from muser_cli.engines.base import ChunkFn, Engine, RowsOf
from muser_cli.errors import SpotCheckFailed
from muser_cli.kvpack import KVPack, LayerKV
from muser_cli.modelinfo import ProgressFn
from muser_cli.reuse import Store, find_resume
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS

MAX_REFUSED_ENTRIES = 4  # entries the gate may refuse in one look-up before prefilling from scratch


@dataclass
class LocalRows:
    """Rows for prompt[:-1] made here."""

    layers: list[LayerKV]
    chunk_tokens: int  # the schedule they were made on
    source: str  # "local" (computed), "store" (a full hit), "store+local" (a stored prefix, then computed)
    held: int = 0  # rows taken from the store
    entry: str | None = None  # the store entry they came from
    problems: list[str] = field(default_factory=list)  # store entries found corrupt (and removed)


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
    (``Engine.decode(adopt=True)``). ``ring_extra``: a full hit must hold that many ring
    rows beyond ``window - 1`` (the header a producer already wrote promises them)."""
    ids = list(ids)
    rows = len(ids) - 1
    resume = None
    problems: list[str] = []
    if reuse:
        store = store or Store()
        for _ in range(MAX_REFUSED_ENTRIES + 1):
            resume = find_resume(store, eng.info.fingerprint, eng.info.tokenizer_fingerprint, ids, dtype=dtype,
                                 chunk_tokens=chunk_tokens, spare_rows=spare_rows, ring_extra=ring_extra)
            if resume is None or entry_may_serve(store, resume.entry, resume.stored, eng, dtype=dtype):
                break
            resume = None  # refused by the gate and removed: look again
        problems = list(store.problems)
        if resume is not None and resume.held < rows and not eng.resumes_prefill:
            resume = None  # this engine cannot continue a prefill: only a full hit helps
    if resume is None:
        chunk = chunk_tokens or DEFAULT_CHUNK_TOKENS
        kw = {"on_chunk": on_chunk} if on_chunk is not None else {}
        layers = eng.prefill(ids[:-1], chunk_tokens=chunk, progress=progress, **kw)
        return LocalRows(layers, chunk, "local", problems=problems)
    chunk = resume.scope.chunk_tokens
    if resume.held == rows:
        if on_chunk is not None:
            on_chunk(rows, rows_of_layers(resume.layers))
        return LocalRows(list(resume.layers), chunk, "store", resume.held, resume.entry, problems)
    kw = {"on_chunk": on_chunk} if on_chunk is not None else {}
    layers = eng.prefill_from(resume.layers, rows=resume.held, token_ids=ids[resume.held : -1],
                              chunk_tokens=chunk, progress=progress, **kw)
    return LocalRows(layers, chunk, "store+local", resume.held, resume.entry, problems)


def entry_may_serve(store: Store, entry: str, stored: KVPack | None, eng: Engine, *, dtype: str) -> bool:
    """Whether a store entry's rows may serve ``eng``: yes when they were made the way it makes
    them (:func:`muser_cli.audit.spot_check_reason`) or a passed gate is recorded with the
    entry; else the sampled gate runs now, on the whole entry, and is recorded. An entry it
    refuses is removed (a line in ``store.problems``) and serves nothing."""
    from muser_cli.audit import sample_check, spot_check_reason

    if stored is None:
        return True
    reason = spot_check_reason(stored.header, engine=eng.name, dtype=dtype)
    if reason is None or store.check_of(entry, engine=eng.name, dtype=dtype) is not None:
        return True
    try:
        checked = sample_check(stored.header, list(stored.layers), eng, reason=reason)
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
        return lk.keys[:, lo - lk.first_row : hi - lk.first_row], lk.values[:, lo - lk.first_row : hi - lk.first_row]
    return rows_of
