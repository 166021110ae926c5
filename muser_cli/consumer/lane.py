"""The one consumer lane: how a request is answered from a producer's stream or here.

Every way a consumer answers — ``muser decode --producer``, ``decode --serve``, ``muser batch``
— goes through :func:`answer`: decode from what the producer streams (or from nothing: local
rows); a pack that a gate refuses (binding, the numeric gate, a delta's merge) is blamed on its
producer, who is dropped from the pool, and the request is computed here, before any token was
given out; the pull is joined and the pool told how it went. What differs between the callers
— how they decode (:data:`RunFn`), where the pack comes from (:class:`Source`) — is what they
hand in; the sequence itself is written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

from muser_cli.consumer.pool import ProducerPool
from muser_cli.errors import DataError

#: decode one request from ``src`` (None: no pack, local rows), with ``why`` as the reason
#: its answer gives should it not come from a pack.
RunFn = Callable[[BinaryIO | None, str], Any]

#: how long a pull may still run once decode finished reading it, before it counts as failed
PULL_JOIN_S = 30.0


@dataclass
class Source:
    """Where one request's pack may come from: ``reader`` (decode's input; None: no pack), the
    ``producer`` it comes from, the reason to give should nothing usable arrive, and ``live``,
    a pull streaming into ``reader`` (a :class:`muser_cli.consumer.pull.PipePull`), joined
    after decode. ``pooled``: the producer was picked from the pool, which is told the end."""

    reader: BinaryIO | None
    producer: str | None = None
    reason: str = ""
    live: Any = None
    pooled: bool = True


@dataclass
class Answered:
    """The lane's outcome: decode's result, and what the producer's part came to."""

    out: Any
    producer: str | None
    refused: DataError | None = None  # the pack a gate refused (the answer was computed here)
    pull_error: BaseException | None = None  # why the pull failed, or outlived its decode

    @property
    def from_producer(self) -> bool:
        return self.refused is None and self.producer is not None


def answer(source: Source, run: RunFn, *, pool: ProducerPool | None = None,
           recompute: Callable[[DataError], bool] = lambda exc: True) -> Answered:
    """Answer one request through the lane (see the module's doc). ``recompute(exc)``: whether a
    pack refused by a gate may be replaced by local rows (False: the refusal is the answer,
    raised, as ``--strict`` asks, or once a token was given out)."""
    refused: DataError | None = None
    out = None
    try:
        try:
            out = run(source.reader, source.reason)
        except DataError as exc:
            if source.reader is None or source.producer is None or not recompute(exc):
                raise
            refused = exc
    finally:
        error = _settle(source, pool, refused)
    if refused is not None:
        out = run(None, one_line(f"the pack from {source.producer} was refused: {refused}"))
    return Answered(out, source.producer, refused=refused, pull_error=error)


def _settle(source: Source, pool: ProducerPool | None, refused: DataError | None) -> BaseException | None:
    """Close the pack's input, join its pull, tell the pool how it went; the pull's error."""
    if source.reader is not None:
        source.reader.close()
    error = None
    live = source.live
    if live is not None:
        live.join(timeout=PULL_JOIN_S)
        error = live.error if not live.is_alive() else TimeoutError("the pull outlived its decode")
    if pool is not None and source.producer is not None and source.pooled:
        pool.done(source.producer, error)
        if refused is not None:
            pool.blame(source.producer, refused)
    return error


def one_line(text: str, limit: int = 500) -> str:
    """``text`` on one line, at most ``limit`` characters (a reason in a JSON line or a log)."""
    return " ".join(text.split())[:limit]


__all__ = ["Answered", "PULL_JOIN_S", "RunFn", "Source", "answer", "one_line"]
