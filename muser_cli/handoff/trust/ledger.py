"""The replay ledger: one append-only file per key id, durable before the receiver acknowledges.

File format (text, one record per line, docs/handoff.md):

    muser-ledger 1 <key_id>\\n
    A <handoff_id> <issued_at_ms> <accepted_at_ms> <payload_size> <root_digest> <crc32>\\n

``crc32`` (8 lowercase hex) covers the record line before it, including the trailing space.

Durability rules:
  * a new ledger file is created with its first line, fsynced, and its directory fsynced
    (so the name survives a crash) before any record is appended;
  * a record is appended with one ``write`` and made durable with ``fsync`` before
    :meth:`Ledger.commit` returns; only then may the receiver acknowledge;
  * a failed ``fsync`` is never retried (the kernel may have dropped the dirty pages):
    the ledger is poisoned and refuses every further commit in this process;
  * on open, a last record without its newline or with a bad CRC (a torn write) makes the
    ledger refuse accepts until ``muser node repair-ledger KEY_ID`` truncates it: a torn
    record was never acknowledged, because the acknowledgement follows the fsync;
  * check and append happen under an exclusive ``flock``, so two receivers sharing a
    ledger directory cannot both accept one handoff id.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from muser_cli import fsio
from muser_cli.errors import AuthError, ConfigError, TempFailure

LEDGER_VERSION = 1
_RECORD_RE = re.compile(r"^A ([0-9a-f]{32}) (\d{1,16}) (\d{1,16}) (\d{1,16}) ([0-9a-f]{1,128}|-) ([0-9a-f]{8})$")
_KEY_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class LedgerError(ConfigError):
    """The ledger cannot be trusted to refuse replays: torn, corrupt, or poisoned by a failed fsync."""


class LedgerFull(TempFailure):
    """The record could not be written (disk full, quota); the ledger is unchanged."""


@dataclass(frozen=True)
class Record:
    handoff_id: str
    issued_at_ms: int
    accepted_at_ms: int
    payload_size: int
    root_digest: str

    def line(self) -> bytes:
        body = (
            f"A {self.handoff_id} {self.issued_at_ms} {self.accepted_at_ms} "
            f"{self.payload_size} {self.root_digest or '-'} "
        )
        return f"{body}{zlib.crc32(body.encode('ascii')):08x}\n".encode("ascii")


def ledger_path(directory: Path, key_id: str) -> Path:
    if not _KEY_ID_RE.match(key_id):
        raise ConfigError(f"bad key id {key_id!r} for a ledger")
    return directory / f"{key_id}.ledger"


def _repair_hint(key_id: str) -> str:
    return f"stop the receiver and run `muser node repair-ledger {key_id}`"


def _parse(data: bytes, start: int, key_id: str, path: Path) -> tuple[list[str], int, str | None]:
    """Parse records in ``data`` (which begins at file offset ``start``).

    Returns (ids, offset after the last good record, problem or None).
    """
    ids: list[str] = []
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            return ids, start + pos, f"torn last record at byte {start + pos} (no newline)"
        line = data[pos:nl]
        m = _RECORD_RE.match(line.decode("ascii", "replace"))
        ok = m is not None and int(m.group(6), 16) == zlib.crc32(line[: -8])
        if not ok:
            last = nl + 1 == len(data)
            kind = "torn last record" if last else "corrupt record"
            return ids, start + pos, f"{kind} at byte {start + pos}"
        ids.append(m.group(1))  # type: ignore[union-attr]
        pos = nl + 1
    return ids, start + pos, None


class Ledger:
    """Accepted handoff ids of one key id. Open with :meth:`open`; one instance per receiver."""

    def __init__(self, directory: Path, key_id: str) -> None:
        self.directory = directory
        self.key_id = key_id
        self.path = ledger_path(directory, key_id)
        self._ids: set[str] = set()
        self._offset = 0
        self._fd: int | None = None
        self._poisoned: str | None = None

    # -- lifecycle
    def open(self) -> "Ledger":
        self._ensure_file()
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        with self._lock(fcntl.LOCK_SH):
            self._refresh(first=True)
        return self

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Ledger":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure_file(self) -> None:
        if self.path.exists():
            return
        created_dir = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        if created_dir:
            fsio.fsync_dir(self.directory.parent)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return
        try:
            first = f"muser-ledger {LEDGER_VERSION} {self.key_id}\n".encode("ascii")
            if os.write(fd, first) != len(first):
                raise OSError(errno.EIO, "short write creating the ledger")
            os.fsync(fd)
        except OSError:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        fsio.fsync_dir(self.directory)

    @contextlib.contextmanager
    def _lock(self, how: int) -> Iterator[None]:
        assert self._fd is not None, "ledger not open"
        fcntl.flock(self._fd, how)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _refresh(self, *, first: bool = False) -> None:
        """Read records appended since the last read (by us or another process)."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if first:
            head = os.pread(self._fd, 256, 0)
            expected = f"muser-ledger {LEDGER_VERSION} {self.key_id}\n".encode("ascii")
            if not head.startswith(expected):
                raise LedgerError(
                    f"{self.path} does not start with a ledger line for key {self.key_id}",
                    hint=_repair_hint(self.key_id),
                )
            self._offset = len(expected)
        if size <= self._offset:
            return
        data = os.pread(self._fd, size - self._offset, self._offset)
        ids, end, problem = _parse(data, self._offset, self.key_id, self.path)
        self._ids.update(ids)
        self._offset = end
        if problem:
            raise LedgerError(
                f"replay ledger {self.path.name} has a {problem}; refusing to accept handoffs",
                hint=_repair_hint(self.key_id),
            )

    # -- queries and commits
    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, handoff_id: str) -> bool:
        return handoff_id in self._ids

    def seen(self, handoff_id: str) -> bool:
        """Whether ``handoff_id`` was accepted (re-reading what other processes appended)."""
        self._check_usable()
        with self._lock(fcntl.LOCK_SH):
            self._refresh()
        return handoff_id in self._ids

    def _check_usable(self) -> None:
        if self._poisoned:
            raise LedgerError(
                f"replay ledger {self.path.name} is unusable after {self._poisoned}; accepting nothing",
                hint="check the disk, then restart the receiver",
            )
        if self._fd is None:
            raise LedgerError("ledger is not open")

    def commit(self, record: Record) -> float:
        """Append ``record`` durably; return the seconds it took. Raises AuthError on a replay."""
        self._check_usable()
        assert self._fd is not None
        line = record.line()
        t0 = time.perf_counter()
        with self._lock(fcntl.LOCK_EX):
            self._refresh()
            if record.handoff_id in self._ids:
                raise AuthError(f"replay refused: handoff {record.handoff_id} was already accepted")
            before = self._offset
            try:
                written = os.write(self._fd, line)
                if written != len(line):
                    raise OSError(errno.ENOSPC, "short write to the ledger")
            except OSError as exc:
                self._undo(before, exc)
                raise LedgerFull(f"could not write the replay ledger ({exc.strerror or exc})") from None
            try:
                os.fsync(self._fd)
            except OSError as exc:
                # Never retry an fsync: the page cache state is unknown. Fail closed.
                self._poisoned = f"fsync failed ({exc.strerror or exc})"
                raise LedgerError(
                    f"replay ledger fsync failed ({exc.strerror or exc}); handoff not accepted",
                    hint="check the disk, then restart the receiver",
                ) from None
            self._offset = before + len(line)
            self._ids.add(record.handoff_id)
        return time.perf_counter() - t0

    def _undo(self, before: int, exc: OSError) -> None:
        """Cut a partial append back to the last good record, or poison the ledger."""
        assert self._fd is not None
        try:
            if os.fstat(self._fd).st_size != before:
                os.ftruncate(self._fd, before)
                os.fsync(self._fd)
        except OSError as exc2:
            self._poisoned = f"a failed write could not be undone ({exc2.strerror or exc2})"


def repair(directory: Path, key_id: str) -> dict[str, object]:
    """Truncate a torn last record. Refuses when damage is anywhere but the tail."""
    path = ledger_path(directory, key_id)
    if not path.exists():
        raise ConfigError(f"no ledger for key {key_id} at {path}",
                          hint="name a key id whose receiver reported a torn ledger (`muser node ls` lists them)")
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0)
        first = f"muser-ledger {LEDGER_VERSION} {key_id}\n".encode("ascii")
        if not data.startswith(first):
            raise LedgerError(
                f"{path} has no valid first line; it cannot be repaired in place",
                hint="move it aside only after the receiver has been stopped for longer than the issued-at window",
            )
        ids, end, problem = _parse(data[len(first):], len(first), key_id, path)
        if problem and problem.startswith("corrupt"):
            raise LedgerError(
                f"{path.name}: {problem} is not at the tail; refusing to repair in place",
                hint="move it aside only after the receiver has been stopped for longer than the issued-at window",
            )
        dropped = size - end
        if dropped:
            os.ftruncate(fd, end)
            os.fsync(fd)
        return {"path": str(path), "records": len(ids), "dropped_bytes": dropped}
    finally:
        os.close(fd)
