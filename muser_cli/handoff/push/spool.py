"""The receiver's storage side: where payloads go, verify-and-sink in a worker thread, stale spools.

Two sinks take the payload while the kvpack reader verifies it:

* :class:`FileSink` writes every byte to a spool file next to the final path and
  publishes it (fsync, rename, fsync the directory) only after the ledger commit;
  nothing half-verified reaches a final path.
* :class:`StreamSink` forwards downstream (stdout) each byte range once it verified
  against the digest chain (kvpack header, then whole frames), and the end frame only at
  :meth:`StreamSink.publish`, i.e. after the trailer verified and the ledger record is
  durable. A failed or cut handoff therefore never ends downstream in something
  decodable. It holds at most one unverified frame.

Spool files are named ``.<final name>.<pid>-<16 hex>.part`` (``fsio.part_name``) and
flock-held while written: a receiver killed with SIGKILL leaves one behind, and
:func:`remove_stale_parts` (run when a receiver starts) removes it once its owner
process is gone, or, whoever the owner, once it is older than the longest session
could keep one open. A stale part is only ever deleted, never published.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from muser_cli import fsio
from muser_cli.errors import DataError, IdentityMismatch

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows: the pid/age rule alone decides
    fcntl = None  # type: ignore[assignment]
from muser_cli.handoff.push.payload import PayloadInfo, PayloadInspector
from muser_cli.handoff.wire.refusal import Refusal  # noqa: F401  (the receiver's name for it, public)

_HANDOFF_NAME = r"[0-9a-f]{32}\.kvpack"


@dataclass
class Destination:
    """Where accepted payloads are published: one file, or ``<handoff_id>.kvpack`` in a folder."""

    file: Path | None = None
    directory: Path | None = None

    def final_path(self, handoff_id: str) -> Path:
        if self.file is not None:
            return self.file
        assert self.directory is not None
        return self.directory / f"{handoff_id}.kvpack"

    def spool_scope(self) -> tuple[Path, re.Pattern[str]] | None:
        """(directory, pattern of the final names) whose spool parts this destination owns."""
        if self.file is not None:
            return self.file.parent if str(self.file.parent) else Path("."), re.compile(re.escape(self.file.name))
        if self.directory is not None:
            return self.directory, re.compile(_HANDOFF_NAME)
        return None


class DownstreamGone(OSError):
    """The reader of the forwarded stream (stdout) went away."""


# ----------------------------------------------------------------------------- stale parts
def remove_stale_parts(directory: Path, final_name: re.Pattern[str], *, max_age_s: float,
                       now: float | None = None) -> list[Path]:
    """Delete spool parts for ``final_name`` in ``directory`` that no live receiver owns.

    The rule is :func:`muser_cli.fsio.sweep_stale_parts`' (one rule for every writer of
    ``.part`` files): a part whose lock is held is kept; otherwise it is stale when its
    recorded owner pid is not running, or when untouched for longer than ``max_age_s``.
    Returns what was removed.
    """
    return fsio.sweep_stale_parts(directory, final_name, max_age_s=max_age_s, now=now)


# ----------------------------------------------------------------------------- sinks
class FileSink:
    """Spool to ``.<name>.<pid>-<random>.part`` beside ``final``; :meth:`publish` makes it ``final``."""

    def __init__(self, final: Path, mode: int = 0o644) -> None:
        self.final = final
        self.mode = mode
        directory = final.parent if str(final.parent) else Path(".")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.part = directory / fsio.part_name(final.name)
        fd = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        if fcntl is not None:  # held while we write: no sweeper ever deletes a live receiver's part
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._f: BinaryIO | None = os.fdopen(fd, "wb")
        self._early: fsio.EarlyWriteback | None = None  # started by the first write
        self.forwarded = 0  # nothing leaves a file sink before publication

    def write(self, data: bytes, verified: int) -> None:  # noqa: ARG002 - every byte is spooled
        assert self._f is not None
        if self._early is None:  # the disk starts while bytes still arrive
            self._early = fsio.EarlyWriteback(self._f.fileno())
        self._f.write(data)

    def publish(self) -> None:
        """fsync the spool file, rename it onto the final path, fsync the directory."""
        assert self._f is not None
        f, self._f = self._f, None
        try:
            f.flush()
            if self._early is not None:
                self._early.close()  # a failed early flush fails the handoff: never retried
            os.fsync(f.fileno())
        finally:
            self._stop_early()
            f.close()
        os.chmod(self.part, self.mode)
        os.replace(self.part, self.final)
        fsio.fsync_dir(self.directory)

    def _stop_early(self) -> None:
        if self._early is not None:
            self._early.stop()

    def discard(self) -> None:
        """Drop the spool file -- also after a publish that failed before its rename (a
        failed fsync), so no unverifiable part is left behind."""
        self._stop_early()
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None
        with contextlib.suppress(FileNotFoundError):
            self.part.unlink()


class StreamSink:
    """Forward verified byte ranges to ``out``; hold the unverified rest (at most one frame)."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._held: deque[memoryview] = deque()
        self._held_bytes = 0
        self.forwarded = 0
        self.first_forward: float | None = None  # time.monotonic() of the first forwarded byte
        self.last_forward: float | None = None

    def _emit(self, chunks: list[memoryview]) -> None:
        try:
            for c in chunks:
                self._out.write(c)
            self._out.flush()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise DownstreamGone(exc.errno, "the reader of the forwarded stream went away") from None
        now = time.monotonic()
        if self.first_forward is None:
            self.first_forward = now
        self.last_forward = now

    def write(self, data: bytes, verified: int) -> None:
        """``data`` arrived; the first ``verified`` payload bytes are now verified."""
        if data:
            self._held.append(memoryview(data))
            self._held_bytes += len(data)
        todo = verified - self.forwarded
        if todo <= 0:
            return
        out: list[memoryview] = []
        while todo > 0:
            head = self._held[0]
            if len(head) <= todo:
                self._held.popleft()
                out.append(head)
                todo -= len(head)
            else:
                out.append(head[:todo])
                self._held[0] = head[todo:]
                todo = 0
        n = sum(len(c) for c in out)
        self._held_bytes -= n
        self.forwarded += n
        self._emit(out)

    def publish(self) -> None:
        """Forward what is held (the end frame): only after the trailer and the ledger."""
        rest = list(self._held)
        self._held.clear()
        self.forwarded += self._held_bytes
        self._held_bytes = 0
        self._emit(rest)

    def discard(self) -> None:
        self._held.clear()
        self._held_bytes = 0


# ----------------------------------------------------------------------------- worker
class SpoolWorker:
    """Verify and sink payload frames in a second thread, behind a bounded queue.

    The network thread keeps reading while the kvpack reader hashes and the sink writes
    (all three release the GIL in C). The first failure is kept and raised, as a
    :class:`Refusal`, by the next :meth:`put` or by :meth:`finish`; later frames are
    dropped. Bytes that verified before a bad frame are still passed to the sink, so a
    stream sink forwards every good frame and nothing after.
    """

    def __init__(self, inspector: PayloadInspector, sink: FileSink | StreamSink, depth: int = 16,
                 stall_s: float | None = None) -> None:
        self.inspector = inspector
        self.sink = sink
        self.stall_s = stall_s  # longest the sink may block (a downstream that stopped reading)
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=depth)
        self._error: Refusal | None = None
        self._thread = threading.Thread(target=self._run, name="muser-spool", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            data = self._queue.get()
            if data is None:
                return
            if self._error is not None:
                continue
            try:
                failure: BaseException | None = None
                try:
                    self.inspector.feed(data)
                except DataError as exc:
                    failure = exc
                self.sink.write(data, self.inspector.verified)
                if failure is not None:
                    raise failure
            except IdentityMismatch as exc:
                self._error = Refusal("model", str(exc))
            except DataError as exc:
                self._error = Refusal("data", str(exc))
            except DownstreamGone as exc:
                self._error = Refusal("aborted", exc.strerror or "the reader of the forwarded stream went away")
            except OSError as exc:
                self._error = Refusal("storage", f"cannot write the spool file ({exc.strerror or exc})")
            except BaseException as exc:  # noqa: BLE001 - reported to the session thread
                self._error = Refusal("data", f"{type(exc).__name__}: {exc}")

    def _stalled(self) -> Refusal:
        self._error = self._error or Refusal(
            "timeout", f"the receiver's output has not drained for {self.stall_s:g} s (is its reader stuck?)")
        return self._error

    def put(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        try:
            self._queue.put(data, timeout=self.stall_s)
        except queue.Full:
            raise self._stalled() from None

    def stop(self) -> None:
        """Let the thread finish what is queued; a sink stuck past ``stall_s`` is abandoned
        (the error set first, so nothing queued after it is written)."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=self.stall_s)
        except queue.Full:
            self._stalled()
            return
        self._thread.join(self.stall_s)
        if self._thread.is_alive():
            self._stalled()

    def finish(self) -> PayloadInfo:
        """Wait for every frame; return the verified payload info."""
        self.stop()
        if self._error is not None:
            raise self._error
        try:
            return self.inspector.finish()
        except DataError as exc:
            raise Refusal("data", str(exc)) from None
