"""What one decode gives back (:class:`DecodeOutcome`: its tokens, where its rows came from,
its timings and checks) and the further sequences a request may decode from the same rows
(:class:`Extra`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from muser_cli.about import STARTED_UNIX
from muser_cli.consumer.source import RowsFrom
from muser_cli.engines.base import Sampling


@dataclass(eq=False)
class Extra:
    """One more sequence decoded from the same rows (``decode(more=...)``: a request's choices
    after the first): its own sampling and token callback; decode fills ``result`` or ``error``."""

    sampling: Sampling
    on_token: Callable[[int], None] | None = None
    result: Any = None  # the engine's DecodeResult
    error: BaseException | None = None


@dataclass
class DecodeOutcome:
    text: str
    token_ids: list[int]
    fallback: bool
    load_s: float
    prefill_s: float
    ttft_s: float
    decode_s: float
    prompt_tokens: int
    engine: str
    dtype: str
    reason: str = ""
    source: RowsFrom = RowsFrom.HANDOFF
    pack_read_s: float = 0.0
    held_tokens: int = 0
    entry: str | None = None
    computed_tokens: int | None = None
    store_problems: list[str] = field(default_factory=list)
    stored: str | None = None
    store_asked: bool = False
    engine_stats: dict = field(default_factory=dict)
    handoff_rows: int | None = None  # a cut stream: verified rows kept
    local_rows: int | None = None  # a cut stream: rows prefilled here
    first_byte_s: float | None = None  # since muser started: the first input byte
    last_frame_s: float | None = None  # since muser started: the last data frame verified
    tail_s: float | None = None  # the last frame's arrival -> the first token
    spot_check: dict | None = None  # the numeric gate on a foreign pack (None: no pack)
    first_token_s: float | None = None  # since muser started: the first new token
    set_aside: str = ""  # why a pack that did not match was set aside for a local prefill ("": none was)

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def reuse(self) -> dict:
        """How the store helped: held rows, the entry, rows computed after it ({} if not at all)."""
        if self.source == RowsFrom.DELTA:
            return {"held_tokens": self.held_tokens, "entry": self.entry}
        if self.source in (RowsFrom.STORE, RowsFrom.STORE_LOCAL):
            return {"held_tokens": self.held_tokens, "entry": self.entry, "computed_tokens": self.computed_tokens}
        if self.source == RowsFrom.HELD:
            return {"held_tokens": self.held_tokens, "computed_tokens": self.computed_tokens}
        return {}

    def to_json(self) -> dict:
        out = {
            "text": self.text, "token_ids": self.token_ids, "fallback": self.fallback,
            "reason": self.reason, "load_s": round(self.load_s, 6), "prefill_s": round(self.prefill_s, 6),
            "ttft_s": round(self.ttft_s, 6), "decode_s": round(self.decode_s, 6),
            "decode_tok_s": round(self.decode_tok_s, 3), "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.token_ids), "engine": self.engine, "dtype": self.dtype,
            "pack_read_s": round(self.pack_read_s, 6), "source": str(self.source), "engine_stats": self.engine_stats,
            "fallback_reason": self.reason if self.fallback else None,
        }
        if self.reuse:
            out["reuse"] = self.reuse
        if self.store_problems:
            out["store_problems"] = self.store_problems
        if self.store_asked:
            out["stored"] = self.stored
        if self.handoff_rows is not None:
            out["handoff_rows"], out["local_rows"] = self.handoff_rows, self.local_rows
        out["started_unix"] = round(STARTED_UNIX, 6)
        if self.spot_check is not None:
            out["spot_check"] = self.spot_check
        for key in ("first_byte_s", "last_frame_s", "tail_s", "first_token_s"):
            value = getattr(self, key)
            out[key] = round(value, 6) if value is not None else None
        return out


__all__ = ["DecodeOutcome", "Extra"]
