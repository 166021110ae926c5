"""A consumer's sequence handle: one sequence decoding from installed rows.

:meth:`muser_cli.engines.base.Consumer.open` installs rows and computes the first step (the
fused gate judging its rows), and gives a :class:`Sequence`: its first token, picked by its own
sampling, and what the engine needs to go on (its cache, its picker: ``state``, the engine's
own). :meth:`~muser_cli.engines.base.Consumer.fork` gives more sequences from that first step
(each its own copy of the cache, its own picker), :meth:`~muser_cli.engines.base.Consumer.run`
steps one to its end. :func:`run_together` runs several at once, each on a thread of its own:
with the engine's batched decode on (``Consumer.batch_decode``) their steps are computed
together, by the stepper (:mod:`muser_cli.engines.stepper`), one call a step.

The engine's calls go through whatever object is passed as the engine (a serving consumer's
engine that holds its turn for each call, :class:`muser_cli.consumer.turns.TurnEngine`, works
as the engine itself). This module holds no arrays and imports no ML framework.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence as Seq

from muser_cli.errors import UsageError


@dataclass(eq=False)
class Sequence:
    """One opened sequence (see the module's doc). ``picked``: whether its first step was
    computed (not when opened for no token); ``first``: the token that step picked, not yet given
    out (an engine that pipelines its steps, MLX, reads it as the sequence runs: None until
    then); ``state``: the engine's own."""

    rows: int  # the installed rows (positions before the first step)
    max_new_tokens: int
    eos: tuple[int, ...]  # the tokens that end it (none when ``stop_on_eos`` was off)
    start: float  # when opening began (perf_counter): its TTFT counts from here
    stats: dict = field(default_factory=dict)
    picked: bool = False
    first: int | None = None
    state: Any = None
    ran: bool = False

    def take(self) -> Any:
        """The engine's state, once: a sequence runs once (its cache goes with it)."""
        if self.ran:
            raise UsageError("this sequence has run already: a sequence runs once")
        self.ran = True
        state, self.state = self.state, None
        return state

    def check_forkable(self) -> None:
        """A fork takes an opened sequence, before it runs."""
        if self.ran:
            raise UsageError("a sequence forks before it runs")


def run_together(engine: Any, seqs: Seq[Sequence], on_tokens: Seq[Callable[[int], None] | None]) -> list[Any]:
    """Run ``seqs`` to their ends at once: the first on this thread, each other on a thread of its
    own (``engine.run``; with the batched decode on, their steps are computed together). Returns
    each one's :class:`~muser_cli.engines.base.DecodeResult`, or the exception its run raised,
    in order, once all ended."""
    out: list[Any] = [None] * len(seqs)

    def one(i: int) -> None:
        try:
            out[i] = engine.run(seqs[i], on_tokens[i])
        except BaseException as exc:  # noqa: BLE001 - the caller reads it from the list
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,), name=f"muser-choice-{i}", daemon=True)
               for i in range(1, len(seqs))]
    for thread in threads:
        thread.start()
    try:
        if seqs:
            one(0)
    finally:
        for thread in threads:
            thread.join()
    return out


__all__ = ["Sequence", "run_together"]
