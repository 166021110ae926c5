"""The batch's pulls: whether a job's producer is asked (the route), the pull streamed into the
job's decode (:meth:`Pulls._live`), and the next job's pull into a spool file while this one
decodes (:meth:`Pulls._prefetch`, :class:`Fetch`)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from muser_cli.batch.plan import Planned
from muser_cli.consumer.costs import COLD_FIRST_STEP_S, CostModel
from muser_cli.consumer.pool import ProducerPool
from muser_cli.consumer.pull import PipePull, PullAsk, note_event, pull_prompt, settle_ask, with_have
from muser_cli.consumer.route import Route, route
from muser_cli.errors import MuserError
from muser_cli.reuse.chain import Scope, chain_at


class Fetch:
    """A pull on a thread into a file: the next job's KV, while this one decodes."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.producer: str | None = None
        self.accepted: dict[str, Any] | None = None
        self.errors: list[str] = []
        self.routed = ""  # why the route kept the job here (no producer asked)
        self.marks: dict[str, float] = {}  # the pull that brought it: start, its events, end
        self.thread: threading.Thread | None = None

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()

    @property
    def reason(self) -> str:
        return "; ".join(self.errors) or self.routed or "no producer up"


class Pulls:
    """The pulls of a :class:`muser_cli.batch.runner.Batch`, which this is mixed into: they read
    its config, producer pool, cost model, model facts, schedule and spool."""

    config: Any  # BatchConfig
    pool: ProducerPool
    costs: CostModel | None
    info: Any  # ModelInfo
    dtype: str
    chunk: int
    _spool: Path | None

    def _ask(self, p: Planned, *, after: Planned | None = None, schedule: int | None = None):
        """What to ask a producer for ``p``: its ids on the batch's schedule, with what the store
        holds — or will hold once ``after`` (the job decoding now) is stored."""

        assert self.info is not None
        ask = PullAsk(list(p.ids), self.info.tokenizer_fingerprint, self.info.fingerprint, self.chunk, self.dtype,
                      engine=self.config.engine)
        if not self.config.reuse:
            return ask
        ask = with_have(ask)
        if after is not None and after.store and schedule == self.chunk:
            held = min(after.shares_next, len(p.ids) - 2)
            held = held // self.chunk * self.chunk
            if held > ask.have_tokens:
                scope = Scope(self.info.fingerprint, self.info.tokenizer_fingerprint, self.dtype, self.chunk)
                ask = replace(ask, have_tokens=held, have_chain=chain_at(scope, p.ids, held))
        return ask

    def _route(self, p: Planned, ask: PullAsk, addr: str, *, lead_s: float = 0.0, key: Any = None) -> Route:
        """Whether to ask ``addr`` for ``p`` (:func:`muser_cli.consumer.route.route`; ``key``: an
        ask is put on that producer's queue under it, for the routes decided after it)."""
        assert self.costs is not None
        return route(self.costs, tokens=len(p.ids), held=ask.have_tokens, producer=addr, chunk=self.chunk,
                     lead_s=lead_s, key=key)

    def _live(self, p: Planned) -> tuple[PipePull | None, str]:
        """A pull of ``p`` streamed into decode as it arrives (the first job, or one not prefetched),
        or None and why not: no producer up, or the route predicts this machine answers sooner."""

        addr = self.pool.pick()
        if addr is None:
            return None, ""
        try:  # what the store holds, and the route: a store that cannot say is no reason to fail the job
            ask = self._ask(p)
            plan = self._route(p, ask, addr)
        except (MuserError, OSError, RuntimeError) as exc:
            self.pool.release(addr)
            return None, f"no handoff: {exc}"
        if not plan.ask:
            self.pool.release(addr)
            return None, f"no handoff: {plan.why}"
        if plan.budget_ms is not None:
            ask = replace(ask, budget_ms=plan.budget_ms)
        return PipePull(addr, lambda: ask, timeout=self.config.timeout, costs=self.costs, plan=plan), ""

    def _start_prefetch(self, p: Planned, *, after: Planned, schedule: int | None, fetches: dict[int, Fetch]) -> None:
        """Start ``p``'s pull while ``after`` decodes. One that cannot start (the store unreadable,
        no thread left) is not ``after``'s failure: ``p`` then pulls (or computes) itself, as a job
        without a prefetch does. Anything else is a bug, and fails ``after``'s line saying so."""
        try:
            fetches[p.job.line] = self._prefetch(p, after=after, schedule=schedule)
        except (MuserError, OSError, RuntimeError):  # no prefetch: p pulls (or computes) itself, as without one
            pass

    def _prefetch(self, p: Planned, *, after: Planned | None, schedule: int | None) -> Fetch:
        fetch = Fetch()
        assert self._spool is not None
        target = self._spool / f"job-{p.job.line}.kvpack"
        ask = self._ask(p, after=after, schedule=schedule)
        costs = self.costs
        assert costs is not None  # a pool: load_info made it
        # the job before decodes meanwhile: the local path would wait for it (its steps, as measured at
        # the whole core's speed, slowed by the share of it the engine gets now)
        step = costs.step_s or costs.first_step_s or COLD_FIRST_STEP_S
        lead_s = after.job.max_tokens * step / costs.share.now() if after is not None else 0.0
        rows = (ask.have_tokens, len(ask.token_ids) - 1)

        def work() -> None:
            tried: list[str] = []
            while (addr := self.pool.pick(exclude=tried)) is not None:
                tried.append(addr)
                key = (p.job.line, addr)  # the ask on that producer's queue, as this consumer sees it
                try:
                    plan = self._route(p, ask, addr, lead_s=lead_s, key=key)
                except Exception as exc:  # noqa: BLE001 - no route, no pull: the job computes itself
                    self.pool.release(addr)
                    fetch.errors.append(f"no route to {addr}: {exc}")
                    continue
                if not plan.ask:
                    self.pool.release(addr)
                    fetch.routed = plan.why
                    continue
                asked = replace(ask, budget_ms=plan.budget_ms) if plan.budget_ms is not None else ask
                marks: dict[str, float] = {"start": time.perf_counter()}
                promise: dict[str, Any] = {}

                def heard(kind: str, fields: dict[str, Any], addr: str = addr, marks: dict = marks,
                          promise: dict = promise) -> None:
                    promise.update(note_event(costs, addr, marks, kind, fields) or {})

                error: BaseException | None = None
                try:
                    fetch.accepted = pull_prompt(addr, asked, output=target, timeout=self.config.timeout,
                                                 on_event=heard)
                except BaseException as exc:  # noqa: BLE001 - the next producer, or local prefill
                    error = exc
                finally:
                    marks["end"] = time.perf_counter()
                    settle_ask(costs, addr, plan.asked_key, error=error, promise=promise or None, rows=rows,
                               marks=marks)
                if error is not None:
                    self.pool.done(addr, error)
                    fetch.errors.append(f"pull from {addr} failed: {error}")
                    continue
                self.pool.done(addr)
                fetch.path, fetch.producer, fetch.marks = target, addr, marks
                return

        fetch.thread = threading.Thread(target=work, name="muser-batch-prefetch", daemon=True)
        fetch.thread.start()
        return fetch


__all__ = ["Fetch", "Pulls"]
