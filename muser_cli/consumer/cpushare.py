"""The share of its cores a consumer's engine gets (issue #39): a machine's other work -- another
service pinned to the same core, a laptop's other programs -- slows a local prefill without
showing in the consumer's own queue. :class:`CpuShare` measures it (from the engine's turns, and
while the engine is idle from the machine's load); :class:`muser_cli.consumer.costs.CostModel`
scales its engine work by it."""

from __future__ import annotations

import math
import threading
import time

from muser_cli.threads import cores_busy_s, my_cores  # one reader of /proc/stat, shared

#: The lowest share counted, and how long after the engine last computed a share still counts whole (it then returns to 1 over as long again: the other work may be over).
MIN_SHARE = 0.1
SHARE_STALE_S = 30.0
#: A hold this long is a whole sample of the share (a shorter one counts in proportion).
SHARE_SAMPLE_S = 0.25
#: The turns' share stands this long after the engine last computed; then (``look``) the machine's.
SHARE_FRESH_S = 2.0
#: Looks at the machine closer than this apart keep the last figure (the kernel counts in ticks).
SHARE_LOOK_S = 0.2

#: The weight of a whole sample in the average (a shorter one counts in proportion).
ALPHA = 0.3


class CpuShare:
    """The share of its cores this process's engine gets (module doc). :meth:`sample` takes one
    turn's seconds: wall, and the holding thread's run and runnable-wait (``Turns.on_hold``; a
    contended thread waits for a CPU as long as it runs when it shares one core with one other
    busy thread; a thread that blocks -- an engine computing on a GPU, a file read -- does neither,
    and says nothing): while the engine computes, the share is ran / (ran + waited), averaged from
    1 by length. A measure of contention, not of how well the engine uses its threads: an idle
    machine gives 1 whatever the engine. ``look`` (a serving consumer, Linux): while the engine
    is idle, the share is what the machine's other work leaves it -- the busy time of the cores
    this process may run on since the last look (``/proc/stat``), its own CPU time taken out: with
    ``o`` of its ``c`` cores kept busy by others, ``t`` threads get ``min(1, c / (o + t))``.
    Without either: 1 (``muser decode`` runs one request alone)."""

    def __init__(self, threads: int = 1, *, look: bool = False) -> None:
        self.threads = max(1, int(threads))
        self.look = look
        self.value: float | None = None
        self.at = 0.0  # time.monotonic() of the last sample
        self._seen: tuple[float, float, float] | None = None  # (monotonic, cores' busy s, own CPU s) last looked
        self._idle: float | None = None  # the share the last look gave
        self._lock = threading.Lock()

    def sample(self, wall_s: float, ran_s: float | None, waited_s: float | None) -> None:
        if ran_s is None or waited_s is None or not (ran_s >= 0 and waited_s >= 0):
            return
        seen = ran_s + waited_s
        if not seen > 1e-3 or not math.isfinite(seen):  # it blocked: nothing said about the cores
            return
        share = min(1.0, max(MIN_SHARE, ran_s / seen))
        weight = ALPHA * min(1.0, seen / SHARE_SAMPLE_S)
        with self._lock:
            value = 1.0 if self.value is None else self.value
            self.value = value + weight * (share - value)
            self.at = time.monotonic()

    def now(self) -> float:
        with self._lock:
            value, at = self.value, self.at
        age = time.monotonic() - at
        if value is not None and age < SHARE_FRESH_S:  # the engine computes: its own turns say it
            return max(MIN_SHARE, min(1.0, value))
        idle = self._look() if self.look else None
        if idle is not None:
            return idle
        if value is None:
            return 1.0
        if age > SHARE_STALE_S:  # the engine has been idle: the other work may be over
            value += (1.0 - value) * min(1.0, (age - SHARE_STALE_S) / SHARE_STALE_S)
        return max(MIN_SHARE, min(1.0, value))

    def _look(self) -> float | None:
        """The share the machine's other work leaves (class doc); None: not readable here, or no
        earlier look to measure from (this one is kept for the next)."""
        cores = my_cores()
        busy = cores_busy_s(cores) if cores else None
        if busy is None:
            return None
        mark = (time.monotonic(), busy, time.process_time())
        with self._lock:
            seen = self._seen
            if seen is None or mark[0] - seen[0] < SHARE_LOOK_S:  # the first look, or too soon to tell
                self._seen = seen or mark
                return self._idle
            self._seen = mark
            others = max(0.0, (mark[1] - seen[1]) - (mark[2] - seen[2])) / (mark[0] - seen[0])
            self._idle = max(MIN_SHARE, min(1.0, len(cores) / (others + self.threads)))
            return self._idle


__all__ = ["CpuShare", "MIN_SHARE", "SHARE_FRESH_S", "SHARE_LOOK_S", "SHARE_SAMPLE_S", "SHARE_STALE_S", "cores_busy_s",
           "my_cores"]
