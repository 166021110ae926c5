"""The rows of a prompt that a decode installs (:func:`muser_cli.consumer.decode.decode`): a
pack's; a delta pack merged with the stored prefix it names (a foreign engine's base gated on
first use); or made here (:func:`muser_cli.rows.local_rows`) -- :class:`Rows`, with where they
came from. :func:`bind` checks a pack's identity against the prompt before anything is loaded;
:func:`store_rows` keeps a prompt's whole cache in the store."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from muser_cli.engines.base import Engine
from muser_cli.errors import SpotCheckFailed, UsageError
from muser_cli.gate.audit import spot_check_reason
from muser_cli.gate.sampled import sample_check
from muser_cli.kvpack import KVPack, LayerKV, PackHeader
from muser_cli.kvpack.layers import ring_extra_held
from muser_cli.model.binding import require_identity
from muser_cli.model.info import ModelInfo, ProgressFn
from muser_cli.reuse import BaseNotHeld, Store, resolve_delta
from muser_cli.reuse.manifest import check_base
from muser_cli.consumer.source import RowsFrom
from muser_cli.rows import local_rows
from muser_cli.schedule import build_header, default_dtype


@dataclass
class Rows:
    """The rows decode installs, and where they came from."""

    layers: list[LayerKV]
    source: RowsFrom
    schedule: int | None  # the chunk size they were made on (None: unknown, a foreign pack's)
    pack: KVPack | None  # the pack they came from; None when made here (the fallback)
    held: int = 0  # rows taken from the store
    entry: str | None = None  # the store entry they came from
    computed: int | None = None  # rows computed here after a stored prefix
    problems: list[str] = field(default_factory=list)
    reason: str = ""  # why there was no usable handoff
    handoff_rows: int | None = None  # after a cut stream: rows kept from it ...
    local_rows: int | None = None  # ... and rows computed here
    cut_prefill_s: float = 0.0
    spot: dict | None = None  # the gate on a cut stream's kept rows


def bind(header: PackHeader | None, info: ModelInfo, prompt_ids: list[int] | None, *, dtype: str | None,
         engine: str) -> tuple[list[int], str]:
    """The prompt ids and dtype to decode with. A pack's identity is checked from its header,
    before anything is loaded or decoded: another model's, tokenizer's or prompt's KV is
    refused here."""
    if header is None:
        assert prompt_ids is not None
        return prompt_ids, dtype or default_dtype(engine)
    require_identity(header, info, prompt_ids=prompt_ids)
    if header.rows_start > 0:
        check_base(header)  # a base that disagrees with its own pack: refused before loading
    dtype = dtype or header.dtype
    if header.dtype != dtype:
        raise UsageError(f"pack holds {header.dtype} KV; decoding it as {dtype} is not supported",
                         hint=f"use --dtype {header.dtype}")
    return list(header.token_ids), dtype


def rows_for(pack: KVPack | None, eng: Engine, ids: list[int], *, can_fall_back: bool, dtype: str,
             chunk_tokens: int | None, reuse: bool, progress: ProgressFn | None = None, spare_rows: int = 0) -> Rows:
    """The rows of ``ids[:-1]``: the pack's; a delta pack merged with the stored prefix it
    names; or, with no pack (or a delta whose base is not held, when ``can_fall_back``),
    made here by :func:`muser_cli.rows.local_rows`."""
    reason = ""
    problems: list[str] = []
    if pack is not None and pack.header.rows_start > 0:
        st = Store()
        try:
            layers, entry = resolve_delta(pack, st)
            _gate_base(st, entry, pack, layers, eng, dtype=dtype)
            return Rows(layers, RowsFrom.DELTA, pack.header.chunk_tokens, pack, held=pack.header.rows_start, entry=entry,
                        problems=list(st.problems))
        except BaseNotHeld as exc:
            if not can_fall_back:
                raise
            reason, problems = str(exc), list(st.problems)
    elif pack is not None:
        return Rows(pack.layers, RowsFrom.HANDOFF, pack.header.chunk_tokens, pack)
    made = local_rows(eng, ids, dtype=dtype, chunk_tokens=chunk_tokens, reuse=reuse, progress=progress,
                      spare_rows=spare_rows)
    problems += [p for p in made.problems if p not in problems]
    source = RowsFrom(made.source)  # this machine's store, or none: local, store, store+local
    computed = len(ids) - 1 - made.held if source != RowsFrom.LOCAL else None
    return Rows(made.layers, source, made.chunk_tokens, None, held=made.held, entry=made.entry,
                computed=computed, problems=problems, reason=reason)


def _gate_base(st: Store, entry: str, pack: KVPack, layers: list[LayerKV], eng: Engine, *, dtype: str) -> None:
    """The stored base a delta extends, when another engine made it and no passed gate is
    recorded with it: its rows [0, base) sampled before use; refused, the entry is removed
    and the delta has no base here (BaseNotHeld)."""
    base = st.header_of(entry)
    if base is None or spot_check_reason(base, engine=eng.name, dtype=dtype) is None:
        return
    if st.check_of(entry, engine=eng.name, dtype=dtype) is not None:
        return
    try:
        sample_check(replace(pack.header, rows_start=0, base=None), layers, eng, rows=pack.header.rows_start)
    except SpotCheckFailed as exc:
        st.discard(entry, f"refused by the numeric gate on first use ({exc})")
        raise BaseNotHeld(f"the stored base of this delta was refused by the numeric gate ({exc})") from None


def store_rows(got: Rows, info: ModelInfo, ids: list[int], *, dtype: str, engine: str, threads: int,
           eng: Engine, spot: dict | None = None) -> str | None:
    """Keep the prompt's whole cache in the store; None when it is not exact KV (quantized).
    A foreign pack's entry records the gate it passed here (not checked again on use)."""
    if got.pack is not None:
        if got.pack.header.quant_scheme != "none":
            return None
        header = replace(got.pack.header, rows_start=0, base=None)
    else:
        header = build_header(info, ids, dtype=dtype, chunk_tokens=got.schedule or 0, engine=engine,
                              threads=threads, extra=eng.producer_info(),
                              ring_extra=ring_extra_held(info.layers, got.layers, len(ids) - 1))
    st = Store()
    entry = st.put_layers(header, got.layers).entry.id
    if got.pack is not None and spot and spot.get("ran") and spot.get("ok") and spot.get("sampled"):
        st.record_check(entry, engine=engine, dtype=dtype, result=spot["sampled"])
    return entry


__all__ = ["Rows", "bind", "rows_for", "store_rows"]
