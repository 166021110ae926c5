"""One resident engine, many clients: a bounded queue of requests in front of one thread that
owns the engine. Each request is the lane (:func:`muser_cli.consumer.decode.decode` with the engine
resident): the longest prefix the store holds, the rest pulled from the least busy producer
(a delta), installed as it verifies, the numeric gate on foreign packs, then decode; with no
producer, or none in time (the deadline), or a cut stream, the rest is prefilled here.

A job reports to its client through ``emit(kind, payload)``: ``("text", str)`` per piece,
then ``("done", summary)`` or ``("error", exception)``. A client that went away cancels
its job (:meth:`Job.cancel`): waiting, it is dropped; running, decoding stops at the next token.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO, Callable

from muser_cli.consumer.costs import Backlog, budget_split, costs_for, overrun
from muser_cli.consumer.route import Route, route, with_memory
from muser_cli.consumer.source import RowsFrom
from muser_cli.consumer.decode import Extra, decode
from muser_cli.costcurve import spread_ids
from muser_cli.consumer.lane import Source, answer
from muser_cli.consumer.memory import Held, TurnMemory
from muser_cli.consumer.pool import ProducerPool, about_the_job
from muser_cli.consumer.pull import PipePull, ask_of, learn_from, with_have
from muser_cli.consumer.turns import TurnEngine, Turns
from muser_cli.engines.base import Sampling
from muser_cli.engines.registry import get_consumer
from muser_cli.errors import DataError, MuserError, PromptTooLong
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tokens import chat_template_text, decode_text, encode_prompt, skipped_tokens, tokenizer_for
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS, check_prompt, default_dtype
from muser_cli.service.api import ApiError, Ask, Piece
from muser_cli.service.metrics import fallback_kind
from muser_cli.service.textstream import TextStream
from muser_cli.service.structured import request_constraint
from muser_cli.service.tools import PYTHON_TAG, ToolStream, plan_tools

Emit = Callable[[str, Any], None]

#: The warm-up's throwaway prompt (:meth:`EngineWorker.warm_up`).
WARM_PROMPT = "Warm up: the first request should cost what the second one does."
#: The calibration's prompt sizes (:meth:`EngineWorker.calibrate`): a short one, and one whole
#: chunk or this many tokens, whichever is more (up to the model's context).
CALIBRATE_SHORT = 32
CALIBRATE_LONG = 256


class _Stop(Exception):
    """Raised from the token callback: a stop string appeared, or the client went away."""


@dataclass(eq=False)  # a job is itself: equal only to itself, hashable
class Job:
    """One request for the worker. ``emit(kind, payload)`` tells its client; after its last
    event (``done`` or ``error``) nothing more is told, so a job the server ended itself
    (:meth:`cut_off`) says nothing after its error, whatever its thread still finishes."""

    ask: Ask
    emit: Emit
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    state: Any = None  # the running request's _RunState
    looked: float | None = None  # when the service last looked whether its client is still there
    cut: ApiError | None = None  # the error the server ended it with as it shut down (:meth:`cut_off`)

    def __post_init__(self) -> None:
        self._tell, self._over, self._said = self.emit, False, threading.Lock()
        self.emit = self._emit_once

    def _emit_once(self, kind: str, payload: Any) -> None:
        with self._said:
            if self._over:
                return
            self._over = kind in ("done", "error")
            self._tell(kind, payload)

    def cancel(self) -> None:
        self.cancelled.set()

    def cut_off(self, error: ApiError) -> bool:
        """The server ends this job itself (it shuts down): its client is told ``error`` now,
        its thread stops at its next token. False: its answer was already given."""
        with self._said:
            if self._over:
                return False
            self.cut, self._over = error, True
            self.cancelled.set()
            self._tell("error", error)
            return True


class QueueFull(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(429, f"the server is busy: {limit} requests already wait for the engine; try again later",
                         type="rate_limit_error", code="queue_full", headers={"retry-after": "1"})


class Draining(ApiError):
    def __init__(self) -> None:
        super().__init__(503, "the server is shutting down and takes no new requests", type="server_error",
                         code="draining")


class ShutDown(ApiError):
    """A request the server ended itself as it stopped (:meth:`EngineWorker.cut`): its drain's
    bound passed, or a second signal came, before its answer was finished."""

    def __init__(self, why: str) -> None:
        super().__init__(503, f"the server is shutting down and ended this request before its answer was "
                              f"finished ({why}); send it again", type="server_error", code="shut_down")


class _Counting:
    """The pull pipe, counting the pack bytes decode reads from it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.bytes = raw, 0

    def readinto(self, b) -> int:
        n = self.raw.readinto(b) or 0
        self.bytes += n
        return n

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.bytes += len(data)
        return data

    def close(self) -> None:
        self.raw.close()


@dataclass
class Config:
    model: str | None
    engine: str = "torch"
    dtype: str | None = None
    threads: int = 1
    producers: tuple[str, ...] = ()
    prefill_deadline: float | None = None  # seconds to wait for a producer's first frame
    max_queue: int = 8
    chunk_tokens: int | None = None
    reuse: bool = True
    store: bool = False
    audit: int | None = None
    max_batch: int = 4  # requests running at once, taking the engine's turns (docs/serve.md)
    exact: bool = False  # each sequence decoded alone, even on an engine that batches decode steps
    turn_memory_mb: float = 1024.0  # conversations' rows kept for their next turn (docs/serve.md); 0: off


class EngineWorker:
    """Up to ``config.max_batch`` requests running at once, each on a thread of its own, taking
    the engine's turns (:class:`muser_cli.consumer.turns.Turns`: one decode step or one prefill
    chunk a turn, first come first served); up to ``config.max_queue`` more waiting."""

    def __init__(self, config: Config, metrics: Any = None, log: Callable[[dict], None] | None = None) -> None:
        if config.max_queue < 0:
            raise MuserError("--max-queue must be >= 0")
        if config.max_batch < 1:
            raise MuserError("--max-batch must be >= 1")
        self.config = config
        self.info = resolve_model(config.model)
        tokenizer_for(self.info)
        self.dtype = config.dtype or default_dtype(config.engine)
        self.turns = Turns(on_step=metrics.batch.observe if metrics is not None else None,
                           on_first_hold=lambda s: self.costs.observe_step(s),  # a batched step's time
                           on_hold=lambda wall, ran, waited: self.costs.share.sample(wall, ran, waited))
        raw = get_consumer(config.engine, self.info, dtype=self.dtype, threads=config.threads)
        self.batched = raw.batches_decode and not config.exact and config.max_batch > 1
        # what is ahead of a new request on the engine: the consumer's own queue in the prediction (issue #39)
        self.backlog = Backlog(batched=self.batched)
        self.chunk = config.chunk_tokens or DEFAULT_CHUNK_TOKENS
        self._mine = threading.local()  # the job this thread runs (its prefill chunks, in the backlog)
        if self.batched:  # concurrent sequences' decode steps computed as one batch (docs/serve.md)
            raw.batch_decode(self.turns, on_step=metrics.batch.observe if metrics is not None else None)
        self.engine = TurnEngine(raw, self.turns)
        self.pool = ProducerPool(config.producers)
        self.costs = costs_for(self.info.fingerprint, config.engine, self.dtype, config.threads)  # issue #39
        self.costs.share.look = True  # idle, the machine's other work says what share its cores leave it
        self.costs.share.now()  # the first look: the next measures from here
        self.memory: TurnMemory | None = None  # turn memory (docs/serve.md): an engine that resumes anywhere
        if config.turn_memory_mb > 0 and raw.resumes_prefill:
            self.memory = TurnMemory([s.kind for s in self.info.layers], self._memory_key(),
                                     int(config.turn_memory_mb * 1e6))
        self.metrics = metrics
        self.log = log or (lambda record: None)
        self._store_warned = False
        self._token_texts: dict[int, str] = {}
        self._cv = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: set[Job] = set()
        self._closing = False
        self.draining = False
        self._threads = [threading.Thread(target=self._loop, name=f"muser-seq-{i}", daemon=True)
                         for i in range(config.max_batch)]
        for thread in self._threads:
            thread.start()

    def _memory_key(self) -> tuple:
        return (self.info.fingerprint, self.info.tokenizer_fingerprint, self.config.engine, self.dtype)

    def warm_up(self) -> dict[str, Any]:
        """One throwaway request on the engine before the service listens, so the first client
        pays no first-touch cost: the lane's local path (tokenize, a prefill on the canonical
        schedule, install, the first decode steps); then the calibration (:meth:`calibrate`).
        It leaves nothing behind: no store read or written, no producer asked, no turn taken, no
        metric counted. Its time, seconds, and what the calibration measured."""
        c = self.config
        t0 = time.perf_counter()
        decode(None, model=c.model, prompt=WARM_PROMPT, chat=False, max_new_tokens=2, engine=c.engine,
               dtype=self.dtype, threads=c.threads, chunk_tokens=c.chunk_tokens, fallback_reason="warm-up",
               reuse=False, store=False, resident=self.engine.inner)  # the engine itself: no turn taken
        warm_s = time.perf_counter() - t0
        return {"warm_s": round(warm_s, 6), **self.calibrate()}

    def calibrate(self) -> dict[str, Any]:
        """The local prefill measured at two sizes before the service listens (issue #47): a
        short prompt and one whole chunk (up to the model's context), each a fresh local decode
        of one token, into the cost model (a fit of fixed, per-token and depth costs: the route's
        local path is then predicted from this machine's own measurements from the first request
        on). Skipped when what this machine kept (the cost file) is calibrated already.
        ``{"calibrate_s", "calibration": [[tokens, seconds], ...]}``."""
        if self.costs.local.calibrated:
            return {"calibrate_s": 0.0, "calibration": [], "calibration_kept": True}
        c, t0, measured = self.config, time.perf_counter(), []
        top = self.info.max_positions - 1
        for n in sorted({min(n, top) for n in (CALIBRATE_SHORT, max(self.chunk + 1, CALIBRATE_LONG)) if min(n, top) >= 2}):
            ids = spread_ids(self.info.vocab_size or 2, n)
            out = decode(None, model=c.model, prompt="", chat=False, max_new_tokens=1, engine=c.engine,
                         dtype=self.dtype, threads=c.threads, chunk_tokens=c.chunk_tokens, fallback_reason="calibration",
                         reuse=False, store=False, resident=self.engine.inner, prompt_ids=ids, info=self.info)
            measured.append([n, round(out.prefill_s, 6)])
            self.costs.observe(held=0, rows=n - 1, prefill_s=out.prefill_s, local=True)
        self.costs.save()
        return {"calibrate_s": round(time.perf_counter() - t0, 6), "calibration": measured}

    # -------------------------------------------------------------- queue
    def submit(self, job: Job) -> None:
        """Queue ``job`` (QueueFull past the bound, Draining once SIGTERM came)."""
        with self._cv:
            if self.draining:
                raise Draining()
            if len(self._running) >= self.config.max_batch and len(self._waiting) >= self.config.max_queue:
                raise QueueFull(self.config.max_queue)
            self._waiting.append(job)
            self.backlog.arrive(job, tokens=_guess_tokens(job.ask.prompt), chunk=self.chunk)  # until tokenized
            self._gauges()
            self._cv.notify_all()

    def withdraw(self, job: Job) -> None:
        """The client went away: a waiting job leaves the queue, a running one stops at its next token."""
        job.cancel()
        with self._cv:
            if job in self._waiting:
                self._waiting.remove(job)
                self.backlog.finish(job)
                self._gauges()

    def busy(self) -> int:
        with self._cv:
            return len(self._waiting) + len(self._running)

    def drain(self, timeout: float | None = None) -> bool:
        """Refuse new work, wait for what is queued and running; True when all finished."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self.draining = True
            while self._waiting or self._running:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 1.0)
        return True

    def cut(self, error: ApiError) -> list[Job]:
        """Shutting down: every waiting and running job ended now with ``error`` (its client's
        answer: a 503, or a stream's error event), new ones refused; the running ones stop at
        their next token. The jobs cut (those whose answer was not given already)."""
        with self._cv:
            self.draining = True
            jobs = list(self._waiting) + list(self._running)
            for job in self._waiting:
                self.backlog.finish(job)
            self._waiting.clear()
            self._gauges()
            self._cv.notify_all()
        return [job for job in jobs if job.cut_off(error)]

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(5)
        self.engine.inner.close()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue.set(len(self._waiting))
            self.metrics.running.set(len(self._running))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closing:
                    self._cv.wait()
                if self._closing and not self._waiting:
                    return
                job = self._waiting.popleft()
                self._running.add(job)
                self._gauges()
            self.turns.join()
            self._mine.job = job
            try:
                if not job.cancelled.is_set():
                    self._run(job)
            except BaseException as exc:  # noqa: BLE001 - reported to the client, the engine serves on
                job.emit("error", exc)
            finally:
                self._mine.job = None
                self.backlog.finish(job)
                self.turns.leave()
                with self._cv:
                    self._running.discard(job)
                    self._gauges()
                    self._cv.notify_all()

    # -------------------------------------------------------------- one request
    def _run(self, job: Job) -> None:
        ask = job.ask
        try:
            plan = plan_tools(ask, chat_template_text(self.info)) if ask.chat else None  # tools: docs/serve.md
            ids = encode_prompt(self.info, plan.turns if plan is not None else ask.prompt, chat=ask.chat,
                                tools=plan.template_tools if plan is not None else None,
                                prefix=plan.prefix if plan is not None else "")
            check_prompt(self.info, ids, new_tokens=ask.max_tokens)
            self.backlog.arrive(job, tokens=len(ids), chunk=self.chunk)  # its length now known
        except PromptTooLong as exc:
            raise ApiError(400, str(exc), param="messages" if ask.chat else "prompt",
                           code="context_length_exceeded") from None
        except MuserError as exc:
            raise ApiError(400, str(exc)) from None
        self._check_sampling(ask, plan is not None and bool(plan.tools))
        constraint = request_constraint(ask, plan, self.info, engine=self.config.engine,  # structured output
                                        shapes=self.engine.inner.shapes_logits)
        state = _RunState(job, self)
        for choice in state.choices:
            choice.constraint = constraint  # each sequence takes its own matcher from it
        state.ids = ids
        state.tools = plan.stream() if plan is not None else None
        if state.tools is not None:  # an opening that is a special token: decoding drops it, the parser must see it
            state.markers = skipped_tokens(self.info, [state.tools.fmt.opening, PYTHON_TAG])
        job.state = state  # the service reads the rows' source from it at the first token
        out = None
        try:
            out = self._decode(job, state, ids)
        except _Stop:
            pass
        finish = "stop" if state.stream.stopped or (out is not None and
                                                     out.engine_stats.get("stop_reason") == "eos") else "length"
        if job.cancelled.is_set():
            finish = "cancelled"
        tail = state.stream.finish()
        if state.tools is not None and not job.cancelled.is_set():
            for kind, payload in state.tools.feed(tail) + state.tools.finish():
                job.emit(kind, payload)
            if state.tools.error is not None:
                raise state.tools.error
        elif (tail or state.first.unsent) and not job.cancelled.is_set():
            job.emit("text", state.first.piece(tail))
        state.first.finish_reason = finish
        for extra, choice in zip(state.extras, state.choices[1:]):
            if extra.error is not None and not isinstance(extra.error, _Stop):
                raise extra.error
            choice.end(finish == "cancelled")
        summary = state.summary(ids, finish)
        if state.tools is not None:
            summary["text"], summary["tool_calls"] = state.tools.content, len(state.tools.calls)
            summary["tool_format"] = state.tools.fmt.name  # the template's own, or muser's generic (docs/serve.md)
            if state.tools.calls and finish != "cancelled":
                summary["finish_reason"] = "tool_calls"
        if out is not None and out.store_problems:
            summary["store_problems"] = list(out.store_problems)
        summary["batched"] = out is not None and bool(out.engine_stats.get("batched"))  # stepped with others' sequences
        self._observe(state, summary)
        ticket = self._will_remember(state, ids, finish)  # before the answer goes: the next turn waits for it
        try:
            job.emit("done", summary)
        finally:
            if ticket is not None:
                self._remember(state, ids, ticket)

    def _will_remember(self, state: "_RunState", ids: list[int], finish: str) -> int | None:
        """Whether this answer's rows go to the turn memory: a ticket (lookups that it would
        serve deeper wait for it), or None."""
        rows = state.rows
        if self.memory is None or rows is None or finish == "cancelled" or not state.stream.ids:
            return None
        return self.memory.begin(self._conversation(ids, state))

    def _conversation(self, ids: list[int], state: "_RunState") -> list[int]:
        """The prompt and the answer's tokens (what the engine generated, up to the model's context)."""
        return (list(ids) + list(state.stream.ids))[: self.info.max_positions - 1]

    def _remember(self, state: "_RunState", ids: list[int], ticket: int) -> None:
        """After the answer was given: its prompt's rows extended over the answer's tokens by the
        engine (taking the engine's turns as any prefill, one chunk a turn) and kept, with the
        layers that cannot be cut anywhere as of the prompt's end too (docs/serve.md). A failure
        only means the next turn computes more: logged, never raised."""
        assert self.memory is not None and state.rows is not None
        memory, got, c = self.memory, state.rows, self.config
        tokens = self._conversation(ids, state)
        rows = len(ids) - 1
        try:
            t0 = time.perf_counter()
            layers = self.engine.prefill_from(got.layers, rows=rows, token_ids=tokens[rows:],
                                              chunk_tokens=c.chunk_tokens or DEFAULT_CHUNK_TOKENS,
                                              progress=self._chunk_done, anywhere=True)
            kept = memory.keep(ticket, tokens, layers, {rows: got.layers})
            self.log({"event": "turn_memory", "kept": kept, "tokens": len(tokens), "extended": len(tokens) - rows,
                      "extend_ms": round((time.perf_counter() - t0) * 1000, 3), "entries": len(memory),
                      "bytes": memory.nbytes, "evicted": memory.evicted})
        except Exception as exc:  # noqa: BLE001 - a cache: the answer was given; the next turn computes more
            memory.end(ticket)
            self.log({"event": "warning", "warning": f"turn memory: an answer's rows were not kept "
                                                     f"({type(exc).__name__}: {exc})"})

    def _check_sampling(self, ask: Ask, tools: bool) -> None:
        """What the engine and the model cannot honour, refused (400) before anything runs."""
        shaping = [k for k, v in (("presence_penalty", ask.presence_penalty), ("frequency_penalty",
                                  ask.frequency_penalty), ("logit_bias", ask.logit_bias),
                                  ("top_logprobs" if ask.chat and ask.logprobs else "logprobs",
                                   ask.logprobs is not None)) if v]
        if shaping and not self.engine.inner.shapes_logits:
            raise ApiError(400, f"{shaping[0]} is not supported by the {self.config.engine} engine",
                           param=shaping[0])
        vocab = self.info.vocab_size
        bad = [t for t, _ in ask.logit_bias if vocab and t >= vocab]
        if bad:
            raise ApiError(400, f"logit_bias: token id {bad[0]} is outside the model's vocabulary of {vocab}",
                           param="logit_bias")
        if tools and ask.n > 1:
            raise ApiError(400, "n > 1 with tools is not supported", param="n")
        if tools and ask.logprobs is not None:
            raise ApiError(400, "logprobs with tools are not supported", param="logprobs")

    def token_text(self, token: int) -> str:
        """One token's text as logprobs show it (special tokens written out; a token that is part
        of a character: U+FFFD)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = decode_text(self.info, [token], skip_special_tokens=False)
        return text

    def _decode(self, job: Job, state: "_RunState", ids: list[int]):
        ask, c = job.ask, self.config
        sampling = state.first.sampling()
        state.extras = [Extra(choice.sampling(), choice.on_token) for choice in state.choices[1:]]

        def run(src, why: str, held: Held | None = None):
            state.why, state.rows = why, None
            if src is None:  # prefilled here (what is held aside): its chunks are the engine's work
                self.backlog.routed(job, start=held.rows if held is not None else 0, end=len(ids) - 1,
                                    chunk=self.chunk, pulled=False)
            state.out = decode(src, model=c.model, prompt=ask.prompt, chat=ask.chat, max_new_tokens=ask.max_tokens,
                          engine=c.engine, dtype=self.dtype, threads=c.threads, sampling=sampling,
                          chunk_tokens=c.chunk_tokens, fallback_reason=why, reuse=c.reuse, store=c.store,
                          audit=c.audit, resident=self.engine, on_token=state.on_token, on_rows=state.on_rows,
                          progress=self._chunk_done, prompt_ids=ids, info=self.info,  # tokenized once, in _run
                          held=held, more=state.extras, hedge=state.live if src is not None else None)
            return state.out

        state.t_lane = time.perf_counter()  # the lane begins: the consumer's queue is behind it (issue #39)
        state.held_t0 = self.turns.held_s()
        held = self.memory.find(ids) if self.memory is not None else None
        if not self.pool:  # the prediction as the request starts, the queue ahead of it included
            have = held.rows if held is not None else 0
            if c.reuse and held is None:  # what this machine's store holds of it
                have = with_have(ask_of(ids, self.info, chunk_tokens=c.chunk_tokens, dtype=self.dtype,
                                        engine=c.engine)).have_tokens
            state.route = route(self.costs, tokens=len(ids), held=have, producer=None, backlog=self.backlog, key=job,
                                chunk=self.chunk)
        live = self._pull(job, held) if self.pool else None
        if held is not None and (state.held_wins or not self.pool):
            return run(None, "", held=held)  # the turn memory holds the prompt (or all but a tail faster here)
        if live is None:
            return run(None, state.route_why or ("no producer given" if not self.pool else "no producer up"))
        state.producer = live.producer
        counting = state.counting = _Counting(live.reader)
        # a pack refused once a token was out cannot be replaced: the refusal is the answer
        got = answer(Source(counting, live.producer, f"nothing from {live.producer}", live=live), run,
                     pool=self.pool, recompute=lambda exc: state.first_token is None)
        state.shipped = counting.bytes
        # the answer says what happened; the hint (what to do: command-line advice) is the log line's alone
        state.pull_error = live.reason(hint=False) if got.pull_error is not None else ""
        state.pull_hint = live.hint if got.pull_error is not None else ""
        if self.metrics is not None:
            # up: it answered (served, or declined this one request: late, too large); 0: unreachable or failing
            down = got.pull_error is not None and not about_the_job(got.pull_error)
            self.metrics.producer_up.labels(live.producer).set(0 if down else 1)
        if got.refused is not None:
            state.refused = got.refused
        return got.out

    def _pull(self, job: Job, held: Held | None = None):
        """The pull for ``job``, or None: no producer up, or the route (issue #39: ``MUSER_ROUTE``,
        :func:`muser_cli.consumer.route.route`) predicts this machine answers sooner, or the turn
        memory holds ``held`` rows of the prompt and computing the rest here is predicted no
        slower than any producer (``state.held_wins``): a prompt held is never pulled again."""
        ask, c, state = job.ask, self.config, job.state
        deadline = ask.prefill_deadline if ask.prefill_deadline is not None else c.prefill_deadline
        ids = state.ids  # tokenized once, in _run
        got = ask_of(ids, self.info, chunk_tokens=c.chunk_tokens, dtype=self.dtype, engine=c.engine)
        got = with_have(got) if c.reuse else got
        addr = self.pool.pick()
        queue = {"backlog": self.backlog, "key": job, "chunk": self.chunk}  # the consumer's own queue (issue #39)
        plan = state.route = route(self.costs, tokens=len(ids), held=got.have_tokens, producer=addr, **queue)
        if held is not None:  # the turn memory's rows, against the producer's paths
            mine = with_memory(self.costs, plan, tokens=len(ids), held=held.rows, producer=addr, **queue)
            if mine is not None:
                state.held_wins, state.route = True, mine
                if addr is not None:
                    self.pool.release(addr)
                    self.costs.answered(addr, job)  # the route's ask is not made: off that producer's queue
                return None
        if addr is None:
            return None
        if not plan.ask:
            self.pool.release(addr)
            state.route_why = plan.why
            return None
        if plan.budget_ms is not None:
            got = replace(got, budget_ms=plan.budget_ms)
        self.backlog.routed(job, start=got.have_tokens, end=len(ids) - 1, chunk=self.chunk, pulled=True)
        state.live = PipePull(addr, lambda: got, timeout=deadline, costs=self.costs, plan=plan, race=True)
        return state.live

    def _chunk_done(self, *progress: Any) -> None:
        """A prefill chunk done (decode's progress callback: ``("prefill", done, total)``): the
        backlog knows it, and the running requests take a step each."""
        job = getattr(self._mine, "job", None)
        if job is not None and len(progress) >= 2 and isinstance(progress[1], int):
            self.backlog.progress(job, progress[1])
        self.turns.pass_turn()

    def _budget(self, state: "_RunState", s: dict[str, Any]) -> None:
        """The answer's route and budget split (issue #39) into its summary ``s``; what it
        measured into the cost model. The budget: the request's deadline if it set one, else
        the chosen path's predicted TTFT with a quarter more (and 5 ms) of headroom."""
        out, live, plan, costs = state.out, state.live, state.route, self.costs
        if plan is None and s.get("ttft_ms") is not None:
            plan = route(costs, tokens=len(state.ids), held=s.get("held_rows") or 0, producer=None)
        if plan is not None:
            s["route"] = plan.to_json(s.get("source"))
            if live is not None and live.promise is not None:
                s["route"]["promise"] = live.promise
        if out is None or s.get("ttft_ms") is None:
            return
        marks = live.marks if live is not None else {}
        arrived, ttft = state.job.arrived, s["ttft_ms"] / 1000
        since = (lambda k: marks[k] - arrived if k in marks else None)
        source = RowsFrom(s["source"])
        from_pack = source.shipped
        spot = out.spot_check or {}
        gate_ms = (spot.get("ms") or 0) if spot.get("ran") else 0
        if isinstance(spot.get("sampled"), dict):
            gate_ms += spot["sampled"].get("ms") or 0
        gate = gate_ms / 1000
        local_s = out.prefill_s if not from_pack or source == RowsFrom.PARTIAL_LOCAL else 0.0
        waited = 0.0  # a local prefill's waits for the others' turns: the consumer's queue, as predicted
        if live is None and not from_pack and state.engine_s is not None:
            waited = min(local_s, max(0.0, out.prefill_s - state.engine_s))
        split = budget_split(
            ttft_s=ttft, consumer_queue_s=state.t_lane - arrived + waited, remote=live is not None,
            lane_s=state.t_lane - arrived, serving_s=since("serving"),
            end_s=since("last_byte") if "last_byte" in marks else since("end"),
            rows_ready_s=None, local_prefill_s=local_s - waited,
            install_s=max(0.0, out.prefill_s - gate) if from_pack and source != RowsFrom.PARTIAL_LOCAL else 0.0,
            gate_s=gate, pack_bytes=int(s.get("bytes") or 0),
            link_Bps=self._measured_link(live.producer) if live is not None else None)
        budget_s = state.job.ask.prefill_deadline
        if budget_s is None and plan is not None:
            budget_s = plan.seconds * 1.25 + 0.005
        over = overrun(split, budget_s, plan.chosen_parts if plan is not None else {})
        s["budget"] = {"budget_ms": round(budget_s * 1000, 3) if budget_s is not None else None,
                       "split_ms": {k: round(v * 1000, 3) for k, v in split.items()}, "overrun": over}
        state.split, state.overrun = split, over
        engine_s = state.engine_s  # its own turns' time (the others' chunks and steps left out)
        learn_from(costs, out, marks=marks, accepted=live.accepted if live is not None else None,
                   prefill_s=min(out.prefill_s, engine_s) if engine_s is not None else None,
                   producer=live.producer if live is not None else None)
        costs.save()

    def _measured_link(self, producer: str) -> float | None:
        """The link rate from ``producer`` as pulls or a probe measured it (None: only the cold guess)."""
        rate, source = self.costs.link_for(producer)
        return None if source == "cold" else rate

    def _observe(self, state: "_RunState", s: dict[str, Any]) -> None:
        try:
            self._budget(state, s)
        except Exception as exc:  # noqa: BLE001 - bookkeeping: never fails an answer that was given
            s["budget_error"] = f"{type(exc).__name__}: {exc}"
        m = self.metrics
        gone = s.get("finish_reason") == "cancelled"  # its client went away while it ran
        if state.job.cut is None:  # one the server cut as it shut down: the service logs its line
            self.log({"event": "request", "status": 499 if gone else 200,
                      **({"reason": "the client went away while its answer was made"} if gone else {}),
                      **{k: v for k, v in s.items() if k not in ("text", "choices")},
                      **({"user": state.job.ask.user} if state.job.ask.user is not None else {})})
        if s.get("store_problems") and not self._store_warned:  # once: every answer's line says it too
            self._store_warned = True
            self.log({"event": "warning", "warning": f"the store could not keep an answer's rows "
                                                     f"({s['store_problems'][0]}); answering on, counted in "
                                                     "muser_store_errors_total"})
        if m is None:
            return
        source = s["source"]
        if s.get("ttft_ms") is not None:
            m.ttft.labels(source).observe(s["ttft_ms"] / 1000)
        for gap in state.gaps:
            m.token.labels(source).observe(gap)
        if s["bytes"]:
            m.shipped.labels(s.get("producer") or "").inc(s["bytes"])
        m.held.inc(s.get("held_rows") or 0)
        m.computed.inc(s.get("computed_rows") or 0)
        m.tokens.inc(s["completion_tokens"])
        if s.get("fallback_reason"):
            m.fallbacks.labels(fallback_kind(s["fallback_reason"])).inc()
        if state.refused is not None:
            m.gate.inc()
        if s.get("store_problems"):
            m.store_errors.inc()
        if state.split is not None:
            m.observe_budget(state.split, state.overrun)


def _guess_tokens(prompt: Any) -> int:
    """A prompt's length in tokens before it is tokenized (about four characters a token)."""
    if isinstance(prompt, str):
        return len(prompt) // 4 + 1
    text = sum(len(str(m.get("content") or "")) for m in prompt if isinstance(m, dict)) if isinstance(
        prompt, list) else 0
    return text // 4 + 1


class _RunState:
    """What one running request has seen: its rows' source, its tokens and their times."""

    def __init__(self, job: Job, worker: EngineWorker) -> None:
        self.job = job
        self.choices = [_Choice(job, worker, i) for i in range(job.ask.n)]  # n: each its own sequence
        self.first = self.choices[0]  # this state's own sequence (on_token); the others: decode's ``more``
        self.extras: list[Extra] = []
        self.stream = self.first.stream
        self.rows = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.gaps: list[float] = []
        self.producer: str | None = None
        self.shipped = 0
        self.refused: DataError | None = None
        self.pull_error = ""
        self.pull_hint = ""  # the failed pull's hint: its log line's, never the answer's
        self.why = ""  # the fallback reason decode was given
        self.ids: list[int] = []
        self.counting: _Counting | None = None
        self.turns = worker.turns
        self.backlog = worker.backlog
        self.held_t0 = 0.0  # the engine time this thread had held when the lane began
        self.engine_s: float | None = None  # ... and from then to its rows ready (the prompt's engine work)
        self.tools: ToolStream | None = None  # the calls read from the answer (a chat with tools)
        self.markers: dict[int, str] = {}  # special tokens decoding drops that the tool parser reads
        # issue #39: the route taken, the pull, the outcome, and the budget split measured from them
        self.t_lane = job.arrived  # when the lane began (the consumer's queue is before it)
        self.route: Route | None = None
        self.route_why = ""  # why the route kept this request local
        self.live: PipePull | None = None
        self.out: Any = None  # decode's outcome
        self.split: dict[str, float] | None = None
        self.overrun: str | None = None
        self.held_wins = False  # the turn memory's rows answer it: no producer asked

    def on_rows(self, rows) -> None:
        self.rows = rows
        self.engine_s = self.turns.held_s() - self.held_t0

    def on_token(self, token: int) -> None:
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
            self.backlog.decoding(self.job)
        else:
            self.gaps.append(now - (self.last_token or now))
        self.last_token = now
        if self.job.cancelled.is_set():
            raise _Stop("the client went away")
        self.first.took(token)
        piece = self.stream.push(token)
        if self.tools is not None:
            for kind, payload in self.tools.feed(self.markers.get(int(token), "") + piece):
                self.job.emit(kind, payload)
            if self.tools.done:
                raise _Stop("the tool call asked for is complete, or it failed")
        elif piece:
            self.job.emit("text", self.first.piece(piece))
        if self.stream.stopped:
            raise _Stop("a stop string")
        self.turns.pass_turn()  # one step done: every other running request takes one

    def summary(self, ids: list[int], finish: str) -> dict[str, Any]:
        """What the client, the log and the metrics are told about this request."""
        rows = self.rows
        source = rows.source if rows is not None else RowsFrom.LOCAL
        if source == RowsFrom.STORE_LOCAL:
            source = RowsFrom.STORE  # some rows held, the rest prefilled here: both are this machine's
        shipped = rows is not None and (rows.pack is not None or bool(rows.handoff_rows))
        held = rows.held if rows is not None else 0
        reason, computed = "", 0
        if rows is not None and rows.pack is None:
            reason = rows.reason or self.pull_error or self.why
            if rows.handoff_rows is not None and rows.reason and self.pull_error:  # a cut stream: why it was cut
                reason = f"{rows.reason} ({self.pull_error})"
            if self.refused is not None:
                reason = f"the pack from {self.producer} was refused: {self.refused}"
            computed = rows.local_rows if rows.local_rows is not None else len(ids) - 1 - held
        ttft = (self.first_token - self.job.arrived) * 1000 if self.first_token is not None else None
        received = self.shipped or (self.counting.bytes if self.counting is not None else 0)
        return {"source": source, "producer": self.producer if shipped else None,
                "ttft_ms": round(ttft, 3) if ttft is not None else None, "bytes": received,
                "prompt_tokens": len(ids), "completion_tokens": sum(len(c.stream.ids) for c in self.choices),
                "held_rows": held,
                "computed_rows": computed, "finish_reason": finish, "fallback_reason": reason,
                **({"pull_hint": self.pull_hint} if self.pull_hint and self.pull_error and reason else {}),
                "text": self.stream.text, **self._choices()}

    def _choices(self) -> dict[str, Any]:
        """``choices``: each choice's text, finish and logprob entries, where there are several or
        logprobs were asked for (else the summary's text and finish are the one choice's)."""
        if len(self.choices) == 1 and self.job.ask.logprobs is None:
            return {}
        return {"choices": [{"index": c.index, "text": c.stream.text, "finish_reason": c.finish_reason,
                             "logprobs": c.entries if c.record is not None else None} for c in self.choices]}


class _Choice:
    """One choice's sequence: its sampling (seeded ``seed + index``), its text, its logprob entries
    (``{"id", "token", "logprob", "offset", "top": [{"id", "token", "logprob"}]}``: ``offset``, the
    token's place in the choice's text as the tokens' own texts add up) and how it ended. The
    first choice's tokens come through :meth:`_RunState.on_token`; the others' through
    :meth:`on_token`, on the threads decode runs them on."""

    def __init__(self, job: Job, worker: EngineWorker, index: int) -> None:
        self.job, self.worker, self.index = job, worker, index
        self.stream = TextStream(worker.info, job.ask.stop)
        self.record: list | None = [] if job.ask.logprobs is not None else None  # the engine appends to it
        self.entries: list[dict[str, Any]] = []
        self.sent = 0  # entries given out with a piece
        self.offset = 0
        self.last: int | None = None
        self.finish_reason: str | None = None
        self.constraint = None  # the grammar of a structured answer (service/structured.py)

    def sampling(self) -> Sampling:
        ask = self.job.ask
        seed = None if ask.seed is None else (ask.seed + self.index) % (1 << 63)
        return Sampling(temperature=ask.temperature, top_p=ask.top_p, seed=seed, presence_penalty=ask.presence_penalty,
                        frequency_penalty=ask.frequency_penalty, logit_bias=ask.logit_bias, logprobs=ask.logprobs,
                        record=self.record, constraint=self.constraint, **ask.filters(self.job.state.ids))

    @property
    def unsent(self) -> bool:
        return self.sent < len(self.entries)

    def took(self, token: int) -> None:
        """The engine gave ``token`` (its logprobs, if asked, are on the record by now)."""
        self.last = token
        if self.record is None or len(self.entries) >= len(self.record):
            return
        logprob, top = self.record[len(self.entries)]
        text = self.worker.token_text(token)
        self.entries.append({"id": token, "token": text, "logprob": logprob, "offset": self.offset,
                             "top": [{"id": t, "token": self.worker.token_text(t), "logprob": v} for t, v in top]})
        self.offset += len(text)

    def piece(self, text: str) -> str:
        """``text`` as given out: with its index and the logprob entries not given out yet."""
        if self.record is None and self.index == 0:
            return text
        entries, self.sent = self.entries[self.sent:], len(self.entries)
        return Piece(text, self.index, entries if self.record is not None else None)

    def on_token(self, token: int) -> None:
        if self.job.cancelled.is_set():
            raise _Stop("the client went away")
        self.took(token)
        piece = self.stream.push(token)
        if piece:
            self.job.emit("text", self.piece(piece))
        if self.stream.stopped:
            raise _Stop("a stop string")
        self.worker.turns.pass_turn()

    def end(self, cancelled: bool) -> None:
        """The sequence ended: its held-back text (and logprobs) given out, its finish reason."""
        eos = self.last is not None and self.last in self.worker.info.eos_token_ids
        self.finish_reason = "cancelled" if cancelled else "stop" if self.stream.stopped or eos else "length"
        tail = self.stream.finish()
        if (tail or self.unsent) and not cancelled:
            self.job.emit("text", self.piece(tail))


__all__ = ["Config", "Draining", "EngineWorker", "Job", "QueueFull", "ShutDown"]
