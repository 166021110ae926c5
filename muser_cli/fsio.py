"""File helpers: atomic publication (temp file, fsync, rename, fsync directory).

Nothing half-written ever sits at a final path.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator


def fsync_dir(directory: Path) -> None:
    fd = os.open(str(directory), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: Path | str, mode: int = 0o644) -> Iterator[BinaryIO]:
    """Yield a binary file; on clean exit it is fsynced and renamed onto ``path``.

    On any exception the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=directory)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        fsync_dir(directory)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_bytes_atomic(path: Path | str, data: bytes, mode: int = 0o644) -> None:
    with atomic_writer(path, mode=mode) as handle:
        handle.write(data)
