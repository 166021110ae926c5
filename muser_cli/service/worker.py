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
from dataclasses import dataclass, replace
from typing import Any, Callable

from muser_cli.consumer.costs import Backlog, costs_for
from muser_cli.consumer.decode import Extra, decode
from muser_cli.consumer.lane import Source, answer
from muser_cli.consumer.memory import Held, TurnMemory
from muser_cli.consumer.pool import ProducerPool, about_the_job
from muser_cli.consumer.pull import PipePull, ask_of, with_have
from muser_cli.consumer.route import route, with_memory
from muser_cli.consumer.turns import TurnEngine, Turns
from muser_cli.consumer.warm import calibrate, warm_up
from muser_cli.engines.registry import get_consumer
from muser_cli.errors import MuserError, PromptTooLong
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tokens import chat_template_text, decode_text, encode_prompt, skipped_tokens, tokenizer_for
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS, check_prompt, default_dtype
from muser_cli.service.api import ApiError, Ask
from muser_cli.service.outcome import observe
from muser_cli.service.request import CountingReader, Job, RunState, Stop, guess_tokens
from muser_cli.service.structured import request_constraint
from muser_cli.service.tools import PYTHON_TAG, plan_tools


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
        self.store_warned = False  # the store's trouble logged once (service/outcome.py)
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
        warm_s = warm_up(self.engine.inner, model=c.model, engine=c.engine, dtype=self.dtype,  # no turn taken
                         threads=c.threads, chunk_tokens=c.chunk_tokens)
        return {"warm_s": round(warm_s, 6), **self.calibrate()}

    def calibrate(self) -> dict[str, Any]:
        """The local prefill measured at two sizes before the service listens (issue #47;
        :func:`muser_cli.consumer.warm.calibrate`): the route's local path is then predicted
        from this machine's own measurements from the first request on."""
        c = self.config
        return calibrate(self.costs, self.engine.inner, info=self.info, model=c.model, engine=c.engine,
                         dtype=self.dtype, threads=c.threads, chunk_tokens=c.chunk_tokens, chunk=self.chunk)

    # -------------------------------------------------------------- queue
    def submit(self, job: Job) -> None:
        """Queue ``job`` (QueueFull past the bound, Draining once SIGTERM came)."""
        with self._cv:
            if self.draining:
                raise Draining()
            if len(self._running) >= self.config.max_batch and len(self._waiting) >= self.config.max_queue:
                raise QueueFull(self.config.max_queue)
            self._waiting.append(job)
            self.backlog.arrive(job, tokens=guess_tokens(job.ask.prompt), chunk=self.chunk)  # until tokenized
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
        state = RunState(job, self)
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
        except Stop:
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
            if extra.error is not None and not isinstance(extra.error, Stop):
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
        observe(self, state, summary)
        ticket = self._will_remember(state, ids, finish)  # before the answer goes: the next turn waits for it
        try:
            job.emit("done", summary)
        finally:
            if ticket is not None:
                self._remember(state, ids, ticket)

    def _will_remember(self, state: "RunState", ids: list[int], finish: str) -> int | None:
        """Whether this answer's rows go to the turn memory: a ticket (lookups that it would
        serve deeper wait for it), or None."""
        rows = state.rows
        if self.memory is None or rows is None or finish == "cancelled" or not state.stream.ids:
            return None
        return self.memory.begin(self._conversation(ids, state))

    def _conversation(self, ids: list[int], state: "RunState") -> list[int]:
        """The prompt and the answer's tokens (what the engine generated, up to the model's context)."""
        return (list(ids) + list(state.stream.ids))[: self.info.max_positions - 1]

    def _remember(self, state: "RunState", ids: list[int], ticket: int) -> None:
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

    def _decode(self, job: Job, state: "RunState", ids: list[int]):
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
        counting = state.counting = CountingReader(live.reader)
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


__all__ = ["Config", "Draining", "EngineWorker", "Job", "QueueFull", "ShutDown"]
