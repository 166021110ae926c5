"""The end of a drain that outlasts its bound (issue #49, item 5): ``decode --serve --drain S``
with answers still streaming and one waiting when SIGTERM comes. Past the bound the server ends
them itself: each open stream gets an error event in its route's shape, then its end (OpenAI's
``data: [DONE]``; Anthropic's stream stops after its ``error`` event), a request not answered yet
a 503 in its route's shape; one log line each (status 503, code ``shut_down``, its answer's id),
never a 499, no traceback on stderr; exit 1 (docs/cli-contract.md). A second signal does the same
at once. Real processes on 127.0.0.1, the real ``openai`` client for one stream and raw HTTP for
the others (to read the bytes of their ends); a tiny model with a long context, long answers and
a drain of a fifth of a second."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from serve_kit import DecodeServer  # first: the module skipped without the serve extra

openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from handoff_kit import HANG_S  # noqa: E402

PROMPT = ("Request 2: the committee met on a grey Tuesday to decide where bridge number 17 would go, "
          "and Cy spoke first.")
LONG = 50_000  # tokens asked for: still streaming when the drain ends (the test checks it did not end first)
NO_EOS = {"2": -100}  # the tiny model's end of text never drawn: a stream ends only when the server ends it


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory) -> Path:
    from muser_cli.model.tiny import make_tiny_long_llama

    return make_tiny_long_llama(tmp_path_factory.mktemp("drain-models") / "tiny-long")


def _server(home: Path, model: Path, *args: str) -> DecodeServer:
    return DecodeServer(home, "-m", str(model), "--threads", "1", "--dtype", "float32", "--no-reuse",
                        "--turn-memory", "0", *args)


def _raw_stream(server: DecodeServer, path: str, body: dict, got: dict, key: str, started: threading.Event) -> None:
    """POST a streamed request and keep every line of its body (``got[key]``: the status and the
    lines; ``got[key + "_error"]`` if the body did not end cleanly)."""
    lines: list[str] = []
    got[key] = {"lines": lines}
    try:
        with httpx.stream("POST", f"http://{server.address}{path}", json=body, timeout=HANG_S) as r:
            got[key]["status"] = r.status_code
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: ") and len(lines) > 6:
                    started.set()
    except Exception as exc:  # noqa: BLE001 - a body cut mid-way: inspected below
        got[key + "_error"] = exc
    finally:
        started.set()


def _openai_stream(server: DecodeServer, got: dict, started: threading.Event) -> None:
    chunks = []
    got["openai"] = chunks
    try:
        for chunk in server.client().chat.completions.create(model="default", max_tokens=LONG, temperature=0,
                                                             messages=[{"role": "user", "content": PROMPT}],
                                                             logit_bias=NO_EOS, stream=True):
            chunks.append(chunk)
            if len(chunks) > 3:
                started.set()
    except Exception as exc:  # noqa: BLE001 - the error event: inspected below
        got["openai_error"] = exc
    finally:
        started.set()


def _whole(server: DecodeServer, got: dict) -> None:
    try:
        got["whole"] = httpx.post(f"http://{server.address}/v1/completions", timeout=HANG_S,
                                  json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    except Exception as exc:  # noqa: BLE001 - inspected below
        got["whole_error"] = exc


def _busy(server: DecodeServer) -> int:
    return httpx.get(f"http://{server.address}/health", timeout=HANG_S).json()["queue"]


def _data(lines: list[str]) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def _clean_stderr(server: DecodeServer) -> list[dict]:
    """The server's stderr: JSON lines and the one ``listening on`` line, no traceback; its records."""
    text = "".join(server.lines)
    for bad in ("Traceback", "Exception", "Event loop is closed", "CancelledError", "Cancel "):
        assert bad not in text, text
    records = []
    for line in server.lines:
        if line.startswith("{"):
            records.append(json.loads(line))
        else:
            assert "decode: listening on http://" in line, line
    return records


def test_a_drain_past_its_bound_ends_each_request_cleanly(tmp_path, tiny_long):
    server = _server(tmp_path / "home", tiny_long, "--max-batch", "3", "--max-queue", "4", "--drain", "0.2")
    got: dict = {}
    starts = [threading.Event() for _ in range(3)]
    runners = [threading.Thread(target=_openai_stream, args=(server, got, starts[0])),
               threading.Thread(target=_raw_stream, args=(server, "/v1/messages", {
                   "model": "default", "max_tokens": LONG, "stream": True, "temperature": 0,
                   "messages": [{"role": "user", "content": PROMPT}]}, got, "messages", starts[1])),
               threading.Thread(target=_raw_stream, args=(server, "/v1/completions", {
                   "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True, "logit_bias": NO_EOS}, got,
                   "completions", starts[2]))]
    try:
        for runner, started in zip(runners, starts):
            runner.start()
            assert started.wait(HANG_S)
        waiting = threading.Thread(target=_whole, args=(server, got))  # the three running: it waits in the queue
        waiting.start()
        end = time.monotonic() + HANG_S
        while _busy(server) < 4 and time.monotonic() < end:
            time.sleep(0.05)
        ended = {k: v["lines"][-2:] for k, v in got.items() if isinstance(v, dict) and "lines" in v}
        assert _busy(server) == 4, (ended, got.get("openai_error"))  # three streaming, one waiting
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(HANG_S) == 1  # what was left had to be ended: docs/cli-contract.md
        for runner in runners + [waiting]:
            runner.join(HANG_S)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()

    # the openai client: tokens, then the error event (raised as an APIError), no finish_reason
    assert "openai_error" in got, got
    err = got["openai_error"]
    assert isinstance(err, openai.APIError) and "shutting down" in err.message, err
    assert err.body["code"] == "shut_down", err.body
    assert got["openai"] and not any(c.choices and c.choices[0].finish_reason for c in got["openai"])

    # OpenAI's raw stream: text chunks, the error object, then [DONE]: a body that ended, not one cut
    assert "completions_error" not in got, got
    data = _data(got["completions"]["lines"])
    assert data[-1] == "[DONE]" and data[-2]["error"]["code"] == "shut_down", data[-3:]
    assert all(d["choices"][0]["finish_reason"] is None for d in data[:-2]), data[-4:]

    # Anthropic's raw stream: its events, the last an error event in Anthropic's shape, no message_stop
    assert "messages_error" not in got, got
    lines = got["messages"]["lines"]
    events = [line[7:] for line in lines if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "error" and "message_stop" not in events, events[-3:]
    last = _data(lines)[-1]
    assert last["type"] == "error" and last["error"]["type"] == "overloaded_error", last
    assert "shutting down" in last["error"]["message"]

    # the request that waited: a 503 in OpenAI's shape
    assert "whole_error" not in got, got
    assert got["whole"].status_code == 503 and got["whole"].json()["error"]["code"] == "shut_down", got["whole"].text

    records = _clean_stderr(server)
    requests = [r for r in records if r.get("event") == "request"]
    assert len(requests) == 4 and all(r["status"] == 503 and r["code"] == "shut_down" for r in requests), requests
    assert sorted(r["endpoint"] for r in requests) == ["chat", "completions", "completions", "messages"]
    assert all(r["id"] for r in requests) and sorted(r["ran"] for r in requests) == [False, True, True, True]
    events = [r["event"] for r in records]
    assert events.index("draining") < events.index("drain_timed_out") and events[-1] == "stopped", events
    assert records[-1]["rc"] == 1


def test_a_second_signal_ends_the_drain_at_once(tmp_path, tiny_long):
    """--drain 600: the second SIGTERM ends the stream left at once (its error event and end), exit 1."""
    server = _server(tmp_path / "home", tiny_long, "--drain", "600")
    got: dict = {}
    started = threading.Event()
    runner = threading.Thread(target=_raw_stream, args=(server, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True, "logit_bias": NO_EOS}, got, "completions",
        started))
    try:
        runner.start()
        assert started.wait(HANG_S)
        server.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + HANG_S
        while not server.events("draining") and time.monotonic() < end:
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(HANG_S) == 1
        runner.join(HANG_S)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert "completions_error" not in got, got
    data = _data(got["completions"]["lines"])
    assert data[-1] == "[DONE]" and data[-2]["error"]["code"] == "shut_down", data[-3:]
    assert "second signal" in data[-2]["error"]["message"]
    records = _clean_stderr(server)
    requests = [r for r in records if r.get("event") == "request"]
    assert len(requests) == 1 and requests[0]["status"] == 503 and requests[0]["ran"], requests
    events = [r["event"] for r in records]
    assert "stopping" in events and "drained" not in events and events[-1] == "stopped", events
