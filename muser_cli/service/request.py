"""A served request as an object: the job a client's call becomes (:class:`Job`: what it asks,
how its client is told, its cancellation) and what it has seen while it runs (:class:`RunState`:
its rows' source, its route and pull, its tokens and their times, each choice's sequence, the
summary its client, the log and the metrics are told). :mod:`muser_cli.service.worker` runs it;
:mod:`muser_cli.service.outcome` reads what it measured."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Protocol

from muser_cli.consumer.decode import Extra
from muser_cli.consumer.pull import PipePull
from muser_cli.consumer.route import Route
from muser_cli.consumer.source import RowsFrom
from muser_cli.engines.base import Sampling
from muser_cli.errors import DataError
from muser_cli.model.info import ModelInfo
from muser_cli.service.api import ApiError, Ask, Piece
from muser_cli.service.textstream import TextStream
from muser_cli.service.tools import ToolStream

Emit = Callable[[str, Any], None]


class Runner(Protocol):
    """What a running request reads of the worker that runs it."""

    info: ModelInfo
    turns: Any  # the engine's turns (muser_cli.consumer.turns.Turns)
    backlog: Any  # the queue ahead on the engine (muser_cli.consumer.costs.Backlog)

    def token_text(self, token: int) -> str: ...


class Stop(Exception):
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
    state: Any = None  # the running request's RunState
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




class CountingReader:
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


def guess_tokens(prompt: Any) -> int:
    """A prompt's length in tokens before it is tokenized (about four characters a token)."""
    if isinstance(prompt, str):
        return len(prompt) // 4 + 1
    text = sum(len(str(m.get("content") or "")) for m in prompt if isinstance(m, dict)) if isinstance(
        prompt, list) else 0
    return text // 4 + 1


class RunState:
    """What one running request has seen: its rows' source, its tokens and their times."""

    def __init__(self, job: Job, worker: Runner) -> None:
        self.job = job
        self.choices = [Choice(job, worker, i) for i in range(job.ask.n)]  # n: each its own sequence
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
        self.counting: CountingReader | None = None
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
            raise Stop("the client went away")
        self.first.took(token)
        piece = self.stream.push(token)
        if self.tools is not None:
            for kind, payload in self.tools.feed(self.markers.get(int(token), "") + piece):
                self.job.emit(kind, payload)
            if self.tools.done:
                raise Stop("the tool call asked for is complete, or it failed")
        elif piece:
            self.job.emit("text", self.first.piece(piece))
        if self.stream.stopped:
            raise Stop("a stop string")
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


class Choice:
    """One choice's sequence: its sampling (seeded ``seed + index``), its text, its logprob entries
    (``{"id", "token", "logprob", "offset", "top": [{"id", "token", "logprob"}]}``: ``offset``, the
    token's place in the choice's text as the tokens' own texts add up) and how it ended. The
    first choice's tokens come through :meth:`RunState.on_token`; the others' through
    :meth:`on_token`, on the threads decode runs them on."""

    def __init__(self, job: Job, worker: Runner, index: int) -> None:
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
            raise Stop("the client went away")
        self.took(token)
        piece = self.stream.push(token)
        if piece:
            self.job.emit("text", self.piece(piece))
        if self.stream.stopped:
            raise Stop("a stop string")
        self.worker.turns.pass_turn()

    def end(self, cancelled: bool) -> None:
        """The sequence ended: its held-back text (and logprobs) given out, its finish reason."""
        eos = self.last is not None and self.last in self.worker.info.eos_token_ids
        self.finish_reason = "cancelled" if cancelled else "stop" if self.stream.stopped or eos else "length"
        tail = self.stream.finish()
        if (tail or self.unsent) and not cancelled:
            self.job.emit("text", self.piece(tail))


__all__ = ["Choice", "CountingReader", "Emit", "Job", "RunState", "Runner", "Stop", "guess_tokens"]
