"""How many compute threads an engine gets when the caller says 0 (no framework import: the
CLI reads this before anything heavy loads)."""

from __future__ import annotations

import os

from muser_cli.errors import ConfigError


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (``taskset`` pins a producer and a
    consumer to different cores on one host), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """Compute threads when --threads is 0: ``MUSER_THREADS``, else the cores this process
    may use (at most 8)."""
    value = os.environ.get("MUSER_THREADS")
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ConfigError(f"MUSER_THREADS={value!r} is not a whole number",
                              hint="set it to a thread count such as 2, or unset it") from None
    return min(usable_cpus(), 8)
