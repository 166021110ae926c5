"""The plumbing under a reuse store's folder: its SQLite index (schema, connection, a
broken index recovered or else bypassed), the lock held while publishing or removing, and
temporary files for packs being written.

:class:`StoreIndex` is the base of :class:`~muser_cli.reuse.store.Store`, which supplies
``_rebuild`` (index every verified pack file again) for the recovery of a broken index.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

from muser_cli.errors import DataError, MuserError
from muser_cli.paths import ensure_dir, store_dir
from muser_cli.strict import parse_size
from muser_cli.units import plural

DEFAULT_MAX_BYTES = 20 << 30
ENV_MAX_BYTES = "MUSER_STORE_MAX"

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id TEXT PRIMARY KEY, model TEXT NOT NULL, tokenizer TEXT NOT NULL, dtype TEXT NOT NULL,
    chunk INTEGER NOT NULL, model_name TEXT NOT NULL, tokens INTEGER NOT NULL, rows INTEGER NOT NULL,
    token_digest TEXT NOT NULL, bytes INTEGER NOT NULL, codec TEXT NOT NULL,
    created REAL NOT NULL, last_used REAL NOT NULL);
CREATE INDEX IF NOT EXISTS entries_lru ON entries(last_used);
CREATE INDEX IF NOT EXISTS entries_scope ON entries(model, tokenizer);
CREATE TABLE IF NOT EXISTS points (
    chain TEXT NOT NULL, entry TEXT NOT NULL, held INTEGER NOT NULL, resumable INTEGER NOT NULL,
    PRIMARY KEY (chain, entry)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS points_entry ON points(entry);
CREATE TABLE IF NOT EXISTS scopes (
    model TEXT NOT NULL, tokenizer TEXT NOT NULL, dtype TEXT NOT NULL, chunk INTEGER NOT NULL,
    PRIMARY KEY (model, tokenizer, dtype, chunk)) WITHOUT ROWID;
INSERT OR IGNORE INTO scopes SELECT DISTINCT model, tokenizer, dtype, chunk FROM entries;
PRAGMA user_version = 1;
"""
SCHEMA_VERSION = 1
ENTRY_COLS = "id, model, tokenizer, dtype, chunk, model_name, tokens, rows, token_digest, bytes, codec, created, last_used"


class StoreIndex:
    """The index, lock and temporary files of a store under ``root`` (default ``paths.store_dir()``)."""

    def __init__(self, root: Path | str | None = None, *, max_bytes: int | None = None) -> None:
        self.root = Path(root) if root is not None else store_dir()
        if max_bytes is None:
            env = os.environ.get(ENV_MAX_BYTES)
            max_bytes = parse_size(env) if env else DEFAULT_MAX_BYTES
        self.max_bytes = max_bytes
        self.problems: list[str] = []  # corrupt entries found and removed, for the caller to report
        self._db: sqlite3.Connection | None = None
        self._recovering = False
        self._lock_depth = 0
        self.bypassed: str | None = None  # why the store is unusable this session (then it holds nothing)

    def _rebuild(self, *, only_if_broken: bool = False) -> tuple[int, list[str], Path | None]:
        raise NotImplementedError  # the store indexes its verified packs again

    # ------------------------------------------------------------------ plumbing
    @property
    def index_path(self) -> Path:
        return self.root / "index.sqlite3"

    def pack_path(self, entry_id: str) -> Path:
        return self.root / "packs" / entry_id[:2] / f"{entry_id}.kvpack"

    def exists(self) -> bool:
        return self.index_path.exists()

    def _open(self) -> sqlite3.Connection:
        """Open the index and check its tables (raises sqlite3.DatabaseError for a broken one)."""
        ensure_dir(self.root)
        db = sqlite3.connect(str(self.index_path), timeout=60.0, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                db.executescript(SCHEMA)
            for table, cols in (("entries", ENTRY_COLS), ("points", "chain, entry, held, resumable"),
                                ("scopes", "model, tokenizer, dtype, chunk")):
                db.execute(f"SELECT {cols} FROM {table} LIMIT 1").fetchall()
        except BaseException:
            db.close()
            raise
        return db

    def _conn(self) -> sqlite3.Connection:
        if self.bypassed is not None:
            raise DataError(f"the reuse store is unavailable: {self.bypassed}",
                            hint="muser reuse gc --rebuild, or remove the store folder")
        if self._db is None:
            try:
                self._db = self._open()
            except sqlite3.DatabaseError as exc:
                self._recover(str(exc))
                return self._conn()
        return self._db

    def _recover(self, reason: str) -> None:
        """A broken index: rebuild it from the verified pack files, or else bypass the store.

        The store is a cache; a broken index must never stand between a caller and a
        local prefill. Either way the event is recorded in ``problems``."""
        self.close()
        if self._recovering:  # broken again while rebuilding: give up for this session
            self.bypassed = f"its index {self.index_path} is broken ({reason}) and could not be rebuilt"
            return
        self._recovering = True
        try:
            kept, removed, aside = self._rebuild(only_if_broken=True)
        except (MuserError, OSError, sqlite3.DatabaseError) as exc:
            self.close()
            if self.bypassed is None:
                self.bypassed = f"its index {self.index_path} is broken ({reason}); rebuilding failed ({exc})"
            self.problems.append(f"reuse store bypassed: {self.bypassed}")
            return
        finally:
            self._recovering = False
        if aside is None:
            return  # another process repaired it meanwhile
        note = f"reuse store index was unreadable ({reason}); rebuilt from {plural(kept, 'verified pack')}"
        if removed:
            note += f", {plural(len(removed), 'unverifiable pack')} removed"
        self.problems.append(note + f"; the old index is kept as {aside.name}")

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _sql(self, query: str, args: Sequence = ()) -> list[tuple]:
        for attempt in (0, 1):
            try:
                return self._conn().execute(query, tuple(args)).fetchall()
            except sqlite3.DatabaseError as exc:
                if attempt or self._recovering:
                    raise DataError(f"reuse store index error ({exc})", hint="muser reuse gc --rebuild") from None
                self._recover(str(exc))
        raise AssertionError("unreachable")

    def readable(self) -> bool:
        """Whether there is an index to read (False when none exists, or the store is bypassed)."""
        if self.bypassed is None and self.index_path.exists():
            with contextlib.suppress(DataError):
                self._conn()
        return self.bypassed is None and self.index_path.exists()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        db = self._conn()
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            if not self._recovering:
                self._recover(str(exc))
            raise DataError(f"reuse store index error ({exc})", hint="muser reuse gc --rebuild") from None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self._lock_depth:  # re-entered (an index repair inside a locked step): already ours
            self._lock_depth += 1
            try:
                yield
            finally:
                self._lock_depth -= 1
            return
        ensure_dir(self.root)
        fd = os.open(str(self.root / "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._lock_depth = 1
            yield
        finally:
            self._lock_depth = 0
            os.close(fd)  # releases the lock

    def _tmp_file(self) -> tuple[int, Path]:
        tmp_dir = ensure_dir(self.root / "tmp")
        fd, name = tempfile.mkstemp(prefix="put-", suffix=".part", dir=tmp_dir)
        return fd, Path(name)
