"""Delta packs: cut a pack down to what a consumer lacks, and merge one back.

A delta kvpack (docs/reuse.md §3) is an ordinary v1.0 kvpack whose ``positions.start``
is the number of prompt tokens the consumer holds (``held``): its full-attention layers
carry rows [held, end), its sliding-window layers their usual last window-1 rows (a ring
always ships whole: the consumer's stored ring belongs to another point), and its
``base`` names the prefix by chain hash. Merging takes full-attention rows [0, held) from
a stored entry with that chain and everything else from the delta: byte for byte the
pack one full prefill would have produced.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from muser_cli.errors import CorruptEntry, DataError, IdentityMismatch
from muser_cli.kvpack import KVPack, LayerKV, LayerSpec, PackHeader, StateKV
from muser_cli.reuse.chain import Scope, delta_point
from muser_cli.reuse.manifest import base_object, check_base


class BaseNotHeld(IdentityMismatch):
    """A delta pack extends a prefix this machine does not hold (exit 65)."""


def delta_header(header: PackHeader, scope: Scope, held: int, chain: str | None) -> PackHeader:
    """``header`` cut to start at ``held`` (0: a full pack, no base) -- or at the chunk
    boundary below it, when a delta from ``held`` would not merge exactly (:func:`delta_point`)."""
    held, chain = delta_point(scope, header.token_ids, held, chain)
    if held == 0:
        return replace(header, rows_start=0, base=None)
    assert chain is not None
    # The sliding history of a whole pack (ring_extra >= its rows) is, in a delta, every row
    # from the consumer's prefix on: ring_extra end - held (docs/kvpack.md 1.3); a ring row stays.
    ring = min(header.ring_extra, header.rows_end - held) if header.ring_extra else 0
    return replace(header, rows_start=held, base=base_object(scope, held, chain), ring_extra=ring)


def layers_at(layers: Sequence[LayerKV], specs: Sequence[LayerSpec], rows: int, extra: int = 0) -> list[LayerKV]:
    """The cache as of ``rows`` positions, taken from ``layers`` (which must hold it): full
    layers rows [0, rows), sliding layers their last window-1 rows before ``rows`` (and
    ``extra`` older ones: a pack's ``ring_extra``)."""
    out: list = []
    for i, (lk, spec) in enumerate(zip(layers, specs)):
        if spec.kind == "state":  # its snapshot at ``rows`` (a chunk end, or the pack's end), and those before
            out.append(state_at(lk, i, rows))
            continue
        first = rows - spec.carried_rows(rows, extra)
        a, b = first - lk.first_row, rows - lk.first_row
        if a < 0 or b > lk.keys.shape[1]:
            raise DataError(f"layer {i} holds positions [{lk.first_row}, {lk.first_row + lk.keys.shape[1]}), "
                            f"not [{first}, {rows})")
        out.append(LayerKV(keys=lk.keys[:, a:b], values=lk.values[:, a:b], first_row=first))
    return out


class StateMissing(DataError):
    """A state layer holds no snapshot at the position asked for (exit 65)."""


def state_at(lk: StateKV, index: int, rows: int) -> StateKV:
    """A state layer's snapshot at ``rows`` with every one before it (a chunk end's, or the end's)."""
    tensors = lk.at(rows) if isinstance(lk, StateKV) else None
    if tensors is None:
        raise StateMissing(f"layer {index} holds no state snapshot at position {rows}")
    return StateKV(tensors=tensors, position=rows, earlier={p: t for p, t in lk.earlier.items() if p < rows})


def merge(prefix: Sequence[LayerKV], delta: KVPack) -> list[LayerKV]:
    """Full layers: ``prefix`` rows [0, held) then the delta's; sliding and chunked layers: the
    delta's own rows; state layers: the delta's snapshots after the prefix's up to ``held``."""
    h = delta.header
    held = h.rows_start
    out: list = []
    for i, (spec, mine, theirs) in enumerate(zip(h.layers, prefix, delta.layers)):
        if spec.kind == "state":
            before = state_at(mine, i, held)
            out.append(StateKV(tensors=theirs.tensors, position=theirs.position,
                               earlier={**before.earlier, held: before.tensors, **theirs.earlier}))
            continue
        if spec.kind in ("sliding", "chunked"):
            out.append(theirs)
            continue
        if mine.first_row != 0 or mine.keys.shape[1] < held:
            raise DataError(f"layer {i}: the stored prefix does not cover rows [0, {held})")
        keys = np.concatenate([mine.keys[:, :held], theirs.keys], axis=1)  # (kv_heads, rows, head_dim)
        values = np.concatenate([mine.values[:, :held], theirs.values], axis=1)
        out.append(LayerKV(keys=keys, values=values, first_row=0))
    return out


def resolve_delta(pack: KVPack, store) -> tuple[list[LayerKV], str]:
    """Merge a delta pack with the stored prefix its base names: (the whole cache, entry id).

    Raises DataError when the base disagrees with the pack itself and BaseNotHeld when no
    stored entry (that still verifies) holds the prefix."""
    scope, held, chain = check_base(pack.header)
    for point in store.points(scope.model, scope.tokenizer, pack.header.token_ids, held, dtype=scope.dtype,
                              chunk_tokens=scope.chunk_tokens, chain=chain):
        try:
            stored = store.load(point.entry)
            return merge(stored.layers, pack), point.entry
        except (CorruptEntry, StateMissing):  # StateMissing: an entry stored without a snapshot there
            continue
    raise BaseNotHeld(
        f"delta pack extends a {held}-token prefix (chain {chain[:19]}…) that this machine's store does not hold",
        hint="ask the producer for a full pack (no --have), or decode with --prompt to prefill locally")


@dataclass
class Resume:
    """Where a local prefill can start: the whole cache as of ``held`` rows, from a store entry."""

    held: int
    layers: list[LayerKV]
    entry: str
    scope: Scope
    stored: KVPack | None = None  # the whole entry, as loaded and verified


def find_resume(store, model: str, tokenizer: str, ids: Sequence[int], *, dtype: str,
                chunk_tokens: int | None = None, spare_rows: int = 0, ring_extra: int = 0) -> Resume | None:
    """The deepest stored point from which prompt ``ids`` can be prefilled exactly (rings
    included): at most len(ids)-1 rows, i.e. a full hit when held == len(ids)-1.
    ``spare_rows``: a full hit's full layers come with that much room after their rows
    (:meth:`Store.load`), for an engine to adopt. ``ring_extra``: a full hit must hold that
    many ring rows beyond ``window - 1`` too (a producer about to write a pack that carries
    them); an entry stored without them serves only shallower points."""
    tried: set[str] = set()
    for point in store.points(model, tokenizer, ids, len(ids) - 1, dtype=dtype, chunk_tokens=chunk_tokens):
        if not point.resumable or point.entry in tried:
            continue
        full = point.held == len(ids) - 1
        if full and ring_extra:
            have = store.ring_extra_of(point.entry)  # header only: an entry without the rows is not loaded
            if have is not None and have < ring_extra:
                continue  # stored without the ring rows asked for: try a shallower point
        try:
            stored = store.load(point.entry, spare_rows=spare_rows if full else 0)
        except CorruptEntry:
            tried.add(point.entry)
            continue
        try:
            layers = layers_at(stored.layers, stored.header.layers, point.held, ring_extra if full else 0)
        except DataError:
            if not (full and ring_extra):
                raise  # an entry that disagrees with its own header is not skipped quietly
            continue  # a full hit stored without the ring rows asked for: try a shallower point
        tried.add(point.entry)
        return Resume(point.held, layers, point.entry, point.scope, stored)
    return None


def with_held_snapshots(header: PackHeader, layers: Sequence) -> PackHeader:
    """``header`` with a ``state_every`` whose frame plan asks its state layers only for
    snapshots ``layers`` hold (a streamed pack keeps its last two: then only the end's, so a
    stored entry resumes at its end only). StateMissing when no ``state_every`` fits."""
    def fits(h: PackHeader) -> bool:
        return all(layers[i].at(s + c) is not None for i, s, c in h.frame_plan() if h.layers[i].kind == "state")

    if fits(header):
        return header
    every = max(2, -(-header.rows_end // header.grid))  # no grid chunk end due before the end
    if every <= 1 << 16 and fits(cut := replace(header, state_every=every)):
        return cut
    raise StateMissing("the state layers' snapshots at the pack's chunk ends are not held here (a streamed pack "
                       "keeps its newest): not stored")


def cut_frame(header: PackHeader, layer: int, start: int, keys, values, count: int | None = None):
    """The part of an input frame (layer, start, rows) that a delta ``header`` carries, or None.
    A state layer's frame (``count`` positions, its snapshot at their end) is carried whole
    when it ends after the delta's start: it then starts there."""
    first = header.layer_first_row(layer)
    if header.layers[layer].kind == "state":
        assert count is not None
        return None if start + count <= first else (max(start, first), keys, values)
    count = keys.shape[1]
    if start + count <= first:
        return None
    a = max(0, first - start)
    return start + a, keys[:, a:], values[:, a:]
