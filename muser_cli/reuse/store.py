"""The reuse store: verified kvpacks, found by chained prefix hashes.

Layout (under ``paths.store_dir()``; ``MUSER_HOME`` overrides), docs/reuse.md §1:

    index.sqlite3            entries, and their points: chain hash -> (entry, held tokens)
    packs/<ab>/<id>.kvpack   each pack as put; id = its root digest (hex): content-addressed
    tmp/                     packs being written (gc sweeps leftovers of killed writers)
    lock                     flock held while publishing or removing (file and index together)

Rules:
  * a pack is published (renamed into packs/, then indexed) only after its root digest
    verified and its bytes were fsynced; nothing half-written ever sits under packs/;
  * every read re-verifies the whole pack with the kvpack reader; a pack that fails, is
    missing, or disagrees with its index row is removed and reported in ``problems``,
    never used (:class:`CorruptEntry`);
  * the total size is capped: after each put, least-recently-used entries are evicted;
  * any number of processes may put, look up, remove and gc at once: publication and
    removal hold ``lock``; SQLite serializes index writes; a reader whose file vanished
    under it (another process evicted it) treats the entry as missing.

The index plumbing is in :mod:`~muser_cli.reuse.index`, the record types in
:mod:`~muser_cli.reuse.records` (both importable from here).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO, Sequence

from muser_cli.errors import CorruptEntry, DataError, KVPackError, MissingInput, UsageError
from muser_cli.fsio import EarlyWriteback, fsync_dir
from muser_cli.kvpack import KVPack, PackHeader, PackReader, read_pack, write_pack
from muser_cli.model.binding import out_of_vocabulary
from muser_cli.reuse.chain import Scope, chain_points, resumable, scope_of_header
from muser_cli.reuse.delta import resolve_delta, with_held_snapshots
from muser_cli.reuse.index import DEFAULT_MAX_BYTES, ENTRY_COLS, ENV_MAX_BYTES, SCHEMA, SCHEMA_VERSION, StoreIndex
from muser_cli.reuse.records import Entry, GCResult, Point, PutResult
from muser_cli.strict import canonical_json, loads, parse_size

STALE_TMP_S = 3600.0
CHECKS_SCHEMA = """CREATE TABLE IF NOT EXISTS checks (
    entry TEXT NOT NULL, engine TEXT NOT NULL, dtype TEXT NOT NULL, ok INTEGER NOT NULL, result TEXT NOT NULL,
    at REAL NOT NULL, PRIMARY KEY (entry, engine, dtype)) WITHOUT ROWID"""
READ_BLOCK = 1 << 20
SQL_BATCH = 500


class Store(StoreIndex):
    """A store of verified kvpacks under ``root`` (default ``paths.store_dir()``); its index,
    lock and temporary files are :class:`~muser_cli.reuse.index.StoreIndex`'s."""

    # ------------------------------------------------------------------ writing
    def put(self, src: BinaryIO, *, vocab_size: int | None = None) -> PutResult:
        """Verify a full, unquantized kvpack from ``src`` while copying it in, then publish it.

        With ``vocab_size`` (the model's), a pack holding a token id outside [0, vocab_size)
        is refused (DataError) as soon as its header is read. A refused pack leaves the
        store as it was: the folders this call made for its part are removed again."""
        made, d = [], self.root / "tmp"
        while not d.exists() and d != d.parent:  # the folders a first put creates, deepest first
            made.append(d)
            d = d.parent
        try:
            return self._put(src, vocab_size=vocab_size)
        except BaseException:
            for d in made:  # only if still empty: another writer's files are never touched
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise

    def _put(self, src: BinaryIO, *, vocab_size: int | None) -> PutResult:
        fd, tmp = self._tmp_file()
        try:
            reader = PackReader(decode=False)  # digests and structure; every later read decodes too
            with os.fdopen(fd, "wb") as out, EarlyWriteback(out.fileno()) as early:
                while True:
                    block = src.read(READ_BLOCK)
                    if not block:
                        break
                    reader.feed(block)
                    if reader.header is not None:
                        _check_storable(reader.header, delta_ok=True, vocab_size=vocab_size)
                    out.write(block)
                reader.finish()
                out.flush()
                early.close()
                os.fsync(out.fileno())
            assert reader.header is not None and reader.root_digest is not None
            if reader.header.rows_start > 0:
                return self._put_delta(tmp, vocab_size=vocab_size)
            return self._publish(tmp, reader.header, reader.root_digest.hex(), reader.bytes_consumed)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _put_delta(self, path: Path, *, vocab_size: int | None = None) -> PutResult:
        """A delta is stored merged with its base (which must be held here). Its rows come from
        two producers when the base's engine is another: the entry names both (``torch+vllm``),
        so that every consumer gates it before it serves (docs/reuse.md §6)."""
        with open(path, "rb") as f:
            pack = read_pack(f)
        layers, base_id = resolve_delta(pack, self)
        header = pack.header
        base = self.header_of(base_id)
        made = str((header.producer or {}).get("engine") or "")
        under = str((base.producer or {}).get("engine") or "") if base is not None else "an unread base"
        if under != made:
            header = replace(header, producer={**(header.producer or {}), "engine": f"{made}+{under}"})
        return self.put_layers(header, layers, vocab_size=vocab_size)

    def put_layers(self, header: PackHeader, layers: Sequence, *, vocab_size: int | None = None) -> PutResult:
        """Write ``layers`` (the whole cache of header.token_ids[:-1]) as an uncompressed pack and publish it."""
        header = replace(header, rows_start=0, base=None, codec={"name": "none"})
        if any(spec.kind == "state" for spec in header.layers):  # a streamed pack holds its newest snapshots only
            header = with_held_snapshots(header, layers)
        _check_storable(header, vocab_size=vocab_size)
        fd, tmp = self._tmp_file()
        try:
            with os.fdopen(fd, "wb") as out:
                with EarlyWriteback(out.fileno()) as early:
                    writer = write_pack(out, header, layers, codec="none")
                    out.flush()
                early.close()
                os.fsync(out.fileno())
            return self._publish(tmp, writer.header, writer.root_digest.hex(), writer.bytes_written)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _publish(self, tmp: Path, header: PackHeader, entry_id: str, nbytes: int) -> PutResult:
        scope = scope_of_header(header)
        points = chain_points(scope, header.token_ids, header.rows_end)
        if any(spec.kind == "state" for spec in header.layers):  # served only where a state snapshot is held
            points = [(held, chain) for held, chain in points if header.snapshot_due(held)]
        rows = [(chain, entry_id, held, int(resumable(header.layers, header.rows_end, held))) for held, chain in points]
        now = time.time()
        final = self.pack_path(entry_id)
        with self._locked():
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
            fsync_dir(final.parent)
            with self._write() as db:
                new = db.execute("SELECT 1 FROM entries WHERE id=?", (entry_id,)).fetchone() is None
                if new:
                    db.execute(f"INSERT INTO entries ({ENTRY_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                               (entry_id, scope.model, scope.tokenizer, scope.dtype, scope.chunk_tokens,
                                header.model_name, len(header.token_ids), header.rows_end, header.token_digest,
                                nbytes, str(header.codec.get("name", "none")), now, now))
                    db.executemany("INSERT OR IGNORE INTO points VALUES (?,?,?,?)", rows)
                    db.execute("INSERT OR IGNORE INTO scopes VALUES (?,?,?,?)",
                               (scope.model, scope.tokenizer, scope.dtype, scope.chunk_tokens))
                else:
                    db.execute("UPDATE entries SET last_used=? WHERE id=?", (now, entry_id))
        evicted = self._enforce_cap(keep=entry_id)
        return PutResult(self.entry(entry_id), len(points), new, evicted)

    # ------------------------------------------------------------------ reading
    def entry(self, entry_id: str) -> Entry:
        rows = self._sql(f"SELECT {ENTRY_COLS} FROM entries WHERE id=?", (entry_id,))
        if not rows:
            raise MissingInput(f"no store entry {entry_id}")
        return Entry(*rows[0])

    def entries(self, *, model: str | None = None) -> list[Entry]:
        if not self.readable():
            return []
        if model is None:
            rows = self._sql(f"SELECT {ENTRY_COLS} FROM entries ORDER BY last_used DESC")
        else:
            rows = self._sql(f"SELECT {ENTRY_COLS} FROM entries WHERE model=? ORDER BY last_used DESC", (model,))
        return [Entry(*r) for r in rows]

    def find(self, prefix: str) -> str:
        """The entry id that starts with ``prefix`` (at least 4 hex digits)."""
        p = prefix.strip().lower()
        if len(p) < 4 or any(ch not in "0123456789abcdef" for ch in p):
            raise UsageError(f"{prefix!r} is not an entry id (4 or more hex digits)", hint="see `muser reuse ls`")
        rows = self._sql("SELECT id FROM entries WHERE id >= ? AND id < ? LIMIT 2", (p, p + "g")) if self.readable() else []
        if not rows:
            raise MissingInput(f"no store entry {prefix}", hint="see `muser reuse ls`")
        if len(rows) > 1:
            raise UsageError(f"entry id {prefix} is ambiguous", hint="give more digits")
        return rows[0][0]

    def points(
        self,
        model: str,
        tokenizer: str,
        ids: Sequence[int],
        limit: int,
        *,
        dtype: str | None = None,
        chunk_tokens: int | None = None,
        chain: str | None = None,
    ) -> list[Point]:
        """Every point at which a stored entry serves a prefix of ``ids[:limit]``, deepest first
        (then resumable first, then most recently used). ``chain`` restricts to one point."""
        if limit < 1 or not self.readable():
            return []
        query = "SELECT dtype, chunk FROM scopes WHERE model=? AND tokenizer=?"  # a scope may be empty: harmless
        args: list = [model, tokenizer]
        if dtype is not None:
            query += " AND dtype=?"
            args.append(dtype)
        if chunk_tokens is not None:
            query += " AND chunk=?"
            args.append(chunk_tokens)
        found: list[Point] = []
        for dt, chunk in self._sql(query, args):
            scope = Scope(model, tokenizer, dt, chunk)
            wanted = {c: n for n, c in chain_points(scope, ids, limit)}
            if chain is not None:
                wanted = {chain: wanted[chain]} if chain in wanted else {}
            keys = list(wanted)
            for i in range(0, len(keys), SQL_BATCH):
                batch = keys[i : i + SQL_BATCH]
                marks = ",".join("?" * len(batch))
                for c, entry_id, held, res, used in self._sql(
                    "SELECT p.chain, p.entry, p.held, p.resumable, e.last_used FROM points p JOIN entries e "
                    f"ON e.id = p.entry WHERE p.chain IN ({marks})", batch,
                ):
                    if held == wanted[c]:
                        found.append(Point(entry_id, held, bool(res), c, scope, used))
        found.sort(key=lambda p: (p.held, p.resumable, p.last_used), reverse=True)
        return found

    def load(self, entry_id: str, *, spare_rows: int = 0) -> KVPack:
        """Read and verify an entry's whole pack; on any failure remove it and raise CorruptEntry.

        The file is memory-mapped and verified at hash speed (:func:`read_pack`); nothing is
        returned before its root digest verified. ``spare_rows`` > 0: each full layer is
        placed once into an array with that much room after its rows, which an engine
        may adopt as its cache (the placement is then the install: no copy follows)."""
        try:
            entry = self.entry(entry_id)
        except MissingInput:
            raise CorruptEntry(f"store entry {entry_id[:12]} vanished (removed by another process)") from None
        path = self.pack_path(entry_id)
        try:
            with open(path, "rb") as f:
                pack = read_pack(f, spare_rows=spare_rows)
        except FileNotFoundError:
            self._drop(entry_id, "its file is missing")
            raise CorruptEntry(f"store entry {entry_id[:12]} vanished (removed)") from None
        except (KVPackError, OSError) as exc:
            self._drop(entry_id, str(exc))
            raise CorruptEntry(f"store entry {entry_id[:12]} is corrupt ({exc}); removed") from None
        h = pack.header
        if (pack.root_digest.hex() != entry_id or h.token_digest != entry.token_digest
                or scope_of_header(h) != entry.scope or h.rows_start != 0):
            self._drop(entry_id, "its pack disagrees with the index")
            raise CorruptEntry(f"store entry {entry_id[:12]} disagrees with its index row; removed")
        self.touch(entry_id)
        return pack

    def ring_extra_of(self, entry_id: str) -> int | None:
        """The ``ring_extra`` an entry's pack header declares, read from its first bytes
        only (advisory, for choosing what to load: :meth:`load` still verifies all of
        it). None when the header cannot be read; the caller then loads as usual."""
        header = self.header_of(entry_id)
        return None if header is None else header.ring_extra

    def header_of(self, entry_id: str) -> PackHeader | None:
        """An entry's pack header, read from its first bytes only (advisory: :meth:`load`
        still verifies all of it); None when it cannot be read."""
        reader = PackReader(decode=False)
        try:
            with open(self.pack_path(entry_id), "rb") as f:
                while reader.header is None:
                    block = f.read(min(max(reader.want(), 1), 1 << 20))
                    if not block:
                        return None
                    reader.feed(block)
        except (OSError, KVPackError):
            return None
        return reader.header

    # ------------------------------------------------------------------ the numeric gate's record
    def _checks(self) -> None:
        if not getattr(self, "_checks_ready", False):
            with self._write() as db:
                db.execute(CHECKS_SCHEMA)
            self._checks_ready = True

    def record_check(self, entry_id: str, *, engine: str, dtype: str, result: dict) -> None:
        """Record that ``entry_id``'s rows passed (or failed) the numeric gate on ``engine`` in
        ``dtype`` (``result``: the gate's JSON). An entry is content-addressed, so the record
        holds for as long as the id does. Advisory: a failure to record is a problem, not an error."""
        try:
            self._checks()
            with self._write() as db:
                row = (entry_id, engine, dtype, int(bool(result.get("ok"))), canonical_json(result).decode(), time.time())
                db.execute("INSERT OR REPLACE INTO checks VALUES (?,?,?,?,?,?)", row)
        except DataError as exc:
            self.problems.append(f"reuse store: could not record the check of {entry_id[:12]} ({exc})")

    def check_of(self, entry_id: str, *, engine: str, dtype: str) -> dict | None:
        """The passed gate recorded for ``entry_id`` on ``engine`` in ``dtype``, or None."""
        try:
            self._checks()
            rows = self._sql("SELECT result FROM checks WHERE entry=? AND engine=? AND dtype=? AND ok=1",
                             (entry_id, engine, dtype))
        except DataError:
            return None
        return loads(rows[0][0], what="a recorded check", limit=1 << 20) if rows else None

    def touch(self, entry_id: str) -> None:
        """Mark an entry used (advisory: a failure to record it never fails a read)."""
        try:
            with self._write() as db:
                db.execute("UPDATE entries SET last_used=? WHERE id=?", (time.time(), entry_id))
        except DataError as exc:
            self.problems.append(f"reuse store: could not record a use of {entry_id[:12]} ({exc})")

    # ------------------------------------------------------------------ removing
    def discard(self, entry_id: str, reason: str) -> None:
        """Remove an entry found unfit to serve (``reason`` goes to ``problems``)."""
        self._drop(entry_id, reason)

    def _drop(self, entry_id: str, reason: str) -> None:
        self.problems.append(f"removed store entry {entry_id[:12]}: {reason}")
        self.remove([entry_id])

    def remove(self, ids: Sequence[str]) -> list[str]:
        """Remove entries (index rows first, then files). Returns the ids that existed."""
        gone = []
        with self._locked():
            with self._write() as db:
                for entry_id in ids:
                    if db.execute("DELETE FROM entries WHERE id=?", (entry_id,)).rowcount:
                        gone.append(entry_id)
                    db.execute("DELETE FROM points WHERE entry=?", (entry_id,))
            for entry_id in ids:
                with contextlib.suppress(FileNotFoundError):
                    self.pack_path(entry_id).unlink()
        return gone

    def total_bytes(self) -> int:
        if not self.readable():
            return 0
        return int(self._sql("SELECT COALESCE(SUM(bytes), 0) FROM entries")[0][0])

    def _enforce_cap(self, *, keep: str | None = None, max_bytes: int | None = None) -> list[str]:
        cap = self.max_bytes if max_bytes is None else max_bytes
        total = self.total_bytes()
        if total <= cap:
            return []
        victims = []
        for entry_id, nbytes in self._sql("SELECT id, bytes FROM entries ORDER BY last_used ASC"):
            if total <= cap:
                break
            if entry_id == keep:
                continue
            victims.append(entry_id)
            total -= nbytes
        return self.remove(victims)

    def gc(self, *, max_bytes: int | None = None, verify: bool = False, rebuild: bool = False) -> GCResult:
        """Sweep stale temporaries, orphaned files and index rows without files; optionally
        re-verify every pack or rebuild the index from the packs; then evict to ``max_bytes``."""
        res = GCResult()
        tmp_dir = self.root / "tmp"
        if tmp_dir.is_dir():
            for p in tmp_dir.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - p.stat().st_mtime > STALE_TMP_S:
                        p.unlink()
                        res.tmp_removed += 1
        if rebuild:
            res.removed += self._rebuild()[1]
        with self._locked():
            known = {r[0] for r in self._sql("SELECT id FROM entries")}
            on_disk = {p.stem: p for p in (self.root / "packs").glob("*/*.kvpack")}
            for entry_id, p in on_disk.items():
                if entry_id not in known:
                    p.unlink()
                    res.removed.append(entry_id)
            missing = sorted(known - set(on_disk))
        if missing:
            res.removed += self.remove(missing)
        if verify:
            for entry in self.entries():
                try:
                    self.load(entry.id)
                except CorruptEntry:
                    res.removed.append(entry.id)
        res.evicted = self._enforce_cap(max_bytes=max_bytes)
        with self._write() as db:
            db.execute("DELETE FROM scopes WHERE NOT EXISTS (SELECT 1 FROM entries e WHERE e.model = scopes.model "
                       "AND e.tokenizer = scopes.tokenizer AND e.dtype = scopes.dtype AND e.chunk = scopes.chunk)")
        res.entries = len(self.entries())
        res.bytes = self.total_bytes()
        return res

    def _rebuild(self, *, only_if_broken: bool = False) -> tuple[int, list[str], Path | None]:
        """Move the index aside and index every pack file again (each one verified).

        Returns (packs indexed, packs removed, where the old index went). With
        ``only_if_broken``, first re-check under the lock: when another process already
        repaired the index, nothing is done (and the third item is None)."""
        removed: list[str] = []
        with self._locked():
            self.close()
            if only_if_broken and self.index_path.exists():
                try:
                    db = self._open()
                    try:
                        healthy = db.execute("PRAGMA quick_check").fetchall() == [("ok",)]
                    except sqlite3.DatabaseError:
                        healthy = False
                    if healthy:
                        self._db = db
                        return 0, [], None
                    db.close()
                except sqlite3.DatabaseError:
                    self.close()
            stamp = time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
            aside = Path(f"{self.index_path}.broken-{stamp}")
            for suffix in ("", "-wal", "-shm"):
                p = Path(str(self.index_path) + suffix)
                if p.exists():
                    os.replace(p, Path(f"{aside}{suffix}"))
            files = sorted((self.root / "packs").glob("*/*.kvpack"))
        for p in files:
            reader = PackReader(decode=False)
            try:
                with open(p, "rb") as f:
                    while block := f.read(READ_BLOCK):
                        reader.feed(block)
                reader.finish()
                assert reader.header is not None and reader.root_digest is not None
                _check_storable(reader.header)
                if reader.root_digest.hex() != p.stem:
                    raise KVPackError("file name is not its root digest")
            except (KVPackError, DataError, OSError):
                p.unlink()
                removed.append(p.stem)
                continue
            fd, tmp = self._tmp_file()
            os.close(fd)
            os.replace(p, tmp)  # _publish renames it back and indexes it
            self._publish(tmp, reader.header, p.stem, reader.bytes_consumed)
        self._conn()  # an empty store still gets a fresh index
        return len(files) - len(removed), removed, aside


def _check_storable(header: PackHeader, *, delta_ok: bool = False, vocab_size: int | None = None) -> None:
    if vocab_size is not None:
        bad = out_of_vocabulary(header.token_ids, vocab_size)
        if bad is not None:
            raise DataError(f"pack refused: token {bad[0]} of {len(header.token_ids)} is {bad[1]}, outside the "
                            f"model's vocabulary [0, {vocab_size})", hint="a corrupt or forged pack; nothing was stored")
    if header.quant_scheme != "none":
        raise DataError("the store keeps exact KV only; this pack is quantized", hint="put the pack before --quant")
    if header.rows_start != 0 and not delta_ok:
        raise DataError("a delta pack cannot be stored by itself", hint="decode it with --store to store the merge")


__all__ = [
    "DEFAULT_MAX_BYTES", "ENV_MAX_BYTES", "SCHEMA", "SCHEMA_VERSION", "CorruptEntry", "Entry", "GCResult", "Point",
    "PutResult", "Store", "parse_size",
]
