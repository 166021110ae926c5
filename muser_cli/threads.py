"""How many compute threads an engine gets when the caller says 0 (no framework import: the
CLI reads this before anything heavy loads)."""

from __future__ import annotations

import os
import time

from muser_cli.errors import ConfigError


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (``taskset`` pins a producer and a
    consumer to different cores on one host), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


#: How long :func:`busy_elsewhere` watches the cores (a command's start pays it once).
WATCH_S = 0.05


def _cpu_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, all) clock ticks so far of ``cpus``, from /proc/stat; None where it cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            if int(name[3:]) not in cpus:
                continue
            ticks = [int(x) for x in rest.split()]
        except ValueError:
            continue
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
        total += sum(ticks[:8])
        busy += sum(ticks[:8]) - idle
    return (busy, total) if total else None


def busy_elsewhere(cpus: set[int] | None = None, watch_s: float = WATCH_S) -> float:
    """How many of ``cpus`` (this process's, by default) other processes keep busy now: their busy
    time over :data:`WATCH_S`, this process's own time taken out, in cores (0.0 where /proc/stat
    cannot be read)."""
    if cpus is None:
        try:
            cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return 0.0
    before, mine = _cpu_ticks(cpus), os.times()
    if before is None:
        return 0.0
    time.sleep(watch_s)
    after, mine2 = _cpu_ticks(cpus), os.times()
    if after is None or after[1] <= before[1]:
        return 0.0
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    own = ((mine2.user - mine.user) + (mine2.system - mine.system)) * tick
    share = max(0.0, (after[0] - before[0]) - own) / (after[1] - before[1])  # of all the cores' time
    return share * len(cpus)


def default_threads() -> int:
    """Compute threads when --threads is 0: ``MUSER_THREADS``, else the cores this process may
    use that other processes do not keep busy now (at least 1, at most 8). A thread more than
    the free cores does not add speed, it waits: torch's threads meet at every operation, so one
    on a core another process holds stalls the others (issue #49's trial: ``decode`` 15x slower
    with 2 threads than with 1 on a 2-core machine where another process held one core)."""
    value = os.environ.get("MUSER_THREADS")
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ConfigError(f"MUSER_THREADS={value!r} is not a whole number",
                              hint="set it to a thread count such as 2, or unset it") from None
    usable = usable_cpus()
    free = usable - int(busy_elsewhere() + 0.5) if usable > 1 else 1
    return max(1, min(free, 8))
