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


def my_cores() -> set[int] | None:
    """The cores this process may run on; None where the platform cannot say (not Linux)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _ticks(cores: set[int]) -> tuple[int, int, float] | None:
    """(busy, all) clock ticks since boot of ``cores`` (``/proc/stat``: busy is all but idle and
    iowait) and seconds per tick; None where it cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            text = f.read()
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    if tick <= 0:
        return None
    busy = total = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cores:
            continue
        try:
            ticks = [int(x) for x in rest.split()[:8]]
        except ValueError:
            return None
        if len(ticks) < 5:
            return None
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]  # user nice system idle iowait irq softirq steal
    return busy, total, 1.0 / tick


def cores_busy_s(cores: set[int]) -> float | None:
    """The seconds ``cores`` spent busy since boot (``/proc/stat``: all but idle and iowait);
    None where it cannot be read."""
    got = _ticks(cores)
    return None if got is None else got[0] * got[2]


def busy_elsewhere(cpus: set[int] | None = None, watch_s: float = WATCH_S) -> float:
    """How many of ``cpus`` (this process's, by default) other processes keep busy now: their busy
    time over :data:`WATCH_S`, this process's own time taken out, in cores (0.0 where /proc/stat
    cannot be read). Busy ticks over all ticks of the same counters: a core busy throughout
    reads 1, whatever the tick's size against the watch."""
    cpus = cpus if cpus is not None else my_cores()
    if not cpus:
        return 0.0
    before, mine = _ticks(cpus), time.process_time()
    if before is None:
        return 0.0
    time.sleep(watch_s)
    after, mine2 = _ticks(cpus), time.process_time()
    if after is None or after[1] <= before[1]:
        return 0.0
    own = (mine2 - mine) / after[2]  # this process's time, in ticks
    share = max(0.0, (after[0] - before[0]) - own) / (after[1] - before[1])  # of all the cores' time
    return min(1.0, share) * len(cpus)


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
