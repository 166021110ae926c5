"""``muser decode --serve``: the OpenAI-compatible endpoint (Starlette on uvicorn).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent
events or not), ``POST /v1/messages`` (Anthropic's Messages API: :mod:`.messages`),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Each generation
route is a *shape* (how a request is read and its answer, stream and errors written) around
one path through the worker.
Requests go to one :class:`~muser_cli.service.worker.EngineWorker`; a streamed answer starts
with its first token, so its headers carry where the rows came from (``x-muser-source``),
the TTFT (``x-muser-ttft-ms``) and the pack bytes shipped (``x-muser-bytes``), as does the
``muser`` field of every answer. SIGTERM (or SIGINT) drains: new requests get 503, the
queued and running ones finish, then the process exits 0. A drain that outlasts its bound
(``ServeOptions.drain_s``), or a second signal, ends what is left itself: a waiting or
not yet streaming request gets a 503, an open stream an error event in its route's shape and
its end, each one a log line (status 503, code ``shut_down``); then the process exits 1."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable

from muser_cli.errors import ConfigError, MuserError, UsageError
from muser_cli.handoff.link import listen_error, parse_hostport
from muser_cli.service.api import MAX_BODY, ApiError, Ask, parse_ask, parse_body
from muser_cli.service.replies import chunk, new_id, response, sse, usage
from muser_cli.service.messages import MessagesShape
from muser_cli.service.tools import call_deltas
from muser_cli.service.worker import Config, Draining, EngineWorker, Job, ShutDown
from muser_cli.units import utc_stamp

LOOPBACK = ("127.0.0.1", "::1", "localhost")
_POLL_S = 0.25  # how often a waiting request looks whether its client is still there


@dataclass
class ServeOptions:
    listen: str = "127.0.0.1:8000"
    api_key: str | None = None
    model_id: str = "default"
    default_max_tokens: int = 256
    drain_s: float = 25.0


class ClientGone(Exception):
    """The client closed its connection before its answer was sent (logged as a 499)."""


def _error(exc: ApiError, shape: Any = None):
    from starlette.responses import JSONResponse

    body = exc.body() if shape is None else shape.error(exc)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


_KEY_NEEDED = "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)"


class OpenAIShape:
    """``/v1/chat/completions`` (kind ``chat``) and ``/v1/completions``: OpenAI's request, answer,
    stream chunks and errors (:mod:`.api`)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.endpoint = "chat" if kind == "chat" else "completions"

    def parse(self, body: dict, *, default_max_tokens: int) -> Ask:
        return parse_ask(body, self.kind, default_max_tokens=default_max_tokens)

    def error(self, exc: ApiError) -> dict:
        return exc.body()

    def new_id(self, ask: Ask) -> str:
        return new_id(ask.kind)

    def whole(self, ask: Ask, rid: str, model: str, s: dict, calls: list[dict]) -> dict:
        return response(ask, rid, model, s["text"], s["finish_reason"], _usage(s), s["muser"], calls=calls,
                        choices=s.get("choices"))

    def streamer(self, ask: Ask, rid: str, model: str, early: dict | None) -> _OpenAIStream:
        return _OpenAIStream(ask, rid, model)


class _OpenAIStream:
    """One streamed OpenAI answer: each method gives the server-sent events of one event of the job."""

    def __init__(self, ask: Ask, rid: str, model: str) -> None:
        self.ask, self.rid, self.model = ask, rid, model

    def start(self) -> list[bytes]:
        ask, rid, model = self.ask, self.rid, self.model
        return [sse(chunk(ask, rid, model, "", None, first=True, index=i) if ask.chat else
                    chunk(ask, rid, model, "", None, index=i)) for i in range(ask.n)]

    def text(self, piece: str) -> list[bytes]:  # a Piece (api.py): its choice and its tokens' logprobs
        return [sse(chunk(self.ask, self.rid, self.model, piece, None, index=getattr(piece, "choice", 0),
                          logprobs=getattr(piece, "logprobs", None)))]

    def call(self, call: dict) -> list[bytes]:  # a whole call: its name, then its arguments, as OpenAI streams them
        return [sse(chunk(self.ask, self.rid, self.model, None, None, tool_calls=[delta])) for delta in call_deltas(call)]

    def error(self, err: ApiError) -> list[bytes]:  # then the stream's end, as a finished one
        return [sse(err.body()), sse("[DONE]")]

    def done(self, s: dict) -> list[bytes]:
        ask, rid, model = self.ask, self.rid, self.model
        ends = [(c["index"], c["finish_reason"]) for c in s["choices"]] if s.get("choices") else \
            [(0, s["finish_reason"])]
        out = [sse(chunk(ask, rid, model, None if ask.chat else "", finish, index=i,
                         muser=s["muser"] if i == ends[-1][0] else None)) for i, finish in ends]
        if ask.include_usage:
            out.append(sse(chunk(ask, rid, model, None, None, use=_usage(s))))
        out.append(sse("[DONE]"))
        return out


def _internal(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MuserError):
        return ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error", code=getattr(exc, "code", None)
                        and str(exc.code))
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


class Service:
    """The app's state: the worker, the metrics, the options; :meth:`app` builds the ASGI app."""

    def __init__(self, worker: EngineWorker, metrics: Any, options: ServeOptions,
                 log: Callable[[dict], None] = lambda record: None) -> None:
        self.worker, self.metrics, self.options, self.log = worker, metrics, options, log
        self.draining = False
        self.stopping = False  # the server ends what is left (the drain's bound passed, a second signal)
        self.ids = {options.model_id, worker.info.name, "default"}  # "default": whatever this server serves

    # ------------------------------------------------------------------ helpers
    def _authorized(self, request) -> bool:
        key = self.options.api_key
        if not key:
            return True
        got = request.headers.get("authorization", "")
        if got.startswith("Bearer "):
            return hmac.compare_digest(got[7:].strip().encode(), key.encode())
        got = request.headers.get("x-api-key")  # Anthropic's clients send their key so
        return got is not None and hmac.compare_digest(got.strip().encode(), key.encode())

    def _count(self, endpoint: str, status: int, reason: ApiError | str | None = None, *,
                logged: bool = False) -> None:
        """Count an answer; one that is not a success also gets its JSON log line, unless the
        worker ran it (``logged``): its line, with the source and timings, is the request's one
        (a success's, or status 499 for one whose client went away while it ran)."""
        if self.metrics is not None:
            self.metrics.requests.labels(endpoint, str(status)).inc()
        if status != 200 and not logged:
            record: dict[str, Any] = {"event": "request", "endpoint": endpoint, "status": status}
            if isinstance(reason, ApiError):
                record.update(code=reason.code, reason=reason.message)
            elif reason:
                record["reason"] = reason
            self.log(record)

    def _cut_line(self, endpoint: str, rid: str, job: Job) -> None:
        """Count and log a request the server ended itself as it shut down (:meth:`Job.cut_off`):
        its answer's id, whether it ran and how many tokens it had made."""
        if self.metrics is not None:
            self.metrics.requests.labels(endpoint, "503").inc()
        err, state = job.cut, job.state
        record: dict[str, Any] = {"event": "request", "endpoint": endpoint, "status": 503, "id": rid,
                                  "code": err.code, "reason": err.message, "stream": job.ask.stream,
                                  "ran": state is not None}
        if state is not None:
            record["completion_tokens"] = sum(len(c.stream.ids) for c in state.choices)
        if job.ask.user is not None:
            record["user"] = job.ask.user
        self.log(record)

    async def _body(self, request) -> bytes:
        """The request body, refused with 413 before it is buffered: a ``Content-Length`` over
        the limit is answered at once, a chunked body stops being read at the limit."""
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, "Content-Length is not a number")
            if int(declared) > MAX_BODY:
                raise ApiError(413, f"the request body is over {MAX_BODY} bytes")
        from starlette.requests import ClientDisconnect  # starlette: the optional serve extra

        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > MAX_BODY:
                    raise ApiError(413, f"the request body is over {MAX_BODY} bytes")
                parts.append(part)
        except ClientDisconnect:
            raise ClientGone("the client went away while sending its body") from None
        return b"".join(parts)

    async def _next(self, queue: asyncio.Queue, request, job: Job) -> tuple[str, Any]:
        """The job's next event; a client that went away withdraws it (:class:`ClientGone`). It
        looks at least every ``_POLL_S``, also while events keep coming (a running request's
        tokens, gathered for a whole answer)."""
        loop = asyncio.get_running_loop()
        looked = job.looked if job.looked is not None else loop.time()
        while True:
            try:
                got = await asyncio.wait_for(queue.get(), max(0.0, looked + _POLL_S - loop.time()))
            except asyncio.TimeoutError:
                got = None
            if loop.time() - looked >= _POLL_S:
                looked = job.looked = loop.time()
                if await request.is_disconnected():
                    self.worker.withdraw(job)
                    raise ClientGone("the client went away before its answer") from None
            if got is not None:
                job.looked = looked
                return got

    # ------------------------------------------------------------------ routes
    async def completions(self, request, kind: str):
        return await self.generate(request, OpenAIShape(kind))

    async def generate(self, request, shape: Any):
        """One generation request of ``shape``'s API (:class:`OpenAIShape`, :class:`MessagesShape`)."""
        endpoint = shape.endpoint
        try:
            if self.draining:
                raise Draining()
            if not self._authorized(request):
                raise ApiError(401, _KEY_NEEDED, code="invalid_api_key")
            ask = shape.parse(parse_body(await self._body(request)), default_max_tokens=self.options.default_max_tokens)
            if ask.model and ask.model not in self.ids:
                raise ApiError(404, f"the model {ask.model!r} does not exist here; this server serves "
                                    f"{self.options.model_id!r}", param="model", code="model_not_found")
            return await self._generate(request, ask, shape)
        except ApiError as exc:
            self._count(endpoint, exc.status, exc)
            return _error(exc, shape)
        except ClientGone as exc:  # nobody reads an answer now: a log line, not a traceback
            self._count(endpoint, 499, str(exc), logged=getattr(exc, "logged", False))
            from starlette.responses import Response

            return Response(status_code=499)

    async def _generate(self, request, ask: Ask, shape: Any):
        from starlette.responses import JSONResponse, StreamingResponse

        endpoint = shape.endpoint
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(kind: str, payload: Any) -> None:  # on the job's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, payload))
            except RuntimeError:  # the loop closed (the server stopped): nobody reads this answer now
                pass

        job = Job(ask, emit)
        self.worker.submit(job)  # QueueFull / Draining: answered by the caller
        rid, model = shape.new_id(ask), ask.model or self.options.model_id
        calls: list[dict] = []  # the answer's tool calls (a chat with tools)
        try:
            kind, payload = await self._next(queue, request, job)
            while not ask.stream and kind in ("text", "call"):  # the whole answer: its summary holds the text
                if kind == "call":
                    calls.append(payload)
                kind, payload = await self._next(queue, request, job)
        except asyncio.CancelledError:  # the server cancels the task of a request whose client left
            self.worker.withdraw(job)
            self._count(endpoint, 499, self._cancelled_why("before its answer"),
                        logged=getattr(job, "state", None) is not None and not self.stopping)
            raise
        except ClientGone as exc:
            self.worker.withdraw(job)
            exc.logged = getattr(job, "state", None) is not None  # it ran: the worker logs its line
            raise
        if kind == "error":
            if job.cut is not None:  # the server ended it as it shut down: a 503, its own log line
                self._cut_line(endpoint, rid, job)
                return _error(job.cut, shape)
            raise _internal(payload)
        if not ask.stream:
            s = _finished(payload, job)
            self._count(endpoint, 200)
            return JSONResponse(shape.whole(ask, rid, model, s, calls), headers=_headers(s))
        first = (kind, payload)
        state = getattr(job, "state", None)
        out = shape.streamer(ask, rid, model, state.summary(state.ids, "") if state is not None else None)

        async def events():
            status, why = 499, None  # until the stream ends as it should: the client went away
            try:
                for piece in out.start():
                    yield piece
                k, p = first
                while k in ("text", "call"):
                    for piece in (out.text(p) if k == "text" else out.call(p)):
                        yield piece
                    k, p = await queue.get()
                if k == "error":  # an error event in the route's shape, then the stream's end
                    err = _internal(p)
                    status, why = err.status, err
                    for piece in out.error(err):
                        yield piece
                    return
                for piece in out.done(_finished(p, job)):
                    yield piece
                status = 200
            finally:
                if status == 499:
                    self.worker.withdraw(job)
                if status != 499 and job.cut is not None:  # ended by the server as it shut down
                    self._cut_line(endpoint, rid, job)
                else:  # a 499 ran: the worker's line says cancelled, 499 (unless the server stopped)
                    self._count(endpoint, status, why if status != 499 else self._cancelled_why("mid-stream"),
                                logged=status == 499 and not self.stopping)

        # the first event came: the rows' source and the TTFT are known for the headers
        head = {"x-muser-source": "", "cache-control": "no-cache"}
        if first[0] in ("text", "call"):
            head.update(self._early_headers(job))
        else:
            head.update(_headers(first[1]))
        return StreamingResponse(events(), media_type="text/event-stream", headers=head)

    def _cancelled_why(self, when: str) -> str:
        if self.stopping:  # uvicorn cancelled what was still open after its own grace: not the client
            return f"the server stopped {when} (its task cancelled at shutdown)"
        return f"the client went away {when}"

    def _early_headers(self, job: Job) -> dict[str, str]:
        """Headers of a streamed answer at its first token (the summary comes at the end)."""
        state = getattr(job, "state", None)
        return _headers(state.summary(state.ids, "")) if state is not None else {}

    async def models(self, request):
        if not self._authorized(request):
            return _error(ApiError(401, _KEY_NEEDED, code="invalid_api_key"))
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [{"id": self.options.model_id, "object": "model",
                                                         "created": 0, "owned_by": "muser"}]})

    async def health(self, request):
        from starlette.responses import JSONResponse

        status = "draining" if self.draining else "ok"
        return JSONResponse({"status": status, "queue": self.worker.busy(),
                             "producers": self.worker.pool.to_json()},
                            status_code=503 if self.draining else 200)

    async def metrics_route(self, request):
        from starlette.responses import Response

        if not self._authorized(request):  # every route but /health, as docs/serve.md says
            return _error(ApiError(401, _KEY_NEEDED, code="invalid_api_key"))

        body, ctype = self.metrics.text()
        return Response(body, media_type=ctype.split(";")[0], headers={"content-type": ctype})

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        async def chat(request):
            return await self.completions(request, "chat")

        async def completions(request):
            return await self.completions(request, "completion")

        async def messages(request):
            return await self.generate(request, MessagesShape())

        async def not_found(request, exc):
            status = getattr(exc, "status_code", 404)
            return _error(ApiError(status, f"{request.method} {request.url.path}: "
                                           f"{'no such route' if status == 404 else 'method not allowed'}",
                                   code="not_found" if status == 404 else "method_not_allowed"))

        routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
                  Route("/v1/completions", completions, methods=["POST"]),
                  Route("/v1/messages", messages, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics_route, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})


def _finished(s: dict, job: Job) -> dict:
    """The worker's summary ``s`` of a finished answer, with what every shape writes of it: the
    stop string that ended it (``stop_sequence``; None: none did) and the ``muser`` field."""
    stream = getattr(getattr(job, "state", None), "stream", None)
    return {**s, "stop_sequence": getattr(stream, "matched", None), "muser": _muser(s)}


def _usage(s: dict) -> dict:
    return usage(s["prompt_tokens"], s["completion_tokens"], s["held_rows"])


def _muser(s: dict) -> dict:
    return {k: s.get(k) for k in ("source", "ttft_ms", "bytes", "producer", "held_rows", "computed_rows",
                                  "fallback_reason", "batched", "route", "budget", "tool_format")}


def _headers(s: dict) -> dict[str, str]:
    out = {"x-muser-source": str(s.get("source") or "")}
    if s.get("ttft_ms") is not None:
        out["x-muser-ttft-ms"] = f"{s['ttft_ms']:.1f}"
    out["x-muser-bytes"] = str(int(s.get("bytes") or 0))
    return out


class _LogLines(logging.Handler):
    """uvicorn's own warnings and errors ("Invalid HTTP request received", an exception in the
    app) as the service's log records, so its log stays one JSON object a line."""

    def __init__(self, log: Callable[[dict], None]) -> None:
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line: dict[str, Any] = {"event": "server_log", "level": record.levelname.lower(), "logger": record.name,
                                    "message": record.getMessage()}
            if record.exc_info and record.exc_info[0] is not None:
                line["exception"] = "".join(logging.Formatter().formatException(record.exc_info)).strip()
            self.log(line)
        except Exception:  # noqa: BLE001 - logging's own rule: a failed line never fails the server
            self.handleError(record)


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def bind_socket(listen: str, api_key: str | None) -> socket.socket:
    """The listening socket: loopback unless an API key guards the endpoint."""

    host, port = parse_hostport(listen, listen=True)
    host = host or "127.0.0.1"
    if host not in LOOPBACK and not api_key:
        raise UsageError(f"--serve {listen} listens beyond this machine without an API key",
                         hint="give --api-key KEY (or $MUSER_API_KEY), or listen on 127.0.0.1")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:  # in use, privileged, not this machine's: configuration (78), as `receive --listen`
        sock.close()

        raise listen_error(exc, listen, port) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve_openai(config: Config, options: ServeOptions, *, log: Callable[[dict], None],
                 on_listening: Callable[[str], None] | None = None) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, return 0 (1 if what was left had to be
    ended: the drain passed ``options.drain_s``, or a second signal came).
    ``log`` gets one record (a dict with a ``ts``) per request and per start, drain and stop."""
    try:
        import uvicorn

        from muser_cli.service.metrics import ConsumerMetrics
    except ImportError as exc:
        raise ConfigError(f"decode --serve needs the serve extra: {exc}",
                          hint="pip install 'muser[serve]' (starlette, uvicorn, prometheus-client)") from None
    sock = bind_socket(options.listen, options.api_key)
    def stamped(record: dict[str, Any]) -> None:
        log({"ts": utc_stamp(), **record})

    log_ = stamped
    metrics = ConsumerMetrics()
    worker = EngineWorker(config, metrics, log=log_)
    service = Service(worker, metrics, options, log=log_)
    outcome: dict[str, Any] = {"rc": 0, "end": None}  # end: "drained", or "cut" (what was left ended)
    ending = threading.Lock()

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # the first signal drains, a second one stops now
            if service.draining:
                threading.Thread(target=end_all, args=(f"stopped by a second signal, {_signame(sig)}", "stopping", sig),
                                 name="muser-stop", daemon=True).start()
                return
            service.draining = True
            log_({"event": "draining", "queued": worker.busy(), "signal": int(sig), "drain_s": options.drain_s})

            def drain() -> None:
                if worker.drain(options.drain_s):
                    with ending:
                        if outcome["end"] is not None:
                            return
                        outcome["end"] = "drained"
                    log_({"event": "drained", "left": worker.busy()})
                    self.should_exit = True
                else:
                    end_all(f"its drain passed {options.drain_s:g} s", "drain_timed_out")

            threading.Thread(target=drain, name="muser-drain", daemon=True).start()

    def end_all(why: str, event: str, sig: int | None = None) -> None:
        """The drain ends here: every request left ended now (a 503, or an error event and the
        end of its stream: :meth:`EngineWorker.cut`), one line each (the service's), exit 1."""
        with ending:
            if outcome["end"] is not None:
                return
            outcome["end"], outcome["rc"] = "cut", 1
        service.stopping = True
        log_({"event": event, "left": worker.busy(), **({"signal": int(sig)} if sig is not None else {})})
        worker.cut(ShutDown(why))
        server.should_exit = True

    log_({"event": "warmed", **worker.warm_up()})  # before "listening": the first client pays no first touch
    cfg = uvicorn.Config(service.app(), log_level="warning", access_log=False, lifespan="off",
                         timeout_graceful_shutdown=5, log_config=None)
    server_log = logging.getLogger("uvicorn")  # its lines as ours (uvicorn.error, uvicorn.access below it)
    server_log.handlers[:] = [_LogLines(log_)]
    server_log.propagate = False
    server = _Server(cfg)
    host, port = sock.getsockname()[:2]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    log_({"event": "listening", "address": address, "model": options.model_id, "engine": config.engine,
         "producers": list(config.producers)})
    if on_listening is not None:
        on_listening(address)
    try:
        server.run(sockets=[sock])
    finally:
        worker.close()
        sock.close()
        log_({"event": "stopped", "rc": outcome["rc"]})
    return outcome["rc"]


__all__ = ["ServeOptions", "Service", "bind_socket", "serve_openai", "utc_stamp"]
