"""Fail closed everywhere (#17): stale parts, out-of-vocabulary ids, honest exit statuses,
a broken store index, bundle integrity, one-line usage errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from muser_cli.fsio import atomic_writer, sweep_stale_parts

PY = sys.executable


def _child_writer(path: Path, *, payload: int = 1 << 20) -> subprocess.Popen:
    """A real process that starts an atomic write of ``path``, says so, and waits to be killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from muser_cli.fsio import atomic_writer
        with atomic_writer({str(path)!r}) as out:
            out.write(b"x" * {payload})
            out.flush()
            print("ready", flush=True)
            time.sleep(120)
    """)
    proc = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _parts(directory: Path, name: str) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith(f".{name}.") and p.name.endswith(".part"))


# ----------------------------------------------------------------------------- 2. stale parts
def test_killed_writer_leaves_a_findable_part_that_the_next_writer_removes(tmp_path):
    final = tmp_path / "x.kvpack"
    proc = _child_writer(final)
    parts = _parts(tmp_path, final.name)
    assert len(parts) == 1 and f".{proc.pid}-" in parts[0].name  # the owner pid is in the name
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not final.exists()  # never published
    assert _parts(tmp_path, final.name) == parts  # left behind by SIGKILL

    with atomic_writer(final) as out:  # the next writer of the same path sweeps it
        assert _parts(tmp_path, final.name) != parts
        out.write(b"good")
    assert final.read_bytes() == b"good"
    assert _parts(tmp_path, final.name) == []


def test_a_live_writers_part_is_never_swept_even_when_old(tmp_path):
    final = tmp_path / "y.kvpack"
    proc = _child_writer(final)
    try:
        (part,) = _parts(tmp_path, final.name)
        old = time.time() - 10 * 24 * 3600
        os.utime(part, (old, old))  # older than any age bound: only the lock protects it
        assert sweep_stale_parts(tmp_path, final.name) == []
        assert part.exists()
        # Another path's writer does not touch it either.
        with atomic_writer(tmp_path / "other.kvpack") as out:
            out.write(b"o")
        assert part.exists()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert sweep_stale_parts(tmp_path, final.name) == [part]
    assert not final.exists()


def test_unlocked_parts_fall_to_pid_and_age_rules(tmp_path):
    name = "z.kvpack"
    sleeper = subprocess.Popen([PY, "-c", "import time; time.sleep(120)"])
    try:
        live = tmp_path / f".{name}.{sleeper.pid}-{'a' * 16}.part"  # a live pid, no lock (e.g. a receiver's spool)
        live.write_bytes(b"1")
        legacy = tmp_path / f".{name}.ab12CD_x.part"  # tempfile.mkstemp name of older versions
        legacy.write_bytes(b"2")
        unrelated = tmp_path / ".notes.txt.1-" "0123456789abcdef.part"
        unrelated.write_bytes(b"3")
        assert sweep_stale_parts(tmp_path, name) == []  # young and (for all we know) owned
        old = time.time() - 2 * 24 * 3600
        os.utime(legacy, (old, old))
        assert sweep_stale_parts(tmp_path, name) == [legacy]
        assert sweep_stale_parts(tmp_path, name, max_age_s=0, now=time.time() + 1) == [live]
        assert unrelated.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    dead = tmp_path / f".{name}.{sleeper.pid}-{'b' * 16}.part"
    dead.write_bytes(b"4")
    assert sweep_stale_parts(tmp_path, name) == [dead]  # owner gone: stale at once
