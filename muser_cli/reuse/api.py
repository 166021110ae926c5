"""Library verbs of ``muser reuse``: have, put, get, ls, rm, gc (the commands only render)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from typing import BinaryIO, Sequence

from muser_cli.errors import DataError, IdentityMismatch, KVPackError, MuserError, PromptTooShort, UsageError
from muser_cli.kvpack import PackReader, token_digest
from muser_cli.model.binding import short_fingerprint
from muser_cli.model.resolve import known_model, resolve_model
from muser_cli.model.tokens import encode_prompt
from muser_cli.reuse.manifest import HaveManifest
from muser_cli.reuse.store import Entry, GCResult, PutResult, Store
from muser_cli.strict import parse_size
from muser_cli.units import plural


def have(
    prompt: str,
    *,
    model: str | None = None,
    chat: bool = False,
    dtype: str | None = None,
    chunk_tokens: int | None = None,
    store: Store | None = None,
) -> HaveManifest:
    """How much of ``prompt`` the store holds: the manifest a consumer gives a producer.

    Loads no weights (fingerprints and the tokenizer only). ``held_tokens`` is the deepest
    point any entry serves (full-attention rows [0, held)); ``complete`` says an entry holds
    the whole cache of prompt[:-1], sliding-window rings included (decode needs no producer).
    """

    info = resolve_model(model)
    ids = encode_prompt(info, prompt, chat=chat)
    if len(ids) < 2:
        raise PromptTooShort(f"prompt is {plural(len(ids), 'token')}; a handoff needs at least 2",
                             hint="the consumer runs the last prompt token itself")
    store = store or Store()
    base = HaveManifest(info.fingerprint, info.name, info.tokenizer_fingerprint, len(ids), token_digest(ids))
    for point in store.points(info.fingerprint, info.tokenizer_fingerprint, ids, len(ids) - 1, dtype=dtype,
                              chunk_tokens=chunk_tokens):
        path = store.pack_path(point.entry)
        try:
            if path.stat().st_size != store.entry(point.entry).bytes:
                continue
        except (OSError, MuserError):  # vanished or removed meanwhile
            continue
        complete = point.held == len(ids) - 1 and point.resumable
        return replace(base, held_tokens=point.held, complete=complete, entry_id=point.entry, chain=point.chain,
                       scope=point.scope)
    return base


def put(src: BinaryIO, *, store: Store | None = None, model: str | None = None) -> PutResult:
    """Verify and store a kvpack (a delta is merged with its stored base first).

    Every token id is checked against the vocabulary of the pack's model: ``model`` (a
    model reference, which the pack must then be for), or else the folder this machine
    already knows by the pack's model fingerprint. A pack for a model it cannot find is
    refused (exit 65): its ids cannot be checked."""
    head = _Peek(src)
    header = head.header()
    if model is not None:
        info = resolve_model(model)
        if header.model_fingerprint != info.fingerprint or header.tokenizer_fingerprint != info.tokenizer_fingerprint:
            raise IdentityMismatch(f"pack refused: it is for model {short_fingerprint(header.model_fingerprint)} "
                                   f"({header.model_name or '?'}), not {info.name} {short_fingerprint(info.fingerprint)}",
                                   hint="pass the pack's own model with -m")
    else:
        info = known_model(header.model_fingerprint)
        if info is None:
            raise DataError(f"pack refused: its model {short_fingerprint(header.model_fingerprint)} ({header.model_name or '?'}) "
                            "is not known on this machine, so its token ids cannot be checked",
                            hint="pass the model folder with -m")
    return (store or Store()).put(head, vocab_size=info.vocab_size)


class _Peek:
    """Read a kvpack's header from a stream, then replay the bytes read for it."""

    def __init__(self, src: BinaryIO) -> None:
        self._src = src
        self._buffered = b""

    def header(self):
        reader = PackReader(decode=False)
        chunks = []
        while reader.header is None:
            block = self._src.read(1 << 16)
            if not block:
                break
            chunks.append(block)
            reader.feed(block)
        self._buffered = b"".join(chunks)
        if reader.header is None:
            reader.finish()  # raises the reader's own error for a short or empty input
            raise KVPackError("not a kvpack: no header")
        return reader.header

    def read(self, n: int = -1) -> bytes:
        if self._buffered:
            if n is None or n < 0:
                data, self._buffered = self._buffered + self._src.read(), b""
                return data
            data, self._buffered = self._buffered[:n], self._buffered[n:]
            return data
        return self._src.read(n)


def get(entry: str, out: BinaryIO, *, store: Store | None = None) -> Entry:
    """Write a stored pack to ``out``, byte for byte, after verifying it."""
    store = store or Store()
    entry_id = store.find(entry)
    store.load(entry_id)  # verifies (a corrupt entry is removed and raises)
    with open(store.pack_path(entry_id), "rb") as f:
        shutil.copyfileobj(f, out, 1 << 20)
    return store.entry(entry_id)


def ls(*, store: Store | None = None, model: str | None = None) -> list[Entry]:
    """The store's entries (of ``model`` only, when given), most recently used first."""
    fingerprint = None
    if model is not None:
        fingerprint = resolve_model(model).fingerprint
    return (store or Store()).entries(model=fingerprint)


def rm(entries: Sequence[str], *, store: Store | None = None, everything: bool = False) -> list[str]:
    store = store or Store()
    if everything:
        ids = [e.id for e in store.entries()]
    else:
        if not entries:
            raise UsageError("name the entries to remove (see `muser reuse ls`), or --all")
        ids = [store.find(e) for e in entries]
    return store.remove(ids)


def listing(entries: Sequence[Entry]) -> dict:
    """``reuse ls --json``: the entries and their total size."""
    return {"entries": [e.to_json() for e in entries], "bytes": sum(e.bytes for e in entries)}


def gc(*, max_bytes: int | None = None, verify: bool = False, rebuild: bool = False,
       store: Store | None = None, max_size: str | None = None) -> GCResult:
    """Sweep, optionally verify or rebuild, then evict to ``max_bytes`` (or ``max_size``, a
    size such as 20G or 512M; a bad one is a UsageError)."""
    if max_size:
        max_bytes = parse_size(max_size)
    return (store or Store()).gc(max_bytes=max_bytes, verify=verify, rebuild=rebuild)


__all__ = ["Entry", "GCResult", "HaveManifest", "PutResult", "Store", "gc", "get", "have", "listing", "ls", "put", "rm"]
