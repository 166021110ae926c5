"""The pull lane's producer end above the sockets.

:class:`ResidentProducer` holds one model and engine, loaded once, and produces a consumer's
request through :func:`muser_cli.produce.pipeline.produce_pack` on the request's schedule: its rows
from the previous request's (memory), this machine's store (``store``), then the engine,
each chunk's frames streamed as the chunk finishes; :func:`serve` runs it behind
:class:`muser_cli.handoff.pull.server.PullServer`.
"""

from __future__ import annotations

import io
import threading
import time
from dataclasses import replace
from typing import Any, BinaryIO, Callable

from muser_cli import paths
from muser_cli.costcurve import CostCurve, cost_key, load_curve, save_curve, spread_ids
from muser_cli.engines.registry import get_engine
from muser_cli.errors import ConfigError, DataError, MuserError, UsageError
from muser_cli.handoff.api import ledger_dir
from muser_cli.handoff.link import DEFAULT_IDLE_S, listen_socket, parse_hostport
from muser_cli.handoff.pull.server import PullServer, ServeConfig
from muser_cli.handoff.push.spool import Refusal
from muser_cli.handoff.trust.node import load_identities
from muser_cli.handoff.wire.pull_protocol import PullRequest
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tokens import encode_prompt, tokenizer_for
from muser_cli.produce.pipeline import (
    MemoryRows, PackJob, PackSink, check_state_every, produce_pack, set_history, stats_of,
)
from muser_cli.reuse import Store
from muser_cli.reuse.chain import Scope, chain_at, delta_point
from muser_cli.rows import EngineRows, StoreRows
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS, check_chunk, check_prompt, default_dtype

EventFn = Callable[[str, dict[str, Any]], None]

#: The warm-up's throwaway prompt (:meth:`ResidentProducer.warm_up`): this many tokens, on chunks
#: of :data:`WARM_CHUNK` (an engine that resumes a prefill) -- whole chunks, a partial last one and a
#: continuation from held rows, as requests have them; short, so a big model starts no slower.
WARM_TOKENS = 40
WARM_CHUNK = 16
#: The calibration's prompt sizes (:meth:`ResidentProducer.calibrate`), besides the warm-up's:
#: one whole canonical chunk, so the fit tells the per-request fixed cost from the per-token one.
CALIBRATE_TOKENS = (DEFAULT_CHUNK_TOKENS + 1,)


def warm_ids(vocab: int, n: int = WARM_TOKENS) -> list[int]:
    """``n`` token ids spread over the vocabulary (no tokenizer: any ids run the same kernels)."""
    return spread_ids(vocab, n)


class _Batcher:
    """An engine with ``prefill_many`` (vLLM) computes concurrent requests together: the
    prompts waiting when the engine becomes free (up to ``limit``, on one chunk size) run as
    one batch. Whichever caller finds the engine free runs the batch for all in it (and
    again while its own prompt is not done); each gets its own rows, or its own error."""

    def __init__(self, engine: Any, limit: int) -> None:
        self.engine = engine
        self.limit = limit
        self._cv = threading.Condition()
        self._waiting: list[dict[str, Any]] = []
        self._busy = False
        self.batches: list[int] = []  # the size of each batch run (tests, stats)

    def prefill(self, ids: list[int], chunk_tokens: int) -> tuple[list, dict[str, Any], int]:
        """``ids``' rows, the producer record of the batch that computed them, and its size."""
        job: dict[str, Any] = {"ids": ids, "chunk": chunk_tokens}
        with self._cv:
            self._waiting.append(job)
            while "rows" not in job and "error" not in job:
                if self._busy:
                    self._cv.wait()
                    continue
                first = self._waiting[0]  # the oldest waiting prompt sets the batch's chunk size
                batch = [j for j in self._waiting if j["chunk"] == first["chunk"]][: self.limit]
                self._waiting = [j for j in self._waiting if not any(j is b for b in batch)]
                self._busy = True
                self._cv.release()
                try:
                    self._run(batch)
                finally:
                    self._cv.acquire()
                    self._busy = False
                    self._cv.notify_all()
        if "error" in job:
            raise job["error"]
        return job["rows"], job["producer"], job["batch"]

    def _run(self, batch: list[dict[str, Any]]) -> None:
        try:
            got = self.engine.prefill_many([j["ids"] for j in batch], chunk_tokens=batch[0]["chunk"],
                                           return_exceptions=True)
            producer = self.engine.producer_info()
        except BaseException as exc:  # noqa: BLE001 - each caller raises it in its own thread
            for j in batch:
                j["error"] = exc
            return
        self.batches.append(len(batch))
        for j, rows in zip(batch, got):
            j.update({"error": rows} if isinstance(rows, BaseException) else
                     {"rows": rows, "producer": producer, "batch": len(batch)})


class ResidentProducer:
    """One model and engine, loaded once; :meth:`check` and :meth:`run` per request.

    On torch and MLX one request computes at a time (:attr:`max_concurrent` is 1). An engine
    with ``prefill_many`` (vLLM) serves up to ``max_batch`` requests at once: those waiting
    when the engine becomes free are computed in one batch (:class:`_Batcher`), each then
    streamed to its own consumer."""

    def __init__(self, model: str | None, *, engine: str = "torch", dtype: str | None = None, threads: int = 1,
                 engine_options: dict | None = None, store: bool = False, max_batch: int = 8,
                 loaded: Any = None, history: bool | None = None, state_every: int = 1) -> None:
        """``loaded``: an engine already made for ``model`` (named ``engine``) to serve with.
        ``state_every``: every pack's state snapshots every this many chunks (a hybrid model)."""
        if not isinstance(max_batch, int) or max_batch < 1:
            raise UsageError(f"--max-batch must be a positive integer, got {max_batch!r}")


        t0 = time.perf_counter()
        self.info = resolve_model(model)
        check_state_every(self.info, state_every)
        self.state_every = state_every
        tokenizer_for(self.info)
        self.engine_name = engine
        self.dtype = dtype or default_dtype(engine)
        self.threads = threads
        self.engine = loaded if loaded is not None else get_engine(engine, self.info, dtype=self.dtype,
                                                                    threads=threads, options=engine_options)

        set_history(self.engine, history)
        self.history = self.engine.history  # what each pack gets, unless its consumer is on this engine
        self._batcher: _Batcher | None = None
        self.max_concurrent = 1  # requests the server may run at once (PullServer's admission)
        if self.engine.batches_prefill and max_batch > 1:
            self.engine.set_max_batch(max_batch)  # before vLLM starts: its max_num_seqs
            self._batcher = _Batcher(self.engine, max_batch)
            self.max_concurrent = max_batch
        self._local = threading.local()  # per request (a batching engine runs several at once)
        self.load_s = time.perf_counter() - t0
        self._memory = MemoryRows(self.info.layers)  # the last request's rows (engines that resume a prefill)
        # ``store``: also continue from this machine's reuse store, and keep every result there
        # (put after the stream ended: :meth:`after_stream`, so the consumer never waits on it).
        self.store = store
        # Its prefill cost curve (issues #39, #47): what it learned before a restart (same model,
        # engine and version, dtype, threads, CPU; not too old), then the calibration and each request.
        self.rate = CostCurve()
        self._curve_key = cost_key(self.info.fingerprint, engine, self.dtype, threads)
        self._curve_path = paths.data_dir() / "costs" / f"producer-{self._curve_key}.json"
        self.curve_saved_at = load_curve(self.rate, self._curve_path, self._curve_key)

    def estimate(self, req: PullRequest) -> float:
        """Seconds this request is expected to compute (rows from its have on; rows this producer
        may continue from memory or its store are not counted: a promise errs on the safe side)."""
        return self.rate.seconds(req.have_tokens, len(req.token_ids) - 1)

    def rates(self) -> dict[str, float]:
        """Tokens per second of whole prompts of a few sizes up to the model's context, from the
        fitted curve (the ``Promise``'s and /metrics'; :meth:`CostCurve.to_rates`)."""
        return self.rate.to_rates(upto=self.info.max_positions)

    def _learn(self, stats: dict[str, Any], rows: int, *, keep: bool = True) -> None:
        start = max(int(stats.get("held_rows") or 0), int(stats.get("reused_rows") or 0))
        if stats.get("batch", 1) == 1:  # a batch's time is the batch's, not one prompt's
            self.rate.observe(start, rows, float(stats.get("prefill_s") or 0))
            if keep:
                save_curve(self.rate, self._curve_path, self._curve_key)

    def warm_up(self) -> dict[str, Any]:
        """Produce throwaway packs before the server listens, so the first consumer pays no
        first-touch cost (the weights paged in, the kernels picked, the pack writer's imports,
        the threads made; a vLLM engine started on the canonical chunk, the one consumers ask
        for unless told otherwise): one pack of a short prompt through :func:`produce_pack`
        on the canonical schedule, and on an engine that resumes a prefill, a second one
        continued from the first's rows (a follow-up's path). It leaves nothing behind: the
        rows are forgotten, nothing is written to the store, the history setting is restored.
        Its timings (seconds): ``{"warm_s", "prefill_s": [...]}``."""
        t0 = time.perf_counter()
        eng = self.engine
        vocab = self.info.vocab_size or 0
        ids = warm_ids(vocab if vocab > 0 else 2, min(WARM_TOKENS, self.info.max_positions - 1))
        chunk = WARM_CHUNK if eng.resumes_prefill else DEFAULT_CHUNK_TOKENS
        batched = self._batcher.prefill if self._batcher is not None else None
        history = eng.history
        times = []
        try:
            memory = MemoryRows(self.info.layers)  # a throwaway one: the producer's own stays empty
            prompts = [ids[: len(ids) * 3 // 4], ids] if eng.resumes_prefill and len(ids) > 2 * chunk else [ids]
            for prompt in prompts:
                job = PackJob(self.info, prompt, self.dtype, chunk, self.engine_name, self.threads,
                              state_every=self.state_every)
                sources: list[Any] = [memory] if eng.resumes_prefill else []
                made = produce_pack(job, [*sources, EngineRows(eng, batched=batched)], PackSink(io.BytesIO()))
                times.append(round(made.prefill_s, 6))
                if prompt is prompts[0]:  # the first touches pages and kernels: not a rate
                    continue
                self._learn(stats_of(made, job), len(prompt) - 1, keep=False)
            calibrated = self.calibrate(vocab, batched)
        finally:
            eng.history = history
        if self._batcher is not None:
            self._batcher.batches.clear()  # the warm-up's batch is no request's
        save_curve(self.rate, self._curve_path, self._curve_key)
        return {"warm_s": round(time.perf_counter() - t0, 6), "prefill_s": times, **calibrated}

    def calibrate(self, vocab: int, batched: Any = None) -> dict[str, Any]:
        """Measure the prefill at two sizes or more before listening (issue #47): the warm-up's
        short prompt again (warm now) and one whole canonical chunk (:data:`CALIBRATE_TOKENS`, up
        to the model's context), fresh rows each (nothing continued), each into the curve. What
        it measured: ``{"calibrate_s", "calibration": [[tokens, seconds], ...]}``."""
        t0 = time.perf_counter()
        top = self.info.max_positions - 1
        sizes = sorted({min(n, top) for n in (WARM_TOKENS, *CALIBRATE_TOKENS) if min(n, top) >= 2})
        measured = []
        for n in sizes:
            ids = warm_ids(vocab if vocab > 0 else 2, n)
            job = PackJob(self.info, ids, self.dtype, DEFAULT_CHUNK_TOKENS, self.engine_name, self.threads,
                          state_every=self.state_every)
            made = produce_pack(job, [EngineRows(self.engine, batched=batched)], PackSink(io.BytesIO()))
            measured.append([n, round(made.prefill_s, 6)])
            self._learn(stats_of(made, job), n - 1, keep=False)
        return {"calibrate_s": round(time.perf_counter() - t0, 6), "calibration": measured}

    def check(self, req: PullRequest) -> PullRequest:
        """Refuse (:class:`Refusal`) a request this producer will not serve; the request to
        compute: in text mode, with the token ids of this producer's tokenization filled in
        (the consumer refuses the pack if they are not its own)."""

        info = self.info
        if req.model_fingerprint != info.fingerprint:
            raise Refusal("model", f"this producer serves model {info.fingerprint}; the request expects "
                                   f"{req.model_fingerprint}")
        if req.tokenizer_fingerprint != info.tokenizer_fingerprint:
            raise Refusal("model", f"this producer's tokenizer is {info.tokenizer_fingerprint}; the request's is "
                                   f"{req.tokenizer_fingerprint}")
        if req.dtype != self.dtype:
            raise Refusal("model", f"this producer serves {self.dtype} KV; the request asks for {req.dtype}")
        if req.text is not None:
            try:
                ids = encode_prompt(info, req.text, chat=req.chat)
            except ConfigError as exc:  # --chat on a model without a chat template
                raise Refusal("model", f"this producer cannot apply a chat template: {exc}") from None
            if len(ids) < 2:
                raise Refusal("too_large", f"the prompt is {len(ids)} token(s) here; a pack needs 2 or more")
            if req.have_tokens >= len(ids):
                raise Refusal("data", f"the request's have ({req.have_tokens} tokens) is not shorter than this "
                                      f"producer's tokenization of the prompt ({len(ids)} tokens)")
            req = replace(req, token_ids=tuple(ids))
        try:
            check_chunk(req.chunk_tokens)
            check_prompt(info, list(req.token_ids))
        except (DataError, MuserError) as exc:
            raise Refusal("too_large", str(exc)) from None
        limit = self.engine.max_model_len  # an engine's own limit (vLLM's), None for the others
        if limit is not None and len(req.token_ids) > limit:
            raise Refusal("too_large", f"{len(req.token_ids)} prompt tokens exceed this producer's limit of {limit} "
                                       f"(the {self.engine_name} engine's max_model_len)")
        vocab = info.vocab_size  # 0: unknown
        if vocab > 0 and max(req.token_ids) >= vocab:
            raise Refusal("data", f"token id {max(req.token_ids)} is outside the vocabulary of {vocab}")
        if req.have_tokens:
            scope = Scope(info.fingerprint, info.tokenizer_fingerprint, req.dtype, req.chunk_tokens)
            if chain_at(scope, list(req.token_ids), req.have_tokens) != req.have_chain:
                raise Refusal("data", f"the request's have chain is not this prompt's first {req.have_tokens} "
                                      "tokens on its schedule")
            req = have_on_grid(req, scope)
        return req

    @property
    def preempts(self) -> bool:
        """Whether a request may pause at a chunk boundary for another (the server's
        admission): one request at a time, on an engine that streams its prefill chunk by chunk."""
        return self._batcher is None and self.engine.streams_prefill

    def run(self, req: PullRequest, out: BinaryIO, pause: Callable[[], None] | None = None) -> dict[str, Any]:
        """Compute ``req`` and write its pack to ``out``: a delta from ``req.have_tokens`` when the
        consumer holds a prefix. The rows of the previous request are kept: a prompt that
        shares whole chunks with it is continued from there (same bytes, less compute).
        ``pause`` (:attr:`preempts`): called after each chunk's frames left; while it blocks,
        other requests compute on this engine (its cache is this request's own; the settings
        this request set on the engine are set again when it returns)."""

        ids = list(req.token_ids)
        eng = self.engine
        # its have chain was checked before admission (check)
        job = PackJob(self.info, ids, req.dtype, req.chunk_tokens, self.engine_name, self.threads,
                      have_tokens=req.have_tokens, have_chain=req.have_chain, state_every=self.state_every)
        sources: list[Any] = [self._memory] if eng.resumes_prefill else []
        if self.store and eng.resumes_prefill:
            sources.append(StoreRows(eng))
        batched = self._batcher.prefill if self._batcher is not None else None
        if batched is None:  # one request at a time: the history is this request's to decide
            # a consumer on this very engine runs no numeric gate: the sliding history would be bytes for nothing
            eng.history = self.history and req.engine != self.engine_name
        self._local.put = None
        between = None
        if pause is not None and batched is None:
            mine = eng.history

            def between() -> None:
                pause()
                eng.history = mine  # what a request computed meanwhile set is undone

        made = produce_pack(job, [*sources, EngineRows(eng, batched=batched)], PackSink(out), between=between)
        rows = made.rows
        if self.store and not (rows.origin == "store" and rows.held == len(ids) - 1):  # a full hit is held already
            self._local.put = (made.full, made.layers)
        stats = stats_of(made, job)
        self._learn(stats, len(ids) - 1)
        stats["rates"] = self.rates()
        return stats

    @property
    def keep_last(self) -> bool:
        """Keep the last request's rows to continue a prompt that shares its prefix."""
        return self._memory.keep

    @keep_last.setter
    def keep_last(self, keep: bool) -> None:
        self._memory.keep = keep

    def after_stream(self, stats: dict[str, Any]) -> None:
        """Once the request's pack is written and its pipe closed: keep the whole result in
        this machine's store (``store``); the entry id, or why not, goes into ``stats``."""
        put, self._local.put = getattr(self._local, "put", None), None
        if put is None:
            return

        t0 = time.perf_counter()
        try:
            stats["stored"] = Store().put_layers(*put).entry.id
        except (MuserError, OSError) as exc:  # the store is a cache: failing to keep the rows is not failing the request
            stats["store_error"] = str(exc)
        stats["store_s"] = round(time.perf_counter() - t0, 6)


def serve(*, listen: str, model: str | None, engine: str, dtype: str | None, threads: int, max_queue: int,
          idle_s: float | None = None, on_event: EventFn | None = None, engine_options: dict | None = None,
          stop: threading.Event | None = None, store: bool = False, max_batch: int = 8,
          live=None, history: bool | None = None, state_every: int = 1) -> dict[str, int]:
    """Load the model once, then answer enrolled consumers until ``stop`` is set; the
    server's counters (served, refused, failed, turned_away: told busy while stopping).
    ``store``: continue from this machine's reuse store too and keep every result there.
    ``max_batch``: on vLLM, how many requests run at once (computed as one batch); torch
    and MLX run one. ``live``: where the server keeps its open connections
    (:class:`~muser_cli.handoff.listener.LiveConnections`; the metrics endpoint's ``/connections``).
    ``history``: packs carry the sliding history (:func:`muser_cli.produce.pipeline.set_history`).
    ``idle_s``: the longest silence tolerated from a consumer once admitted (its Ready, its
    reads); None: the link's default (``DEFAULT_IDLE_S``, 30 s).
    ``state_every``: a hybrid model's packs carry their state snapshots every this many chunks."""

    if max_queue < 0:
        raise UsageError("--max-queue must be >= 0")
    if max_batch < 1:
        raise UsageError("--max-batch must be >= 1")
    if idle_s is None:
        idle_s = DEFAULT_IDLE_S
    if not idle_s > 0:  # NaN too
        raise UsageError(f"--idle-timeout must be a positive number of seconds, got {idle_s}")
    if state_every != 1:  # a usage error before identities and engines
        check_state_every(resolve_model(model), state_every)
    host, port = parse_hostport(listen, listen=True)
    identity, *more = load_identities(paths.keys_dir())  # one per consumer joined
    if identity.consumer is None or identity.consumer == identity.name:
        raise UsageError("this node has not joined a consumer", hint="muser node join BUNDLE (made on the consumer)")
    config = ServeConfig(host=host or "0.0.0.0", port=port, max_queue=max_queue, idle_s=idle_s)
    # A taken port fails now, not after a long model load: bind once and let go (no socket is
    # held while engines start their workers); it listens only once the producer can answer.
    listen_socket(config.host, config.port, backlog=None).close()
    producer = ResidentProducer(model, engine=engine, dtype=dtype, threads=threads, engine_options=engine_options,
                                store=store, max_batch=max_batch, history=history, state_every=state_every)
    # Warm before listening: "listening" means the first request is served as fast as the next.
    warmed = producer.warm_up()
    if on_event is not None:
        on_event("warmed", {"load_s": round(producer.load_s, 6), **warmed, "rates": producer.rates()})
    server = PullServer(identity, config, ledger_dir=ledger_dir() / "serve", compute=producer, on_event=on_event,
                        more=more, live=live, keys_dir=paths.keys_dir())
    try:
        server.bind()
        if stop is not None:
            threading.Thread(target=lambda: (stop.wait(), server.stop()), daemon=True).start()
        server.serve()
    finally:
        server.close()
    return dict(server.counters)


def have_on_grid(req: PullRequest, scope) -> PullRequest:
    """A ``have`` off the chunk grid (17 rows on chunk 8), rounded down to the grid (16): a
    delta from 17 could not be merged exactly, so ``verify`` and ``decode`` would refuse it
    (docs/reuse.md); one from 16 merges from the same stored entry, which holds that point.
    Below one chunk: a full pack."""

    held, chain = delta_point(scope, req.token_ids, req.have_tokens, req.have_chain)
    return req if held == req.have_tokens else replace(req, have_tokens=held, have_chain=chain)


__all__ = ["ResidentProducer", "have_on_grid", "serve"]
