"""What the reuse store holds and reports: an entry (one stored pack, as its index row),
a point (where an entry serves a prompt's prefix), and the results of a put and a gc.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from muser_cli.reuse.chain import Scope


@dataclass(frozen=True)
class Entry:
    id: str
    model: str
    tokenizer: str
    dtype: str
    chunk_tokens: int
    model_name: str
    tokens: int  # prompt tokens (rows = tokens - 1)
    rows: int
    token_digest: str
    bytes: int
    codec: str
    created: float
    last_used: float

    @property
    def scope(self) -> Scope:
        return Scope(self.model, self.tokenizer, self.dtype, self.chunk_tokens)

    def to_json(self) -> dict:
        return {"id": self.id, "model": self.model_name, "model_fingerprint": self.model,
                "tokenizer_fingerprint": self.tokenizer, "dtype": self.dtype, "chunk_tokens": self.chunk_tokens,
                "tokens": self.tokens, "rows": self.rows, "token_digest": self.token_digest, "bytes": self.bytes,
                "codec": self.codec, "created": round(self.created, 3), "last_used": round(self.last_used, 3)}


@dataclass(frozen=True)
class Point:
    """An entry can serve rows [0, held) of a prompt whose chain at ``held`` is ``chain``."""

    entry: str
    held: int
    resumable: bool  # it also holds the sliding-window rings as of ``held``
    chain: str
    scope: Scope
    last_used: float


@dataclass
class PutResult:
    entry: Entry
    points: int
    new: bool
    evicted: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"entry": self.entry.to_json(), "new": self.new, "points": self.points, "evicted": self.evicted}


@dataclass
class GCResult:
    evicted: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)  # corrupt, missing or orphaned
    tmp_removed: int = 0
    entries: int = 0
    bytes: int = 0

    def to_json(self) -> dict:
        return {"evicted": self.evicted, "removed": self.removed, "tmp_removed": self.tmp_removed,
                "entries": self.entries, "bytes": self.bytes}
