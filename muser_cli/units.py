"""Numbers in words for people: one byte unit (decimal: kB, MB, GB) and one throughput unit
(MB/s) across commands, bench tables and charts, and counts with their nouns in the right
number. Pure formatting: nothing here prints.
"""

from __future__ import annotations


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 entry``, ``2 entries``: a count with its noun in the right number."""
    return f"{count:,} {word if count == 1 else (many or word + 's')}"


def size_text(nbytes: float) -> str:
    """A byte count for people, in decimal units (the ones MB/s uses): ``812 bytes``, ``47.2 MB``."""
    if nbytes < 1000:
        return plural(int(nbytes), "byte")
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if nbytes < scale * 1000 or unit == "GB":
            return f"{nbytes / scale:.3g} {unit}" if nbytes < scale * 100 else f"{nbytes / scale:.0f} {unit}"
    raise AssertionError("unreachable")


def rate_text(bytes_per_s: float) -> str:
    """Throughput in muser's one unit, MB/s (10^6 bytes per second), as charts and tables show it."""
    mbps = bytes_per_s / 1e6
    return f"{mbps:.3g} MB/s" if mbps < 100 else f"{mbps:,.0f} MB/s"


def utc_stamp() -> str:
    """Now, as 2026-12-02T10:12:42.383Z: the stamp at the head of every service log line."""
    import time

    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
