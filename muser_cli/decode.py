"""``decode``: verify a pack against the local model, install it, decode; or, with no pack
and a prompt, prefill locally on the same canonical schedule (the fallback).

It reads as four steps: the pack (or none) -> its binding to this model and prompt ->
the rows (the pack's, a delta merged with the stored prefix, the store's, or computed
here) -> the engine's decode. Each step is a function below; the outcome is typed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import BinaryIO, Callable

from muser_cli.engines.base import Engine, Sampling
from muser_cli.engines.registry import get_engine
from muser_cli.errors import MissingInput, UsageError
from muser_cli.identity import require_identity
from muser_cli.kvpack import KVPack, LayerKV, read_pack
from muser_cli.modelinfo import ModelInfo, ProgressFn
from muser_cli.models import resolve_model
from muser_cli.reuse import BaseNotHeld, Store, resolve_delta
from muser_cli.reuse.manifest import check_base
from muser_cli.rows import local_rows
from muser_cli.schedule import build_header, check_prompt, default_dtype
from muser_cli.tokens import decode_text, encode_prompt, tokenizer_for


@dataclass
class Rows:
    """The rows decode installs, and where they came from."""

    layers: list[LayerKV]
    source: str  # handoff | delta | store | store+local | local
    schedule: int | None  # the chunk size they were made on (None: unknown, a foreign pack's)
    pack: KVPack | None  # the pack they came from; None when made here (the fallback)
    held: int = 0  # rows taken from the store
    entry: str | None = None  # the store entry they came from
    computed: int | None = None  # rows computed here after a stored prefix
    problems: list[str] = field(default_factory=list)
    reason: str = ""  # why there was no usable handoff


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
    source: str = "handoff"
    pack_read_s: float = 0.0
    held_tokens: int = 0
    entry: str | None = None
    computed_tokens: int | None = None
    store_problems: list[str] = field(default_factory=list)
    stored: str | None = None
    store_asked: bool = False
    engine_stats: dict = field(default_factory=dict)

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def reuse(self) -> dict:
        """How the store helped: held rows, the entry, rows computed after it ({} if not at all)."""
        if self.source == "delta":
            return {"held_tokens": self.held_tokens, "entry": self.entry}
        if self.source in ("store", "store+local"):
            return {"held_tokens": self.held_tokens, "entry": self.entry, "computed_tokens": self.computed_tokens}
        return {}

    def to_json(self) -> dict:
        out = {
            "text": self.text, "token_ids": self.token_ids, "fallback": self.fallback,
            "reason": self.reason, "load_s": round(self.load_s, 6), "prefill_s": round(self.prefill_s, 6),
            "ttft_s": round(self.ttft_s, 6), "decode_s": round(self.decode_s, 6),
            "decode_tok_s": round(self.decode_tok_s, 3), "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.token_ids), "engine": self.engine, "dtype": self.dtype,
            "pack_read_s": round(self.pack_read_s, 6), "source": self.source, "engine_stats": self.engine_stats,
        }
        if self.reuse:
            out["reuse"] = self.reuse
        if self.store_problems:
            out["store_problems"] = self.store_problems
        if self.store_asked:
            out["stored"] = self.stored
        return out


def read_optional_pack(src: BinaryIO | None) -> KVPack | None:
    """Read a pack, or ``None`` when the input is empty (no handoff arrived)."""
    return read_optional_pack_timed(src)[0]


def read_optional_pack_timed(src: BinaryIO | None) -> tuple[KVPack | None, float]:
    """(pack or None, perf_counter when the first byte arrived or the input ended).

    In a pipe (``receive | verify | decode``) the wait for the first byte is the
    producer's time, not the consumer's: TTFT on this side starts when data arrives.
    """
    if src is None:
        return None, time.perf_counter()
    first = src.read(1)
    t_first = time.perf_counter()
    if not first:
        return None, t_first

    class _Prefixed:
        def __init__(self) -> None:
            self._first = first

        def read(self, n: int = -1) -> bytes:
            if self._first:
                head, self._first = self._first, b""
                return head + (src.read(n - 1) if n and n > 1 else b"")
            return src.read(n)

    return read_pack(_Prefixed()), t_first  # type: ignore[arg-type]


def decode(
    src: BinaryIO | None,
    *,
    model: str | None = None,
    prompt: str | None = None,
    chat: bool = False,
    max_new_tokens: int = 64,
    engine: str = "torch",
    dtype: str | None = None,
    threads: int = 1,
    sampling: Sampling = Sampling(),
    chunk_tokens: int | None = None,
    fallback_reason: str = "",
    reuse: bool = True,
    store: bool = False,
    on_token: Callable[[int], None] | None = None,
    progress: ProgressFn | None = None,
) -> DecodeOutcome:
    """Decode from a kvpack (full, or a delta merged with the stored prefix it names), or,
    with no pack and a prompt, from local state: the store first (``reuse``; a full hit
    needs no prefill at all, a partial hit prefills only the suffix), else a local prefill
    on the canonical schedule. ``chunk_tokens`` None: any stored schedule, else 512.
    ``store``: keep the prompt's whole cache in the store afterwards."""
    if max_new_tokens < 1:
        raise UsageError("-n must be at least 1")
    pack, t_req = read_optional_pack_timed(src)
    t_read = time.perf_counter()
    if pack is None and prompt is None:
        raise MissingInput("no kvpack on input", hint="give a kvpack, or --prompt FILE to prefill locally")

    t_res0 = time.perf_counter()
    info = resolve_model(model)
    tokenizer_for(info)  # loading the tokenizer is part of loading the model
    resolve_s = time.perf_counter() - t_res0
    prompt_ids = encode_prompt(info, prompt, chat=chat) if prompt is not None else None
    ids, dtype = bind(pack, info, prompt_ids, dtype=dtype, engine=engine)
    check_prompt(info, ids, new_tokens=max_new_tokens)

    t_load0 = time.perf_counter()
    eng = get_engine(engine, info, dtype=dtype, threads=threads)
    load_s = time.perf_counter() - t_load0 + resolve_s

    t0 = time.perf_counter()
    got = rows_for(pack, eng, ids, can_fall_back=prompt_ids is not None, dtype=dtype, chunk_tokens=chunk_tokens,
                   reuse=reuse, progress=progress)
    prefill_s = time.perf_counter() - t0
    result = eng.decode(got.layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=max_new_tokens,
                        sampling=sampling, on_token=on_token, chunk_tokens=got.schedule)
    # TTFT: request to first token, model load excluded (reading/verifying the pack included).
    ttft = (t_load0 - t_req) - resolve_s + prefill_s + result.ttft_s
    stored = _store(got, info, ids, dtype=dtype, engine=engine, threads=threads, eng=eng) if store else None
    return DecodeOutcome(
        text=decode_text(info, result.token_ids), token_ids=list(result.token_ids), fallback=got.pack is None,
        load_s=load_s, prefill_s=prefill_s, ttft_s=ttft, decode_s=result.decode_s, prompt_tokens=len(ids),
        engine=engine, dtype=dtype, reason=(got.reason or fallback_reason) if got.pack is None else "",
        source=got.source, pack_read_s=t_read - t_req, held_tokens=got.held, entry=got.entry,
        computed_tokens=got.computed, store_problems=got.problems, stored=stored, store_asked=store,
        engine_stats={k: v for k, v in result.stats.items() if isinstance(v, (str, int, float, bool))},
    )


def bind(pack: KVPack | None, info: ModelInfo, prompt_ids: list[int] | None, *, dtype: str | None,
         engine: str) -> tuple[list[int], str]:
    """The prompt ids and dtype to decode with. A pack's identity is checked before anything
    is loaded or decoded: another model's, tokenizer's or prompt's KV is refused here."""
    if pack is None:
        assert prompt_ids is not None
        return prompt_ids, dtype or default_dtype(engine)
    require_identity(pack.header, info, prompt_ids=prompt_ids)
    if pack.header.rows_start > 0:
        check_base(pack.header)  # a base that disagrees with its own pack: refused before loading
    dtype = dtype or pack.header.dtype
    if pack.header.dtype != dtype:
        raise UsageError(f"pack holds {pack.header.dtype} KV; decoding it as {dtype} is not supported",
                         hint=f"use --dtype {pack.header.dtype}")
    return list(pack.header.token_ids), dtype


def rows_for(pack: KVPack | None, eng: Engine, ids: list[int], *, can_fall_back: bool, dtype: str,
             chunk_tokens: int | None, reuse: bool, progress: ProgressFn | None = None) -> Rows:
    """The rows of ``ids[:-1]``: the pack's; a delta pack merged with the stored prefix it
    names; or, with no pack (or a delta whose base is not held, when ``can_fall_back``),
    made here by :func:`muser_cli.rows.local_rows`."""
    reason = ""
    problems: list[str] = []
    if pack is not None and pack.header.rows_start > 0:
        st = Store()
        try:
            layers, entry = resolve_delta(pack, st)
            return Rows(layers, "delta", pack.header.chunk_tokens, pack, held=pack.header.rows_start, entry=entry,
                        problems=list(st.problems))
        except BaseNotHeld as exc:
            if not can_fall_back:
                raise
            reason, problems = str(exc), list(st.problems)
    elif pack is not None:
        return Rows(pack.layers, "handoff", pack.header.chunk_tokens, pack)
    made = local_rows(eng, ids, dtype=dtype, chunk_tokens=chunk_tokens, reuse=reuse, progress=progress)
    problems += [p for p in made.problems if p not in problems]
    computed = len(ids) - 1 - made.held if made.source != "local" else None
    return Rows(made.layers, made.source, made.chunk_tokens, None, held=made.held, entry=made.entry,
                computed=computed, problems=problems, reason=reason)


def _store(got: Rows, info: ModelInfo, ids: list[int], *, dtype: str, engine: str, threads: int,
           eng: Engine) -> str | None:
    """Keep the prompt's whole cache in the store; None when it is not exact KV (quantized)."""
    if got.pack is not None:
        if got.pack.header.quant_scheme != "none":
            return None
        header = replace(got.pack.header, rows_start=0, base=None)
    else:
        header = build_header(info, ids, dtype=dtype, chunk_tokens=got.schedule or 0, engine=engine,
                              threads=threads, extra=eng.producer_info())
    return Store().put_layers(header, got.layers).entry.id
