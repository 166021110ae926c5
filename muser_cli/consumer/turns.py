"""Many requests, one engine: the engine's turns, handed round one step at a time.

Each running request (a *sequence*) has a thread of its own: it tokenizes, waits for its
producer's bytes, checks them, all without the engine. Only engine work needs the engine, and
that is taken in :class:`Turns`: one holder at a time, in the order asked (first come, first
served), given up after every decode step and every prefill chunk (:meth:`Turns.pass_turn`), so
that a long local prefill never freezes the streams already answering — between two of its
chunks every other running sequence takes one step — and a request whose rows are still on
the wire costs the others nothing (it does not hold the engine while it waits).

Each sequence is computed exactly as it would be alone (the same calls on the same arrays, one
sequence per call), so its tokens are its solo tokens, greedy or seeded: the exact mode. (An
engine that steps several sequences in one batched call would round differently; see
docs/serve.md.)

:class:`TurnEngine` puts an engine behind the turns: every method call holds the turn (nested
calls of the same thread take it once), and the progress and token callbacks of the lane pass
it on (:meth:`Turns.pass_turn`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Callable, Iterator


class Turns:
    """A fair, re-entrant turn on one engine: FIFO among threads, nested holds by one thread count once.

    ``on_step(n)``: called at every pass with the number of sequences taking turns (the batch
    size of that step, for the metrics). ``on_first_hold(s)``: called with how long each turn
    taken ahead of the queue (``acquire(first=True)``: a batched decode step) was held, in
    seconds (the cost model's step time, issue #39). ``on_hold(wall_s, ran_s, waited_s)``: called
    as every hold ends with its wall seconds and the seconds the holding thread ran and waited
    runnable for a CPU meanwhile (Linux's ``/proc/thread-self/schedstat``; None and None where
    it cannot be read): the share of the cores the engine got
    (:class:`muser_cli.consumer.cpushare.CpuShare`)."""

    def __init__(self, on_step: Callable[[int], None] | None = None,
                 on_first_hold: Callable[[float], None] | None = None,
                 on_hold: Callable[[float, float | None, float | None], None] | None = None) -> None:
        self._cv = threading.Condition()
        self._queue: collections.deque[int] = collections.deque()
        self._holder: int | None = None
        self._last: int | None = None  # who held the turn last
        self._depth = 0
        self._members: set[int] = set()
        self.on_step = on_step
        self.on_first_hold = on_first_hold
        self.on_hold = on_hold
        self._sched_since: tuple[float, float] | None = None  # the holder's (ran, waited) when it took the turn
        self._first_since: float | None = None  # when the turn held now was taken ahead of the queue
        self._since = 0.0  # when the holder took the turn
        self._held: dict[int, float] = {}  # seconds each member thread held the turn, in all

    def _took(self) -> None:
        """(lock held) the holder took the turn now."""
        self._since = time.perf_counter()
        self._sched_since = thread_sched() if self.on_hold is not None else None

    def _let_go(self, me: int) -> None:
        """(lock held) ``me`` gives the turn up: its holding time counted."""
        wall = time.perf_counter() - self._since
        if me in self._members:
            self._held[me] = self._held.get(me, 0.0) + wall
        if self.on_hold is not None:
            now, since = thread_sched(), self._sched_since
            ran, waited = ((now[0] - since[0], now[1] - since[1]) if now is not None and since is not None
                           else (None, None))
            try:
                self.on_hold(wall, ran, waited)
            except Exception:  # noqa: BLE001 - bookkeeping: it never keeps the turn from passing
                pass

    def held_s(self) -> float:
        """The seconds the calling thread has held the turn since it joined (the engine time
        its own work took, the others' turns left out), the hold in progress included."""
        me = threading.get_ident()
        with self._cv:
            now = time.perf_counter() - self._since if self._holder == me else 0.0
            return self._held.get(me, 0.0) + now

    # -------------------------------------------------------------- membership
    def join(self) -> None:
        """The calling thread runs a sequence (counted in the batch size until :meth:`leave`)."""
        with self._cv:
            self._members.add(threading.get_ident())

    def leave(self) -> None:
        with self._cv:
            self._members.discard(threading.get_ident())
            self._held.pop(threading.get_ident(), None)

    # -------------------------------------------------------------- the turn
    def acquire(self, *, first: bool = False) -> None:
        """Take the turn (wait for it). ``first``: at the head of the queue, not its tail —
        the batched decode's stepper asks so, so that between two of its steps at most one
        other holder (one prefill chunk) runs."""
        me = threading.get_ident()
        with self._cv:
            if self._holder == me:
                self._depth += 1
                return
            if first and self._last == me and self._queue:
                self._queue.insert(1, me)  # it just had the turn: the one waiting longest goes first
            elif first:
                self._queue.appendleft(me)
            else:
                self._queue.append(me)
            while self._holder is not None or self._queue[0] != me:
                self._cv.wait()
            self._queue.popleft()
            self._holder, self._depth = me, 1
            self._took()
            self._first_since = self._since if first else None

    def release(self) -> None:
        held = None
        with self._cv:
            if self._holder != threading.get_ident():
                raise RuntimeError("released a turn this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                if self._first_since is not None:
                    held, self._first_since = time.perf_counter() - self._first_since, None
                self._let_go(self._holder)
                self._holder, self._last = None, self._holder
                self._cv.notify_all()
        if held is not None and self.on_first_hold is not None:
            self.on_first_hold(held)

    def holds(self) -> bool:
        with self._cv:
            return self._holder == threading.get_ident()

    @contextlib.contextmanager
    def away(self) -> Iterator[None]:
        """Let go of the turn (all nesting levels) for the block, and take it back after, at
        the same depth: a sequence whose steps someone else computes (a batched decode) waits
        for its tokens here, costing the engine nothing. A no-op wrap for a thread not holding it."""
        me = threading.get_ident()
        with self._cv:
            depth = self._depth if self._holder == me else 0
            if depth:
                self._let_go(me)
                self._holder, self._depth, self._last = None, 0, me
                self._cv.notify_all()
        try:
            yield
        finally:
            if depth:
                self.acquire()
                with self._cv:
                    self._depth = depth

    def pass_turn(self) -> None:
        """After a step or a chunk: let every sequence waiting for the engine take one turn,
        then carry on (at the same nesting depth). A no-op for a thread not holding the turn,
        and when no one waits."""
        me = threading.get_ident()
        with self._cv:
            if self._holder != me:
                return
            if self.on_step is not None:
                self.on_step(max(1, len(self._members)))
            self._let_go(me)  # its time so far counted (and the share sampled, a long prefill's too)
            if not self._queue:
                self._took()
                return
            depth, self._holder, self._depth, self._last = self._depth, None, 0, me
            self._queue.append(me)
            self._cv.notify_all()
            while self._holder is not None or self._queue[0] != me:
                self._cv.wait()
            self._queue.popleft()
            self._holder, self._depth, self._first_since = me, depth, None
            self._took()


def thread_sched() -> tuple[float, float] | None:
    """The calling thread's seconds on a CPU and waiting runnable for one, since it started
    (Linux: ``/proc/thread-self/schedstat``); None where that cannot be read."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            ran, waited = f.read().split()[:2]
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return None


class TurnEngine:
    """An engine whose every method call holds the engine's turn (see the module's doc); its
    attributes read through. What the lane passes as ``resident``."""

    def __init__(self, engine: Any, turns: Turns) -> None:
        self._engine = engine
        self._turns = turns

    @property
    def inner(self) -> Any:
        return self._engine

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._engine, name)
        if not callable(value) or name.startswith("__"):
            return value
        turns = self._turns

        def held(*args: Any, **kwargs: Any) -> Any:
            turns.acquire()
            try:
                return value(*args, **kwargs)
            finally:
                turns.release()

        return held


__all__ = ["TurnEngine", "Turns", "thread_sched"]
