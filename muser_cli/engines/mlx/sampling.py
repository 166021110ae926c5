"""The MLX engine's token picker: greedy, or temperature + top-p with a seeded key (the torch
engine's rule, on mlx arrays). Takes ``mlx.core`` as an argument: importing this module
imports no MLX."""

from __future__ import annotations

import os
from typing import Any, Callable

from muser_cli.engines.base import Sampling


def sampler(mx: Any, sampling: Sampling) -> Callable[[Any], Any]:
    """Greedy (temperature 0) or temperature + top-p with a seeded key: logits (1, vocab) -> (1,)."""
    if sampling.temperature <= 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
    state = {"key": mx.random.key(int(seed))}
    temperature, top_p = float(sampling.temperature), float(sampling.top_p)

    def pick(logits: Any) -> Any:
        state["key"], sub = mx.random.split(state["key"])
        scaled = logits.astype(mx.float32) / temperature
        if top_p >= 1.0:
            return mx.random.categorical(scaled, key=sub)
        order = mx.argsort(-scaled, axis=-1)  # (1, vocab), most likely first
        ranked = mx.take_along_axis(scaled, order, axis=-1)
        probs = mx.softmax(ranked, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs  # mass ahead of each token; the top one always stays
        ranked = mx.where(before >= top_p, -mx.inf, ranked)
        choice = mx.random.categorical(ranked, key=sub)
        return mx.take_along_axis(order, choice[:, None], axis=-1)[:, 0]

    pick.state = lambda: [state["key"]]  # type: ignore[attr-defined] - arrays it carries to its next call
    return pick
