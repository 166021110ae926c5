"""Times relative to the start of this process, for ``--json`` timings a script can line up.

The kernel records when a process started (``/proc/self/stat`` field 22, in clock ticks
since boot; resolution 1/CLK_TCK, 10 ms on Linux); :func:`since_start` turns a
``time.monotonic()`` reading into seconds since then. Where /proc is missing the origin
is the import of this module (documented as such in docs/handoff.md).
"""

from __future__ import annotations

import os
import time


def _origin() -> float:
    """``time.monotonic()`` value at which this process started."""
    now_mono = time.monotonic()
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        fields = stat[stat.rindex(")") + 2 :].split()
        start_ticks = int(fields[19])  # field 22 overall; fields[0] is field 3
        ticks = os.sysconf("SC_CLK_TCK")
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / ticks
        if 0 <= age < 7 * 86400:
            return now_mono - age
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    return now_mono


ORIGIN = _origin()


def since_start(t_mono: float | None) -> float | None:
    """Seconds from process start to the ``time.monotonic()`` reading ``t_mono``."""
    return None if t_mono is None else round(t_mono - ORIGIN, 6)


def unix_of(t_mono: float | None) -> float | None:
    """The Unix time of a ``time.monotonic()`` reading (for lining up two processes)."""
    return None if t_mono is None else round(time.time() - (time.monotonic() - t_mono), 6)
