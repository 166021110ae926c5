"""The pull lane's consumer end above the sockets.

:func:`ask_for` tokenizes the prompt here (the consumer's tokenization is authoritative: it
sends those token ids, or with ``send_text`` the text for the producer to tokenize, and
refuses a pack that binds other ids); :func:`pull_prompt` asks the producer and receives the
verified pack; :func:`start_pull_pipe` does that on a thread into a pipe that ``decode``
reads as its input, so a failed or cut pull is decode's ordinary empty or cut stream (local
fallback), whose reason :meth:`PipePull.explain` then names.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Callable

from muser_cli import paths
from muser_cli.consumer.costs import CostModel, costs_for
from muser_cli.consumer.route import Route, route, route_mode
from muser_cli.consumer.source import RowsFrom
from muser_cli.errors import MuserError, TempFailure
from muser_cli.handoff.api import ledger_dir
from muser_cli.handoff.link import parse_hostport
from muser_cli.handoff.pull.client import pull
from muser_cli.handoff.push.receiver import Destination
from muser_cli.handoff.wire.refusal import NotInTime, ProducerBusy
from muser_cli.handoff.trust.node import load_identity
from muser_cli.model.info import ModelInfo
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tokens import encode_prompt
from muser_cli.reuse import Store
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS, check_chunk, check_prompt, default_dtype

EventFn = Callable[[str, dict[str, Any]], None]


@dataclass
class PullAsk:
    token_ids: list[int]
    tokenizer_fingerprint: str
    model_fingerprint: str
    chunk_tokens: int
    dtype: str
    have_tokens: int = 0  # this consumer's store holds rows [0, have_tokens) ...
    have_chain: str | None = None  # ... with this chain hash: ask for a delta
    text: str | None = None  # send the prompt as text (the producer tokenizes; token_ids still checks it) ...
    chat: bool = False  # ... as one user turn of the chat template
    engine: str | None = None  # the engine this consumer decodes on (a producer on it skips the sliding history)
    budget_ms: int | None = None  # the producer must have sent the pack within it, else it says "late" at once


def with_have(ask: PullAsk, store=None) -> PullAsk:
    """``ask`` with what this machine's store holds of the prompt (on the ask's schedule), so
    the producer ships only the rest."""

    store = store or Store()
    ids = ask.token_ids
    if len(ids) < 3:
        return ask
    for point in store.points(ask.model_fingerprint, ask.tokenizer_fingerprint, ids, len(ids) - 2, dtype=ask.dtype,
                              chunk_tokens=ask.chunk_tokens):
        if point.held % ask.chunk_tokens == 0:  # a delta from off the grid could not be merged exactly
            return replace(ask, have_tokens=point.held, have_chain=point.chain)  # the deepest
    return ask


def ask_for(prompt: str, *, model: str | None, chat: bool, chunk_tokens: int | None, dtype: str | None,
            engine: str, send_text: bool = False) -> PullAsk:
    """What to request: this consumer's own tokenization and model, on the canonical schedule.
    ``send_text``: send the text (and ``chat``) for the producer to tokenize; the pack must
    still bind this consumer's own token ids (else it is refused, 65)."""

    check_chunk(chunk_tokens)
    info = resolve_model(model)
    ask = ask_of(encode_prompt(info, prompt, chat=chat), info, chunk_tokens=chunk_tokens, dtype=dtype, engine=engine)
    return replace(ask, text=prompt if send_text else None, chat=chat and send_text)


def ask_of(ids: list[int], info: ModelInfo, *, chunk_tokens: int | None, dtype: str | None, engine: str) -> PullAsk:
    """What to request for a prompt already tokenized here (a service or a batch tokenizes each
    request once): its ids on the canonical schedule, for this model."""
    check_chunk(chunk_tokens)
    check_prompt(info, ids)
    return PullAsk(list(ids), info.tokenizer_fingerprint, info.fingerprint, chunk_tokens or DEFAULT_CHUNK_TOKENS,
                   dtype or default_dtype(engine), engine=engine)


def pull_prompt(producer: str, ask: PullAsk, *, out_stream: BinaryIO | None = None, output: Path | None = None,
                timeout: float | None = None, on_event: EventFn | None = None,
                race: Callable[[str], None] | None = None,
                on_socket: Callable[[socket.socket], None] | None = None) -> dict[str, Any]:

    identity = load_identity(paths.keys_dir())
    destination = Destination(file=output) if output is not None else None
    accepted = pull(producer, identity, token_ids=ask.token_ids, tokenizer_fingerprint=ask.tokenizer_fingerprint,
                    model_fingerprint=ask.model_fingerprint, chunk_tokens=ask.chunk_tokens, dtype=ask.dtype,
                    ledger_dir=ledger_dir(), out_stream=out_stream, destination=destination, timeout=timeout,
                    on_event=on_event, have_tokens=ask.have_tokens, have_chain=ask.have_chain, text=ask.text,
                    chat=ask.chat, engine=ask.engine, budget_ms=ask.budget_ms, race=race, on_socket=on_socket)
    return {**accepted.to_json(), "held_tokens": ask.have_tokens}


class PipePull:
    """A pull on a thread, into a pipe: :attr:`reader` is decode's input; :attr:`error` says
    why nothing (or not all) arrived, once the reader saw its end.

    :attr:`marks`: ``time.perf_counter()`` when the pull began (``start``), the producer promised
    (``promise``, a request with a budget), admitted it (``serving``), its header came
    (``header``), the pack's last byte came (``last_byte``) and the pull ended (``end``: after
    the ledger and the Ack); :attr:`promise` what it promised (also told to
    ``costs``). :attr:`plan`: the routing (:func:`muser_cli.consumer.route.route`). ``asked``
    False: the route chose not to ask (no thread, no reader; :attr:`routed_local` says why).

    ``race``: a promise the producer breaks does not cut the pull; :attr:`broken` is set (and
    :attr:`broken_why` says how) and the pull goes on, while decode computes the prompt here and
    keeps whichever is ready first (:mod:`muser_cli.consumer.hedge`); :meth:`cancel` ends a pull
    that lost (its error then says why)."""

    def __init__(self, producer: str, make_ask: Callable[[], PullAsk] | None, *, timeout: float | None,
                 costs: CostModel | None = None, plan: Route | None = None,
                 planner: Callable[[PullAsk], tuple[CostModel, Route]] | None = None,
                 race: bool = False) -> None:
        self.error: BaseException | None = None
        self.accepted: dict[str, Any] | None = None
        self.producer = producer
        self.costs, self.plan = costs, plan
        self.marks: dict[str, float] = {}
        self.promise: dict[str, Any] | None = None
        self.asked = make_ask is not None
        self._planner = planner
        self.race = race
        self.broken = threading.Event()
        self.broken_why = ""
        self._sock: socket.socket | None = None
        self._cancelled = ""
        self._lock = threading.Lock()
        self.reader: BinaryIO | None = None
        self._thread: threading.Thread | None = None
        self._rows: tuple[int, int] | None = None  # the rows asked for: [have, rows)
        if make_ask is None:
            return
        self._ask_key: Any = self
        if costs is not None and plan is not None:  # its work is on that producer's queue in the next predictions
            if plan.asked_key is not None:  # the route put it there already
                self._ask_key = plan.asked_key
            else:
                costs.asking(producer, self, float(plan.chosen_parts.get("producer_compute") or 0.0))
        r, w = os.pipe()
        self.reader = open(r, "rb")
        self._w = w
        self._thread = threading.Thread(target=self._run, args=(make_ask, timeout), name="muser-pull", daemon=True)
        self._thread.start()

    @property
    def routed_local(self) -> str:
        """Why the route kept this request here ("" when it asked the producer)."""
        return "" if self.asked or self.plan is None else self.plan.why

    def _on_event(self, kind: str, fields: dict[str, Any]) -> None:
        promise = note_event(self.costs, self.producer, self.marks, kind, fields)
        if promise is not None:
            self.promise = promise

    def _run(self, make_ask: Callable[[], PullAsk], timeout: float | None) -> None:
        self.marks["start"] = time.perf_counter()
        try:
            with open(self._w, "wb") as out:
                try:
                    ask = make_ask()
                    self._rows = (ask.have_tokens, len(ask.token_ids) - 1)
                    if self._planner is not None:  # the prediction, made on the pull's own thread
                        self.costs, self.plan = self._planner(ask)
                    self.accepted = pull_prompt(self.producer, ask, out_stream=out, timeout=timeout,
                                                on_event=self._on_event,
                                                race=self._on_broken if self.race else None,
                                                on_socket=self._on_socket)
                    last = (self.accepted or {}).get("last_byte_unix")
                    if isinstance(last, (int, float)):  # the pack's last byte in (before the ledger and the Ack)
                        self.marks["last_byte"] = time.perf_counter() - max(0.0, time.time() - last)
                except BaseException as exc:  # noqa: BLE001 - decode falls back; the reason is reported
                    self.error = TempFailure(self._cancelled) if self._cancelled else exc
                finally:
                    self.marks["end"] = time.perf_counter()
        except OSError as exc:  # decode stopped reading
            self.error = self.error or exc
        finally:
            self._answered()

    def _answered(self) -> None:
        """The pull ended: its work is off the producer's queue as this consumer sees it, and what
        the producer's compute measured against its own estimate is kept (issue #47)."""
        if self.costs is not None:
            settle_ask(self.costs, self.producer, self._ask_key, error=self.error, promise=self.promise,
                       rows=self._rows, marks=self.marks)

    def _on_socket(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            cancelled = self._cancelled
        if cancelled:
            _shut(sock)

    def _on_broken(self, why: str) -> None:
        self.broken_why = why
        self.marks.setdefault("hedged", time.perf_counter())
        self.broken.set()

    def cancel(self, why: str) -> None:
        """End the pull now (a hedge it lost: the prompt was computed here first); its error then
        is a TempFailure saying ``why``. Returns at once; :meth:`join` waits for the thread."""
        with self._lock:
            self._cancelled = why
            sock = self._sock
        if sock is not None:
            _shut(sock)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def learn(self, out: Any, *, arrived: float | None = None) -> None:
        """What decode's result ``out`` measured, into ``costs`` (kept for the next run)."""
        costs = self.costs
        if costs is None:
            return
        learn_from(costs, out, marks=self.marks, accepted=self.accepted, producer=self.producer)
        costs.save()

    @property
    def empty_reason(self) -> str:
        """decode's fallback reason should nothing arrive (:meth:`explain` then names why)."""
        return f"nothing from {self.producer}"

    def explain(self, out: Any, *, timeout: float = 5) -> None:
        """Once decode finished reading: why the pull gave nothing, or not all, written into
        decode's result ``out`` (its ``reason``, for a fallback or a cut stream)."""
        self.join(timeout=timeout)
        why = self.reason() or self.routed_local
        if why and (out.source == RowsFrom.PARTIAL_LOCAL or str(out.reason).startswith("hedge:")):
            out.reason = f"{out.reason}; {why}"  # a hedge's reason names the broken promise; the pull's, its end
        elif why and out.fallback:
            out.reason = why

    def reason(self, *, hint: bool = True) -> str:
        """Why the pull failed ("" if it did not). ``hint``: with its error's hint, what to do
        (enroll, check HOST:PORT, decode with --prompt, ...): advice for the command line, which a
        served answer leaves out (:attr:`hint`)."""
        exc = self.error
        if exc is None:
            return ""
        if isinstance(exc, MuserError):
            return f"pull from {self.producer} failed: {exc}" + (f"; {exc.hint}" if exc.hint and hint else "")
        return f"pull from {self.producer} failed: {type(exc).__name__}: {exc}"

    @property
    def hint(self) -> str:
        """The failed pull's hint ("" if none): what the operator may do about it."""
        return (getattr(self.error, "hint", None) or "") if isinstance(self.error, MuserError) else ""


def note_event(costs: CostModel | None, producer: str, marks: dict[str, float], kind: str,
               fields: dict[str, Any]) -> dict[str, Any] | None:
    """A pull's event (:func:`pull_prompt`'s ``on_event``) into its ``marks`` (when each first
    came); a ``promise`` is told to ``costs`` and returned (its fields less the producer's name)."""
    marks.setdefault(kind, time.perf_counter())
    if kind != "promise":
        return None
    if costs is not None:
        costs.heard(producer, fields)
    return {k: v for k, v in fields.items() if k != "producer"}


def settle_ask(costs: CostModel, producer: str, key: Any, *, error: BaseException | None,
               promise: dict[str, Any] | None, rows: tuple[int, int] | None, marks: dict[str, float]) -> None:
    """A pull asked under ``key`` ended (``error`` None: served): its work is off ``producer``'s
    queue as this consumer sees it, and what the producer's compute measured against its own
    estimate is kept (issue #47). Bookkeeping: it never raises."""
    outcome = ("served" if error is None else "late" if isinstance(error, NotInTime)
               else "busy" if isinstance(error, ProducerBusy) else "failed")
    start, end = rows or (0, 0)
    try:
        promised = None
        if promise is not None and isinstance(promise.get("compute_ms"), (int, float)):
            promised = promise["compute_ms"] / 1000
        elif end > start:
            view = costs.producers.get(producer)
            promised = view.rates.seconds(start, end) if view is not None and view.known else None
        measured = None
        if outcome == "served" and "serving" in marks and ("last_byte" in marks or "end" in marks):
            measured = marks.get("last_byte", marks["end"]) - marks["serving"]
        costs.answered(producer, key, promised_s=promised, measured_s=measured, rows=end, outcome=outcome)
    except Exception:  # noqa: BLE001 - bookkeeping never fails a pull
        pass


def _shut(sock: socket.socket) -> None:
    """Shut a pull's connection down from another thread: its blocked read then ends (the TLS
    object is left to the pull's own thread, which closes it)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # already closed or never connected: nothing to end
        pass


def learn_from(costs: CostModel, out: Any, *, marks: dict[str, float], accepted: dict[str, Any] | None,
               prefill_s: float | None = None, producer: str | None = None) -> None:
    """One decode's measurements (its :class:`~muser_cli.consumer.decode.DecodeOutcome`) into ``costs``.
    ``prefill_s``: the local prefill's own engine time where it shared the engine (a serving
    consumer: the wall time less the others' turns), else ``out.prefill_s``. ``producer``: the
    address the pack came from (its link rate is kept per producer)."""
    rows = out.prompt_tokens - 1
    spot = out.spot_check or {}
    gate_ms = spot.get("ms") if spot.get("ran") else None
    if isinstance(spot.get("sampled"), dict) and spot["sampled"].get("ms") is not None:
        gate_ms = (gate_ms or 0) + spot["sampled"]["ms"]
    gate_s = gate_ms / 1000 if isinstance(gate_ms, (int, float)) else None
    if RowsFrom(out.source).computed_here:  # held: the server's turn memory
        held = out.held_tokens if out.source != RowsFrom.LOCAL else 0
        first = out.ttft_s - out.prefill_s - out.pack_read_s
        own = out.prefill_s if prefill_s is None else prefill_s
        costs.observe(held=held, rows=rows, prefill_s=own if out.source != RowsFrom.STORE else None, local=True,
                      install_s=out.prefill_s if out.source == RowsFrom.STORE else None,
                      first_step_s=first if first >= 0 else None)
        return
    if out.source not in (RowsFrom.HANDOFF, RowsFrom.DELTA):
        return
    install = max(0.0, out.prefill_s - (gate_s or 0.0))
    first = (out.tail_s - out.prefill_s) if out.tail_s is not None else None
    wire_s = None
    if "header" in marks and ("last_byte" in marks or "end" in marks):
        wire_s = marks.get("last_byte", marks.get("end", 0.0)) - marks["header"]
    # set-up to admission (TCP, TLS, the request's checks) when it did not wait in the queue
    connect = marks["serving"] - marks["start"] if "serving" in marks and "start" in marks and "queued" not in marks \
        else None
    got_bytes = int((accepted or {}).get("payload_bytes") or 0)
    shipped = rows - (out.held_tokens if out.source == RowsFrom.DELTA else 0)
    costs.observe(held=0, rows=rows, local=False, install_s=install, gate_s=gate_s,
                  first_step_s=first if first is not None and first >= 0 else None, connect_s=connect,
                  pack_bytes=got_bytes, wire_s=wire_s, shipped_rows=shipped, producer=producer)


def start_pull_pipe(producer: str, *, prompt: str, model: str | None, chat: bool, chunk_tokens: int | None,
                    dtype: str | None, engine: str, timeout: float | None, have: bool = True,
                    send_text: bool = False, threads: int = 1, race: bool = False) -> PipePull:
    """``have``: tell the producer what this machine's store holds of the prompt, so only the
    rest is computed there and shipped (a delta pack; decode merges it with the stored prefix).
    ``send_text``: send the prompt as text for the producer to tokenize (:func:`ask_for`).
    ``race``: a broken promise is raced, not cut (:class:`PipePull`).

    The route (issue #39): the TTFT of every path is predicted (:func:`muser_cli.consumer.route.route`,
    :attr:`PipePull.plan`); with ``MUSER_ROUTE=fastest`` the prompt is tokenized here first and
    the producer asked only when that is predicted faster, with the budget to beat the local
    path (a producer that cannot make it says so at once); else it is asked as before."""

    parse_hostport(producer)  # a bad address is a usage error, not a fallback

    def make_ask() -> PullAsk:
        ask = ask_for(prompt, model=model, chat=chat, chunk_tokens=chunk_tokens, dtype=dtype, engine=engine,
                      send_text=send_text)
        return with_have(ask) if have else ask

    def planned(ask: PullAsk) -> tuple[CostModel, Route]:
        costs = costs_for(ask.model_fingerprint, engine, ask.dtype, threads)
        return costs, route(costs, tokens=len(ask.token_ids), held=ask.have_tokens, producer=producer)

    if route_mode() == "fastest":
        ask = make_ask()
        costs, plan = planned(ask)
        if not plan.ask:
            return PipePull(producer, None, timeout=timeout, costs=costs, plan=plan)
        ask = replace(ask, budget_ms=plan.budget_ms)
        return PipePull(producer, lambda: ask, timeout=timeout, costs=costs, plan=plan, race=race)

    return PipePull(producer, make_ask, timeout=timeout, planner=planned, race=race)


__all__ = ["PipePull", "PullAsk", "ask_for", "ask_of", "learn_from", "note_event", "pull_prompt", "settle_ask",
           "start_pull_pipe", "with_have"]
