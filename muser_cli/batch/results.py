"""A batch's results file: one JSON object per line, appended durably (written, flushed and
fsynced line by line) so a killed run loses at most the job in flight, and ``--resume``
skips what is done.

Each line names the model (fingerprint) and the job (the digest of its line and document)
it answers: resuming against another model, or a jobs file whose line for that id changed,
is refused (exit 65) instead of mixing two batches in one file. Each line also carries the
digest of its own content (``line_digest``): a done line that fails it (edited since it was
written), or that has none (an older muser wrote it: unverifiable), is redone, not kept. At
a clean end the file is rewritten (atomically) in input order, one line per id: the latest.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Sequence

from muser_cli.errors import DataError, OutputError, UsageError
from muser_cli.fsio import atomic_writer, check_output_path, fsync_dir, is_special
from muser_cli.strict import loads

MAX_RESULT_LINE = 64 << 20
DIGEST_KEY = "line_digest"
EDITED = "its results line was changed after it was written (line_digest does not match)"
NO_DIGEST = "its results line has no line_digest (an older muser wrote it): unverifiable"


def line_digest(result: dict[str, Any]) -> str:
    """The digest of a result line's content: every field but this one, as sorted compact JSON."""
    body = {k: v for k, v in result.items() if k != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


def unverified(result: dict[str, Any]) -> str | None:
    """Why a result line cannot be trusted as it stands (None: its digest matches)."""
    if DIGEST_KEY not in result:
        return NO_DIGEST
    return None if result[DIGEST_KEY] == line_digest(result) else EDITED


class Results:
    """Where results go: a file (appended, resumable) or a stream (stdout: in input order)."""

    def __init__(self, path: Path | None = None, *, stream: BinaryIO | None = None, resume: bool = False,
                 force: bool = False) -> None:
        if (path is None) == (stream is None):
            raise ValueError("a results file or a stream")
        if resume and path is None:
            raise UsageError("--resume needs a results file (-o FILE), not stdout")
        if resume and force:
            raise UsageError("--resume and --force contradict each other")
        if path is not None:
            check_output_path(path)
        self.path = Path(path) if path is not None else None
        self.stream = stream
        self.resume = resume
        self._fh: BinaryIO | None = None
        self._special = False
        self._order: list[str] = []
        self._pending: dict[str, bytes] = {}  # stdout: results waiting for those before them
        self._next = 0
        self.redo: dict[str, str] = {}  # id -> why its done line is not kept (resume): set by done()
        if (self.path is not None and self.path.is_file() and self.path.stat().st_size > 0
                and not (resume or force)):
            raise UsageError(f"{self.path} already holds results",
                             hint="--resume to continue that batch, --force to start over")

    # ------------------------------------------------------------------ resume
    def done(self, *, model: str, jobs: dict[str, str], schedule: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        """The results already in the file (``--resume``): id -> its latest line. ``jobs``: id ->
        job digest of this run; ``schedule``: engine, dtype and chunk, which a resumed run must
        share (tokens of two schedules never mix in one file). A torn last line is cut off."""
        if not self.resume or self.path is None or not self.path.exists() or is_special(self.path):
            return {}
        data = self.path.read_bytes()
        cut = data.rfind(b"\n") + 1
        if cut < len(data):  # the line being written when the run died: not a result
            with open(self.path, "r+b") as fh:
                fh.truncate(cut)
                os.fsync(fh.fileno())
            data = data[:cut]
        out: dict[str, dict[str, Any]] = {}
        for n, raw in enumerate(data.splitlines(), 1):
            if not raw.strip():
                continue
            obj = loads(raw, f"{self.path.name} line {n}", limit=MAX_RESULT_LINE)
            if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
                raise DataError(f"{self.path.name} line {n} is not a muser batch result",
                                hint="--resume continues a results file that muser batch wrote")
            rid = obj["id"]
            ok = obj.get("error") is None
            why = unverified(obj) if ok else None
            out[rid] = obj
            self.redo.pop(rid, None)
            if why is not None:
                self.redo[rid] = why  # the latest line for rid: redone, whatever the earlier ones said
                if why == EDITED:
                    continue  # its fields are not what muser wrote: nothing to check against
            if obj.get("model") != model:
                raise DataError(f"{self.path.name} holds results of another model ({obj.get('model')!s:.40})",
                                hint="resume with the -m it was made with, or write to another file")
            if ok and rid in jobs and obj.get("job") != jobs[rid]:
                raise DataError(f"{self.path.name}: the result for {rid!r} answers another job line than this "
                                "jobs file's", hint="resume with the jobs file it was made for, or --force")
            for key, want in (schedule or {}).items():
                if ok and key in obj and obj[key] != want:
                    raise DataError(f"{self.path.name} was made with {key} {obj[key]!r}, this run uses {want!r}",
                                    hint=f"resume with the same --{key}, or write to another file")
        return out

    # ------------------------------------------------------------------ writing
    def open(self, order: Sequence[str]) -> None:
        """``order``: every id in input order (stdout is written in that order)."""
        self._order = list(order)
        self._special = self.path is not None and is_special(self.path)
        if self.path is not None:
            try:
                flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if self.resume else os.O_TRUNC)
                self._fh = os.fdopen(os.open(self.path, flags, 0o644), "ab" if self.resume else "wb")
                if not self._special:
                    fsync_dir(self.path.parent if str(self.path.parent) else Path("."))  # the file itself survives
            except OSError as exc:
                raise OutputError(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def skip(self, rid: str) -> None:
        """``rid`` is done already (resume): nothing to write, but stdout order moves on."""
        self._pending[rid] = b""
        self._drain()

    def write(self, result: dict[str, Any]) -> None:
        result = {**result, DIGEST_KEY: line_digest(result)}
        line = json.dumps(result, sort_keys=True, ensure_ascii=False).encode("utf-8") + b"\n"
        if self._fh is not None:
            try:
                self._fh.write(line)
                self._fh.flush()
                if not self._special:  # a pipe or device has nothing to make durable
                    os.fsync(self._fh.fileno())
            except OSError as exc:
                raise OutputError(f"cannot write {self.path}: {exc.strerror or exc}") from None
            return
        self._pending[result["id"]] = line
        self._drain()

    def _drain(self) -> None:
        assert self.stream is not None or self._fh is not None
        if self.stream is None:
            return
        while self._next < len(self._order) and self._order[self._next] in self._pending:
            line = self._pending.pop(self._order[self._next])
            if line:
                self.stream.write(line)
                self.stream.flush()
            self._next += 1

    def close(self, *, complete: bool) -> None:
        """``complete``: every job has a line — rewrite the file in input order, the latest line
        per id (atomically: a kill now leaves the old file, not a half one)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self.stream is not None:
            for rid in self._order[self._next:]:  # an interrupted run: what finished still comes out
                line = self._pending.pop(rid, b"")
                if line:
                    self.stream.write(line)
            self.stream.flush()
            return
        if not complete or self.path is None or is_special(self.path):
            return  # a pipe or device (-o /dev/stdout) is written once, in finishing order
        latest: dict[str, bytes] = {}
        for raw in self.path.read_bytes().splitlines(keepends=True):
            if raw.strip():
                latest[json.loads(raw)["id"]] = raw
        with atomic_writer(self.path) as out:
            for rid in self._order:
                if rid in latest:
                    out.write(latest.pop(rid))
            for raw in latest.values():  # ids no longer in the jobs file: kept, at the end
                out.write(raw)
