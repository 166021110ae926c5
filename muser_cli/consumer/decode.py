"""``decode``: verify a pack against the local model, install it, decode; or, with no pack
and a prompt, prefill locally on the same canonical schedule (the fallback).

It reads as four steps: the pack (or none) -> its binding to this model and prompt ->
the rows (the pack's, a delta merged with the stored prefix, the store's, or computed
here) -> the engine's decode. Each step is a function below; the checks on a pack's rows
(set aside, the numeric gate, a cut stream's kept rows) are :mod:`muser_cli.consumer.checks`'s,
the typed outcome :mod:`muser_cli.consumer.outcome`'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Sequence

from muser_cli.about import STARTED_AT
from muser_cli.consumer.hedge import header_or_broken, race, ready_or_broken
from muser_cli.consumer.checks import after_cut, check_pack_rows, keep_verified, set_aside
from muser_cli.consumer.memory import Held
from muser_cli.consumer.outcome import DecodeOutcome, Extra
from muser_cli.consumer.prompt_rows import Rows, bind, rows_for, store_rows
from muser_cli.engines.base import Engine, Sampling
from muser_cli.engines.registry import get_consumer
from muser_cli.engines.sequence import run_together
from muser_cli.errors import DataError, KVPackError, MissingInput, MuserError, SpotCheckFailed, UsageError
from muser_cli.gate.audit import SpotGate
from muser_cli.gate.sampled import DEFAULT_SAMPLE_POSITIONS
from muser_cli.kvpack import PackHeader
from muser_cli.kvpack.stream import Cut, StreamedPack
from muser_cli.model.info import ModelInfo, ProgressFn
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tokens import decode_text, encode_prompt, tokenizer_for
from muser_cli.consumer.source import RowsFrom
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS, check_prompt


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
    audit: int | None = None,
    resident: Engine | None = None,
    on_rows: Callable[[Rows], None] | None = None,
    strict: bool = False,
    audit_seed: int | None = None,
    prompt_ids: list[int] | None = None,
    info: ModelInfo | None = None,
    held: Held | None = None,
    more: Sequence[Extra] = (),
    hedge: Any = None,
) -> DecodeOutcome:
    """Decode from a kvpack (full, or a delta merged with the stored prefix it names), or,
    with no pack and a prompt, from local state: the store first (``reuse``; a full hit
    needs no prefill at all, a partial hit prefills only the suffix), else a local prefill
    on the canonical schedule. ``chunk_tokens`` None: any stored schedule, else 512.
    ``store``: keep the prompt's whole cache in the store afterwards.

    ``prompt_ids`` and ``info``: the prompt already tokenized for this model (a service or a
    batch tokenizes each request once, and passes the ids and the loaded model's facts); else
    ``prompt`` is tokenized here for ``model``.

    ``held``: with no pack, rows of a prefix of the prompt a server's turn memory holds
    (:class:`muser_cli.consumer.memory.Held`): the rest is computed from them, its chunks
    starting there (source ``held``; not the canonical schedule, so never stored).

    ``more``: sequences decoded from the same rows besides this one (:class:`Extra`): the rows
    are installed once and the first step computed once (never adopted), then each extra forks
    from it (its own copy of the cache, its own sampling: ``Consumer.fork``) and runs on a
    thread of its own beside this one's (an engine that batches decode steps steps them
    together); a gate on the rows runs before that first step (not fused into it).

    ``audit``: a pack made by another engine, in another dtype, quantized or with an
    unknown codec gets a numeric spot-check before its first token (its last position
    recomputed here from its own prefix, inside the first decode step where every layer
    holds that prefix: :class:`muser_cli.gate.audit.SpotGate`; else as a step of its own,
    :func:`muser_cli.gate.audit.spot_check`). None: that
    default (1 position, only when needed); N > 0: N positions, always; 0: skipped (said
    so in the outcome).

    ``resident``: an engine already loaded (``muser batch``: one model load for many
    prompts); it must be ``engine``'s, for the same model, in the dtype decoded.
    ``on_rows``: called once the rows are final (verified and spot-checked), before the
    first token is decoded (``store`` keeps them after the last).

    Besides that last-position check, the gate recomputes :data:`DEFAULT_SAMPLE_POSITIONS`
    positions drawn across the whole prompt in every layer (:func:`muser_cli.gate.sampled.sample_check`,
    ``audit_seed``; None: an unpredictable seed, reported), wherever foreign rows enter: a
    whole pack, a delta merged with its base, a cut stream's kept chunks, a store entry.

    A pack that does not match (another prompt, model or tokenizer, damaged, or refused by
    the gate) with a prompt given is set aside: the tokens come from local rows and
    ``set_aside`` says why. ``strict``: refuse it instead (65). Without a prompt it is refused.

    ``hedge``: the pull streaming into ``src`` races a computation here once its producer broke
    its promise (:class:`muser_cli.consumer.pull.PipePull` made with ``race``: its ``broken``
    event, ``broken_why`` and ``cancel``); whichever is ready first is kept
    (:mod:`muser_cli.consumer.hedge`).

    Four steps: :func:`_set_up` (the model, the pack's binding, the engine), :func:`_rows_ready`
    (the rows: the pack's, the store's or made here, through the gate), :func:`_generate` (the
    tokens), :func:`_outcome`."""
    _check_args(max_new_tokens, audit, sampling)
    t_begin = time.perf_counter()
    # The pack is read and verified on a thread from the first byte on, while the model loads.
    # Each full layer's rows land in an array with room for every new token: the engine's
    # cache adopts it (no copy at install, none per token).
    spare = max(max_new_tokens + 1, DEFAULT_SAMPLE_POSITIONS)  # room for the gate's rows, then decode's
    stream = StreamedPack(src, spare_rows=spare) if src is not None else None
    run = _Run(stream=stream, t_begin=t_begin, max_new_tokens=max_new_tokens, engine=engine, threads=threads,
               chunk_tokens=chunk_tokens, reuse=reuse, progress=progress, audit=audit, strict=strict,
               audit_seed=audit_seed, on_rows=on_rows, held=held, more=list(more),
               hedge=hedge if stream is not None else None)
    _set_up(run, model=model, prompt=prompt, chat=chat, dtype=dtype, resident=resident, prompt_ids=prompt_ids,
            info=info)
    _rows_ready(run)
    result = _generate(run, sampling=sampling, on_token=on_token)
    if stream is not None and run.got.pack is not None:
        stream.confirm_end()  # bytes after the end frame: refused before anything is kept or returned
    stored = None
    if store and run.got.source != RowsFrom.HELD:  # the store keeps canonical rows only (docs/reuse.md)
        try:
            stored = store_rows(run.got, run.info, run.ids, dtype=run.dtype, engine=engine, threads=threads, eng=run.eng,
                            spot=run.spot)
        except (MuserError, OSError) as exc:  # the store is a cache: failing to keep the answer is not failing it
            run.got.problems.append(f"not stored: {exc}")
    return _outcome(run, result, stored=stored, store_asked=store, fallback_reason=fallback_reason)


@dataclass
class _Run:
    """One decode as it goes through its steps: what it was asked, and what each step found."""

    stream: StreamedPack | None
    t_begin: float
    max_new_tokens: int
    engine: str
    threads: int
    chunk_tokens: int | None
    reuse: bool
    progress: ProgressFn | None
    audit: int | None
    strict: bool
    audit_seed: int | None
    on_rows: Callable[[Rows], None] | None
    held: Held | None = None
    more: list[Extra] = field(default_factory=list)
    hedge: Any = None  # a pull that may be raced (decode's ``hedge``)
    racing: bool = False  # its promise broke before its header came
    # _set_up
    info: ModelInfo | None = None
    ids: list[int] = field(default_factory=list)
    dtype: str = ""
    eng: Engine | None = None
    header: PackHeader | None = None
    has_prompt: bool = False  # a prompt to prefill: a pack may fall back to local rows
    may_set_aside: bool = False  # ... and is not --strict: a pack that fails a check is set aside
    aside: str = ""
    load: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))
    # _rows_ready
    got: Rows | None = None
    spot: dict | None = None
    gate: SpotGate | None = None
    sampled: dict | None = None
    prefill_s: float = 0.0
    # _generate
    t_dec: float = 0.0

    @property
    def load_s(self) -> float:
        (res0, res1), (load0, load1) = self.load
        return (load1 - load0) + (res1 - res0)


def _check_args(max_new_tokens: int, audit: int | None, sampling: Sampling) -> None:
    if max_new_tokens < 1:
        raise UsageError("-n must be at least 1")
    if audit is not None and audit < 0:
        raise UsageError("--audit must be >= 0")
    if not sampling.temperature >= 0 or not 0 < sampling.top_p <= 1:
        raise UsageError(f"--temperature must be >= 0 and --top-p in (0, 1] (got {sampling.temperature}, "
                         f"{sampling.top_p})")


def _set_up(run: _Run, *, model: str | None, prompt: str | None, chat: bool, dtype: str | None,
            resident: Engine | None, prompt_ids: list[int] | None, info: ModelInfo | None) -> None:
    """The model and the prompt's ids (tokenized here unless given), the pack's header and its
    binding to them (a mismatch set aside or refused), the engine (loaded while the pack still
    arrives when the dtype is known)."""
    t_res0 = time.perf_counter()
    info = info or resolve_model(model)
    tokenizer_for(info)  # loading the tokenizer is part of loading the model
    if prompt_ids is None and prompt is not None:
        prompt_ids = encode_prompt(info, prompt, chat=chat)
    t_res1 = time.perf_counter()
    eng, t_load0, t_load1 = resident, 0.0, 0.0
    if eng is not None and eng.info.fingerprint != info.fingerprint:
        raise UsageError("the resident engine holds another model than the one asked for")
    if eng is None and dtype is not None:  # the engine needs no header: load it while the producer still works
        t_load0 = time.perf_counter()
        eng = get_consumer(run.engine, info, dtype=dtype, threads=run.threads)
        t_load1 = time.perf_counter()
    run.has_prompt = prompt_ids is not None
    run.may_set_aside = run.has_prompt and not run.strict
    header = None
    try:
        if run.stream is not None and run.hedge is not None and run.has_prompt \
                and not header_or_broken(run.stream, run.hedge.broken):
            run.racing = True  # no header by the promise: computed here, the stream raced (_race)
        elif run.stream is not None:
            header = run.stream.header()
    except KVPackError as exc:
        run.aside = set_aside(exc, run.may_set_aside)
    if header is None and prompt_ids is None:
        raise MissingInput("no kvpack on input", hint="give a kvpack, or --prompt FILE to prefill locally")
    try:
        ids, dtype = bind(header, info, prompt_ids, dtype=dtype, engine=run.engine)
    except DataError as exc:  # another prompt, model or tokenizer; a base that disagrees with its delta
        header, run.aside = None, set_aside(exc, run.may_set_aside)
        ids, dtype = bind(None, info, prompt_ids, dtype=dtype, engine=run.engine)
    check_prompt(info, ids, new_tokens=run.max_new_tokens)
    if eng is None:
        t_load0 = time.perf_counter()
        eng = get_consumer(run.engine, info, dtype=dtype, threads=run.threads)
        t_load1 = time.perf_counter()
    elif resident is not None:
        t_load0 = t_load1 = time.perf_counter()
        if eng.dtype != dtype:
            raise UsageError(f"the resident engine decodes {eng.dtype}; this input needs {dtype}",
                             hint=f"use --dtype {dtype}")
    run.info, run.ids, run.dtype, run.eng, run.header = info, ids, dtype, eng, header
    run.load = ((t_res0, t_res1), (t_load0, t_load1))


def _local(run: _Run, why: str) -> Rows:
    """The prompt's rows made on this machine (the store's prefix, then a prefill)."""
    made = rows_for(None, run.eng, run.ids, can_fall_back=True, dtype=run.dtype, chunk_tokens=run.chunk_tokens,
                    reuse=run.reuse, progress=run.progress, spare_rows=run.max_new_tokens + 1)
    made.reason = why
    return made


def _held(run: _Run) -> Rows:
    """The prompt's rows from a turn memory's prefix: the rest computed here, its chunks
    starting at the held point (a schedule break: ``anywhere``)."""
    held, ids = run.held, run.ids
    assert held is not None and run.eng is not None
    rows, chunk = len(ids) - 1, run.chunk_tokens or DEFAULT_CHUNK_TOKENS
    if held.rows > rows:
        raise DataError(f"turn memory gave {held.rows} rows for a prompt of {rows}")
    layers = held.layers
    if held.rows < rows:
        layers = run.eng.prefill_from(held.layers, rows=held.rows, token_ids=ids[held.rows:-1], chunk_tokens=chunk,
                                      progress=run.progress, anywhere=True)
    return Rows(list(layers), RowsFrom.HELD, chunk, None, held=held.rows, computed=rows - held.rows)


def _rows_ready(run: _Run) -> None:
    """The rows decode installs, through the gate: the pack's (whole, a delta merged with its
    base, or a cut stream's kept chunks and the rest made here), the store's, or made here; a
    pack that fails a check set aside for local rows (or refused: :func:`muser_cli.consumer.checks.set_aside`)."""
    eng, stream, got, pack = run.eng, run.stream, None, None
    if run.header is not None or run.racing:
        assert stream is not None
        if not stream.finished:
            eng.warm_up()  # the rest is still arriving: pay the first-call costs now, not after
        if run.hedge is not None and run.has_prompt and (run.racing or not ready_or_broken(stream, run.hedge.broken)):
            got = _race(run)  # None: the stream won, whole
        try:
            arrived = stream.result() if got is None else None
        except KVPackError as exc:  # a damaged frame: nothing of it is used
            arrived, run.aside = None, set_aside(exc, run.may_set_aside)
        if isinstance(arrived, Cut):
            got = after_cut(stream, arrived, eng, run.ids, can_fall_back=run.has_prompt, progress=run.progress,
                             dtype=run.dtype, audit=run.audit, strict=run.strict, seed=run.audit_seed)
        elif arrived is not None:
            pack = arrived
    t0 = time.perf_counter()
    if got is None and run.aside:
        got = _local(run, run.aside)
    if got is None and pack is None and run.held is not None and run.held.rows > 0:
        got = _held(run)
    if got is None:
        got = rows_for(pack, eng, run.ids, can_fall_back=run.has_prompt, dtype=run.dtype,
                       chunk_tokens=run.chunk_tokens, reuse=run.reuse, progress=run.progress,
                       spare_rows=run.max_new_tokens + 1)
    on_rows = run.on_rows
    try:
        spot, gate, sampled = check_pack_rows(got, eng, engine=run.engine, dtype=run.dtype, audit=run.audit,
                                          seed=run.audit_seed, fuse=not run.more,
                                          on_pass=(lambda: on_rows(got)) if on_rows is not None else None)
    except SpotCheckFailed as exc:
        run.aside = set_aside(exc, run.may_set_aside)
        got, spot, gate, sampled = _local(run, run.aside), None, None, None
    run.got, run.gate, run.sampled = got, gate, sampled
    run.spot = spot if spot is not None else got.spot
    run.prefill_s = time.perf_counter() - t0 + got.cut_prefill_s
    if on_rows is not None and gate is None:
        on_rows(got)


def _generate(run: _Run, *, sampling: Sampling, on_token: Callable[[int], None] | None) -> Any:
    """The tokens: the engine installs the rows and decodes (the gate fused into its first step
    where it can be; refused there, the rows are made here and decoding starts over, before any
    token was given out)."""
    got, gate, eng, ids = run.got, run.gate, run.eng, run.ids
    run.t_dec = time.perf_counter()
    layers, rows, first_feed = got.layers, len(ids) - 1, [ids[-1]]
    if gate is not None:  # the spot-check rides in the first step: its positions are fed again
        layers, rows, first_feed = gate.prefix, gate.start, gate.token_ids + [ids[-1]]
    if run.more:  # several sequences from one first step: it adopts nothing (no gate is fused: _rows_ready)
        return _several(run, sampling=sampling, on_token=on_token)
    try:
        result = eng.decode(layers, rows=rows, next_tokens=first_feed, max_new_tokens=run.max_new_tokens,
                            sampling=sampling, on_token=on_token, chunk_tokens=got.schedule,
                            adopt=(got.source == RowsFrom.HANDOFF and run.stream is not None) or got.source == RowsFrom.STORE,
                            check_first=gate)
    except SpotCheckFailed as exc:  # the fused check refused the rows before any token was picked
        if gate is None:
            raise
        run.aside = set_aside(exc, run.may_set_aside)
        got = run.got = _local(run, run.aside)
        run.spot, run.gate, run.sampled, gate = None, None, None, None
        if run.on_rows is not None:
            run.on_rows(got)
        result = eng.decode(got.layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=run.max_new_tokens,
                            sampling=sampling, on_token=on_token, chunk_tokens=got.schedule,
                            adopt=got.source == RowsFrom.STORE)
    if gate is not None:
        gate.restore(got.layers)  # an adopting engine wrote its recomputation over the pack's last rows
        if gate.result is None:  # every engine calls it after its first step; one that did not checked nothing
            raise DataError(f"the {run.engine} engine decoded without running the spot-check",
                            hint="decode with --no-audit to skip it knowingly")
        run.spot = gate.result.to_json()
    if run.spot is not None and run.sampled is not None:
        run.spot["sampled"] = run.sampled
    return result


def _several(run: _Run, *, sampling: Sampling, on_token: Callable[[int], None] | None) -> Any:
    """This sequence and ``run.more``'s from one install of the rows and one first step: the
    sequence opened once, forked for each extra (its own copy of the cache, its own sampling),
    then all run at once, the extra ones on threads of their own (stepping together where the
    engine's batched decode is on); this one's result returned (or its exception raised) once
    all ended."""
    got, eng, ids = run.got, run.eng, run.ids
    seq = eng.open(got.layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=run.max_new_tokens,
                   sampling=sampling, chunk_tokens=got.schedule)
    forks = eng.fork(seq, [extra.sampling for extra in run.more])
    results = run_together(eng, [seq, *forks], [on_token, *(extra.on_token for extra in run.more)])
    for extra, result in zip(run.more, results[1:]):
        if isinstance(result, BaseException):
            extra.error = result
        else:
            extra.result = result
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]


def _outcome(run: _Run, result: Any, *, stored: str | None, store_asked: bool, fallback_reason: str) -> DecodeOutcome:
    """What decode returns: the text and tokens, where the rows came from, and the timings."""
    got, stream, ids = run.got, run.stream, run.ids
    t_first_token = run.t_dec + result.ttft_s
    # TTFT: from the first input byte (or the start, with none) to the first token, model
    # load excluded: the load overlapped the read, so its overlap with that span is taken out.
    t_req = stream.first_byte_t if stream is not None and stream.first_byte_t is not None else run.t_begin
    overlap = sum(max(0.0, min(b, t_first_token) - max(a, t_req)) for a, b in run.load)
    t_read = stream.end_t if stream is not None and stream.end_t is not None else t_req
    return DecodeOutcome(
        text=decode_text(run.info, result.token_ids), token_ids=list(result.token_ids), fallback=got.pack is None,
        load_s=run.load_s, prefill_s=run.prefill_s, ttft_s=t_first_token - t_req - overlap,
        decode_s=result.decode_s, prompt_tokens=len(ids), engine=run.engine, dtype=run.dtype,
        reason=(got.reason or fallback_reason) if got.pack is None else "",
        source=got.source, pack_read_s=max(0.0, t_read - t_req), held_tokens=got.held, entry=got.entry,
        computed_tokens=got.computed, store_problems=got.problems, stored=stored, store_asked=store_asked,
        engine_stats={k: v for k, v in result.stats.items() if isinstance(v, (str, int, float, bool))},
        handoff_rows=got.handoff_rows, local_rows=got.local_rows,
        first_byte_s=_since_start(stream.first_byte_t if stream is not None else None),
        last_frame_s=_since_start(stream.last_frame_t if stream is not None else None),
        tail_s=(t_first_token - stream.last_frame_t) if stream is not None and stream.last_frame_t is not None
        and got.pack is not None else None,
        first_token_s=_since_start(t_first_token), spot_check=run.spot, set_aside=run.aside,
    )


def _since_start(t: float | None) -> float | None:
    return None if t is None else round(t - STARTED_AT, 6)


def _race(run: _Run) -> Rows | None:
    """The prompt computed here while the stream of a producer that broke its promise keeps
    coming (:func:`muser_cli.consumer.hedge.race`): the rows of whichever was ready first. None:
    the stream's pack came whole first (bound to this prompt: ``run.header`` is set)."""
    stream, eng, hedge, ids = run.stream, run.eng, run.hedge, run.ids
    assert stream is not None and eng is not None
    schedule = run.header.chunk_tokens if run.header is not None else run.chunk_tokens or DEFAULT_CHUNK_TOKENS
    bound: list[PackHeader | None] = [run.header]  # the stream's header, once it came and bound this prompt
    refused: list[str] = []

    def usable() -> bool:
        if bound[0] is None and not refused and stream.wait_header(0):
            try:
                header = stream.header()
                if header is not None and header.chunk_tokens == schedule:
                    bind(header, run.info, ids, dtype=run.dtype, engine=run.engine)
                    bound[0] = header
            except MuserError as exc:  # another prompt, dtype, schedule: the stream is not raced
                refused.append(str(exc))
        return bound[0] is not None and not refused

    def keep(kept: int, prefix: list) -> tuple[int, list, Any]:
        kept, prefix, spot, aside = keep_verified(bound[0], kept, prefix, eng, dtype=run.dtype, audit=run.audit,
                                                   strict=run.strict, seed=run.audit_seed)
        if aside:
            refused.append(f"verified rows set aside: {aside}")
        return kept, prefix, spot

    t0 = time.perf_counter()
    won = race(stream, eng, ids, schedule=schedule, usable=usable, keep=keep, resumes=eng.resumes_prefill,
               progress=run.progress)
    if won is None:
        run.header = bound[0]
        return None
    layers, kept, spot, taken = won
    hedge.cancel("cancelled: the prompt was computed here first"
                 + (f" (the producer's rows taken {taken} times)" if taken else ""))
    rows = len(ids) - 1
    why = f"hedge: {hedge.broken_why or 'the producer broke its promise'}"
    return Rows(layers, RowsFrom.PARTIAL_LOCAL if kept else RowsFrom.LOCAL, schedule, None, reason="; ".join([why, *refused]),
                handoff_rows=kept, local_rows=rows - kept, cut_prefill_s=time.perf_counter() - t0, spot=spot)

