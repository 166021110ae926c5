"""Turn memory: a serving consumer keeps each answered conversation's rows, its prompt and the
answer it generated, so that the next turn, which repeats them, computes only what is new
(issue #38; docs/serve.md, "Turn memory").

An entry is a conversation's tokens (the prompt, then the answer's tokens) and the rows of all
of them: the prompt's rows as the request had them, extended over the answer by the engine's own
``prefill_from`` once the answer was given (:meth:`TurnMemory.begin` before the answer is sent,
:meth:`TurnMemory.keep` after). A later prompt takes the longest common token prefix with an
entry (:meth:`TurnMemory.find`):

* full and latent layers are cut at any token (their rows are positions: a slice);
* sliding, chunked and recurrent-state layers only at a point whose rows or snapshot the entry
  holds: its end, and the end of the prompt it answered (:attr:`_Entry.points`); the cut falls
  back to the deepest such point within the common prefix (or the entry is not used).

So a turn's rows equal a prefill whose chunks break at each earlier turn's end (and at each cut):
deterministic on one engine and dtype, whatever the decode's company, and not the canonical
schedule's rows (the store keeps only those; docs/reuse.md).

Entries are kept most recently used first, bounded in bytes; one over the bound is not kept.
Pure Python over numpy arrays: no ML framework here.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from muser_cli.kvpack.layers import LayerKV, StateKV

#: Layer kinds whose rows are positions, cut at any token; the others need a held point.
CUT_ANYWHERE = ("full", "latent")
#: The most seconds a lookup waits for an answer's rows still being extended (:meth:`TurnMemory.find`).
WAIT_S = 30.0


@dataclass
class Held:
    """Rows [0, rows) of a prompt, from turn memory."""

    rows: int
    layers: list[Any]
    entry_tokens: int  # the tokens the entry held
    exact_points: tuple[int, ...] = ()  # where the entry could be cut (empty: anywhere)


@dataclass
class _Entry:
    key: tuple
    tokens: tuple[int, ...]
    layers: list[Any]  # rows of every token; local layers as of the end
    points: dict[int, dict[int, Any]]  # position -> {layer index: that layer as of position} (local layers)
    nbytes: int
    used: float = field(default_factory=time.monotonic)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n], dtype=np.int64), np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def layer_bytes(kv: Any) -> int:
    if isinstance(kv, StateKV):
        return sum(int(np.asarray(t).nbytes) for t in kv.tensors.values())
    return int(np.asarray(kv.keys).nbytes + np.asarray(kv.values).nbytes)


def own_copy(kv: Any) -> Any:
    """A layer in arrays of its own (a view of a pack's larger buffer would keep all of it alive);
    a state layer's newest snapshot only."""
    if isinstance(kv, StateKV):
        return StateKV(tensors={k: np.array(v) for k, v in kv.tensors.items()}, position=kv.position,
                       first_row=kv.first_row)
    return LayerKV(keys=np.array(kv.keys), values=np.array(kv.values), first_row=kv.first_row, extra=dict(kv.extra))


class TurnMemory:
    """The rows of answered conversations (module doc), for one model, engine and dtype.
    ``budget_bytes``: the most the entries hold together (0: nothing is kept)."""

    def __init__(self, kinds: Sequence[str], key: tuple, budget_bytes: int) -> None:
        self.kinds = tuple(kinds)
        self.key = key
        self.budget = max(0, int(budget_bytes))
        self.anywhere = all(k in CUT_ANYWHERE for k in self.kinds)
        self._entries: list[_Entry] = []
        self._pending: dict[int, tuple[int, ...]] = {}
        self._cv = threading.Condition()
        self._tickets = itertools.count(1)
        self.evicted = 0

    # -------------------------------------------------------------- reading
    @property
    def nbytes(self) -> int:
        with self._cv:
            return sum(e.nbytes for e in self._entries)

    def __len__(self) -> int:
        with self._cv:
            return len(self._entries)

    def find(self, ids: Sequence[int], key: tuple | None = None, wait_s: float = WAIT_S) -> Held | None:
        """The deepest held prefix of prompt ``ids``' rows (``ids[:-1]``), or None. An answer
        still being extended that would give a deeper one is waited for (up to ``wait_s``)."""
        if key is not None and key != self.key:
            return None
        ids = [int(t) for t in ids]
        end = time.monotonic() + wait_s
        with self._cv:
            while True:
                best = self._best(ids)
                depth = best[1] if best is not None else 0
                later = [t for t in self._pending.values() if min(common_prefix(t, ids), len(ids) - 1) > depth]
                left = end - time.monotonic()
                if not later or left <= 0:
                    break
                self._cv.wait(left)
            if best is None:
                return None
            entry, h = best
            entry.used = time.monotonic()
            return Held(h, self._cut(entry, h), len(entry.tokens),
                        () if self.anywhere else tuple(sorted({*entry.points, len(entry.tokens)})))

    def _best(self, ids: list[int]) -> tuple[_Entry, int] | None:
        best: tuple[_Entry, int] | None = None
        for entry in self._entries:
            reach = min(common_prefix(entry.tokens, ids), len(ids) - 1)
            h = reach if self.anywhere else max((p for p in (*entry.points, len(entry.tokens)) if p <= reach),
                                                default=0)
            if h > 0 and (best is None or h > best[1]):
                best = (entry, h)
        return best

    def _cut(self, entry: _Entry, h: int) -> list[Any]:
        out = []
        for index, (kind, kv) in enumerate(zip(self.kinds, entry.layers)):
            if kind in CUT_ANYWHERE:
                out.append(kv if h == len(entry.tokens) else
                           LayerKV(keys=kv.keys[:, :h], values=kv.values[:, :h], first_row=0, extra=kv.extra))
            elif h == len(entry.tokens):
                out.append(kv)
            else:
                out.append(entry.points[h][index])
        return out

    # -------------------------------------------------------------- keeping
    def begin(self, tokens: Sequence[int]) -> int:
        """An answer's rows are about to be extended over ``tokens``: lookups that it would
        serve deeper wait for :meth:`keep` or :meth:`end` (the ticket returned)."""
        with self._cv:
            ticket = next(self._tickets)
            self._pending[ticket] = tuple(int(t) for t in tokens)
            return ticket

    def end(self, ticket: int) -> None:
        with self._cv:
            self._pending.pop(ticket, None)
            self._cv.notify_all()

    def keep(self, ticket: int, tokens: Sequence[int], layers: Sequence[Any],
             points: dict[int, Sequence[Any]] | None = None) -> bool:
        """Keep ``layers`` (rows of every one of ``tokens``) and, at each of ``points``
        (position -> every layer as of it), the layers not cut anywhere; the least recently
        used entries go to make room. False (nothing kept) when it alone is over the budget."""
        try:
            tokens = tuple(int(t) for t in tokens)
            held_points = {p: {i: own_copy(kv) for i, (kind, kv) in enumerate(zip(self.kinds, ls))
                               if kind not in CUT_ANYWHERE}
                           for p, ls in (points or {}).items() if 0 < p < len(tokens) and not self.anywhere}
            nbytes = sum(layer_bytes(kv) for kv in layers) + sum(
                layer_bytes(kv) for ls in held_points.values() for kv in ls.values())
            if nbytes > self.budget:
                return False
            entry = _Entry(self.key, tokens, list(layers), held_points, nbytes)
            with self._cv:
                # an entry the new one covers: its tokens a prefix of the new one's, each point it cuts at held too
                self._entries = [e for e in self._entries if not self._covers(entry, e)]
                self._entries.append(entry)
                self._entries.sort(key=lambda e: e.used, reverse=True)
                while sum(e.nbytes for e in self._entries) > self.budget:
                    self._entries.pop()
                    self.evicted += 1
            return True
        finally:
            self.end(ticket)

    def _covers(self, new: _Entry, old: _Entry) -> bool:
        n = len(old.tokens)
        if n > len(new.tokens) or new.tokens[:n] != old.tokens:
            return False
        return self.anywhere or all(p in new.points or p == len(new.tokens) for p in (*old.points, n))

    def clear(self) -> None:
        with self._cv:
            self._entries.clear()


__all__ = ["CUT_ANYWHERE", "Held", "TurnMemory", "common_prefix"]
