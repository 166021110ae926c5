"""The batch's spool: a folder in the temp folder for the packs pulled ahead of their job.

It is named after its owner — ``muser-batch-<pid>.<start>-<random>``, ``start`` the process's
start time (Linux: ticks since boot, from ``/proc``; 0 where unknown) — so that a run killed
with SIGKILL, which cannot remove its own spool, leaves one the next batch (or ``--resume``)
removes: an owner whose pid is gone, or whose pid now belongs to a process started at
another time (a reused pid), is gone. A live owner's spool is never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from muser_cli.fsio import DEFAULT_PART_MAX_AGE_S, pid_alive

PREFIX = "muser-batch-"
_OWNED = re.compile(r"^muser-batch-(?P<pid>[0-9]{1,10})\.(?P<start>[0-9]{1,20})-[a-z0-9_]+$")
_LEGACY = re.compile(r"^muser-batch-[a-z0-9_]{8}$")  # tempfile.mkdtemp names (older muser): no owner


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None (no such process, no /proc)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
        return int(data[data.rindex(b")") + 2:].split()[19])  # field 22; fields after ")" start at 3
    except (OSError, ValueError, IndexError):
        return None


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process that made a spool still runs (the pid alive, and started when it did)."""
    if not pid_alive(pid):
        return False
    now = start_time(pid)
    return start == 0 or now is None or now == start


def make_spool() -> Path:
    """A new spool for this process, after removing those of runs that are gone."""
    sweep_spools()
    pid = os.getpid()
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{pid}.{start_time(pid) or 0}-"))


def sweep_spools(folder: Path | str | None = None, *, max_age_s: float = DEFAULT_PART_MAX_AGE_S) -> list[Path]:
    """Remove this user's batch spools in ``folder`` (the temp folder) whose owner is gone; an
    old-style spool (no owner in its name) only when untouched for ``max_age_s``. Returns what
    was removed; never raises."""
    folder = Path(folder) if folder is not None else Path(tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = [e for e in os.scandir(folder) if e.name.startswith(PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid():
            continue
        m = _OWNED.match(entry.name)
        if m is not None:
            gone = not owner_alive(int(m.group("pid")), int(m.group("start")))
        else:
            gone = _LEGACY.match(entry.name) is not None and time.time() - st.st_mtime > max_age_s
        if gone:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed
