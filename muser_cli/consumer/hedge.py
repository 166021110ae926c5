"""A hedge's race (issue #39): a producer that broke its promise is not waited for, nor cut off.

When a pull's producer has not sent its pack by the start it promised plus the compute, a
quarter more and half a second (:data:`muser_cli.handoff.pull.client.HEDGE_MARGIN`), the consumer
starts computing the prompt here while the producer's stream keeps coming, and keeps whichever is
ready first:

  * it computes from the deepest chunk boundary whose rows verified in every layer (whole chunks
    from the producer still count: they pass the gate first, as a cut stream's do);
  * after each chunk computed here it looks at the stream: a pack whole and verified wins at once
    (the rest computed here is dropped); rows verified past the chunk computed here are taken
    instead (it goes on from there);
  * what it computes here to the end wins: the pull is cancelled.

The engine is spent on both only within a bound: it computes here only after the promise broke,
and it takes the producer's rows at the first chunk boundary after they passed its own, so at
most one chunk computed here covers rows the producer had already delivered. The producer's
rows and the rows computed here are on the same schedule (a chunk boundary is the same position
on both), so the rows kept are those a cut at that boundary would keep: same tokens as the cut.

Nothing here knows the stream's format or the engine's arrays: :func:`race` is given the
stream (a :class:`muser_cli.kvpack.stream.StreamedPack`), the engine and callables.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from muser_cli.model.info import ProgressFn

#: How often a wait for the stream looks at whether the promise broke meanwhile (seconds).
POLL_S = 0.02


class Overtaken(Exception):
    """Raised from a chunk's progress call: the producer's stream is ahead (``whole``: its pack
    is whole; else its verified rows passed the rows computed here)."""

    def __init__(self, whole: bool) -> None:
        super().__init__("overtaken by the producer's stream")
        self.whole = whole


def header_or_broken(stream: Any, broken: Any) -> bool:
    """Wait for the stream's header (True) unless the promise breaks first (False)."""
    while not stream.wait_header(POLL_S):
        if broken.is_set():
            return False
    return True


def ready_or_broken(stream: Any, broken: Any) -> bool:
    """Wait for the stream's end (True) unless the promise breaks first (False)."""
    while not stream.wait(POLL_S):
        if broken.is_set():
            return False
    return True


class _Watch:
    """The progress call of a prefill that races the stream (see the module's doc)."""

    def __init__(self, stream: Any, schedule: int, usable: Callable[[], bool], jumps: bool,
                 progress: ProgressFn | None) -> None:
        self.stream, self.schedule, self.usable, self.jumps, self.progress = stream, schedule, usable, jumps, progress

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(stage, done, total)
        if done >= total or not self.usable():
            return
        if self.stream.whole:
            raise Overtaken(True)
        if self.jumps and self.stream.boundary(self.schedule) > done:
            raise Overtaken(False)


def race(stream: Any, eng: Any, ids: Sequence[int], *, schedule: int, usable: Callable[[], bool],
         keep: Callable[[int, list], tuple[int, list, Any]], resumes: bool,
         progress: ProgressFn | None = None) -> tuple[list, int, Any, int] | None:
    """Compute ``ids[:-1]``'s rows here on ``schedule`` while ``stream`` keeps coming, keeping
    whichever is ready first (the module's doc). ``usable()``: whether the stream's rows may be
    used (its header came and binds this prompt on this schedule); ``keep(kept, prefix)``: the
    gate on verified rows before they are built on, returning what may be kept (``(0, [], spot)``
    sets them aside) and the gate's record.

    Returns None when the stream won (its pack whole: the caller takes ``stream.result()``), else
    ``(layers, kept, spot, jumps_taken)``: the rows, how many came from the stream, the gate's
    record of them (None: none kept or no gate) and how often the stream's rows were taken.
    ``resumes``: the engine continues a prefill from installed rows (``resumes_prefill``): the
    stream's verified rows are then built on; else only a whole pack overtakes."""
    jumps = resumes
    taken = 0
    while True:
        if usable() and stream.whole:
            return None
        kept, prefix, spot = 0, [], None
        if jumps and usable():
            kept, prefix = stream.verified(schedule)
            if kept:
                kept, prefix, spot = keep(kept, prefix)
                jumps = bool(kept)  # rows set aside by the gate: the stream's rows are not taken again
        watch = _Watch(stream, schedule, usable, jumps, progress)
        try:
            if kept:
                layers = eng.prefill_from(prefix, rows=kept, token_ids=list(ids[kept:-1]), chunk_tokens=schedule,
                                          progress=watch)
            else:
                layers = eng.prefill(list(ids[:-1]), chunk_tokens=schedule, progress=watch)
        except Overtaken as exc:
            if exc.whole:
                return None
            taken += 1
            continue
        return list(layers), kept, spot, taken


__all__ = ["Overtaken", "POLL_S", "header_or_broken", "race", "ready_or_broken"]
