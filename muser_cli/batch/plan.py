"""The batch's run order: each job's prompt tokens and group (:class:`Planned`), the
whole-chunk prefix each shares with the next one run on the same consumer, and which of them
to keep in the store (:func:`mark_sharing`); the prefixes the batch pays once
(:func:`shared_prefixes`, what ``--dry-run`` lists)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from muser_cli.batch.jobs import Job


@dataclass
class Planned:
    job: Job
    ids: list[int]
    group: Any
    store: bool = False  # keep this job's cache: the next job shares a prefix it adds
    shares_next: int = 0  # whole-chunk prefix shared with the next job in run order


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def mark_sharing(order: Sequence[Planned], chunk: int, reuse: bool) -> None:
    """For jobs run in this order on one consumer: the whole-chunk prefix each shares with the
    next, and whether to keep it in the store (the next gains from it, the previous did not
    keep it already)."""
    prev_shared = 0
    for i, p in enumerate(order):
        nxt = order[i + 1] if i + 1 < len(order) else None
        shared = common_prefix(p.ids[:-1], nxt.ids[:-1]) // chunk * chunk if nxt is not None else 0
        p.shares_next = shared
        p.store = reuse and shared > prev_shared
        prev_shared = shared


def shared_prefixes(order: Sequence[Planned], chunk: int) -> list[dict[str, Any]]:
    """Each group of two or more jobs (one document, or one first chunk) and the whole-chunk
    prefix all of them share: what the batch pays once."""
    groups: dict[Any, list[Planned]] = {}
    for p in order:
        groups.setdefault(p.group, []).append(p)
    out = []
    for key, members in groups.items():
        if len(members) < 2:
            continue
        shared = min(common_prefix(members[0].ids[:-1], m.ids[:-1]) for m in members[1:]) // chunk * chunk
        out.append({"document": key[1] if key[0] == "doc" else None, "jobs": [m.job.id for m in members],
                    "shared_tokens": shared})
    return out
