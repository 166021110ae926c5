"""Constrained decoding: a grammar each generated token must keep to (structured output,
docs/serve.md). A :class:`Constraint` is a compiled grammar (llguidance's, on the model's own
tokenizer); each sequence takes its own :class:`Matcher` from it, which says before each pick
which tokens may come next (an end-of-sequence token only where the grammar accepts) and is
advanced with each token picked. The engines apply the mask after the penalties and the bias,
before temperature and top-p (:class:`muser_cli.engines.base.Sampling`).

llguidance is imported only when a constraint is built (a request that asks for structured
output); importing this module imports nothing but numpy. ``whitespace``: JSON is written
without free whitespace (``", "`` between items, ``": "`` after a key): a model cannot fill its
tokens with blanks, so an answer that fits in ``max_tokens`` is whole.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from muser_cli.errors import DataError, UsageError

if TYPE_CHECKING:
    import numpy as np

    from muser_cli.model.info import ModelInfo

#: How JSON is written under a constraint (llguidance's ``x-guidance`` options).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_TOKENIZERS: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise UsageError("structured output needs llguidance", hint="pip install 'muser[serve]'") from None
    return llguidance


def grammar_tokenizer(info: ModelInfo) -> Any:
    """llguidance's tokenizer for ``info``'s own (kept per model: building it takes ~0.3 s)."""
    key = (str(info.path), info.tokenizer_fingerprint, info.vocab_size, tuple(info.eos_token_ids))
    with _LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            from muser_cli.model.tokens import tokenizer_for  # lazy: pulls transformers

            hf = tokenizer_for(info)
            backend = getattr(hf, "backend_tokenizer", None)
            if backend is None:
                raise DataError(f"the tokenizer of {info.path} is not a fast tokenizer: no structured output with it")
            n = max(int(info.vocab_size or 0), len(hf))
            tok = _TOKENIZERS[key] = _llguidance().LLTokenizer(backend.to_str(), n_vocab=n,
                                                               eos_token=list(info.eos_token_ids))
        return tok


def _styled(schema: dict[str, Any], lenient: bool = False, flexible: bool = False) -> dict[str, Any]:
    """``schema`` with the JSON style (``flexible``: free whitespace, llguidance's default);
    ``lenient``: a keyword llguidance does not implement is left out (the rest still constrains)
    instead of failing the grammar."""
    style = {"whitespace_flexible": True} if flexible else JSON_STYLE
    return {**schema, "x-guidance": {**style, "lenient": lenient}}


def _literal(text: str) -> str:
    """A Lark string literal of ``text`` (JSON's escapes)."""
    return json.dumps(text)


@dataclass(frozen=True)
class Constraint:
    """A compiled grammar (llguidance's JSON form) on one tokenizer; :meth:`matcher` gives a
    sequence its own state."""

    grammar: str
    tokenizer: Any

    def matcher(self) -> Matcher:
        return Matcher(self)


class Matcher:
    """One sequence's place in a :class:`Constraint`: :meth:`allowed` before each pick,
    :meth:`advance` with the token picked."""

    def __init__(self, constraint: Constraint) -> None:
        import numpy as np

        ll = _llguidance()
        self._np = np
        self._m = ll.LLMatcher(constraint.tokenizer, constraint.grammar, log_level=0)
        if self._m.is_error():
            raise UsageError(f"the grammar does not compile: {self._m.get_error()}")
        words = (constraint.tokenizer.vocab_size + 31) // 32
        self._mask = np.zeros((1, words), dtype=np.int32)
        from llguidance.numpy import fill_next_token_bitmask

        self._fill = fill_next_token_bitmask

    def allowed(self, width: int) -> np.ndarray:
        """A bool array of ``width`` (the logits'): the tokens that may come next."""
        np = self._np
        self._fill(self._m, self._mask, 0)
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little").astype(bool)
        if self._m.is_error():
            raise DataError(f"constrained decoding: {self._m.get_error()}")
        if bits.size < width:
            bits = np.concatenate([bits, np.zeros(width - bits.size, dtype=bool)])
        bits = bits[:width]
        if not bits.any():
            raise DataError("constrained decoding: the grammar allows no token here")
        return bits

    def advance(self, token: int) -> None:
        if self._m.is_stopped():  # the grammar ended (an end token taken): a step picked ahead is moot
            return
        if not self._m.consume_token(int(token)):
            raise DataError(f"constrained decoding: token {int(token)} is not allowed here ({self._m.get_error()})")

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())


def schema_problem(schema: dict[str, Any], lenient: bool = False) -> str | None:
    """Why llguidance cannot compile ``schema`` (a keyword it does not implement, unless
    ``lenient``; a bad ``$ref``), or None. Needs no tokenizer."""
    ll = _llguidance()
    try:
        grammar = ll.LLMatcher.grammar_from_json_schema(_styled(schema, lenient))
    except (ValueError, TypeError) as exc:
        return str(exc)
    error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if error else None


def json_constraint(info: ModelInfo, schema: dict[str, Any] | None = None, lenient: bool = False) -> Constraint:
    """The answer is one JSON value by ``schema`` (None: any JSON object), then the end."""
    ll = _llguidance()
    grammar = ll.LLMatcher.grammar_from_json_schema(_styled(schema if schema is not None else {"type": "object"},
                                                            lenient))
    return _checked(grammar, grammar_tokenizer(info))


def tool_constraint(info: ModelInfo, calls: Sequence[tuple[str, dict[str, Any]]], closing: str, *,
                    between: str | None = None, whole: Sequence[dict[str, Any]] = (), tail: str = "",
                    tail_needed: bool = False, lenient: bool = True) -> Constraint:
    """The answer goes on from a forced call opening: one of ``calls`` (text, then a JSON object by
    its schema: the arguments), then ``closing`` (what closes the call's JSON); then, where
    ``between`` is given (parallel calls), any number of further calls, each ``between`` and a
    whole call's JSON by one of the schemas ``whole``; then ``tail`` (optional unless
    ``tail_needed``: the format's closing tag), then the end. One call (no ``between``): after its
    tail any text may follow (a model's token can run past the call: the caller reads only the
    call, as :class:`muser_cli.service.tools.ToolStream` does with one call asked for). A call's
    JSON takes free whitespace
    (models write their templates' style); ``lenient`` (the default: a tool's schema is not
    refused for it): a keyword llguidance does not implement is left out of the grammar."""
    parallel = between is not None and bool(whole)
    seq = f"first ({_literal(between)} more)*" if parallel else "first"
    if tail:  # one call: after its closing tag the text is free (the server reads no further)
        after = "tail" if parallel else "tail free?"
        seq += f" {after}" if tail_needed else f" ({after})?"
    elif not parallel:
        seq += " free?"
    lines = [f"start: {seq}", "first: " + " | ".join(f"c{i}" for i in range(len(calls))),
             "free: /(?s:.+)/"]
    for i, (text, schema) in enumerate(calls):
        head = f"{_literal(text)} " if text else ""
        lines.append(f"c{i}: {head}a{i} {_literal(closing)}" if closing else f"c{i}: {head}a{i}")
        lines.append(f"a{i}: %json {json.dumps(_styled(schema, lenient, flexible=True))}")
    if between is not None and whole:
        lines.append(f"more: %json {json.dumps(_styled({'anyOf': list(whole)}, lenient, flexible=True))}")
    if tail:
        lines.append(f"tail: {_literal(tail)}")
    ll = _llguidance()
    return _checked(ll.LLMatcher.grammar_from_lark("\n".join(lines) + "\n"), grammar_tokenizer(info))


def _checked(grammar: str, tokenizer: Any) -> Constraint:
    ll = _llguidance()
    error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if error:
        raise UsageError(f"the grammar does not compile: {messages[0]}")
    return Constraint(grammar, tokenizer)


__all__ = [
    "JSON_STYLE",
    "Constraint",
    "Matcher",
    "grammar_tokenizer",
    "json_constraint",
    "schema_problem",
    "tool_constraint",
]
