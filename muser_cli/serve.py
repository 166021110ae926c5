"""The pull lane's two ends above the sockets.

Producer: :class:`ResidentProducer` holds one model and engine, loaded once, and computes a
consumer's request on the canonical schedule, streaming each chunk's frames through
prefill's :class:`~muser_cli.prefill.FrameEmitter` as the chunk finishes; :func:`serve`
runs it behind :class:`muser_cli.handoff.pull.server.PullServer`.

Consumer: :func:`pull_prompt` tokenizes the prompt here (the consumer's tokenization is
authoritative: it sends those token ids, or with ``send_text`` the text for the producer to
tokenize, and refuses a pack that binds other ids), asks the producer and receives the verified pack;
:func:`start_pull_pipe` does that on a thread into a pipe that ``decode`` reads as its
input, so a failed or cut pull is decode's ordinary empty or cut stream (local fallback).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Callable

from muser_cli.errors import DataError, MuserError, TempFailure, UsageError
from muser_cli.handoff.wire.pull_protocol import PullRequest
from muser_cli.handoff.push.spool import Refusal

EventFn = Callable[[str, dict[str, Any]], None]


# ----------------------------------------------------------------------------- producer
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
                 loaded: Any = None, history: bool | None = None) -> None:
        """``loaded``: an engine already made for ``model`` (named ``engine``) to serve with.
        ``history``: packs carry the sliding history (:func:`muser_cli.prefill.set_history`)."""
        if not isinstance(max_batch, int) or max_batch < 1:
            raise UsageError(f"--max-batch must be a positive integer, got {max_batch!r}")
        from muser_cli.engines.registry import get_engine
        from muser_cli.models import resolve_model
        from muser_cli.schedule import default_dtype
        from muser_cli.tokens import tokenizer_for

        t0 = time.perf_counter()
        self.info = resolve_model(model)
        tokenizer_for(self.info)
        self.engine_name = engine
        self.dtype = dtype or default_dtype(engine)
        self.threads = threads
        self.engine = loaded if loaded is not None else get_engine(engine, self.info, dtype=self.dtype,
                                                                    threads=threads, options=engine_options)
        from muser_cli.prefill import set_history

        set_history(self.engine, history)
        self._batcher: _Batcher | None = None
        self.max_concurrent = 1  # requests the server may run at once (PullServer's admission)
        if self.engine.batches_prefill and max_batch > 1:
            self.engine.set_max_batch(max_batch)  # before vLLM starts: its max_num_seqs
            self._batcher = _Batcher(self.engine, max_batch)
            self.max_concurrent = max_batch
        self._local = threading.local()  # per request (a batching engine runs several at once)
        self.load_s = time.perf_counter() - t0
        self.keep_last = True  # keep the last request's rows to continue a prompt that shares its prefix
        self._last: tuple[list[int], tuple[int, str], list] | None = None
        # ``store``: also continue from this machine's reuse store, and keep every result there
        # (put after the stream ended: :meth:`after_stream`, so the consumer never waits on it).
        self.store = store

    def check(self, req: PullRequest) -> PullRequest:
        """Refuse (:class:`Refusal`) a request this producer will not serve; the request to
        compute: in text mode, with the token ids of this producer's tokenization filled in
        (the consumer refuses the pack if they are not its own)."""
        from muser_cli.errors import ConfigError, DataError
        from muser_cli.schedule import check_chunk, check_prompt
        from muser_cli.tokens import encode_prompt

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
            from muser_cli.reuse.chain import Scope, chain_at

            scope = Scope(info.fingerprint, info.tokenizer_fingerprint, req.dtype, req.chunk_tokens)
            if chain_at(scope, list(req.token_ids), req.have_tokens) != req.have_chain:
                raise Refusal("data", f"the request's have chain is not this prompt's first {req.have_tokens} "
                                      "tokens on its schedule")
            req = have_on_grid(req, scope)
        return req

    def run(self, req: PullRequest, out: BinaryIO) -> dict[str, Any]:
        """Compute ``req`` and write its pack to ``out``: a delta from ``req.have_tokens`` when the
        consumer holds a prefix. The rows of the previous request are kept: a prompt that
        shares whole chunks with it is continued from there (same bytes, less compute)."""
        from muser_cli.kvpack import PackWriter, write_pack
        from muser_cli.prefill import FrameEmitter
        from muser_cli.reuse.chain import scope_of_header
        from muser_cli.reuse.delta import delta_header
        from muser_cli.kvpack.layers import ring_extra_held
        from muser_cli.schedule import build_header

        ids = list(req.token_ids)
        eng = self.engine
        rows = len(ids) - 1
        header = build_header(self.info, ids, dtype=req.dtype, chunk_tokens=req.chunk_tokens,
                              engine=self.engine_name, threads=self.threads, extra=eng.producer_info(),
                              ring_extra=eng.pack_ring_extra(rows))
        if req.have_tokens:  # its chain was checked before admission (check)
            header = delta_header(header, scope_of_header(header), req.have_tokens, req.have_chain)
            header = replace(header, ring_extra=eng.pack_ring_extra(rows, header.rows_start))
        t0 = time.perf_counter()
        writer = PackWriter(out, header) if eng.streams_prefill else None
        if writer is not None:
            out.flush()  # the header leaves before the first chunk is computed
        full = header if not req.have_tokens else None
        emitter = FrameEmitter(writer, out) if writer is not None else None
        self._local.put = None
        self._local.producer = None
        self._local.batch = None
        layers, reused, source = self._rows(ids, req, on_chunk=emitter)
        if writer is None:  # a whole-pack engine (vLLM): its producer record is complete only now
            full = build_header(self.info, ids, dtype=req.dtype, chunk_tokens=req.chunk_tokens,
                                engine=self.engine_name, threads=self.threads, extra=self._producer_info(),
                                ring_extra=eng.pack_ring_extra(rows))
            header = replace(full, rows_start=header.rows_start, base=header.base, ring_extra=header.ring_extra)
            writer = write_pack(out, header, layers)
        else:
            writer.finish()
        out.flush()
        if self.store and not (source == "store" and reused == len(ids) - 1):  # a full hit is held already
            if full is None:
                full = build_header(self.info, ids, dtype=req.dtype, chunk_tokens=req.chunk_tokens,
                                    engine=self.engine_name, threads=self.threads, extra=self._producer_info(),
                                    ring_extra=ring_extra_held(self.info.layers, layers, rows))
            self._local.put = (full, layers)
        stats = {"prefill_s": round(time.perf_counter() - t0 - (emitter.seconds if emitter else 0.0), 6),
                 "held_rows": req.have_tokens, "shipped_rows": len(ids) - 1 - req.have_tokens,
                 "reused_rows": reused, "reused_from": source if reused else None}
        if self._local.batch is not None:
            stats["batch"] = self._local.batch  # computed together with batch - 1 other requests
        return stats

    def _producer_info(self) -> dict[str, Any]:
        """The producer record of this request's prefill (its batch's, on a batching engine)."""
        got = getattr(self._local, "producer", None)
        return dict(got) if got is not None else self.engine.producer_info()

    def after_stream(self, stats: dict[str, Any]) -> None:
        """Once the request's pack is written and its pipe closed: keep the whole result in
        this machine's store (``store``); the entry id, or why not, goes into ``stats``."""
        put, self._local.put = getattr(self._local, "put", None), None
        if put is None:
            return
        from muser_cli.reuse import Store

        t0 = time.perf_counter()
        try:
            stats["stored"] = Store().put_layers(*put).entry.id
        except MuserError as exc:  # the store is a cache: failing to keep the rows is not failing the request
            stats["store_error"] = str(exc)
        stats["store_s"] = round(time.perf_counter() - t0, 6)

    def _rows(self, ids: list[int], req: PullRequest, *, on_chunk) -> tuple[list, int, str]:
        """The rows of ``ids[:-1]``, how many were not computed and where they came from: the
        previous request's rows (``memory``) or, with ``store``, this machine's store
        (``store``), whichever holds the deeper exact prefix on the request's schedule."""
        from muser_cli.reuse.chain import resumable
        from muser_cli.reuse.delta import layers_at
        from muser_cli.rows import rows_of_layers

        eng = self.engine
        rows = len(ids) - 1
        last = self._last
        held, prefix, source = 0, None, "local"
        if last is not None and eng.resumes_prefill and last[1] == (req.chunk_tokens, req.dtype):
            common = 0
            for a, b in zip(last[0], ids[:rows]):
                if a != b:
                    break
                common += 1
            held = min(common, len(last[0]) - 1, rows) // req.chunk_tokens * req.chunk_tokens
            if eng.keeps_history:  # a pack then carries every sliding row from the consumer's prefix on
                held = min(held, req.have_tokens) // req.chunk_tokens * req.chunk_tokens
            specs = self.info.layers
            while held > 0 and not resumable(specs, len(last[0]), held):
                held -= req.chunk_tokens
            source = "memory" if held else "local"
        self._last = None  # dropped before the next prefill: at most one prompt's rows held
        if self.store and eng.resumes_prefill and held < rows and not eng.keeps_history:
            found = self._from_store(ids, req, deeper_than=held)
            if found is not None:
                held, prefix, source = found.held, found.layers, "store"
        if source == "memory":
            assert last is not None
            try:
                prefix = layers_at(last[2], self.info.layers, held, eng.ring_extra if held == rows else 0)
            except DataError:  # the remembered rows do not reach back that far (a delta's history)
                held, prefix, source = 0, None, "local"
        if held == 0 and self._batcher is not None:
            layers, self._local.producer, self._local.batch = self._batcher.prefill(ids[:-1], req.chunk_tokens)
        elif held == 0:
            layers = eng.prefill(ids[:-1], chunk_tokens=req.chunk_tokens,
                                 **({"on_chunk": on_chunk} if on_chunk is not None else {}))
        elif held == rows:
            layers = list(prefix)
            if on_chunk is not None:
                on_chunk(rows, rows_of_layers(layers))
        else:
            kw = {"on_chunk": on_chunk} if on_chunk is not None else {}
            layers = eng.prefill_from(prefix, rows=held, token_ids=ids[held:-1], chunk_tokens=req.chunk_tokens, **kw)
        if self.keep_last and eng.resumes_prefill:
            self._last = (list(ids[:rows]), (req.chunk_tokens, req.dtype), list(layers))
        return layers, held, source

    def _from_store(self, ids: list[int], req: PullRequest, *, deeper_than: int):
        """The deepest exact prefix of ``ids`` this machine's store holds on the request's
        schedule, when it is deeper than ``deeper_than`` rows (else None: nothing is read)."""
        from muser_cli.reuse import Store
        from muser_cli.reuse.delta import find_resume
        from muser_cli.rows import entry_may_serve

        store = Store()  # one per request: its index connection belongs to this thread
        info = self.info
        points = [p for p in store.points(info.fingerprint, info.tokenizer_fingerprint, ids, len(ids) - 1,
                                          dtype=req.dtype, chunk_tokens=req.chunk_tokens) if p.resumable]
        if not points or max(p.held for p in points) <= deeper_than:
            return None
        found = find_resume(store, info.fingerprint, info.tokenizer_fingerprint, ids, dtype=req.dtype,
                            chunk_tokens=req.chunk_tokens, ring_extra=self.engine.ring_extra)
        # another engine's rows (a foreign pack put in the store) serve only once the gate passed them
        if found is not None and not entry_may_serve(store, found.entry, found.stored, self.engine, dtype=req.dtype):
            return None
        return found if found is not None and found.held > deeper_than else None


def serve(*, listen: str, model: str | None, engine: str, dtype: str | None, threads: int, max_queue: int,
          on_event: EventFn | None = None, engine_options: dict | None = None,
          stop: threading.Event | None = None, store: bool = False, max_batch: int = 8,
          live=None, history: bool | None = None) -> dict[str, int]:
    """Load the model once, then answer enrolled consumers until ``stop`` is set; the
    server's counters (served, refused, failed, turned_away: told busy while stopping).
    ``store``: continue from this machine's reuse store too and keep every result there.
    ``max_batch``: on vLLM, how many requests run at once (computed as one batch); torch
    and MLX run one. ``live``: where the server keeps its open connections
    (:class:`~muser_cli.handoff.listener.LiveConnections`; the metrics endpoint's ``/connections``)."""
    from muser_cli import paths
    from muser_cli.handoff.api import ledger_dir
    from muser_cli.handoff.link import listen_socket, parse_hostport
    from muser_cli.handoff.trust.node import load_identities
    from muser_cli.handoff.pull.server import PullServer, ServeConfig

    if max_queue < 0:
        raise UsageError("--max-queue must be >= 0")
    if max_batch < 1:
        raise UsageError("--max-batch must be >= 1")
    host, port = parse_hostport(listen, listen=True)
    identity, *more = load_identities(paths.keys_dir())  # one per consumer joined
    if identity.consumer is None or identity.consumer == identity.name:
        raise UsageError("this node has not joined a consumer", hint="muser node join BUNDLE (made on the consumer)")
    config = ServeConfig(host=host or "0.0.0.0", port=port, max_queue=max_queue)
    # A taken port fails now, not after a long model load: bind once and let go (no socket is
    # held while engines start their workers); it listens only once the producer can answer.
    listen_socket(config.host, config.port, backlog=None).close()
    producer = ResidentProducer(model, engine=engine, dtype=dtype, threads=threads, engine_options=engine_options,
                                store=store, max_batch=max_batch, history=history)
    server = PullServer(identity, config, ledger_dir=ledger_dir() / "serve", compute=producer, on_event=on_event,
                        more=more, live=live)
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
    from muser_cli.reuse.chain import delta_point

    held, chain = delta_point(scope, req.token_ids, req.have_tokens, req.have_chain)
    return req if held == req.have_tokens else replace(req, have_tokens=held, have_chain=chain)


# ----------------------------------------------------------------------------- consumer
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


def with_have(ask: PullAsk, store=None) -> PullAsk:
    """``ask`` with what this machine's store holds of the prompt (on the ask's schedule), so
    the producer ships only the rest."""
    from muser_cli.reuse import Store

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
    from muser_cli.models import resolve_model
    from muser_cli.schedule import DEFAULT_CHUNK_TOKENS, check_chunk, check_prompt, default_dtype
    from muser_cli.tokens import encode_prompt

    check_chunk(chunk_tokens)
    info = resolve_model(model)
    ids = encode_prompt(info, prompt, chat=chat)
    check_prompt(info, ids)
    return PullAsk(list(ids), info.tokenizer_fingerprint, info.fingerprint, chunk_tokens or DEFAULT_CHUNK_TOKENS,
                   dtype or default_dtype(engine), text=prompt if send_text else None, chat=chat and send_text)


def pull_prompt(producer: str, ask: PullAsk, *, out_stream: BinaryIO | None = None, output: Path | None = None,
                timeout: float | None = None, on_event: EventFn | None = None) -> dict[str, Any]:
    from muser_cli import paths
    from muser_cli.handoff.api import ledger_dir
    from muser_cli.handoff.trust.node import load_identity
    from muser_cli.handoff.pull.client import pull
    from muser_cli.handoff.push.receiver import Destination

    identity = load_identity(paths.keys_dir())
    destination = Destination(file=output) if output is not None else None
    accepted = pull(producer, identity, token_ids=ask.token_ids, tokenizer_fingerprint=ask.tokenizer_fingerprint,
                    model_fingerprint=ask.model_fingerprint, chunk_tokens=ask.chunk_tokens, dtype=ask.dtype,
                    ledger_dir=ledger_dir(), out_stream=out_stream, destination=destination, timeout=timeout,
                    on_event=on_event, have_tokens=ask.have_tokens, have_chain=ask.have_chain, text=ask.text,
                    chat=ask.chat)
    return {**accepted.to_json(), "held_tokens": ask.have_tokens}


class PipePull:
    """A pull on a thread, into a pipe: :attr:`reader` is decode's input; :attr:`error` says
    why nothing (or not all) arrived, once the reader saw its end."""

    def __init__(self, producer: str, make_ask: Callable[[], PullAsk], *, timeout: float | None) -> None:
        r, w = os.pipe()
        self.reader: BinaryIO = open(r, "rb")
        self._w = w
        self.error: BaseException | None = None
        self.accepted: dict[str, Any] | None = None
        self.producer = producer
        self._thread = threading.Thread(target=self._run, args=(make_ask, timeout), name="muser-pull", daemon=True)
        self._thread.start()

    def _run(self, make_ask: Callable[[], PullAsk], timeout: float | None) -> None:
        try:
            with open(self._w, "wb") as out:
                try:
                    self.accepted = pull_prompt(self.producer, make_ask(), out_stream=out, timeout=timeout)
                except BaseException as exc:  # noqa: BLE001 - decode falls back; the reason is reported
                    self.error = exc
        except OSError as exc:  # decode stopped reading
            self.error = self.error or exc

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def reason(self) -> str:
        exc = self.error
        if exc is None:
            return ""
        if isinstance(exc, MuserError):  # with its hint: what to do (enroll, check HOST:PORT, ...)
            return f"pull from {self.producer} failed: {exc}" + (f"; {exc.hint}" if exc.hint else "")
        return f"pull from {self.producer} failed: {type(exc).__name__}: {exc}"


def start_pull_pipe(producer: str, *, prompt: str, model: str | None, chat: bool, chunk_tokens: int | None,
                    dtype: str | None, engine: str, timeout: float | None, have: bool = True,
                    send_text: bool = False) -> PipePull:
    """``have``: tell the producer what this machine's store holds of the prompt, so only the
    rest is computed there and shipped (a delta pack; decode merges it with the stored prefix).
    ``send_text``: send the prompt as text for the producer to tokenize (:func:`ask_for`)."""
    from muser_cli.handoff.link import parse_hostport

    parse_hostport(producer)  # a bad address is a usage error, not a fallback

    def make_ask() -> PullAsk:
        ask = ask_for(prompt, model=model, chat=chat, chunk_tokens=chunk_tokens, dtype=dtype, engine=engine,
                      send_text=send_text)
        return with_have(ask) if have else ask

    return PipePull(producer, make_ask, timeout=timeout)


__all__ = ["PipePull", "PullAsk", "ResidentProducer", "ask_for", "pull_prompt", "serve", "start_pull_pipe",
           "TempFailure", "with_have"]
