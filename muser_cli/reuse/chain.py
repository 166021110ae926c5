"""Prefix identity for reuse: a scope, and chained hashes of token-id blocks.

Rules (docs/reuse.md is the normative text):
  * the **scope** is what makes two rows interchangeable: model fingerprint, tokenizer
    fingerprint, storage dtype and the canonical chunk size C of the schedule that
    computed them;
  * ``H_0 = sha256("muser-reuse/v1 scope\\0" || canonical JSON of the scope)``;
  * ids are cut into blocks of C from position 0 and folded in order:
    ``H_k = sha256(H_{k-1} || u32le(len(block)) || block as u32le)``; only a last block
    may be shorter than C;
  * ``chain(n)`` = ``"sha256:" + hex(H)`` after the blocks covering ids[:n].

The rows of positions [0, n) are the same bytes for every prompt with that chain when n
is a multiple of C (every chunk before n was computed whole, with the same inputs), and
for a prompt whose rows end exactly at n (its last, shorter chunk was computed with the
same inputs too). Those are the only points a store entry serves: a hit is always exact.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

from muser_cli.kvpack.format import canonical_json
from muser_cli.kvpack.layers import LayerSpec

SCOPE_TAG = b"muser-reuse/v1 scope\x00"


@dataclass(frozen=True)
class Scope:
    """Rows are reusable only within one scope."""

    model: str  # model fingerprint "sha256:<hex>"
    tokenizer: str  # tokenizer fingerprint
    dtype: str  # storage dtype of the rows
    chunk_tokens: int  # canonical chunk size C

    def to_json(self) -> dict:
        return {"model": self.model, "tokenizer": self.tokenizer, "dtype": self.dtype,
                "chunk_tokens": self.chunk_tokens}

    @property
    def root(self) -> bytes:
        return hashlib.sha256(SCOPE_TAG + canonical_json(self.to_json())).digest()

    @property
    def digest(self) -> str:
        return self.root.hex()


def scope_of_header(header) -> Scope:
    """The scope of a kvpack header's rows."""
    return Scope(header.model_fingerprint, header.tokenizer_fingerprint, header.dtype, header.chunk_tokens)


def _fold(h: bytes, block: Sequence[int]) -> bytes:
    return hashlib.sha256(h + struct.pack(f"<I{len(block)}I", len(block), *block)).digest()


def chain_points(scope: Scope, ids: Sequence[int], limit: int) -> list[tuple[int, str]]:
    """``(n, chain(n))`` for every multiple n of C in (0, limit], then ``limit`` itself
    when it is not a multiple of C (the exact rows end). ``limit <= len(ids)``."""
    c = scope.chunk_tokens
    limit = min(limit, len(ids))
    h = scope.root
    out: list[tuple[int, str]] = []
    for begin in range(0, limit - limit % c, c):
        h = _fold(h, ids[begin : begin + c])
        out.append((begin + c, "sha256:" + h.hex()))
    if limit % c:
        tail = _fold(h, ids[limit - limit % c : limit])
        out.append((limit, "sha256:" + tail.hex()))
    return out


def chain_at(scope: Scope, ids: Sequence[int], n: int) -> str:
    """The chain hash of ids[:n] (n >= 1)."""
    if not 1 <= n <= len(ids):
        raise ValueError(f"chain point {n} outside [1, {len(ids)}]")
    return chain_points(scope, ids, n)[-1][1]


def servable(scope: Scope, n: int, rows_end: int) -> bool:
    """Can an entry whose rows end at ``rows_end`` serve rows [0, n) exactly?"""
    return 0 < n <= rows_end and (n % scope.chunk_tokens == 0 or n == rows_end)


def delta_point(scope: Scope, ids: Sequence[int], held: int, chain: str | None) -> tuple[int, str | None]:
    """Where a delta for a consumer holding rows [0, ``held``) of ``ids`` (chain ``chain``)
    starts: ``held`` when a delta from there merges exactly (:func:`servable`), else the
    chunk boundary below it, with that point's chain (0, None: below one chunk, a full pack).
    An entry that serves ``held`` serves every boundary below it, so the merge still finds it."""
    if held <= 0 or servable(scope, held, len(ids) - 1):
        return held, chain
    down = held - held % scope.chunk_tokens
    return down, (chain_at(scope, ids, down) if down else None)


def ring_first(spec: LayerSpec, rows: int) -> int:
    """First position a layer's cache holds after ``rows`` positions (0 for full layers)."""
    return rows - spec.carried_rows(rows)


def resumable(layers: Sequence[LayerSpec], rows_end: int, n: int) -> bool:
    """Does an entry whose rows end at ``rows_end`` hold the whole cache as of ``n`` rows,
    sliding-window rings included? (Full layers: rows [0, n). A sliding layer needs its
    last window-1 rows before n, and the entry carries only those before ``rows_end``.)"""
    if not 0 < n <= rows_end:
        return False
    return all(ring_first(s, rows_end) <= ring_first(s, n) for s in layers if s.kind in ("sliding", "chunked"))
