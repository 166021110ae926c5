"""File helpers: atomic publication (temp file, fsync, rename, fsync directory).

Nothing half-written ever sits at a final path.

Temporary parts are named ``.<final name>.<pid>-<16 hex>.part`` beside the final path
(the same names the handoff receiver's spool uses), and the writer holds an exclusive
``flock`` on its part for as long as it writes. A process killed with SIGKILL leaves its
part behind; :func:`sweep_stale_parts` -- run by every new :func:`atomic_writer` for
the same path, and reusable by any other writer of such parts -- deletes a part when no
one holds its lock and either its owner pid is gone or it is older than a bound. A
stale part is only ever deleted, never published.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from muser_cli.errors import MissingInput, OutputError, UsageError

try:  # POSIX; elsewhere the pid/age rule alone decides
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

# Any part (whoever its owner) untouched for longer than this is stale -- unless its
# lock is held, which only a live writer can do.
DEFAULT_PART_MAX_AGE_S = 24 * 3600.0

_OWNED_PART = re.compile(r"^\.(?P<name>.+)\.(?P<pid>[0-9]{1,10})-[0-9a-f]{16}\.part$")
_LEGACY_PART = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{6,16}\.part$")  # tempfile.mkstemp names (older muser)


# Start writing back each time this much more was written. 8 MiB measured better than 32 on
# this machine (2048-token save 127 vs 140 ms, 8064: 467 vs 473; docs/benchmarks.md, session 6):
# the disk starts sooner, and the final fsync waits for less.
WRITEBACK_STEP = 8 << 20


class EarlyWriteback:
    """Start the disk writing a file's pages while the file is still being written, so
    the final ``fsync`` waits for the last few megabytes rather than for all of them.

    A background thread watches the file's size; each time ``step`` more bytes are
    there, it runs ``fdatasync`` (releasing the GIL, while the writer goes on). It only
    moves work earlier: the caller's final ``fsync`` is still what makes the file
    durable, and publication still follows it. A failed ``fdatasync`` is kept and
    raised by :meth:`close` -- after one, the final fsync might report success for pages
    the kernel already dropped, so the write must fail instead (never retried).
    """

    def __init__(self, fd: int, *, step: int | None = None, poll_s: float = 0.02) -> None:
        self._fd = fd
        self._step = WRITEBACK_STEP if step is None else step
        self._poll_s = poll_s
        self._stop = threading.Event()
        self.error: OSError | None = None
        self.syncs = 0
        self._thread = threading.Thread(target=self._run, name="muser-writeback", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        synced = 0
        while not self._stop.wait(self._poll_s):
            try:
                size = os.fstat(self._fd).st_size
                if size - synced >= self._step:
                    os.fdatasync(self._fd)
                    synced = size
                    self.syncs += 1
            except OSError as exc:
                self.error = exc
                return

    def stop(self) -> None:
        """Stop watching, waiting for a flush under way."""
        self._stop.set()
        self._thread.join()

    def close(self) -> None:
        """:meth:`stop`; raise the OSError the watcher met."""
        self.stop()
        if self.error is not None:
            raise self.error

    def __enter__(self) -> "EarlyWriteback":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Stop watching; an error met is raised by :meth:`close`, which the caller runs
        where it reports its own fsync errors (a failed write reports its own error)."""
        self.stop()


def fsync_dir(directory: Path) -> None:
    fd = os.open(str(directory), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- stale parts
def part_name(final_name: str, pid: int | None = None) -> str:
    """The temporary name for ``final_name``: ``.<name>.<pid>-<16 hex>.part``."""
    return f".{final_name}.{os.getpid() if pid is None else pid}-{secrets.token_hex(8)}.part"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (on this host)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    except OSError:
        return False
    return True


def _lock_state(path: str) -> bool | None:
    """True: a live process holds the part's lock; False: no one does; None: cannot tell."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # also drops our lock
    return False


def sweep_stale_parts(directory: Path | str, name: str | re.Pattern[str], *,
                      max_age_s: float = DEFAULT_PART_MAX_AGE_S, now: float | None = None) -> list[Path]:
    """Delete the temporary parts of final name(s) ``name`` in ``directory`` that no live writer owns.

    ``name`` is a final file name, or a compiled pattern every matching final name must
    fully match. A part is kept while its lock is held (a live :func:`atomic_writer`).
    Otherwise it is stale when its recorded owner pid is not running (a different pid
    than ours), or when it is older than ``max_age_s`` (a reused pid, a writer that
    does not lock, or an old-style part without a pid). Returns what was removed; never
    raises for a part it cannot inspect or remove.
    """
    directory = Path(directory) if str(directory) else Path(".")
    pattern = re.compile(re.escape(name)) if isinstance(name, str) else name
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        m = _OWNED_PART.match(entry.name) or _LEGACY_PART.match(entry.name)
        if m is None or not pattern.fullmatch(m.group("name")):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        locked = _lock_state(entry.path)
        if locked:
            continue
        owner_gone = False
        if m.re is _OWNED_PART:
            pid = int(m.group("pid"))
            owner_gone = pid != os.getpid() and not pid_alive(pid)
        if owner_gone or now - st.st_mtime > max_age_s:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    if removed:
        with contextlib.suppress(OSError):
            fsync_dir(directory)
    return removed


# ----------------------------------------------------------------------------- writing
def _describe(exc: OSError) -> str:
    if exc.errno:
        return exc.strerror or os.strerror(exc.errno)
    return str(exc)


def check_output_path(path: Path | str) -> Path:
    """Refuse an output path that cannot be written, before any work is done.

    A directory at ``path`` is a usage error (exit 2); a missing parent folder is
    missing input (exit 66); an unwritable folder is an :class:`OutputError` (exit 1).
    Returns the folder the file goes into.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"cannot write {path}: it is a directory", hint="name a file inside it")
    if not directory.exists():
        raise MissingInput(f"cannot write {path}: folder {directory} does not exist", hint="create it first")
    if not directory.is_dir():
        raise MissingInput(f"cannot write {path}: {directory} is not a folder")
    if path.exists() and not path.is_file() and not _is_special(path):
        raise UsageError(f"cannot write {path}: not a regular file")
    if not _is_special(path) and not os.access(directory, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {path}: permission denied on folder {directory}")
    return directory


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path: Path | str) -> int:
    """A read-only descriptor of the regular file at ``path``; refuse anything else.

    Opened non-blocking, then checked with ``fstat`` before any read: a FIFO that no one
    writes, a device or a socket is refused at once (:class:`MissingInput`, 66: not a file
    that can be read) instead of hanging or reading forever. The descriptor is returned in
    blocking mode; the caller closes it.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise MissingInput(f"no such file: {path}") from None
    except OSError as exc:
        raise MissingInput(f"cannot read {path}: {_describe(exc)}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "an unknown kind of file")
            raise MissingInput(f"cannot read {path}: it is {kind}, not a regular file", hint="name a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_special(path: Path | str) -> bool:
    """A character device or FIFO (``/dev/null``, a named pipe): written in place, never replaced."""
    return _is_special(Path(path))


def _is_special(path: Path) -> bool:
    """A character device or FIFO (``/dev/null``, a named pipe): written in place, never replaced."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


class _Output:
    """The writer's file, with OS errors reported against the user's path, not the part's."""

    def __init__(self, handle: BinaryIO, path: Path) -> None:
        self._handle = handle
        self._path = path

    def _wrap(self, exc: OSError) -> OutputError:
        return OutputError(f"cannot write {self._path}: {_describe(exc)}")

    def write(self, data: Any) -> int:
        try:
            return self._handle.write(data)
        except OSError as exc:
            raise self._wrap(exc) from exc

    def flush(self) -> None:
        try:
            self._handle.flush()
        except OSError as exc:
            raise self._wrap(exc) from exc

    def writev(self, buffers: list) -> int:
        """``os.writev`` of ``buffers`` after what is buffered (one syscall for many views;
        kvpack's writer uses it); returns the bytes written, which may be fewer."""
        self.flush()
        try:
            return os.writev(self._handle.fileno(), buffers)
        except OSError as exc:
            if isinstance(exc, (BlockingIOError, InterruptedError)):
                raise
            raise self._wrap(exc) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _close_quietly(handle: BinaryIO) -> None:
    """Close without a second error: a failed flush was already reported (or the data is discarded)."""
    with contextlib.suppress(OSError, ValueError):
        handle.close()  # the raw file is closed even when the final flush fails


@contextlib.contextmanager
def atomic_writer(path: Path | str, mode: int = 0o644, *,
                  max_part_age_s: float = DEFAULT_PART_MAX_AGE_S) -> Iterator[BinaryIO]:
    """Yield a binary file; on clean exit it is fsynced and renamed onto ``path``.

    On any exception the temporary file is removed and ``path`` is untouched. The path
    is checked first (:func:`check_output_path`), stale parts of earlier writers of the
    same path are removed, and OS errors name ``path``, never the temporary part. A
    character device or FIFO at ``path`` (``-o /dev/null``) is written in place.
    """
    path = Path(path)
    directory = check_output_path(path)
    if _is_special(path):
        try:
            special = open(path, "wb")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise OutputError(f"cannot write {path}: {_describe(exc)}") from exc
        try:
            yield _Output(special, path)  # type: ignore[misc]
            _Output(special, path).flush()
        finally:
            _close_quietly(special)
        return
    sweep_stale_parts(directory, path.name, max_age_s=max_part_age_s)
    tmp = directory / part_name(path.name)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {_describe(exc)}") from exc
    try:
        if fcntl is not None:
            with contextlib.suppress(OSError):  # a filesystem without locks: the pid/age rule remains
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        handle = os.fdopen(fd, "wb")
        try:
            out = _Output(handle, path)
            with EarlyWriteback(fd) as early:
                yield out  # type: ignore[misc]
                out.flush()
            try:
                early.close()  # a failed early flush fails the write (never retried)
                os.fsync(handle.fileno())
            except OSError as exc:
                raise OutputError(f"cannot write {path}: {_describe(exc)}") from exc
            try:
                os.chmod(tmp, mode)
                os.replace(tmp, path)  # while still locked: no sweeper can take it meanwhile
            except OSError as exc:
                if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise UsageError(f"cannot write {path}: it is a directory") from exc
                raise OutputError(f"cannot write {path}: {_describe(exc)}") from exc
        finally:
            _close_quietly(handle)
        try:
            fsync_dir(directory)
        except OSError as exc:
            raise OutputError(f"wrote {path} but could not make it durable (fsync of {directory}): "
                              f"{_describe(exc)}") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def make_private(fd: int, what: str, *, hint: str | None = None) -> None:
    """Before a secret is written to ``fd`` (stdout redirected to a file): a regular file
    readable by group or others is made 0600 (``fchmod``); a pipe, socket or device is
    left as it is. A file whose mode cannot be changed is refused (:class:`UsageError`)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or not stat.S_IMODE(st.st_mode) & 0o077:
        return
    try:
        os.fchmod(fd, 0o600)
    except OSError as exc:
        raise UsageError(f"{what} is a file readable by others (mode {stat.S_IMODE(st.st_mode):o}) "
                         f"and cannot be made private: {_describe(exc)}", hint=hint) from None


def write_bytes_atomic(path: Path | str, data: bytes, mode: int = 0o644) -> None:
    with atomic_writer(path, mode=mode) as handle:
        handle.write(data)
