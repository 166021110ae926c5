"""The resident producer's admission: who computes now, who waits, whose turn is next.

Pure bookkeeping under one condition variable (no sockets): :class:`~muser_cli.handoff.pull.server.PullServer`
asks it for a turn per request or probe and tells it when a turn ends.

The order (issue #39): waiting requests take turns in **rounds** between consumers -- a consumer
gets no second turn while another consumer that waited has not had its turn of the round -- and
within a round the request with the **earliest deadline** goes first (a request without one has
none: after those with one; ties to the consumer that waited longest since its last turn, then
the oldest request). So a consumer that floods the producer never starves another (A flooding
with three waiting, then B with two: A, B, A, B, A), and a request with a tight deadline overtakes
a relaxed one of another consumer within the round.

**Preemption at chunk boundaries**: a running request's compute asks :meth:`Admission.preempt_for`
between two chunks whether the request next in that order should pass it -- one with an earlier
deadline whose expected compute is short (at most :data:`PREEMPT_MAX_S`: the paused stream's
consumer sees no frame meanwhile) -- and if so :meth:`Admission.pause` gives its turn up and
waits to take it back. A paused request goes before every waiting one whose deadline is not
earlier than its own (so it resumes right after what passed it); its rows stay exact: its
cache is its own, and the chunks it computes after the pause are the ones it would have.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable


@dataclass(eq=False)
class Ticket:
    """One waiting request: its deadline (``time.monotonic()`` seconds; inf: none) and what the
    producer expects it to cost (seconds of compute; None: unknown)."""

    deadline: float = math.inf
    cost_s: float | None = None
    seq: int = 0


#: The longest expected compute (seconds) of a request that may pass a running one at a chunk
#: boundary: the paused stream's consumer waits that long for its next frame.
PREEMPT_MAX_S = 5.0


@dataclass(eq=False)
class Turn:
    """A request's turn (running or paused): when it started, its expected cost and deadline,
    the thread that entered (the one that leaves), and how often and how long it paused."""

    started: float
    cost_s: float | None
    deadline: float = math.inf
    thread: int = 0
    paused: int = 0
    paused_s: float = 0.0
    paused_at: float | None = None  # while paused: since when

    def ran_s(self, now: float) -> float:
        """Seconds it computed (its pauses left out)."""
        pausing = now - self.paused_at if self.paused_at is not None else 0.0
        return now - self.started - self.paused_s - pausing


@dataclass
class _Queue:
    tickets: list[Ticket] = field(default_factory=list)
    turns: int = 0  # turns taken since it last had nothing waiting (the rounds)

    def __len__(self) -> int:  # its waiting requests
        return len(self.tickets)


class Admission:
    """Who computes now: up to ``slots`` requests at once (1 on torch/MLX; a batching engine's
    limit on vLLM), or one probe alone (a probe is never measured against a running prefill,
    nor slows one). Waiting requests queue per consumer, in rounds, earliest deadline first
    within a round (module doc). ``enter`` returns False when ``timeout`` passed first."""

    def __init__(self, slots: int) -> None:
        self.slots = max(1, int(slots))
        self._cv = threading.Condition()
        self._running: list[Turn] = []
        self._paused: list[Turn] = []  # turns given up at a chunk boundary, to be taken back
        self._probing = False
        self._probe_waiting = 0  # a waiting probe holds new requests back, so it is not starved
        self._queues: OrderedDict[str, _Queue] = OrderedDict()  # consumer -> its waiting tickets
        self._seq = 0

    # -------------------------------------------------------------- the order
    def _order_key(self, queues: "OrderedDict[str, _Queue]") -> tuple[str, Ticket] | None:
        """The next (consumer, ticket) to go, by the rule of the module doc."""
        if not queues:
            return None
        low = min(q.turns for q in queues.values())
        best: tuple[tuple, str, Ticket] | None = None
        for rank, (who, q) in enumerate(queues.items()):
            if q.turns != low or not q.tickets:
                continue
            t = min(q.tickets, key=lambda t: (t.deadline, t.seq))
            key = (t.deadline, rank, t.seq)
            if best is None or key < best[0]:
                best = (key, who, t)
        return None if best is None else (best[1], best[2])

    def _free(self, probe: bool, who: str = "", ticket: object = None) -> bool:
        if probe:
            return not self._running and not self._probing
        if self._probing or self._probe_waiting or len(self._running) >= self.slots:
            return False
        nxt = self._order_key(self._queues)
        if nxt is None or nxt[0] != who or nxt[1] is not ticket:
            return False
        return all(ticket.deadline < t.deadline for t in self._paused)  # a paused one goes first

    def enter(self, probe: bool, timeout: float | None = 0.0, who: str = "", *, deadline: float = math.inf,
              cost_s: float | None = None) -> bool:
        """A turn within ``timeout`` seconds (None: however long it takes)."""
        end = None if timeout is None else time.monotonic() + timeout
        return self.wait(probe, lambda: end is not None and time.monotonic() >= end,
                         poll=0.2 if timeout is None else max(0.0, min(0.2, timeout)), who=who,
                         deadline=deadline, cost_s=cost_s)

    def wait(self, probe: bool, stop: Callable[[], bool], poll: float = 0.2, who: str = "", *,
             deadline: float = math.inf, cost_s: float | None = None) -> bool:
        """Wait for a turn until ``stop()`` says to give up (False then). A waiting
        probe holds new requests back for the whole wait, not only while a poll runs."""
        served = False
        with self._cv:
            self._seq += 1
            ticket = Ticket(deadline, cost_s, self._seq)
            if probe:
                self._probe_waiting += 1
            else:
                if who not in self._queues:  # joins the current round, with no credit from before
                    low = min((q.turns for q in self._queues.values()), default=0)
                    self._queues[who] = _Queue(turns=low)
                self._queues[who].tickets.append(ticket)
            try:
                while not self._free(probe, who, ticket):
                    if stop():
                        return False
                    if poll > 0:
                        self._cv.wait(poll)
                if probe:
                    self._probing = True
                else:
                    self._running.append(Turn(time.monotonic(), cost_s, deadline, threading.get_ident()))
                served = True
                return True
            finally:
                if probe:
                    self._probe_waiting -= 1
                else:
                    self._dequeue(who, ticket, served)
                self._cv.notify_all()

    def _dequeue(self, who: str, ticket: Ticket, served: bool) -> None:
        """Take ``ticket`` out of its consumer's queue; after a turn, the consumer's round count
        goes up and, if it still waits, it goes last among equals (one that gave up keeps its place)."""
        q = self._queues[who]
        q.tickets.remove(ticket)
        if served:
            q.turns += 1
        if not q.tickets:
            del self._queues[who]
        elif served:
            self._queues.move_to_end(who)

    def leave(self, probe: bool) -> None:
        with self._cv:
            if probe:
                self._probing = False
            else:
                me = threading.get_ident()
                at = next((i for i, t in enumerate(self._running) if t.thread == me), 0)
                if self._running:
                    self._running.pop(at)
            self._cv.notify_all()

    # -------------------------------------------------------------- preemption
    def turn(self) -> Turn | None:
        """The running turn the calling thread entered (None: it holds none)."""
        me = threading.get_ident()
        with self._cv:
            return next((t for t in self._running if t.thread == me), None)

    def preempt_for(self, turn: Turn) -> bool:
        """Whether ``turn`` should give its turn up now (module doc): the request next in order
        has an earlier deadline and a known compute of at most :data:`PREEMPT_MAX_S`."""
        with self._cv:
            if turn not in self._running or self._probing or self._probe_waiting:
                return False
            nxt = self._order_key(self._queues)
            if nxt is None:
                return False
            t = nxt[1]
            return t.deadline < turn.deadline and t.cost_s is not None and t.cost_s <= PREEMPT_MAX_S

    def yield_turn(self, turn: Turn) -> float | None:
        """At a chunk boundary: pause ``turn`` when :meth:`preempt_for` says so; the seconds it
        was paused (None: it went on)."""
        return self.pause(turn) if self.preempt_for(turn) else None

    def pause(self, turn: Turn) -> float:
        """Give ``turn`` up and wait to take it back (module doc); the seconds it was paused.
        Called by the thread computing for it (not necessarily the one that entered)."""
        with self._cv:
            t0 = turn.paused_at = time.monotonic()
            self._running.remove(turn)
            self._paused.append(turn)
            self._cv.notify_all()
            try:
                while not self._resumable(turn):
                    self._cv.wait(0.2)
            finally:
                self._paused.remove(turn)
                self._running.append(turn)
                waited = time.monotonic() - t0
                turn.paused, turn.paused_s, turn.paused_at = turn.paused + 1, turn.paused_s + waited, None
                self._cv.notify_all()
        return waited

    def _resumable(self, turn: Turn) -> bool:
        if self._probing or self._probe_waiting or len(self._running) >= self.slots:
            return False
        if min(self._paused, key=lambda t: t.deadline) is not turn:
            return False
        nxt = self._order_key(self._queues)
        return nxt is None or not nxt[1].deadline < turn.deadline

    # -------------------------------------------------------------- the promise
    def waiting(self) -> int:
        with self._cv:
            return sum(len(q.tickets) for q in self._queues.values())

    def expected_start(self, who: str, *, deadline: float = math.inf, cost_s: float | None,
                       default_s: float = 0.0) -> tuple[float, int]:
        """When a request of ``who`` with ``deadline`` arriving now would start (seconds from
        now), were nothing else to arrive, and how many requests would go before it: the order
        of the module doc played forward over the running and waiting requests' expected costs
        (``default_s`` for one whose cost is unknown). A running request past its estimate is
        expected to need as long again as it has run (it overran: no better guess)."""
        now = time.monotonic()
        with self._cv:
            free = []
            for r in self._running:
                cost = r.cost_s if r.cost_s is not None else default_s
                ran = r.ran_s(now)
                free.append(cost - ran if ran < cost else ran)
            free += [0.0] * (self.slots - len(free))
            heapq.heapify(free)
            for r in sorted(self._paused, key=lambda t: t.deadline):  # each resumes on the first free slot
                cost = r.cost_s if r.cost_s is not None else default_s
                ran = r.ran_s(now)
                heapq.heappush(free, heapq.heappop(free) + (cost - ran if ran < cost else ran))
            queues: OrderedDict[str, _Queue] = OrderedDict(
                (w, _Queue(list(q.tickets), q.turns)) for w, q in self._queues.items())
        mine = Ticket(deadline, cost_s, 1 << 62)
        if who not in queues:
            queues[who] = _Queue(turns=min((q.turns for q in queues.values()), default=0))
        queues[who].tickets.append(mine)
        ahead = 0
        while True:
            nxt = self._order_key(queues)
            assert nxt is not None
            w, t = nxt
            at = heapq.heappop(free)
            if t is mine:
                return max(0.0, at), ahead
            ahead += 1
            heapq.heappush(free, at + (t.cost_s if t.cost_s is not None else default_s))
            q = queues[w]
            q.tickets.remove(t)
            q.turns += 1
            if not q.tickets:
                del queues[w]
            else:
                queues.move_to_end(w)


__all__ = ["PREEMPT_MAX_S", "Admission", "Ticket", "Turn"]
