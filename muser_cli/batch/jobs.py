"""A batch's jobs: one JSON object per line, read strictly; a bad line is a failed job, not a
stopped batch.

    {"id": "q17", "prompt": "...", "max_tokens": 128}
    {"id": "q18", "prompt_file": "doc.txt", "question": "Who chose the site?"}

``prompt`` (the whole prompt) or ``prompt_file`` (a UTF-8 file, relative to the jobs file's
folder; ``question`` appended after a blank line: the document first, so jobs asking about
one document share its KV) — exactly one. Optional: ``max_tokens``, ``temperature``,
``top_p``, ``seed``, ``chat`` (the batch's ``--chat`` otherwise). Any other key is refused:
a misspelt option must not silently fall back to a default.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from muser_cli.errors import DataError, MissingInput, MuserError
from muser_cli.fsio import open_regular
from muser_cli.strict import canonical_json, loads

MAX_LINE_BYTES = 64 << 20  # an inline long-context prompt
MAX_DOC_BYTES = 256 << 20
MAX_NEW_TOKENS = 1 << 16
KEYS = {"id", "prompt", "prompt_file", "question", "max_tokens", "temperature", "top_p", "seed", "chat"}
_ID_RE = re.compile(r"^[\x21-\x7e][\x20-\x7e]{0,127}$")


@dataclass(frozen=True)
class Job:
    """One well-formed job line. ``line`` is its 1-based line number (the input order)."""

    line: int
    id: str
    text: str  # the prompt as decoded: the document, then the question
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    chat: bool
    document: str | None  # prompt_file as resolved (jobs naming one document share its prefix)
    spec: bytes  # the job line as canonical JSON, with the document's digest: what a result is bound to

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.spec).hexdigest()


@dataclass(frozen=True)
class BadJob:
    """A line that is not a job: its result line says why, with the exit status it would have had."""

    line: int
    id: str
    error: MuserError


@dataclass(frozen=True)
class Defaults:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    chat: bool = False


def _number(obj: dict, key: str, default, *, lo: float, hi: float, integer: bool):
    if key not in obj:
        return default
    v = obj[key]
    ok = type(v) is int if integer else type(v) in (int, float)
    if not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise DataError(f"job field {key!r} must be {kind} in [{lo:g}, {hi:g}]")
    return v


def parse_job(raw: bytes, line: int, *, base_dir: Path, defaults: Defaults) -> Job:
    """One job line; every malformation is a DataError (65), a missing document MissingInput (66)."""
    obj = loads(raw, f"job line {line}", limit=MAX_LINE_BYTES)
    if not isinstance(obj, dict):
        raise DataError(f"job line {line} is not a JSON object")
    extra = sorted(set(obj) - KEYS)
    if extra:
        raise DataError(f"job line {line}: unknown field {extra[0]!r}", hint="fields: " + ", ".join(sorted(KEYS)))
    job_id = obj.get("id", f"line-{line}")
    if not isinstance(job_id, str) or not _ID_RE.match(job_id):
        raise DataError(f"job line {line}: 'id' must be 1-128 printable ASCII characters")
    has_prompt, has_file = "prompt" in obj, "prompt_file" in obj
    if has_prompt == has_file:
        raise DataError(f"job {job_id}: give exactly one of 'prompt' and 'prompt_file'")
    question = obj.get("question")
    if question is not None and (not isinstance(question, str) or not has_file):
        raise DataError(f"job {job_id}: 'question' must be a string, with 'prompt_file'")
    document = None
    if has_prompt:
        text = obj["prompt"]
        if not isinstance(text, str) or not text:
            raise DataError(f"job {job_id}: 'prompt' must be a non-empty string")
        doc_digest = None
    else:
        name = obj["prompt_file"]
        if not isinstance(name, str) or not name or "\x00" in name:
            raise DataError(f"job {job_id}: 'prompt_file' must be a file name")
        path = (base_dir / name) if not Path(name).is_absolute() else Path(name)
        body = _read_document(path, job_id)
        doc_digest = hashlib.sha256(body).hexdigest()
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"job {job_id}: {name} is not UTF-8 text") from None
        if question:
            text = f"{text.rstrip()}\n\n{question}"
        document = str(path.resolve())
    chat = obj.get("chat", defaults.chat)
    if not isinstance(chat, bool):
        raise DataError(f"job {job_id}: 'chat' must be true or false")
    seed = obj.get("seed", defaults.seed)
    if seed is not None and (type(seed) is not int or not 0 <= seed < 1 << 63):
        raise DataError(f"job {job_id}: 'seed' must be a non-negative integer")
    max_tokens = _number(obj, "max_tokens", defaults.max_tokens, lo=1, hi=MAX_NEW_TOKENS, integer=True)
    temperature = _number(obj, "temperature", defaults.temperature, lo=0, hi=100, integer=False)
    top_p = _number(obj, "top_p", defaults.top_p, lo=0, hi=1, integer=False)
    if top_p <= 0:
        raise DataError(f"job {job_id}: 'top_p' must be in (0, 1]")
    spec = canonical_json({"job": obj, "document_sha256": doc_digest, "max_tokens": max_tokens,
                           "temperature": temperature, "top_p": top_p, "seed": seed, "chat": chat})
    return Job(line, job_id, text, max_tokens, float(temperature), float(top_p), seed, chat, document, spec)


def _read_document(path: Path, job_id: str) -> bytes:
    """The document's bytes; a FIFO, a device or a socket is refused before any read (a
    named pipe no one writes would hang the whole batch)."""

    if path.is_dir():
        raise DataError(f"job {job_id}: {path} is a directory, not a file")
    try:
        fd = open_regular(path)
    except MissingInput as exc:
        if not path.exists():
            raise MissingInput(f"job {job_id}: no such prompt_file: {path}") from None
        raise MissingInput(f"job {job_id}: {exc}", hint=exc.hint) from None
    try:
        with open(fd, "rb") as fh:
            body = fh.read(MAX_DOC_BYTES + 1)
    except OSError as exc:
        raise MissingInput(f"job {job_id}: cannot read {path}: {exc.strerror or exc}") from None
    if len(body) > MAX_DOC_BYTES:
        raise DataError(f"job {job_id}: {path} is over {MAX_DOC_BYTES >> 20} MiB")
    return body


def read_jobs(lines: Iterable[bytes], *, base_dir: Path, defaults: Defaults = Defaults()) -> list[Job | BadJob]:
    """Every non-blank line as a Job or a BadJob, in input order. Two lines with one id —
    given, or a default ``line-N``, or the id a bad line meant — refuse the whole file
    (DataError, 65, naming the lines): one result line per id is what ``--resume`` relies on."""
    out: list[Job | BadJob] = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            out.append(parse_job(raw.rstrip(b"\r\n"), n, base_dir=base_dir, defaults=defaults))
        except MuserError as exc:
            out.append(BadJob(n, _id_of(raw, n), exc))
    _refuse_repeated_ids(out)
    return out


def _refuse_repeated_ids(items: list[Job | BadJob]) -> None:
    lines: dict[str, list[int]] = {}
    for item in items:
        lines.setdefault(item.id, []).append(item.line)
    repeated = [(rid, ns) for rid, ns in lines.items() if len(ns) > 1]
    if repeated:
        rid, ns = repeated[0]
        more = f" (and {len(repeated) - 1} more repeated id(s))" if len(repeated) > 1 else ""
        own = [n for n in ns if rid == f"line-{n}"]
        default = f" (it is line {own[0]}'s default id)" if own else ""
        raise DataError(f"jobs file: id {rid!r} is on lines {', '.join(map(str, ns))}{default}{more}",
                        hint="give every job its own id (a line without one is line-N, N its line number)")


def _id_of(raw: bytes, line: int) -> str:
    """The id a bad line meant, when it can be read at all (for its result line)."""
    m = re.search(rb'"id"\s*:\s*"([\x21-\x7e][\x20-\x21\x23-\x5b\x5d-\x7e]{0,127})"', raw[:4096])
    return m.group(1).decode("ascii") if m else f"line-{line}"
