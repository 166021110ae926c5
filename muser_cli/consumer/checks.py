"""The consumer's checks on a pack's rows before its first token, beside decode's steps: a pack
that does not match set aside (or refused), the numeric gate (fused into the first decode step
where it can be, else a step of its own; positions sampled across the whole prompt first), and
a stream cut short (its verified whole chunks kept once they pass the sampled gate, the rest
prefilled here on the pack's schedule)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from muser_cli.consumer.prompt_rows import Rows
from muser_cli.consumer.source import RowsFrom
from muser_cli.engines.base import Engine
from muser_cli.errors import DataError, KVPackError, SpotCheckFailed
from muser_cli.gate.audit import SpotGate, spot_check, spot_check_reason
from muser_cli.gate.sampled import sample_check
from muser_cli.gate.state import has_state
from muser_cli.kvpack import KVPack, PackHeader
from muser_cli.kvpack.stream import Cut, StreamedPack
from muser_cli.model.info import ProgressFn


def set_aside(exc: DataError, allowed: bool) -> str:
    """Why a pack that does not match is set aside for local rows; raise ``exc`` where that is
    not allowed (no prompt to prefill, or ``strict``)."""
    if not allowed:
        raise exc
    return f"pack set aside: {exc}"


def check_pack_rows(got: Rows, eng: Engine, *, engine: str, dtype: str, audit: int | None, seed: int | None = None,
                on_pass: Callable[[], None] | None = None, fuse: bool = True) -> tuple[dict | None, SpotGate | None, dict | None]:
    """The numeric gate before the first token of a pack this consumer would not have made
    itself: SpotCheckFailed (65) names the worst layer and the likely cause. Where it can,
    the gate is fused into the first decode step (returned, to be given to the engine;
    ``on_pass`` runs once it passed); else it runs here, as a step of its own. Before either,
    positions sampled across the whole prompt are recomputed in every layer (the third
    value: :meth:`muser_cli.gate.sampled.SampleCheck.to_json`)."""
    if got.pack is None:
        return None, None, None
    header = got.pack.header
    reason = spot_check_reason(header, engine=engine, dtype=dtype)
    if audit == 0:
        return {"ran": False, "skipped": True, "reason": reason or ""}, None, None
    if reason is None and audit is None:
        return {"ran": False, "reason": "made by this engine, in this dtype, lossless"}, None, None
    pack = got.pack if header.rows_start == 0 else KVPack(
        header=replace(header, rows_start=0, base=None), layers=got.layers, root_digest=got.pack.root_digest,
        total_bytes=got.pack.total_bytes, stored_bytes=got.pack.stored_bytes)
    positions, why = audit or 1, reason or "asked for (--audit)"
    # A delta's base was made here or passed the gate already (_gate_base): its own rows are sampled.
    sampled = sample_check(pack.header, list(pack.layers), eng, seed=seed, lo=header.rows_start,
                           reason=why).to_json()
    if has_state(header):  # its last chunk was recomputed from the pack's own state checkpoint, above
        return {"ran": True, "ok": True, "reason": why, "method": sampled["method"],
                "layers_checked": len(sampled["layers"]), "layers_unchecked": sampled["layers_unchecked"],
                "worst_rel": sampled["worst_rel"]}, None, sampled
    # Fused, the first token comes from a step of several tokens and the consumer's own
    # recomputation of the checked rows: equal within the tolerance, not in every bit (in
    # bfloat16 later tokens can differ). A pack this consumer would have made itself keeps
    # its bit-exact decode, so a check asked for on one (--audit N) runs as a step of its own.
    if fuse and reason is not None and SpotGate.fusable(pack, positions):
        return None, SpotGate(pack, engine, positions=positions, reason=why, on_pass=on_pass), sampled
    return spot_check(pack, eng, positions=positions, reason=why).to_json(), None, sampled


def after_cut(stream: StreamedPack, cut: Cut, eng: Engine, ids: list[int], *, can_fall_back: bool,
               progress: ProgressFn | None, dtype: str, audit: int | None = None, strict: bool = False,
               seed: int | None = None) -> Rows:
    """A stream that ended before its end frame: keep the whole chunks that verified and
    prefill only the rest here, on the pack's schedule (same tokens as a full fallback).
    Kept rows of a foreign pack pass the sampled gate first; refused, they are set aside
    (``strict``: SpotCheckFailed)."""
    if not can_fall_back:
        raise KVPackError(cut.reason, hint="give --prompt FILE to prefill what is missing locally")
    header = stream.header()
    assert header is not None
    rows = len(ids) - 1
    schedule = header.chunk_tokens
    kept, prefix = stream.prefix(schedule) if eng.resumes_prefill else (0, [])
    why = f"cut stream: {cut.reason}"
    kept, prefix, spot, aside = keep_verified(header, kept, prefix, eng, dtype=dtype, audit=audit, strict=strict,
                                               seed=seed)
    if aside:
        why = f"{why}; kept rows set aside: {aside}"
    t0 = time.perf_counter()
    if kept:
        layers = eng.prefill_from(prefix, rows=kept, token_ids=ids[kept:-1], chunk_tokens=schedule, progress=progress)
    else:
        layers = eng.prefill(ids[:-1], chunk_tokens=schedule, progress=progress)
    return Rows(layers, RowsFrom.PARTIAL_LOCAL if kept else RowsFrom.LOCAL, schedule, None, reason=why,
                handoff_rows=kept, local_rows=rows - kept, cut_prefill_s=time.perf_counter() - t0, spot=spot)


def keep_verified(header: PackHeader, kept: int, prefix: list, eng: Engine, *, dtype: str, audit: int | None,
                   strict: bool, seed: int | None) -> tuple[int, list, dict | None, str]:
    """A stream's verified rows ``[0, kept)`` through the sampled gate before anything is built
    on them (a foreign pack's, or asked for): ``(kept, prefix, spot, "")``, or refused
    ``(0, [], None, why)`` (``strict``: SpotCheckFailed raised)."""
    reason = spot_check_reason(header, engine=eng.name, dtype=dtype)
    if kept and audit == 0:
        return kept, prefix, {"ran": False, "skipped": True, "reason": reason or ""}, ""
    if kept and (reason is not None or audit):
        try:
            checked = sample_check(header, prefix, eng, rows=kept, seed=seed)
        except SpotCheckFailed as exc:
            if strict:
                raise
            return 0, [], None, str(exc)
        return kept, prefix, {"ran": True, "ok": True, "reason": reason or "asked for (--audit)",
                              "sampled": checked.to_json()}, ""
    return kept, prefix, None, ""


__all__ = ["after_cut", "check_pack_rows", "keep_verified", "set_aside"]
