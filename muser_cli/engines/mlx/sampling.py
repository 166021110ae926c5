"""The MLX engine's token picker: greedy, or temperature + top-k, top-p and min-p with a seeded
key (the torch engine's rule, on mlx arrays), after the penalties and the bias of
:class:`Sampling`, with its logprob record. Takes ``mlx.core`` as an argument: importing this
module imports no MLX."""

from __future__ import annotations

import collections
import math
import os
from typing import Any, Callable

from muser_cli.engines.base import Sampling


def sampler(mx: Any, sampling: Sampling) -> Callable[[Any], Any]:
    """Greedy (temperature 0) or temperature, top-k, top-p and min-p (:class:`Sampling`'s rule)
    with a seeded key: logits (1, vocab) -> (1,).

    Everything stays lazy (mlx-lm's batch computes a step ahead): the penalty counts are an array
    updated with each pick, and each pick's log-probabilities wait in ``pick.pending`` until
    ``pick.emit()`` (called as its token is given out, on the thread that evaluates it) appends
    them to ``sampling.record`` as numbers. ``pick.state()``: the arrays it carries to its next
    call (evaluated before the sequence moves to another thread).

    A constraint (``sampling.constraint``) is the one thing not lazy: its matcher (this sequence's
    own) must have taken the previous pick before it can mask this step's logits, so each call
    first reads the token the previous call picked (evaluating it), advances the matcher with it,
    then masks the shaped logits (after penalties and bias, before temperature and top-p)."""
    temperature, top_p = float(sampling.temperature), float(sampling.top_p)
    top_k, min_p = int(sampling.top_k), float(sampling.min_p)
    penalised = bool(sampling.presence_penalty or sampling.frequency_penalty)
    repeats, penalty = sampling.repeats, float(sampling.repetition_penalty)
    k = sampling.logprobs
    record = sampling.record if k is not None else None
    state: dict[str, Any] = {"counts": None, "seen": None}
    if temperature > 0:
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
        state["key"] = mx.random.key(int(seed))
    bias = None
    if sampling.logit_bias:
        ids, values = zip(*sampling.logit_bias)
        bias = (mx.array(ids, dtype=mx.int32), mx.array(values, dtype=mx.float32))
    pending: collections.deque = collections.deque()
    matcher = sampling.constraint.matcher() if sampling.constraint is not None else None

    def choose(scaled: Any) -> Any:
        if temperature <= 0:
            return mx.argmax(scaled, axis=-1)
        state["key"], sub = mx.random.split(state["key"])
        scaled = scaled.astype(mx.float32) / temperature
        if not sampling.filters:
            return mx.random.categorical(scaled, key=sub)
        order = mx.argsort(-scaled, axis=-1)  # (1, vocab), most likely first
        ranked = mx.take_along_axis(scaled, order, axis=-1)
        if 0 < top_k < ranked.shape[-1]:  # the k largest stay, and any tied with the k-th
            ranked = mx.where(ranked < ranked[:, top_k - 1:top_k], -mx.inf, ranked)
        if top_p < 1.0:
            probs = mx.softmax(ranked, axis=-1)  # over what top-k left
            before = mx.cumsum(probs, axis=-1) - probs  # mass ahead of each token; the top one always stays
            ranked = mx.where(before >= top_p, -mx.inf, ranked)
        if min_p > 0.0:  # probability below min_p x the top one's: its logit below the top's + log(min_p)
            ranked = mx.where(ranked < ranked[:, :1] + math.log(min_p), -mx.inf, ranked)
        choice = mx.random.categorical(ranked, key=sub)
        return mx.take_along_axis(order, choice[:, None], axis=-1)[:, 0]

    def keep_raw(tokens: Any, logits: Any) -> Any:
        """mlx-lm's generation batch gives its samplers log-probabilities, not logits: the same
        pick for everything but a repetition penalty, which divides positive logits. So with one,
        this logits processor (the batch runs it first) hands the step's raw logits to the pick."""
        state["raw"] = logits
        return logits

    def pick(logits: Any) -> Any:
        raw_logits = state.pop("raw", None)
        if raw_logits is not None:
            logits = raw_logits
        shaped = logits
        if repeats and state["seen"] is None:
            vocab = logits.shape[-1]
            seen = mx.zeros((vocab,), dtype=mx.bool_)
            ids = [t for t in sampling.seen if 0 <= t < vocab]
            state["seen"] = seen.at[mx.array(ids, dtype=mx.int32)].add(True) if ids else seen
        if penalised or bias is not None or repeats:
            shaped = logits.astype(mx.float32)
            if repeats:
                seen = state["seen"][None, :]
                shaped = mx.where(seen, mx.where(shaped > 0, shaped / penalty, shaped * penalty), shaped)
            if state["counts"] is not None:
                counts = state["counts"]
                shaped = shaped - (sampling.frequency_penalty * counts
                                   + sampling.presence_penalty * (counts > 0).astype(mx.float32))
            if bias is not None:
                ids, values = bias
                keep = ids < shaped.shape[-1]
                shaped = shaped.at[:, mx.where(keep, ids, 0)].add(mx.where(keep, values, 0.0)[None, :])
        if matcher is not None:
            last = state.get("last")
            if last is not None:  # the previous pick, read now: the matcher takes it before this mask
                matcher.advance(int(last.item()))
            allowed = mx.array(matcher.allowed(shaped.shape[-1]))[None, :]
            shaped = mx.where(allowed, shaped.astype(mx.float32), -mx.inf)
        token = choose(shaped)
        if matcher is not None:
            state["last"] = token
        if repeats:
            state["seen"] = state["seen"].at[token].add(True)
        if penalised:
            counts = state["counts"]
            if counts is None:
                counts = mx.zeros((logits.shape[-1],), dtype=mx.float32)
            state["counts"] = counts.at[token].add(1.0)
        if record is not None:
            raw = logits.astype(mx.float32)
            raw = raw - mx.logsumexp(raw, axis=-1, keepdims=True)  # (1, vocab)
            chosen = mx.take_along_axis(raw, token[:, None], axis=-1)[0, 0]
            top = None
            if k:  # the k largest (argpartition: no sort of the whole vocabulary), then in order
                top = mx.argpartition(-raw[0], kth=k - 1)[:k]
                top = top[mx.argsort(-raw[0][top])]
            pending.append((chosen, top, raw[0][top] if k else None))
        return token

    def emit() -> None:
        """The oldest pending pick's log-probabilities, as numbers, onto the record."""
        if record is None or not pending:
            return
        chosen, top, values = pending.popleft()
        mx.eval(chosen, *(a for a in (top, values) if a is not None))
        record.append((float(chosen.item()), list(zip(top.tolist(), values.tolist())) if top is not None else []))

    def carried() -> list:
        out = [state[key] for key in ("key", "counts", "seen", "last") if state.get(key) is not None]
        for chosen, top, values in pending:
            out.extend(a for a in (chosen, top, values) if a is not None)
        return out

    pick.processors = [keep_raw] if repeats else []  # type: ignore[attr-defined]
    pick.state = carried  # type: ignore[attr-defined]
    pick.emit = emit  # type: ignore[attr-defined]
    pick.pending = pending  # type: ignore[attr-defined]
    return pick
