"""The MLX engine's running batch: mlx-lm's own generation batch over its batch caches.

Each sequence comes in with its own mlx-lm caches (installed from rows, its first step done)
and the token that step picked; its caches are merged into batch caches by mlx-lm's own
``merge`` (left-padded: ``BatchKVCache``, ``BatchRotatingKVCache``, ``ArraysCache``), and
mlx-lm's ``GenerationBatch`` steps them all in one forward, each with its own token picker,
counting each one's tokens and stopping it at its end-of-sequence tokens. Imported only by an
engine that has MLX loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from muser_cli.engines.stepper import Member


@dataclass
class Entry:
    """What a sequence brings to the batch."""

    caches: list[Any]  # mlx-lm caches, one per layer, holding every row before ``first``
    first: Any  # (1,) the token its own first step picked (not yet in its caches)
    pick: Callable[[Any], Any] | None  # log-probabilities (1, vocab) -> (1,); None: plain greedy. Its
    # ``processors`` (if any) are mlx-lm logits processors the batch runs on its raw logits first.
    max_tokens: int  # tokens to give out after ``first``
    eos: tuple[int, ...]


def batchable(caches: list[Any]) -> bool:
    """Whether mlx-lm can merge these caches into batch caches (each layer's kind has its batch
    twin): full-attention ``KVCache``, sliding ``RotatingKVCache``, recurrent ``ArraysCache``.
    A chunked layer's cache (Llama 4) has none: such a model decodes each sequence alone."""
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    return bool(caches) and all(type(c) in (KVCache, RotatingKVCache, ArraysCache) for c in caches)


def settled(caches: list[Any]) -> list[Any]:
    """Every array the caches hold, to evaluate on the sequence's own thread before they join: a
    lazy array carries the stream of the thread that built it, which the stepper's thread cannot
    run (mlx: "There is no Stream(cpu, N) in current thread")."""
    out = []
    for cache in caches:
        out.extend(a for a in cache.state if a is not None and not isinstance(a, int))
    return out


class MlxBatch:
    """A :class:`muser_cli.engines.stepper.Batch` on mlx-lm's ``GenerationBatch``."""

    def __init__(self, mx: Any, model: Any) -> None:
        from mlx_lm.generate import GenerationBatch, StopSequences

        self._mx = mx
        self._model = model
        self._gen_batch = GenerationBatch
        self._stops = StopSequences
        self._greedy = lambda logprobs: mx.argmax(logprobs, axis=-1)  # one call for every greedy sequence
        self._batch: Any = None
        self._by_uid: dict[int, Member] = {}
        self._next_uid = 0

    def __len__(self) -> int:
        return 0 if self._batch is None else len(self._batch)

    def add(self, members: list[Member]) -> None:
        uids = []
        for member in members:
            uids.append(self._next_uid)
            self._by_uid[self._next_uid] = member
            self._next_uid += 1
        entries: list[Entry] = [m.entry for m in members]
        caches = [entries[0].caches[i].merge([e.caches[i] for e in entries]) for i in range(len(entries[0].caches))]
        fresh = self._gen_batch(
            self._model, uids, self._mx.concatenate([e.first for e in entries]), caches,
            tokens=[[] for _ in entries], samplers=[e.pick for e in entries], fallback_sampler=self._greedy,
            logits_processors=[list(getattr(e.pick, "processors", None) or []) for e in entries],
            stop_sequences=[self._stops([[t] for t in e.eos]) for e in entries],
            max_tokens=[e.max_tokens for e in entries])
        if self._batch is None or not len(self._batch):
            self._batch = fresh
        else:
            self._batch.extend(fresh)

    def drop(self, members: list[Member]) -> None:
        if self._batch is None:
            return
        gone = {id(m) for m in members}
        keep = [i for i, uid in enumerate(self._batch.uids) if id(self._by_uid[uid]) not in gone]
        for uid in self._batch.uids:
            if id(self._by_uid[uid]) in gone:
                del self._by_uid[uid]
        if not keep:
            self._empty()
        elif len(keep) < len(self._batch.uids):
            self._batch.filter(keep)

    def step(self) -> list[tuple[Member, int, str | None]]:
        out = []
        for r in self._batch.next():
            member = self._by_uid[r.uid]
            emit = getattr(member.entry.pick, "emit", None)
            if emit is not None:
                emit()  # the token's logprobs (if asked) onto its record, evaluated on this thread
            if r.finish_reason is not None:
                del self._by_uid[r.uid]
            out.append((member, int(r.token), r.finish_reason))
        if not len(self._batch):
            self._empty()
        return out

    def _empty(self) -> None:
        """No sequence left: the step mlx-lm queued ahead (computed asynchronously) is waited
        for, so no work is left on this thread's stream when the thread ends (mlx aborts the
        process at exit otherwise: "terminate called without an active exception")."""
        self._batch = None
        self._mx.synchronize()


__all__ = ["Entry", "MlxBatch", "batchable", "settled"]
