"""``muser batch``: many prompts on one resident consumer engine.

* One model load for the whole batch (:func:`muser_cli.consumer.decode.decode` with ``resident=``).
* Jobs naming the same document (or sharing their first chunk) run one after another, so
  the shared prefix is hot: the first is prefilled — here or by a producer — and kept in
  the store; the next ones compute (or ship: a delta from the pull lane) only their own
  suffix. Results still come out in input order.
* With producers, while job i decodes the KV of job i+1 is already being pulled (its
  ``have``: what the store holds, plus what job i's rows will add once stored).
* A producer is asked as the served consumer asks one: when the route predicts it is faster
  (``MUSER_ROUTE``, :func:`muser_cli.consumer.route.route`; a pull started while the job
  before decodes counts that decode as time the local path would wait), with the budget that
  beats the local path; what each job measured is learned (the cost file the service reads too).
* Every correctness gate is decode's: a pulled pack is verified, bound to the prompt and
  spot-checked when foreign; whatever fails falls back to local prefill, same tokens.
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Sequence

from muser_cli.batch.jobs import BadJob, Job
from muser_cli.batch.plan import Planned, mark_sharing, shared_prefixes
from muser_cli.batch.pulls import Fetch, Pulls
from muser_cli.batch.results import Results
from muser_cli.batch.spool import make_spool, sweep_spools
from muser_cli.batch.tally import ResultFn, Summary, Tally, failure
from muser_cli.consumer.decode import decode
from muser_cli.consumer.lane import Source, answer
from muser_cli.consumer.pool import ProducerPool
from muser_cli.consumer.costs import CostModel, costs_for
from muser_cli.consumer.pull import PipePull, learn_from
from muser_cli.consumer.source import RowsFrom
from muser_cli.consumer.turns import TurnEngine, Turns
from muser_cli.consumer.warm import calibrate, warm_up
from muser_cli.engines.base import Sampling
from muser_cli.engines.registry import get_consumer
from muser_cli.errors import MuserError, UsageError
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tokens import encode_prompt, tokenizer_for
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS, check_chunk, check_prompt, default_dtype

@dataclass(frozen=True)
class BatchConfig:
    model: str | None = None
    engine: str = "torch"
    dtype: str | None = None
    threads: int = 1
    chunk_tokens: int | None = None
    producers: tuple[str, ...] = ()
    timeout: float | None = None  # per pull: seconds to the producer's first frame
    audit: int | None = None
    reuse: bool = True  # the store: look there first, keep shared prefixes there
    max_batch: int = 1  # jobs running at once in the engine's turns (decoded together where it batches)


def waves(order: Sequence[Planned]) -> list[list[Planned]]:
    """``order`` (the plan's run order) in waves that can run at once: a job that shares a
    prefix with the job before it waits for the last job of that chain that stores its rows
    (one wave later), so it finds them in the store; a job that shares nothing starts at once."""
    out: list[list[Planned]] = []
    stored_in: int | None = None  # the wave of the chain's last storing job
    for i, p in enumerate(order):
        if not (i and order[i - 1].shares_next > 0):  # a new chain
            stored_in = None
        w = 0 if stored_in is None else stored_in + 1
        while len(out) <= w:
            out.append([])
        out[w].append(p)
        if p.store:
            stored_in = w
    return out


class Batch(Pulls):
    """Load once (:meth:`load`), then :meth:`run` a list of jobs into a :class:`Results`."""

    def __init__(self, config: BatchConfig, *, on_result: ResultFn | None = None,
                 stop: threading.Event | None = None) -> None:

        check_chunk(config.chunk_tokens)
        self.config = config
        self.chunk = config.chunk_tokens or DEFAULT_CHUNK_TOKENS
        self.pool = ProducerPool(config.producers)
        self.on_result = on_result
        self.stop = stop or threading.Event()
        self.info = None
        self.engine = None
        self.dtype = ""
        self._spool: Path | None = None
        self._fetches: dict[int, Fetch] = {}  # by job line: pulls started ahead
        self.turns: Turns | None = None  # with max_batch > 1: the engine's turns
        self.costs: CostModel | None = None  # the route's cost model (this machine, model, engine, dtype, threads)
        self.calibration: dict[str, Any] | None = None  # what load() measured of the local prefill
        if config.max_batch < 1:
            raise UsageError("--max-batch must be at least 1")

    # ------------------------------------------------------------------ set-up
    def load_info(self) -> None:
        """The model's description and tokenizer (no weights): enough to plan."""

        if self.info is None:
            self.info = resolve_model(self.config.model)
            tokenizer_for(self.info)
            self.dtype = self.config.dtype or default_dtype(self.config.engine)
        if self.costs is None and self.pool:
            c = self.config
            self.costs = costs_for(self.info.fingerprint, c.engine, self.dtype, c.threads)

    def load(self) -> float:
        """The model and engine, once for the batch; with producers, warmed up with a throwaway
        request and this machine's local prefill calibrated (once: kept in the cost file), as
        ``decode --serve`` does, so the route is right from the first job and what each job
        measures holds no first touch (docs/batch.md). Returns the seconds it took."""

        t0 = time.perf_counter()
        self.load_info()
        c = self.config
        engine = get_consumer(c.engine, self.info, dtype=self.dtype, threads=c.threads)
        if c.max_batch > 1:  # jobs on threads of their own, taking the engine's turns
            self.turns = Turns()
            if engine.batches_decode:
                engine.batch_decode(self.turns)
            engine = TurnEngine(engine, self.turns)
        self.engine = engine
        if self.pool and self.costs is not None:  # the route: as the service, from the first job on
            raw = engine.inner if self.turns is not None else engine
            kw = dict(model=c.model, engine=c.engine, dtype=self.dtype, threads=c.threads, chunk_tokens=self.chunk)
            warm_up(raw, **kw)  # no job's times (learned) hold the engine's first touch
            self.calibration = calibrate(self.costs, raw, info=self.info, chunk=self.chunk, **kw)
        return time.perf_counter() - t0

    @property
    def schedule(self) -> dict[str, Any]:
        """What a resumed run must share with the results it continues."""
        return {"engine": self.config.engine, "dtype": self.dtype, "chunk": self.chunk}

    @property
    def model_fingerprint(self) -> str:
        assert self.info is not None
        return self.info.fingerprint

    def plan(self, jobs: Sequence[Job]) -> tuple[list[Planned], list[tuple[Job, MuserError]]]:
        """Tokenize, check, and order the jobs so shared prefixes are hot: groups (one document,
        or one first chunk) in order of first appearance, input order inside a group."""

        assert self.info is not None
        groups: dict[Any, list[Planned]] = {}
        bad: list[tuple[Job, MuserError]] = []
        for job in jobs:
            try:
                ids = encode_prompt(self.info, job.text, chat=job.chat)
                check_prompt(self.info, ids, new_tokens=job.max_tokens)
            except MuserError as exc:
                bad.append((job, exc))
                continue
            key = ("doc", job.document, job.chat) if job.document else ("ids", tuple(ids[: self.chunk]))
            groups.setdefault(key, []).append(Planned(job, ids, key))
        order = [p for g in groups.values() for p in g]
        mark_sharing(order, self.chunk, self.config.reuse)
        return order, bad

    def dry_run(self, items: Sequence[Job | BadJob]) -> dict[str, Any]:
        """What :meth:`run` would do, with the tokenizer only (no weights, no producer contacted,
        no results file): the jobs in run order, the prefixes they share, the producers."""
        self.load_info()
        order, bad = self.plan([j for j in items if isinstance(j, Job)])
        failed = [failure(j, j.error, model="") for j in items if isinstance(j, BadJob)]
        failed += [failure(j, exc, model="") for j, exc in bad]
        jobs = []
        for i, p in enumerate(order):
            held = order[i - 1].shares_next if i else 0
            jobs.append({"id": p.job.id, "line": p.job.line, "prompt_tokens": len(p.ids), "document": p.job.document,
                         "shares_previous": held, "store": p.store})
        failed.sort(key=lambda f: f["line"])
        return {"jobs": jobs, "prefixes": shared_prefixes(order, self.chunk), "producers": list(self.config.producers),
                "bad": [{"id": f["id"], "line": f["line"], **f["error"]} for f in failed],
                "chunk": self.chunk, "model": self.model_fingerprint}

    # ------------------------------------------------------------------ the run
    def run(self, items: Sequence[Job | BadJob], results: Results) -> Summary:
        tally = Tally(Summary(jobs=len(items)), results, self.on_result)
        sweep_spools()  # a killed run's prefetched packs: removed even when nothing is left to run
        if self.engine is None:
            tally.summary.load_s = self.load()
            tally.summary.calibration = self.calibration
        order = self.prepare(items, tally)
        ran_all = False
        try:
            if self.turns is not None:
                ran_all = self._run_together(order, tally)
            else:
                for i, p in enumerate(order):
                    if self.stop.is_set():
                        tally.summary.interrupted = True
                        break
                    tally.emit(self.run_one(p, order[i + 1] if i + 1 < len(order) else None))
                else:
                    ran_all = True
        finally:
            try:
                self.close()
            finally:
                tally.finish(self.pool.to_json(), complete=ran_all)
        return tally.summary

    def _run_together(self, order: list[Planned], tally: "Tally") -> bool:
        """Up to ``max_batch`` jobs at once, each on a thread of its own in the engine's turns
        (their decode steps computed together where the engine batches), wave by wave: a job
        whose prompt shares a prefix with a job that stores it (the document of several
        questions) starts once that job is done, so it computes only its own tail; the others
        of a wave start together. Results are written as they come (stdout keeps input order).
        No pull starts ahead here: each job pulls for itself (into a file, trying the pool's
        producers in turn, as a pull started ahead does) while the others compute."""
        if self._spool is None:
            self._spool = make_spool()
        for wave in waves(order):
            with ThreadPoolExecutor(self.config.max_batch, thread_name_prefix="muser-batch-job") as pool:
                running = [pool.submit(self._in_turns, p) for p in wave]
                for done in as_completed(running):
                    result = done.result()
                    if result is not None:
                        tally.emit(result)
            if self.stop.is_set():
                tally.summary.interrupted = True
                return False
        return True

    def _in_turns(self, p: Planned) -> dict[str, Any] | None:
        """One job on a pool thread, counted among the sequences taking the engine's turns; None
        when the run was stopped before it began."""
        if self.stop.is_set():
            return None
        assert self.turns is not None
        self.turns.join()
        try:
            return self.run_one(p, None, pulled=bool(self.pool))
        finally:
            self.turns.leave()

    def prepare(self, items: Sequence[Job | BadJob], tally: "Tally") -> list[Planned]:
        """Resume (skip what is done), report bad lines, and plan the rest (in run order)."""
        self.load_info()
        model = self.model_fingerprint
        results = tally.results
        jobs = [j for j in items if isinstance(j, Job)]
        done = results.done(model=model, jobs={j.id: j.digest for j in jobs}, schedule=self.schedule)
        results.open([j.id for j in items])
        todo: list[Job] = []
        for item in items:
            prior = done.get(item.id)
            if isinstance(item, Job) and prior is not None and prior.get("error") is None:
                if item.id not in results.redo:
                    tally.summary.skipped += 1
                    results.skip(item.id)
                    continue
                tally.summary.redone.append({"id": item.id, "reason": results.redo[item.id]})
                todo.append(item)
            elif isinstance(item, BadJob):
                tally.emit(failure(item, item.error, model=model))
            else:
                todo.append(item)
        order, bad = self.plan(todo)
        for job, exc in bad:
            tally.emit(failure(job, exc, model=model))
        return order

    def run_one(self, p: Planned, nxt: Planned | None, *, pulled: bool = False) -> dict[str, Any]:
        """One job's result line (its failure is its line too); ``nxt``: the job that runs next
        here, whose pull starts while this one decodes. ``pulled``: the job's own pull, to a file
        from the first producer of the pool that serves it, before it decodes (jobs running at
        once: :meth:`_run_together`)."""
        if self._spool is None:
            self._spool = make_spool()
        try:
            if pulled:
                return self._one(p, None, {p.job.line: self._prefetch(p, after=None, schedule=None)})
            return self._one(p, nxt, self._fetches)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - one job's failure is its result line
            return failure(p.job, exc, model=self.model_fingerprint)

    def close(self) -> None:
        """Pulls joined, the spool removed; with jobs at once, the engine's stepper stopped (a
        later run loads the engine again)."""
        for f in self._fetches.values():
            f.wait()
        self._fetches.clear()
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
            self._spool = None
        if self.turns is not None and self.engine is not None:
            self.engine.inner.close()  # the stepper's thread ends with nothing queued on its stream
            self.engine, self.turns = None, None

    def _one(self, p: Planned, nxt: Planned | None, fetches: dict[int, "Fetch"]) -> dict[str, Any]:
        c, job = self.config, p.job
        src: BinaryIO | None = None
        producer: str | None = None
        reason = "local: no producer given" if not self.pool else ""
        shipped = 0
        live = None
        fetch = fetches.pop(p.job.line, None)
        if fetch is not None:
            fetch.wait()
            if fetch.path is not None:
                src, producer = open(fetch.path, "rb"), fetch.producer  # noqa: SIM115 - closed below
                shipped = int((fetch.accepted or {}).get("payload_bytes", 0))
            else:
                reason = f"no handoff: {fetch.reason}"
        elif self.pool:
            live, why = self._live(p)
            if live is None:
                reason = why or "no handoff: no producer up"
            else:
                src, producer = live.reader, live.producer

        turns, engine_s = self.turns, [None]
        held_t0 = turns.held_s() if turns is not None else 0.0  # the engine time this job's thread held so far

        def rows_ready(got) -> None:  # the next job's pull starts while this one decodes
            if turns is not None:  # the prompt's own engine work: the others' chunks and steps left out
                engine_s[0] = turns.held_s() - held_t0
            if nxt is not None and self.pool and nxt.job.line not in fetches:
                self._start_prefetch(nxt, after=p, schedule=got.schedule, fetches=fetches)

        def run(inp: BinaryIO | None, why: str):
            return decode(inp, model=c.model, prompt=job.text, chat=job.chat, max_new_tokens=job.max_tokens,
                          engine=c.engine, dtype=self.dtype, threads=c.threads,
                          sampling=Sampling(temperature=job.temperature, top_p=job.top_p, seed=job.seed),
                          chunk_tokens=self.chunk, fallback_reason=why or "empty input", reuse=c.reuse,
                          store=p.store, audit=c.audit, resident=self.engine, on_rows=rows_ready,
                          prompt_ids=list(p.ids), info=self.info,  # tokenized once, when planned
                          progress=self._pass_turn if self.turns is not None else None)

        def unlink_fetched() -> None:
            if fetch is not None and fetch.path is not None:
                fetch.path.unlink(missing_ok=True)

        # a prefetched pack's pull already told the pool how it went; a live one is told here
        source = Source(src, producer, reason, live=live, pooled=live is not None)
        try:
            got = answer(source, run, pool=self.pool)
        finally:
            unlink_fetched()
        out = got.out
        self._learn(out, live, fetch, engine_s=engine_s[0])
        if live is not None and got.pull_error is None and live.accepted:
            shipped = int(live.accepted.get("payload_bytes", 0))
        if got.refused is not None and not source.pooled:
            self.pool.blame(producer, got.refused)
        elif got.refused is None and live is not None and live.error is not None and out.fallback:
            out.reason = live.reason()
        result = out.to_json()
        result["batched"] = bool(result.pop("engine_stats", {}).get("batched"))  # stepped with other jobs
        if out.fallback:
            producer, shipped = None, 0 if out.source != RowsFrom.PARTIAL_LOCAL else shipped
        result.update({"id": job.id, "line": job.line, "model": self.model_fingerprint, "job": job.digest,
                       "error": None, "producer": producer, "shipped_bytes": shipped, "chunk": self.chunk})
        return result

    def _learn(self, out: Any, live: PipePull | None, fetch: "Fetch | None", *, engine_s: float | None) -> None:
        """What the job measured, into the route's cost model (kept for the next run, and for a
        service on this machine). ``engine_s``: jobs at once share the engine's turns, so a local
        prefill is learned from the turns its own thread held up to its rows (the others' steps
        left out), as the service learns it."""
        costs = self.costs
        if costs is None:
            return
        if live is not None:
            marks, accepted, producer = live.marks, live.accepted, live.producer
        elif fetch is not None and fetch.path is not None:  # pulled ahead into a file
            marks, accepted, producer = fetch.marks, fetch.accepted, fetch.producer
        else:
            marks, accepted, producer = {}, None, None
        try:
            learn_from(costs, out, marks=marks, accepted=accepted, producer=producer,
                       prefill_s=min(out.prefill_s, engine_s) if engine_s is not None else None)
            costs.save()
        except Exception:  # noqa: BLE001 - bookkeeping: it never fails a job whose answer is made
            pass

    def _pass_turn(self, *progress: Any) -> None:
        """A prefill chunk done: the other running jobs take a step each (or a batched step)."""
        assert self.turns is not None
        self.turns.pass_turn()
