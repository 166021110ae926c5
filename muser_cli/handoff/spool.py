"""The receiver's storage side: where payloads go, and verify-and-spool in a worker thread.

A payload is written to a temporary file next to its final path (``fsio.atomic_writer``)
while the kvpack reader verifies it; the receiver publishes (fsync, rename, fsync the
directory) only after the ledger commit. Nothing half-verified reaches a final path.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from muser_cli.errors import DataError, IdentityMismatch
from muser_cli.handoff.payload import PayloadInfo, PayloadInspector


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


class Refusal(Exception):
    """Refuse this handoff with a Reject code; ``fatal`` stops the receiver afterwards."""

    def __init__(self, code: str, message: str, *, fatal: BaseException | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fatal = fatal


class SpoolWorker:
    """Verify and spool payload frames in a second thread, behind a bounded queue.

    The network thread keeps reading while the kvpack reader hashes and the disk writes
    (all three release the GIL in C). The first failure is kept and raised, as a
    :class:`Refusal`, by the next :meth:`put` or by :meth:`finish`; later frames are dropped.
    """

    def __init__(self, inspector: PayloadInspector, out: BinaryIO, depth: int = 16) -> None:
        self._inspector = inspector
        self._out = out
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
                self._inspector.feed(data)
                self._out.write(data)
            except IdentityMismatch as exc:
                self._error = Refusal("model", str(exc))
            except DataError as exc:
                self._error = Refusal("data", str(exc))
            except OSError as exc:
                self._error = Refusal("storage", f"cannot write the spool file ({exc.strerror or exc})")
            except BaseException as exc:  # noqa: BLE001 - reported to the session thread
                self._error = Refusal("data", f"{type(exc).__name__}: {exc}")

    def put(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(data)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def finish(self) -> PayloadInfo:
        """Wait for every frame; return the verified payload info."""
        self.stop()
        if self._error is not None:
            raise self._error
        try:
            return self._inspector.finish()
        except DataError as exc:
            raise Refusal("data", str(exc)) from None
