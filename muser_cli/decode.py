"""``decode``: verify a pack against the local model, install it, decode; or, with no pack
and a prompt, prefill locally on the same canonical schedule (the fallback)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import BinaryIO, Callable

from muser_cli.engines.base import DEFAULT_CHUNK_TOKENS, ProgressFn, Sampling
from muser_cli.errors import MissingInput, UsageError
from muser_cli.identity import require_identity
from muser_cli.kvpack import KVPack, read_pack


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
    stats: dict = field(default_factory=dict)

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "text": self.text, "token_ids": self.token_ids, "fallback": self.fallback,
            "reason": self.reason, "load_s": round(self.load_s, 6), "prefill_s": round(self.prefill_s, 6),
            "ttft_s": round(self.ttft_s, 6), "decode_s": round(self.decode_s, 6),
            "decode_tok_s": round(self.decode_tok_s, 3), "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.token_ids), "engine": self.engine, "dtype": self.dtype, **self.stats,
        }


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
    from muser_cli.engines.base import get_engine
    from muser_cli.models import resolve_model
    from muser_cli.prefill import DEFAULT_DTYPE, check_prompt
    from muser_cli.tokens import decode_text, encode_prompt

    if max_new_tokens < 1:
        raise UsageError("-n must be at least 1")
    pack, t_req = read_optional_pack_timed(src)
    t_read = time.perf_counter()
    if pack is None and prompt is None:
        raise MissingInput("no kvpack on input", hint="give a kvpack, or --prompt FILE to prefill locally")

    t_res0 = time.perf_counter()
    info = resolve_model(model)
    from muser_cli.tokens import tokenizer_for

    tokenizer_for(info)  # loading the tokenizer is part of loading the model
    resolve_s = time.perf_counter() - t_res0
    prompt_ids = encode_prompt(info, prompt, chat=chat) if prompt is not None else None
    if pack is not None:
        # Identity before anything is loaded or decoded: refuse another model's or prompt's KV.
        require_identity(pack.header, info, prompt_ids=prompt_ids)
        if pack.header.rows_start > 0:
            from muser_cli.reuse.manifest import check_base

            check_base(pack.header)  # a base that disagrees with its own pack: refused before loading
        ids = list(pack.header.token_ids)
        dtype = dtype or pack.header.dtype
        if pack.header.dtype != dtype:
            raise UsageError(f"pack holds {pack.header.dtype} KV; decoding it as {dtype} is not supported",
                             hint=f"use --dtype {pack.header.dtype}")
    else:
        assert prompt_ids is not None
        ids = prompt_ids
        dtype = dtype or DEFAULT_DTYPE.get(engine, "float32")
    check_prompt(info, ids, new_tokens=max_new_tokens)

    t_load0 = time.perf_counter()
    eng = get_engine(engine, info, dtype=dtype, threads=threads)
    load_s = time.perf_counter() - t_load0 + resolve_s

    t0 = time.perf_counter()
    rows = len(ids) - 1
    reuse_stats: dict = {}
    problems: list[str] = []
    st = None
    layers = None
    chunk = 0
    source = "handoff"
    if pack is not None and pack.header.rows_start > 0:
        from muser_cli.reuse import BaseNotHeld, Store, resolve_delta

        st = Store()
        try:
            layers, entry = resolve_delta(pack, st)
            source = "delta"
            reuse_stats = {"held_tokens": pack.header.rows_start, "entry": entry}
        except BaseNotHeld as exc:
            if prompt_ids is None:
                raise
            fallback_reason = str(exc)
            pack = None
        problems += st.problems
    elif pack is not None:
        layers = pack.layers
    if pack is None:
        source = "local"
        chunk = chunk_tokens or DEFAULT_CHUNK_TOKENS
        resume = None
        if reuse:
            from muser_cli.reuse import Store, find_resume

            st = st or Store()
            resume = find_resume(st, info.fingerprint, info.tokenizer_fingerprint, ids, dtype=dtype,
                                 chunk_tokens=chunk_tokens)
            problems += [p for p in st.problems if p not in problems]
            if resume is not None and resume.held < rows and not hasattr(eng, "prefill_from"):
                resume = None  # this engine cannot continue a prefill: only a full hit helps
        if resume is not None:
            chunk = resume.scope.chunk_tokens
            reuse_stats = {"held_tokens": resume.held, "entry": resume.entry, "computed_tokens": rows - resume.held}
            if resume.held == rows:
                layers, source = resume.layers, "store"
            else:
                layers = eng.prefill_from(resume.layers, rows=resume.held, token_ids=ids[resume.held : -1],  # type: ignore[attr-defined]
                                          chunk_tokens=chunk, progress=progress)
                source = "store+local"
        else:
            layers = eng.prefill(ids[:-1], chunk_tokens=chunk, progress=progress)
    prefill_s = time.perf_counter() - t0
    schedule = pack.header.chunk_tokens if pack is not None else (chunk or None)
    result = eng.decode(layers, rows=rows, next_tokens=[ids[-1]], max_new_tokens=max_new_tokens,
                        sampling=sampling, on_token=on_token, chunk_tokens=schedule)
    # TTFT: request to first token, model load excluded (reading/verifying the pack included).
    ttft = (t_load0 - t_req) - resolve_s + prefill_s + result.ttft_s
    stats = {"pack_read_s": round(t_read - t_req, 6), "source": source,
             "engine_stats": {k: v for k, v in result.stats.items() if isinstance(v, (str, int, float, bool))}}
    if reuse_stats:
        stats["reuse"] = reuse_stats
    if problems:
        stats["store_problems"] = problems
    if store:
        stats["stored"] = _store(layers, pack, info, ids, dtype=dtype, chunk=chunk,
                                 engine=engine, threads=threads, eng=eng)
    return DecodeOutcome(
        text=decode_text(info, result.token_ids), token_ids=list(result.token_ids), fallback=pack is None,
        load_s=load_s, prefill_s=prefill_s, ttft_s=ttft, decode_s=result.decode_s, prompt_tokens=len(ids),
        engine=engine, dtype=dtype, reason=fallback_reason if pack is None else "", stats=stats,
    )


def _store(layers, pack: KVPack | None, info, ids, *, dtype: str, chunk: int, engine: str, threads: int, eng) -> str | None:
    """Keep the prompt's whole cache in the store; None when it is not exact KV (quantized)."""
    from dataclasses import replace

    from muser_cli.prefill import build_header
    from muser_cli.reuse import Store

    if pack is not None:
        if pack.header.quant_scheme != "none":
            return None
        header = replace(pack.header, rows_start=0, base=None)
    else:
        header = build_header(info, ids, dtype=dtype, chunk_tokens=chunk, engine=engine, threads=threads,
                              extra=getattr(eng, "producer_info", lambda: {})())
    return Store().put_layers(header, layers).entry.id
