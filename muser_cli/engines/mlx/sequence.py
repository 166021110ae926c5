"""The MLX engine's sequence handles (:mod:`muser_cli.engines.sequence`): the first step over
installed caches (:func:`open_caches`), more sequences from it (:func:`fork`: a copy of the
caches and a picker each) and the steps to a sequence's end (:func:`run`: alone, pipelined with
``mx.async_eval`` as mlx-lm's own loop, or in mlx-lm's generation batch,
:mod:`muser_cli.engines.mlx.batch`, when the engine's batched decode is on).

A sequence that runs on another thread than the one that opened it (a fork, a choice of its
own) has everything it carries evaluated first: a lazy array carries the stream of the thread
that built it, which another thread cannot run. Imported only by an engine that has MLX loaded.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence as Seq

from muser_cli.engines.base import DecodeResult, RowsOf, Sampling
from muser_cli.engines.mlx.batch import Entry, batchable, settled
from muser_cli.engines.mlx.sampling import sampler
from muser_cli.engines.sequence import Sequence


@dataclass(eq=False)
class MlxState:
    """An MLX sequence's own: its caches, its picker, its first token as an array."""

    caches: list[Any]
    pick: Callable[[Any], Any]  # engines/mlx/sampling.py sampler
    plain: bool  # greedy with nothing to shape or record: the batch picks it with its own argmax
    y: Any = None  # (1,) the first token, maybe not yet evaluated
    logits: Any = None  # (1, vocab) the first step's logits, kept until it runs (what a fork picks from)


def _plain(sampling: Sampling) -> bool:
    return (sampling.temperature <= 0 and not sampling.shapes and sampling.logprobs is None
            and sampling.constraint is None)


def open_caches(engine: Any, caches: list[Any], rows: int, next_tokens: list[int], max_new_tokens: int,
                sampling: Sampling, stop_on_eos: bool, start: float, stats: dict, *,
                check_first: Callable[[RowsOf], None] | None = None) -> Sequence:
    """A sequence over ``caches`` (``rows`` positions): ``next_tokens`` run at ``rows..``, the
    picker picks (lazily), the fused check (``check_first``) judges the rows before any token
    is read. ``first`` is read as the sequence runs (the pipelined loop reads it after queueing
    the next step), or here when a check ran."""
    mx = engine.mx
    eos = tuple(engine.info.eos_token_ids) if stop_on_eos else ()
    state = MlxState(caches, sampler(mx, sampling), _plain(sampling))
    seq = Sequence(rows=rows, max_new_tokens=max_new_tokens, eos=eos, start=start, stats=stats, state=state)
    if max_new_tokens > 0:
        state.logits = engine.model(mx.array([next_tokens]), cache=caches)[:, -1, :]
        state.y = state.pick(state.logits)
        if check_first is not None:  # the first step's rows are judged before anything is queued
            mx.eval(state.y)
            check_first(engine._rows_of(caches, rows + len(next_tokens)))
        seq.picked = True  # its token read when it runs, after the next step is queued (see run)
    return seq


def fork(engine: Any, seq: Sequence, samplings: Seq[Sampling]) -> list[Sequence]:
    """One sequence per sampling from ``seq``'s first step: a copy of its caches, a picker of its
    own picking its first token from the same logits; everything evaluated on this thread, so
    that each may run on a thread of its own."""
    seq.check_forkable()
    mx, own = engine.mx, seq.state
    mx.eval(*(a for a in (own.y, own.logits) if a is not None), settled(own.caches), own.pick.state())
    out = []
    for sampling in samplings:
        state = MlxState(copy.deepcopy(own.caches), sampler(mx, sampling), _plain(sampling))
        other = Sequence(rows=seq.rows, max_new_tokens=seq.max_new_tokens, eos=seq.eos, start=seq.start,
                         stats=dict(seq.stats), picked=seq.picked, state=state)
        if own.logits is not None:
            state.logits = own.logits
            state.y = state.pick(own.logits)
            mx.eval(state.y, settled(state.caches), state.pick.state())
        out.append(other)
    return out


def run(engine: Any, seq: Sequence, on_token: Callable[[int], None] | None) -> DecodeResult:
    """``seq`` stepped to its end: in the running batch (more than one token asked, a model and
    caches the batch takes), else alone, each step queued before the previous token is read."""
    mx = engine.mx
    state: MlxState = seq.take()
    caches, pick, y, eos = state.caches, state.pick, state.y, set(seq.eos)
    state.logits = None
    stats, rows, start, max_new_tokens = seq.stats, seq.rows, seq.start, seq.max_new_tokens

    def step(feed: Any) -> Any:
        return pick(engine.model(feed, cache=caches)[:, -1, :])  # (1,) token id

    tokens: list[int] = []
    ttft, first_done, stop = 0.0, start, "length"
    if y is not None:
        if engine._stepper is not None and max_new_tokens > 1 and not engine.decodes_alone and batchable(caches):
            mx.eval(y, settled(caches), getattr(pick, "state", list)())  # nothing left on this thread's stream
            return _batched(engine, Entry(caches, y, None if state.plain else pick, max_new_tokens - 1, tuple(eos)),
                            on_token, start, stats, rows)
        mx.async_eval(y)
        try:
            for n in range(max_new_tokens):
                if n + 1 < max_new_tokens:  # queue the next step before reading this token
                    next_y = step(y[:, None])
                    mx.async_eval(next_y)
                token = int(y.item())
                pick.emit()  # its logprobs (if asked) onto the record, before it is given out
                tokens.append(token)
                if n == 0:
                    seq.first = token
                    first_done = time.perf_counter()
                    ttft = first_done - start
                if on_token is not None:
                    on_token(token)
                if token in eos:
                    stop = "eos"
                    break
                if n + 1 < max_new_tokens:
                    y = next_y
        finally:  # a step queued ahead and never read (an end, a stop): no work left on this
            mx.synchronize()  # thread's stream when it ends (mlx aborts the process at exit otherwise)
    decode_s = time.perf_counter() - first_done if tokens else 0.0
    stats.update(stop_reason=stop, rows=rows, **engine._stats())
    return DecodeResult(token_ids=tokens, ttft_s=ttft, decode_s=decode_s, stats=stats)


def _batched(engine: Any, entry: Entry, on_token: Callable[[int], None] | None, start: float, stats: dict,
             rows: int) -> DecodeResult:
    """The rest of a sequence whose first step is done: in the running batch (the stepper's
    thread computes the steps), this thread waiting away from the engine's turn."""
    first = int(entry.first.item())  # the batch steps from it: its first step gives the second token
    if entry.pick is not None:
        entry.pick.emit()  # its logprobs (if asked) onto the record, before it is given out
    first_done = time.perf_counter()
    ttft, stop, peak = first_done - start, "eos", 1
    if first in entry.eos:
        tokens = [first]
        if on_token is not None:
            on_token(first)
    else:
        tokens, stop, peak = engine._stepper.follow(entry, first, on_token)
    stats.update(stop_reason=stop, rows=rows, batched=peak > 1, batch_peak=peak, **engine._stats())
    return DecodeResult(token_ids=tokens, ttft_s=ttft,
                        decode_s=time.perf_counter() - first_done if tokens else 0.0, stats=stats)


__all__ = ["MlxState", "fork", "open_caches", "run"]
