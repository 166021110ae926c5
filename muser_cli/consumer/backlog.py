"""What is ahead of a new request on a serving consumer's engine (issue #39): :class:`Backlog`
keeps each request queued or running -- its prompt work still to do here, whether its rows come
from a producer, whether it decodes -- so that the cost model
(:meth:`muser_cli.consumer.costs.CostModel.predict`) adds the consumer's own queue to every path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


@dataclass
class Work:
    """One request on a serving consumer's engine, as :class:`Backlog` keeps it: positions
    ``[done, end)`` still to prefill here (``done == end``: none), in chunks of ``chunk``;
    ``pulled``: its rows come from a producer (its engine work is their install and first step);
    ``decoding``: its first token is out (it takes a decode step every round)."""

    done: int = 0
    end: int = 0
    chunk: int = 256
    pulled: bool = False
    decoding: bool = False
    rows: int = 0  # the prompt's rows (what an install of pulled rows costs)

    @property
    def todo(self) -> int:
        return max(0, self.end - self.done)


class Backlog:
    """What is ahead of a new request on one engine (module doc), updated by the serving
    consumer as requests arrive, are routed, finish prefill chunks, decode and finish.
    Thread-safe. ``batched``: the engine steps the decoding sequences in one batched call
    (else each takes its own step every round)."""

    def __init__(self, *, batched: bool = True) -> None:
        self.batched = batched
        self._lock = threading.Lock()
        self._work: dict[Any, Work] = {}

    def arrive(self, key: Any, *, tokens: int, chunk: int) -> None:
        """A request queued (``tokens``: its prompt's length, or an estimate until it is
        tokenized; it counts as local work until routed)."""
        with self._lock:
            self._work[key] = Work(0, max(0, tokens - 1), max(1, chunk), rows=max(0, tokens - 1))

    def routed(self, key: Any, *, start: int, end: int, chunk: int, pulled: bool) -> None:
        """Its route: rows ``[start, end)`` to prefill here (``pulled``: none, from a producer)."""
        with self._lock:
            w = self._work.setdefault(key, Work())
            w.done, w.end, w.chunk, w.pulled, w.rows = (end if pulled else start), end, max(1, chunk), pulled, end

    def progress(self, key: Any, done: int) -> None:
        """A prefill chunk of it done: positions up to ``done`` computed. A request routed to a
        producer that computes here after all (a broken promise raced, the rest of a cut stream)
        counts as prompt work here from then on."""
        with self._lock:
            w = self._work.get(key)
            if w is None:
                return
            if w.pulled:
                w.pulled, w.done = False, min(max(0, done), w.end)
            else:
                w.done = max(w.done, min(done, w.end))

    def decoding(self, key: Any) -> None:
        """Its first token is out: no prompt work left, a decode step every round."""
        with self._lock:
            w = self._work.get(key)
            if w is not None:
                w.done, w.pulled, w.decoding = w.end, False, True

    def finish(self, key: Any) -> None:
        with self._lock:
            self._work.pop(key, None)

    def ahead(self, key: Any = None) -> list[Work]:
        """A copy of every request's work but ``key``'s own."""
        with self._lock:
            return [Work(**vars(w)) for k, w in self._work.items() if k is not key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._work)


__all__ = ["Backlog", "Work"]
