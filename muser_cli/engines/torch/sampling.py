"""The torch engine's token picker: greedy, or temperature + top-k, top-p and min-p with a seeded
generator, after the penalties and the bias of :class:`~muser_cli.engines.base.Sampling`, with its
logprob record and its grammar's mask (one :class:`Picker` a sequence, solo and batched)."""

from __future__ import annotations

import os

import torch

from muser_cli.engines.base import Sampling


def _generator(sampling: Sampling) -> "torch.Generator | None":
    if sampling.temperature <= 0:
        return None
    seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator().manual_seed(int(seed))


class Picker:
    """One sequence's token picker: its seeded generator, the counts of the tokens it picked (the
    penalties'), its bias, and its log-probability record (:class:`Sampling`'s rule). Without a
    penalty, a bias, logprobs or a constraint asked it is :func:`_pick` on the logits as they come.
    A constraint's matcher (its own) masks the shaped logits before each pick and takes the token
    picked."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self.generator = _generator(sampling)
        self.counts: torch.Tensor | None = None  # (vocab,) float32 once a penalty is asked
        self.seen: torch.Tensor | None = None  # (vocab,) bool: the tokens seen, once a repetition penalty is asked
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if sampling.logit_bias:
            ids, values = zip(*sampling.logit_bias)
            self.bias = (torch.tensor(ids, dtype=torch.long), torch.tensor(values, dtype=torch.float32))
        self.matcher = sampling.constraint.matcher() if sampling.constraint is not None else None

    def __call__(self, logits: torch.Tensor) -> int:
        s = self.sampling
        raw = torch.log_softmax(logits.float(), dim=-1) if s.logprobs is not None else None
        if s.repeats and self.seen is None:
            self.seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
            ids = torch.tensor([t for t in s.seen if 0 <= t < logits.shape[-1]], dtype=torch.long)
            self.seen[ids] = True
        shaped = shape_logits(logits, s, self.counts, self.bias, seen=self.seen) if s.shapes else logits
        if self.matcher is not None:  # the grammar's mask, after penalties and bias, before temperature/top-p
            allowed = torch.from_numpy(self.matcher.allowed(shaped.shape[-1]))
            shaped = shaped.float().masked_fill(~allowed, float("-inf"))
        token = _pick(shaped, s, self.generator)
        if self.matcher is not None:
            self.matcher.advance(token)
        if s.presence_penalty or s.frequency_penalty:
            if self.counts is None:
                self.counts = torch.zeros(logits.shape[-1], dtype=torch.float32)
            self.counts[token] += 1
        if self.seen is not None and token < self.seen.shape[0]:
            self.seen[token] = True
        if raw is not None and s.record is not None:
            s.record.append(logprobs_of(raw, token, s.logprobs or 0))
        return token


def shape_logits(logits: torch.Tensor, sampling: Sampling, counts: torch.Tensor | None,
                 bias: tuple[torch.Tensor, torch.Tensor] | None, *, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The logits a token is picked from: each ``seen`` token's divided by the repetition penalty
    where positive, multiplied by it where negative; minus ``frequency * count + presence *
    (count > 0)`` of each generated token; plus the bias (float32, a new tensor)."""
    out = logits.float().clone()
    if seen is not None:
        penalty = float(sampling.repetition_penalty)
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    if counts is not None:
        out -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0).float()
    if bias is not None:
        ids, values = bias
        keep = ids < out.shape[-1]
        out.index_add_(0, ids[keep], values[keep])
    return out


def logprobs_of(row: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability in ``row`` (a log-softmax) and the ``k`` most likely tokens'."""
    top = torch.topk(row, k) if k else None
    return float(row[token]), ([(int(i), float(v)) for v, i in zip(top.values, top.indices)] if top is not None
                               else [])


def _pick(logits: "torch.Tensor", sampling: Sampling, generator: "torch.Generator | None") -> int:
    """Greedy (temperature 0), or temperature, then top-k, top-p and min-p (transformers' order;
    each keeps the most likely token), then a sample with a seeded generator."""
    if sampling.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / float(sampling.temperature), dim=-1)
    if 0 < sampling.top_k < probs.shape[-1]:  # the k largest stay, and any tied with the k-th
        kth = torch.topk(probs, int(sampling.top_k)).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
        probs = probs / probs.sum()
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ahead of each token
        sorted_probs[before >= float(sampling.top_p)] = 0.0  # the top token always stays
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if sampling.min_p > 0.0:  # the ratio to the top probability, the same before or after renormalising
        probs = torch.where(probs < float(sampling.min_p) * probs.max(), torch.zeros_like(probs), probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


__all__ = ["Picker", "logprobs_of", "shape_logits"]
