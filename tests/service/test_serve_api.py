"""``decode --serve`` in process (issue 28): the OpenAI request and error shapes, the bounded
queue, cancellation, the API key and loopback binding, streamed text; on a real tiny model
with a real resident engine (Starlette's TestClient drives the ASGI app, no sockets)."""

from __future__ import annotations

import threading
import time

import pytest

from serve_kit import PROMPT, engine_worker  # first: the module skipped without Starlette or prometheus_client

from muser_cli.errors import UsageError  # noqa: E402
from muser_cli.service.api import ApiError, parse_ask, parse_body  # noqa: E402
from muser_cli.service.textstream import TextStream  # noqa: E402
from muser_cli.service.worker import Job, QueueFull  # noqa: E402
from handoff_kit import HANG_S  # noqa: E402


@pytest.fixture(scope="module")
def worker(tiny_llama):
    with engine_worker(tiny_llama, max_queue=1) as w:
        yield w


@pytest.fixture
def client(worker):
    from starlette.testclient import TestClient

    from muser_cli.service.app import ServeOptions, Service

    logs: list[dict] = []
    service = Service(worker, worker.metrics, ServeOptions(model_id="tiny", default_max_tokens=8), log=logs.append)
    with TestClient(service.app()) as c:
        c.logs = logs
        c.service = service
        yield c


def local_text(tiny_llama, prompt: str, n: int, *, chat: bool = False) -> str:
    from muser_cli.consumer.decode import decode

    return decode(None, model=str(tiny_llama.path), prompt=prompt, chat=chat, max_new_tokens=n, dtype="float32",
                  threads=1, reuse=False).text


def test_completion_equals_decode_and_says_its_source(client, tiny_llama):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == local_text(tiny_llama, PROMPT, 8)
    assert r.headers["x-muser-source"] == "local" and float(r.headers["x-muser-ttft-ms"]) > 0
    assert r.headers["x-muser-bytes"] == "0"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert body["muser"]["source"] == "local" and body["muser"]["fallback_reason"] == "no producer given"


def test_streamed_chat_equals_the_whole_answer(client):
    ask = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0}
    whole = client.post("/v1/chat/completions", json=ask).json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions",
                       json={**ask, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    import json

    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert "".join(pieces) == whole
    assert sum(1 for p in pieces if p) >= 2  # several chunks, not one at the end
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and chunks[-1]["choices"] == []


@pytest.mark.parametrize("body, status, code", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"model": "tiny", "prompt": ""}', 400, None),
    (b'{"model": "tiny", "prompt": "hi there", "temperature": -1}', 400, None),
    (b'{"model": "tiny", "prompt": "hi there", "n": 9}', 400, None),
    (b'{"model": "other", "prompt": "hi there"}', 404, "model_not_found"),
    (b'{"model": "tiny", "prompt": "hi there", "max_tokens": 100000}', 400, "context_length_exceeded"),
])
def test_bad_requests_get_openai_errors(client, body, status, code):
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == code


def test_an_oversized_prompt_is_refused_400(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "word " * 5000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_models_health_metrics(client):
    from prometheus_client.parser import text_string_to_metric_families

    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/health").json()["status"] == "ok"
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    r = client.get("/metrics")
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert {"muser_ttft_seconds", "muser_shipped_bytes", "muser_queue_depth", "muser_fallbacks",
            "muser_token_latency_seconds", "muser_requests"} <= names
    assert client.get("/nowhere").json()["error"]["code"] == "not_found"


def test_the_queue_is_bounded_429(worker, tiny_llama):
    """One running (held at its first token), one waiting (max_queue 1): a third is refused."""
    release = threading.Event()
    got: list[tuple[str, object]] = []

    def held(kind, payload):
        got.append((kind, payload))
        if kind == "text":
            release.wait(HANG_S)

    first = Job(parse_ask({"prompt": PROMPT, "max_tokens": 4}, "completion", default_max_tokens=4), held)
    worker.submit(first)
    end = time.monotonic() + HANG_S
    while not got and time.monotonic() < end:
        time.sleep(0.01)
    done = threading.Event()
    second = Job(parse_ask({"prompt": PROMPT, "max_tokens": 2}, "completion", default_max_tokens=2),
                 lambda k, p: done.set() if k == "done" else None)
    worker.submit(second)
    third = Job(parse_ask({"prompt": PROMPT, "max_tokens": 2}, "completion", default_max_tokens=2), lambda k, p: None)
    with pytest.raises(QueueFull) as exc:
        worker.submit(third)
    assert exc.value.status == 429 and exc.value.body()["error"]["code"] == "queue_full"
    release.set()
    assert done.wait(HANG_S)  # the waiting one is answered in turn
    assert [k for k, _ in got][-1] == "done"


def test_a_client_that_goes_away_stops_its_request(worker):
    """Withdrawn after its first token: the engine stops at the next one and serves on."""
    got: list[tuple[str, object]] = []
    done = threading.Event()
    job = Job(parse_ask({"prompt": PROMPT, "max_tokens": 200, "temperature": 0}, "completion",
                        default_max_tokens=4), lambda k, p: None)

    def emit(kind, payload):
        got.append((kind, payload))
        if kind == "text":
            worker.withdraw(job)
        if kind in ("done", "error"):
            done.set()

    job.emit = emit
    worker.submit(job)
    assert done.wait(HANG_S)
    kind, summary = got[-1]
    assert kind == "done" and summary["finish_reason"] == "cancelled"
    assert summary["completion_tokens"] < 200
    assert worker.busy() == 0


def test_a_waiting_request_withdrawn_never_runs(worker):
    release = threading.Event()
    started = threading.Event()

    def held(kind, payload):
        if kind == "text":
            started.set()
            release.wait(HANG_S)

    worker.submit(Job(parse_ask({"prompt": PROMPT, "max_tokens": 2}, "completion", default_max_tokens=2), held))
    assert started.wait(HANG_S)
    ran: list[str] = []
    waiting = Job(parse_ask({"prompt": PROMPT, "max_tokens": 2}, "completion", default_max_tokens=2),
                  lambda k, p: ran.append(k))
    worker.submit(waiting)
    worker.withdraw(waiting)
    release.set()
    assert worker.drain(HANG_S) and ran == []
    worker.draining = False


def test_api_key_and_loopback(worker):
    from starlette.testclient import TestClient

    from muser_cli.service.app import ServeOptions, Service, bind_socket

    service = Service(worker, worker.metrics, ServeOptions(model_id="tiny", api_key="s3cret"), log=lambda r: None)
    with TestClient(service.app()) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"authorization": "Bearer nope"}).status_code == 401
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                   headers={"authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert c.get("/health").status_code == 200  # no key needed to ask whether it is up
    with pytest.raises(UsageError, match="without an API key"):
        bind_socket("0.0.0.0:0", None)
    sock = bind_socket(":0", None)  # no host: loopback
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()


def test_draining_refuses_new_work_503(client):
    client.service.draining = True
    try:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert client.get("/health").status_code == 503
    finally:
        client.service.draining = False


def test_stop_strings_cut_the_answer(client, tiny_llama):
    full = local_text(tiny_llama, PROMPT, 12)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    if not stop.strip() or full.index(stop) == 0:
        pytest.skip("no usable stop string in this model's answer")
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": stop})
    assert r.json()["choices"][0]["text"] == full[: full.index(stop)]
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_text_stream_pieces_join_to_the_text(tiny_llama):
    import random

    from muser_cli.model.tokens import decode_text

    rng = random.Random(5)
    ids = [rng.randrange(0, 250) for _ in range(60)]
    ts = TextStream(tiny_llama)
    pieces = [ts.push(i) for i in ids] + [ts.finish()]
    assert "".join(pieces) == decode_text(tiny_llama, ids) == ts.text


def test_parse_ask_fields():
    a = parse_ask({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                   "max_completion_tokens": 5, "max_tokens": 9, "seed": 3, "stop": "x", "stream": True,
                   "stream_options": {"include_usage": True}, "muser_prefill_deadline": 2.5}, "chat",
                  default_max_tokens=64)
    assert (a.prompt, a.max_tokens, a.seed, a.stop, a.stream, a.include_usage, a.prefill_deadline) == (
        [{"role": "user", "content": "hi"}], 5, 3, ["x"], True, True, 2.5)
    with pytest.raises(ApiError):
        parse_body(b"\xff")
    with pytest.raises(ApiError):
        parse_ask({"messages": []}, "chat", default_max_tokens=1)


@pytest.mark.parametrize("args, status, words", [
    (["decode", "--serve", "0.0.0.0:0"], 2, "without an API key"),
    (["decode", "--serve", "127.0.0.1:0", "--prompt", "x.txt"], 2, "--serve takes no"),
    (["decode", "--serve", "127.0.0.1:0", "--max-queue", "-1"], 2, "--max-queue"),
    (["decode", "--serve", "127.0.0.1:0", "--engine", "vllm"], 2, "torch or mlx"),
    (["decode", "--serve", "127.0.0.1:0", "--drain", "-1"], 2, "--drain"),
    (["decode", "--serve", "127.0.0.1:0", "--producer", "nohost"], 2, "no port"),
    (["decode", "--producer", "a:1", "--producer", "b:2", "--prompt", "x.txt"], 2, "more than once"),
    (["prefill", "--metrics", "127.0.0.1:0"], 2, "--metrics needs --serve"),
])
def test_serve_options_are_checked_one_line(args, status, words, tiny_llama):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "muser_cli.commands", *args, "-m", str(tiny_llama.path)],
                       capture_output=True, timeout=HANG_S, input=b"")
    assert r.returncode == status, r.stderr
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines


def test_a_port_in_use_is_78(tiny_llama):
    import socket
    import subprocess
    import sys

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        r = subprocess.run([sys.executable, "-m", "muser_cli.commands", "decode", "--serve",
                            f"127.0.0.1:{s.getsockname()[1]}", "-m", str(tiny_llama.path)],
                           capture_output=True, timeout=HANG_S)
    finally:
        s.close()
    assert r.returncode == 78 and b"cannot listen" in r.stderr, r.stderr  # configuration, as receive --listen


def test_without_the_serve_extra_it_says_so_78(tiny_llama, tmp_path):
    """uvicorn missing (shadowed by a package that fails to import): one line naming the extra, 78."""
    import os
    import subprocess
    import sys

    (tmp_path / "uvicorn").mkdir()
    (tmp_path / "uvicorn" / "__init__.py").write_text("raise ImportError('uvicorn is not installed')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "muser_cli.commands", "decode", "--serve", "127.0.0.1:0", "-m",
                        str(tiny_llama.path)], capture_output=True, timeout=HANG_S, env=env)
    assert r.returncode == 78, r.stderr
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "muser[serve]" in lines[0]
