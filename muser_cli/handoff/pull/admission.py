"""The resident producer's admission: who computes now, who waits, whose turn is next.

Pure bookkeeping under one condition variable (no sockets): :class:`~muser_cli.handoff.pull.server.PullServer`
asks it for a turn per request or probe and tells it when a turn ends.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Callable


class Admission:
    """Who computes now: up to ``slots`` requests at once (1 on torch/MLX; a batching engine's
    limit on vLLM), or one probe alone (a probe is never measured against a running prefill,
    nor slows one). Waiting requests queue per consumer and take turns round-robin: the
    next turn goes to the first request of the consumer that waited longest since its last
    turn, so one consumer's flood never starves another. ``enter`` returns False when
    ``timeout`` passed first."""

    def __init__(self, slots: int) -> None:
        self.slots = max(1, int(slots))
        self._cv = threading.Condition()
        self._running = 0
        self._probing = False
        self._probe_waiting = 0  # a waiting probe holds new requests back, so it is not starved
        self._queues: OrderedDict[str, deque[object]] = OrderedDict()  # consumer -> its waiting tickets

    def _free(self, probe: bool, who: str = "", ticket: object = None) -> bool:
        if probe:
            return self._running == 0 and not self._probing
        if self._probing or self._probe_waiting or self._running >= self.slots:
            return False
        first = next(iter(self._queues))  # the ticket's own consumer is queued: never empty here
        return first == who and self._queues[first][0] is ticket

    def enter(self, probe: bool, timeout: float | None = 0.0, who: str = "") -> bool:
        """A turn within ``timeout`` seconds (None: however long it takes)."""
        end = None if timeout is None else time.monotonic() + timeout
        return self.wait(probe, lambda: end is not None and time.monotonic() >= end,
                         poll=0.2 if timeout is None else max(0.0, min(0.2, timeout)), who=who)

    def wait(self, probe: bool, stop: Callable[[], bool], poll: float = 0.2, who: str = "") -> bool:
        """Wait for a turn until ``stop()`` says the server is stopping (False then). A waiting
        probe holds new requests back for the whole wait, not only while a poll runs."""
        ticket, served = object(), False
        with self._cv:
            if probe:
                self._probe_waiting += 1
            else:
                self._queues.setdefault(who, deque()).append(ticket)
            try:
                while not self._free(probe, who, ticket):
                    if stop():
                        return False
                    if poll > 0:
                        self._cv.wait(poll)
                if probe:
                    self._probing = True
                else:
                    self._running += 1
                served = True
                return True
            finally:
                if probe:
                    self._probe_waiting -= 1
                else:
                    self._dequeue(who, ticket, served)
                self._cv.notify_all()

    def _dequeue(self, who: str, ticket: object, served: bool) -> None:
        """Take ``ticket`` out of its consumer's queue; after a turn, a consumer that still
        waits goes last (one that gave up keeps its place)."""
        queue = self._queues[who]
        queue.remove(ticket)
        if not queue:
            del self._queues[who]
        elif served:
            self._queues.move_to_end(who)

    def leave(self, probe: bool) -> None:
        with self._cv:
            if probe:
                self._probing = False
            else:
                self._running -= 1
            self._cv.notify_all()


__all__ = ["Admission"]
