"""The "have" manifest (what a consumer holds of a prompt) and a delta pack's ``base``.

A consumer prints a manifest with ``muser reuse have``; a producer reads it with
``prefill --have`` / ``pack --have`` and ships only rows the consumer lacks, in a delta
kvpack whose header ``base`` names the prefix. Both documents are specified in
docs/reuse.md; both are checked strictly (wrong types, unknown versions → DataError).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from muser_cli.errors import DataError, IdentityMismatch
from muser_cli.kvpack import token_digest
from muser_cli.kvpack.format import MAX_TOKENS
from muser_cli.kvpack.layers import DTYPES
from muser_cli.model.binding import short_fingerprint
from muser_cli.reuse.chain import Scope, chain_at, scope_of_header, servable
from muser_cli.strict import is_sha256_ref, loads

MANIFEST_FORMAT = "muser-have"
MANIFEST_VERSION = (1, 0)
MAX_MANIFEST_BYTES = 1 << 20
BASE_SCHEME = "muser-reuse/v1"


def _fp(value: Any, where: str) -> str:
    if not is_sha256_ref(value):
        raise DataError(f"have manifest: {where} is not a sha256 value")
    return value


def _int(obj: dict, key: str, where: str, lo: int, hi: int) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise DataError(f"have manifest: {where}.{key} must be an integer in [{lo}, {hi}]")
    return value


def _obj(obj: Any, key: str, where: str) -> dict:
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, dict):
        raise DataError(f"have manifest: {where}.{key} must be an object")
    return value


@dataclass(frozen=True)
class HaveManifest:
    """What the consumer holds of one prompt: rows [0, held_tokens) in ``scope``."""

    model: str
    model_name: str
    tokenizer: str
    prompt_tokens: int
    prompt_digest: str
    held_tokens: int = 0
    complete: bool = False  # the whole cache of prompt[:-1] is held: no producer needed
    entry_id: str | None = None
    chain: str | None = None  # chain(held_tokens) in scope
    scope: Scope | None = None

    def to_json(self) -> dict[str, Any]:
        entry = None
        if self.held_tokens:
            assert self.scope is not None and self.chain is not None
            entry = {"id": self.entry_id, "model": self.scope.model, "tokenizer": self.scope.tokenizer,
                     "dtype": self.scope.dtype, "chunk_tokens": self.scope.chunk_tokens,
                     "held_tokens": self.held_tokens, "chain": self.chain}
        return {
            "format": MANIFEST_FORMAT, "version": list(MANIFEST_VERSION),
            "model": {"fingerprint": self.model, "name": self.model_name},
            "tokenizer": {"fingerprint": self.tokenizer},
            "prompt_tokens": self.prompt_tokens, "prompt_digest": self.prompt_digest,
            "held_tokens": self.held_tokens, "complete": self.complete, "entry": entry,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, indent=1) + "\n"

    @classmethod
    def loads(cls, data: bytes | str) -> "HaveManifest":
        # It crosses machines: read as strictly as every other untrusted input.
        obj = loads(data, "have manifest", limit=MAX_MANIFEST_BYTES)
        if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT:
            raise DataError("not a have manifest (format is not 'muser-have')", hint="make it with `muser reuse have`")
        version = obj.get("version")
        if not isinstance(version, list) or len(version) != 2 or version[0] != MANIFEST_VERSION[0]:
            raise DataError(f"have manifest version {version} is not supported (this reader reads "
                            f"{MANIFEST_VERSION[0]}.x)")
        model = _fp(_obj(obj, "model", "manifest").get("fingerprint"), "model.fingerprint")
        name = _obj(obj, "model", "manifest").get("name", "")
        tokenizer = _fp(_obj(obj, "tokenizer", "manifest").get("fingerprint"), "tokenizer.fingerprint")
        prompt_tokens = _int(obj, "prompt_tokens", "manifest", 2, MAX_TOKENS)
        digest = _fp(obj.get("prompt_digest"), "prompt_digest")
        held = _int(obj, "held_tokens", "manifest", 0, prompt_tokens - 1)
        complete = obj.get("complete", False)
        if not isinstance(complete, bool):
            raise DataError("have manifest: complete must be true or false")
        entry = obj.get("entry")
        if held == 0:
            if entry is not None:
                raise DataError("have manifest: entry must be null when nothing is held")
            return cls(model, str(name), tokenizer, prompt_tokens, digest)
        if not isinstance(entry, dict):
            raise DataError("have manifest: held_tokens > 0 needs an entry")
        if _int(entry, "held_tokens", "entry", 1, prompt_tokens - 1) != held:
            raise DataError("have manifest: entry.held_tokens disagrees with held_tokens")
        dtype = entry.get("dtype")
        if not isinstance(dtype, str):
            raise DataError("have manifest: entry.dtype must be a string")
        if dtype not in DTYPES:
            raise DataError(f"have manifest: entry.dtype {dtype[:32]!r} is unknown (known: {', '.join(DTYPES)})",
                            hint="the manifest is corrupt or edited; make it again with `muser reuse have`")
        scope = Scope(_fp(entry.get("model"), "entry.model"), _fp(entry.get("tokenizer"), "entry.tokenizer"), dtype,
                      _int(entry, "chunk_tokens", "entry", 1, 1 << 16))
        if scope.model != model or scope.tokenizer != tokenizer:
            raise DataError("have manifest: entry fingerprints disagree with the manifest's")
        entry_id = entry.get("id")
        return cls(model, str(name), tokenizer, prompt_tokens, digest, held, complete,
                   entry_id if isinstance(entry_id, str) else None, _fp(entry.get("chain"), "entry.chain"), scope)

    def check_model(self, model_fp: str, tokenizer_fp: str, *, what: str = "this model") -> None:
        """Refuse a manifest made for another model or tokenizer (IdentityMismatch, exit 65)."""
        if self.model != model_fp:
            raise IdentityMismatch(f"have manifest is for model {short_fingerprint(self.model)} ({self.model_name or '?'}), "
                                   f"not {what} {short_fingerprint(model_fp)}",
                                   hint="the consumer must run `muser reuse have` with the producer's model")
        if self.tokenizer != tokenizer_fp:
            raise IdentityMismatch(f"have manifest is for tokenizer {short_fingerprint(self.tokenizer)}, not {short_fingerprint(tokenizer_fp)}",
                                   hint="the consumer's model folder has another tokenizer")

    def check_prompt(self, ids: list[int]) -> None:
        """Refuse a manifest made for another prompt (whole-prompt digest and the chain at the held point)."""

        if self.prompt_digest != token_digest(ids) or self.prompt_tokens != len(ids):
            raise IdentityMismatch(
                f"have manifest describes a {self.prompt_tokens}-token prompt ({short_fingerprint(self.prompt_digest)}); "
                f"this one is {len(ids)} tokens ({short_fingerprint(token_digest(ids))})",
                hint="run `muser reuse have` on the same prompt file (and the same --chat)")
        if self.held_tokens:
            assert self.scope is not None
            if chain_at(self.scope, ids, self.held_tokens) != self.chain:
                raise IdentityMismatch("have manifest's chain hash does not match this prompt's first "
                                       f"{self.held_tokens} tokens", hint="the manifest was edited or is for another prompt")


# ------------------------------------------------------------------ delta base
def base_object(scope: Scope, held: int, chain: str) -> dict[str, Any]:
    """The ``base`` of a delta kvpack: the prefix it extends (docs/reuse.md §3)."""
    return {"scheme": BASE_SCHEME, "chain": chain, "tokens": held, "model": scope.model,
            "tokenizer": scope.tokenizer, "dtype": scope.dtype, "chunk_tokens": scope.chunk_tokens}


def check_base(header) -> tuple[Scope, int, str]:
    """Validate a delta header's ``base`` against the header itself; returns (scope, held, chain).

    A base that disagrees with the pack it sits in (other model, other tokens, another
    count than positions.start) makes the pack unusable: DataError (exit 65)."""
    base = header.base
    if not isinstance(base, dict):
        raise DataError("delta pack has no base", hint="a pack with positions.start > 0 must name its prefix")
    if base.get("scheme") != BASE_SCHEME:
        raise DataError(f"delta base scheme {base.get('scheme')!r} is unknown (known: {BASE_SCHEME})")
    scope = scope_of_header(header)
    held = base.get("tokens")
    if held != header.rows_start:
        raise DataError(f"delta base holds {held!r} tokens but the pack starts at position {header.rows_start}")
    for key, want in (("model", scope.model), ("tokenizer", scope.tokenizer), ("dtype", scope.dtype),
                      ("chunk_tokens", scope.chunk_tokens)):
        if base.get(key) != want:
            raise DataError(f"delta base {key} {base.get(key)!r} disagrees with the pack's {want!r}")
    if not servable(scope, header.rows_start, header.rows_end):
        raise DataError(f"delta starts at {header.rows_start}, not a multiple of chunk_tokens={scope.chunk_tokens}: "
                        "the merge would not be exact")
    chain = base.get("chain")
    if chain != chain_at(scope, header.token_ids, header.rows_start):
        raise DataError("delta base chain hash does not match the pack's own first "
                        f"{header.rows_start} tokens (corrupt or forged base)")
    return scope, header.rows_start, chain
