"""A pack's binding: is it for this model, this tokenizer, this prompt? Checked before any decode.

(Named for what it checks, so it is not confused with a node's credentials,
:class:`muser_cli.handoff.trust.node.Identity`.)"""

from __future__ import annotations

from dataclasses import dataclass

from muser_cli.errors import IdentityMismatch
from muser_cli.kvpack import PackHeader
from muser_cli.model.info import ModelInfo


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def to_json(self) -> dict:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def short_fingerprint(fp: str) -> str:
    """A fingerprint as a message names it: its first 19 characters (``sha256:`` and 12 hex), then …."""
    return fp[:19] + "…" if len(fp) > 20 else fp


def _layer_diff(header: PackHeader, info: ModelInfo) -> str | None:
    if len(header.layers) != len(info.layers):
        return f"pack has {len(header.layers)} layers, the model {len(info.layers)}"
    for i, (a, b) in enumerate(zip(header.layers, info.layers)):
        if a == b:
            continue
        ja, jb = a.to_json(), b.to_json()
        for key in ja:
            if ja[key] != jb[key]:
                if key == "rope" and ja[key] and jb[key]:
                    for rk in ja[key]:
                        if ja[key][rk] != jb[key][rk]:
                            return f"layer {i} rope.{rk}: pack {ja[key][rk]!r}, model {jb[key][rk]!r}"
                return f"layer {i} {key}: pack {ja[key]!r}, model {jb[key]!r}"
    return None


def out_of_vocabulary(token_ids, vocab_size: int) -> tuple[int, int] | None:
    """(index, id) of the first id outside [0, vocab_size), or None when all are inside."""
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            return i, t
    return None


def vocabulary_check(token_ids, info: ModelInfo) -> Check:
    """Every token id must be a row of the model's embedding."""
    n = len(token_ids)
    if info.vocab_size <= 0:
        return Check("tokens", False, f"the model's vocabulary size is unknown: {n} token ids cannot be checked")
    bad = out_of_vocabulary(token_ids, info.vocab_size)
    if bad is not None:
        return Check("tokens", False, f"token {bad[0]} of {n} is {bad[1]}, outside the model's vocabulary "
                                      f"[0, {info.vocab_size})")
    return Check("tokens", True, f"{n} token ids inside the vocabulary of {info.vocab_size}")


def identity_checks(header: PackHeader, info: ModelInfo, *, prompt_ids: list[int] | None = None) -> list[Check]:
    checks = [
        Check("model", header.model_fingerprint == info.fingerprint,
              f"pack {short_fingerprint(header.model_fingerprint)} ({header.model_name or '?'}), "
              f"local {short_fingerprint(info.fingerprint)} ({info.name})"),
        Check("tokenizer", header.tokenizer_fingerprint == info.tokenizer_fingerprint,
              f"pack {short_fingerprint(header.tokenizer_fingerprint)}, local {short_fingerprint(info.tokenizer_fingerprint)}"),
    ]
    diff = _layer_diff(header, info)
    checks.append(Check("structure", diff is None, diff or f"{len(info.layers)} layers match the model"))
    n = len(header.token_ids)
    checks.append(vocabulary_check(header.token_ids, info))
    checks.append(Check("context", n < info.max_positions,
                        f"{n} prompt tokens, model context {info.max_positions}"))
    if prompt_ids is not None:
        same = list(header.token_ids) == list(prompt_ids)
        if same:
            detail = f"{n} tokens match the prompt"
        else:
            k = next((i for i, (a, b) in enumerate(zip(header.token_ids, prompt_ids)) if a != b), min(n, len(prompt_ids)))
            detail = f"pack holds {n} tokens, the prompt {len(prompt_ids)}; first difference at token {k}"
        checks.append(Check("prompt", same, detail))
    return checks


def require_identity(header: PackHeader, info: ModelInfo, *, prompt_ids: list[int] | None = None) -> list[Check]:
    """Raise :class:`IdentityMismatch` on the first failed check."""
    checks = identity_checks(header, info, prompt_ids=prompt_ids)
    for c in checks:
        if not c.ok:
            hints = {
                "model": "decode with the model the pack was made for (-m)",
                "tokenizer": "the model folder's tokenizer differs from the producer's",
                "structure": "the pack's attention/RoPE layout does not fit this model",
                "tokens": "the pack's token ids cannot come from this model's tokenizer (corrupt or forged pack)",
                "context": "the prompt is longer than the model's context",
                "prompt": "this pack was made for another prompt",
            }
            raise IdentityMismatch(f"pack refused: {c.name} mismatch: {c.detail}", hint=hints.get(c.name))
    return checks
