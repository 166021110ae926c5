"""The torch engine's sequence handles (:mod:`muser_cli.engines.sequence`): the first step over an
installed cache (:func:`open_cache`), more sequences from it (:func:`fork`: a copy of the cache
and a picker each) and the steps to a sequence's end (:func:`run`: alone, or in the running
batch, :mod:`muser_cli.engines.torch.batch`, when the engine's batched decode is on).

Imported only by an engine that has torch loaded.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence as Seq

import torch

from muser_cli.engines.base import DecodeResult, RowsOf, Sampling
from muser_cli.engines.sequence import Sequence
from muser_cli.engines.torch.sampling import Picker


@dataclass(eq=False)
class TorchState:
    """A torch sequence's own: its cache, its picker, where its next token goes."""

    cache: Any  # its DynamicCache, holding every position before ``position``
    pick: Picker
    position: int
    may_batch: bool  # whether it may join the running batch (a reference decode never does)
    logits: Any = None  # the first step's logits (vocab,), kept until it runs (what a fork picks from)


def open_cache(engine: Any, cache: Any, rows: int, next_tokens: list[int], max_new_tokens: int, sampling: Sampling,
               stop_on_eos: bool, start: float, *, stats: dict, check_first: Callable[[RowsOf], None] | None = None,
               may_batch: bool = False) -> Sequence:
    """A sequence over ``cache`` (``rows`` positions): ``next_tokens`` run at ``rows..``, the fused
    check (``check_first``) judges their rows, the sequence's picker picks the first token."""
    eos = tuple(engine.info.eos_token_ids) if stop_on_eos else ()
    state = TorchState(cache, Picker(sampling), rows, may_batch)
    seq = Sequence(rows=rows, max_new_tokens=max_new_tokens, eos=eos, start=start, stats=stats, state=state)
    if max_new_tokens > 0:
        logits = engine._forward(next_tokens, rows, cache, keep=1)[0, -1]
        if check_first is not None:
            check_first(engine._rows_of(cache, rows + len(next_tokens)))
        seq.first, seq.picked = state.pick(logits), True
        state.position = rows + len(next_tokens)
        state.logits = logits
        seq.stats["first_done"] = time.perf_counter()
    return seq


def fork(engine: Any, seq: Sequence, samplings: Seq[Sampling]) -> list[Sequence]:
    """One sequence per sampling from ``seq``'s first step: a copy of its cache, a picker of its
    own picking its first token from the same logits."""
    seq.check_forkable()
    own: TorchState = seq.state
    out = []
    for sampling in samplings:
        stats = dict(seq.stats)
        state = TorchState(copy.deepcopy(own.cache), Picker(sampling), own.position, own.may_batch)
        other = Sequence(rows=seq.rows, max_new_tokens=seq.max_new_tokens, eos=seq.eos, start=seq.start,
                         stats=stats, state=state)
        if own.logits is not None:
            other.first, other.picked = state.pick(own.logits), True
            state.logits = own.logits
        out.append(other)
    return out


def run(engine: Any, seq: Sequence, on_token: Callable[[int], None] | None) -> DecodeResult:
    """``seq`` stepped to its end, alone or in the running batch (a first token that is no end
    token, more than one token asked, a model and cache the batch takes)."""
    state: TorchState = seq.take()
    stats, eos, rows = seq.stats, set(seq.eos), seq.rows
    first_done = stats.pop("first_done", seq.start)
    ttft = first_done - seq.start if seq.picked else 0.0
    tokens: list[int] = []
    stop = "length"
    with engine._session():
        if seq.picked:
            token = seq.first
            state.logits = None
            if (state.may_batch and engine._stepper is not None and seq.max_new_tokens > 1 and token not in eos
                    and not engine.decodes_alone and engine._batchable(state.cache)):
                from muser_cli.engines.torch.batch import Entry  # lazy: pulls transformers

                entry = Entry(state.cache, token, state.position, state.pick, seq.max_new_tokens - 1, tuple(eos))
                state.cache = None  # the batch copies the rows and drops the entry's cache
                return _batched(engine, entry, on_token, first_done, ttft, stats, rows)
            cache, position, pick = state.cache, state.position, state.pick
            state.cache = None
            for step in range(seq.max_new_tokens):
                if step:
                    token = pick(engine._forward([token], position, cache, keep=1)[0, -1])
                    position += 1
                tokens.append(token)
                if on_token is not None:
                    on_token(token)
                if token in eos:
                    stop = "eos"
                    break
    decode_s = time.perf_counter() - first_done if tokens else 0.0
    stats.update(stop_reason=stop, rows=rows, load_s=engine.load_s, threads=torch.get_num_threads())
    return DecodeResult(token_ids=tokens, ttft_s=ttft, decode_s=decode_s, stats=stats)


def _batched(engine: Any, entry: Any, on_token: Callable[[int], None] | None, first_done: float, ttft: float,
             stats: dict, rows: int) -> DecodeResult:
    """The rest of a sequence whose first step is done (``entry.first`` picked, not an end
    token): in the running batch (the stepper's thread computes the steps), this thread
    waiting away from the engine's turn (:meth:`Stepper.follow`)."""
    tokens, stop, peak = engine._stepper.follow(entry, entry.first, on_token)
    stats.update(stop_reason=stop, rows=rows, load_s=engine.load_s, threads=torch.get_num_threads(),
                 batched=peak > 1, batch_peak=peak)
    return DecodeResult(token_ids=tokens, ttft_s=ttft, decode_s=time.perf_counter() - first_done, stats=stats)


__all__ = ["TorchState", "fork", "open_cache", "run"]
