"""``muser decode --serve`` as a user runs it (issue 28): real processes on 127.0.0.1, the real
``openai`` client, a resident enrolled producer (``prefill --serve --metrics``) on mutual TLS.

    producer$ muser prefill --serve 127.0.0.1:0 -m MODEL --metrics 127.0.0.1:0
    consumer$ muser decode --serve 127.0.0.1:0 -m MODEL --producer HOST:PORT
    consumer$ OPENAI_BASE_URL=http://127.0.0.1:PORT/v1 python -c 'import openai; ...'
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
import httpx  # noqa: E402

from handoff_kit import (  # noqa: E402
    HANG_S, LANE_PROMPT as PROMPT, Producer, env_for, local_decode, muser_cmd, pull_lane,
)
from serve_kit import DecodeServer  # noqa: E402

N = 8
_LISTEN = re.compile(r"listening on http://(\S+)/v1")
_METRICS = re.compile(r"metrics on http://(\S+)/metrics")


Consumer = DecodeServer  # ``muser decode --serve 127.0.0.1:0 ...``; its stderr lines collected on a thread


@pytest.fixture(scope="module")
def lane(tmp_path_factory, tiny_llama):
    with pull_lane(tmp_path_factory.mktemp("serve"), tiny_llama.path, "--metrics", "127.0.0.1:0", prompt=PROMPT,
                   check_exit=False) as lane:
        lane["local"] = local_decode(lane["nodes"].consumer_home, *lane["common"], "--prompt", str(lane["prompt"]),
                                     "-n", str(N), "--no-reuse", "--json")
        lane["consumer"] = Consumer(lane["nodes"].consumer_home, *lane["common"], "--producer",
                                    lane["producer"].address, "--no-reuse", "--max-queue", "4",
                                    "--turn-memory", "0")  # the pull lane every time (docs/serve.md "Turn memory")
        yield lane
        lane["consumer"].stop()


def complete(client, **extra):
    return client.completions.with_raw_response.create(model="default", prompt=PROMPT, max_tokens=N, temperature=0,
                                                       **extra)


def test_completion_through_the_producer_equals_decode(lane):
    raw = complete(lane["consumer"].client())
    body = raw.parse()
    assert body.choices[0].text == lane["local"]["text"]
    assert raw.headers["x-muser-source"] == "handoff", raw.headers
    assert int(raw.headers["x-muser-bytes"]) > 0 and float(raw.headers["x-muser-ttft-ms"]) > 0
    served = lane["producer"].wait_events(1)
    assert served and served[-1]["outcome"] == "served"


def test_four_concurrent_requests_all_return_it(lane):
    client = lane["consumer"].client()
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: complete(client), range(4)))
    assert [r.parse().choices[0].text for r in got] == [lane["local"]["text"]] * 4
    assert all(r.headers["x-muser-source"] != "local" for r in got)


def test_eight_clients_on_a_queue_of_four_lose_nothing(lane):
    """Each is answered, or refused 429 at once (never dropped, never a wrong text)."""
    client = lane["consumer"].client()

    def one(_):
        try:
            return complete(client).parse().choices[0].text
        except openai.RateLimitError:
            return 429

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(8)))
    answered = [g for g in got if g != 429]
    assert len(answered) >= 5 and set(answered) == {lane["local"]["text"]}, got


def test_streamed_chat_arrives_in_several_chunks(lane):
    client = lane["consumer"].client()
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="default", messages=messages, max_tokens=N, temperature=0)
    stream = client.chat.completions.create(model="default", messages=messages, max_tokens=N, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert sum(1 for p in pieces if p) >= 2
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == N


def test_malformed_json_gets_400_with_an_openai_error(lane):
    r = httpx.post(lane["consumer"].base + "/completions", content=b'{"prompt": ', timeout=HANG_S,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        lane["consumer"].client().completions.create(model="default", prompt=PROMPT, max_tokens=10 ** 6)


def test_a_client_that_disconnects_mid_stream_is_cancelled(lane):
    c = lane["consumer"]
    before = len(c.records())
    with httpx.stream("POST", c.base + "/completions", timeout=HANG_S,
                      json={"prompt": "Tell me", "max_tokens": 240, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text":""' not in line:
                break  # the first token arrived: go away
    end = time.monotonic() + HANG_S
    while time.monotonic() < end and len(c.records()) <= before:
        time.sleep(0.05)
    last = c.records()[before]
    assert last["finish_reason"] == "cancelled" and last["completion_tokens"] < 240, last
    assert complete(c.client()).parse().choices[0].text == lane["local"]["text"]  # it serves on


def test_metrics_of_both_services_parse(lane):
    from prometheus_client.parser import text_string_to_metric_families

    complete(lane["consumer"].client())
    text = httpx.get(lane["consumer"].base[:-3] + "/metrics", timeout=HANG_S).text
    consumer = {f.name: f for f in text_string_to_metric_families(text)}
    assert "muser_ttft_seconds" in consumer and "muser_shipped_bytes" in consumer
    shipped = sum(s.value for s in consumer["muser_shipped_bytes"].samples if s.name.endswith("_total"))
    assert shipped > 0
    ttft = [s for s in consumer["muser_ttft_seconds"].samples
            if s.name.endswith("_count") and s.labels["source"] == "handoff"]
    assert ttft and ttft[0].value >= 1
    address = next(m.group(1) for line in lane["producer"].lines if (m := _METRICS.search(line)))
    text = httpx.get(f"http://{address}/metrics", timeout=HANG_S).text
    producer = {f.name: f for f in text_string_to_metric_families(text)}
    assert "muser_shipped_bytes" in producer and "muser_producer_request_seconds" in producer
    assert "muser_producer_ttft_seconds" in producer  # the done-when: a TTFT family on both services
    assert [s.value for s in producer["muser_producer_ttft_seconds"].samples if s.name.endswith("_count")][0] >= 1
    assert sum(s.value for s in producer["muser_shipped_bytes"].samples if s.name.endswith("_total")) > 0


def test_producer_killed_the_same_text_from_local_prefill(lane, tmp_path):
    """A second producer, SIGKILLed: the consumer prefills here and answers the same text."""
    from handoff_kit import copy_home

    home = copy_home(lane["nodes"].producer_home, tmp_path / "p2")
    victim = Producer(home, *lane["common"])
    consumer = Consumer(lane["nodes"].consumer_home, *lane["common"], "--producer", victim.address, "--no-reuse",
                        "--prefill-deadline", str(HANG_S), "--turn-memory", "0")
    try:
        first = complete(consumer.client())
        assert first.headers["x-muser-source"] == "handoff"
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(HANG_S)
        raw = complete(consumer.client())
        assert raw.parse().choices[0].text == lane["local"]["text"]
        assert raw.headers["x-muser-source"] == "local"
        assert "failed" in raw.parse().model_extra["muser"]["fallback_reason"]
    finally:
        assert consumer.stop() == 0


def test_sigterm_drains_and_exits_0(lane):
    c = Consumer(lane["nodes"].consumer_home, *lane["common"], "--producer", lane["producer"].address, "--no-reuse")
    got: dict = {}

    def long_request() -> None:
        try:
            got["text"] = c.client().completions.create(model="default", prompt=PROMPT, max_tokens=120,
                                                        temperature=0).choices[0].text
        except Exception as exc:  # noqa: BLE001 - inspected below
            got["error"] = exc

    t = threading.Thread(target=long_request)
    t.start()
    end = time.monotonic() + HANG_S
    while time.monotonic() < end and '"running"' not in "".join(c.lines) and not c.records("request"):
        if httpx.get(c.base[:-3] + "/health", timeout=HANG_S).json()["queue"] > 0:
            break
        time.sleep(0.02)
    c.proc.send_signal(signal.SIGTERM)
    refused = None
    for _ in range(100):  # while it drains, new work is refused with 503
        try:
            r = httpx.post(c.base + "/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=HANG_S)
        except httpx.HTTPError:
            break  # already gone
        if r.status_code == 503:
            refused = r
            break
        time.sleep(0.01)
    # Drained and gone: the wait's HANG_S ceiling only catches a hang (no stopwatch on a loaded
    # machine); the events below say it finished the running request, then stopped.
    assert c.proc.wait(HANG_S) == 0
    t.join(HANG_S)
    assert "error" not in got and got.get("text"), got  # the running request finished
    events = [r["event"] for r in (json.loads(x) for x in c.lines if x.startswith("{"))]
    assert "draining" in events and "drained" in events and events[-1] == "stopped"
    if refused is not None:
        assert refused.json()["error"]["code"] == "draining"


def test_a_second_turn_ships_only_its_delta(lane, tmp_path, monkeypatch):
    """With --store the consumer keeps each prompt's rows: the next turn of the same chat asks
    the producer for the rest only (a delta), and its text is still the local text."""
    c = Consumer(lane["nodes"].consumer_home, *lane["common"], "--producer", lane["producer"].address, "--store",
                 "--chunk", "8", "--turn-memory", "0")  # the store's delta, not the turn memory
    try:
        client = c.client()
        turns = [{"role": "user", "content": PROMPT}]
        first = client.chat.completions.with_raw_response.create(model="default", messages=turns, max_tokens=4,
                                                                 temperature=0)
        assert first.headers["x-muser-source"] == "handoff"
        turns += [{"role": "assistant", "content": first.parse().choices[0].message.content},
                  {"role": "user", "content": "And the school?"}]
        second = client.chat.completions.with_raw_response.create(model="default", messages=turns, max_tokens=4,
                                                                  temperature=0)
        body = second.parse()
        assert second.headers["x-muser-source"] == "delta", body.model_extra["muser"]
        assert body.usage.prompt_tokens_details.cached_tokens > 0
        assert 0 < int(second.headers["x-muser-bytes"]) < int(first.headers["x-muser-bytes"]) * 2
        from muser_cli.consumer.decode import decode

        monkeypatch.setenv("MUSER_HOME", str(tmp_path / "fresh"))  # a home with an empty store: all local
        want = decode(None, model=lane["common"][1], prompt=turns, chat=True, max_new_tokens=4, dtype="float32",
                      threads=1, reuse=False, chunk_tokens=8).text
        assert body.choices[0].message.content == want
    finally:
        assert c.stop() == 0


def test_decode_streams_its_text_to_stdout(lane):
    """`muser decode` writes each piece as it is decided (flushed per token); the whole stdout
    is the text --json reports, plus one newline."""
    args = (*lane["common"], "--prompt", str(lane["prompt"]), "-n", str(N), "--no-reuse")
    r = subprocess.run(muser_cmd("decode", *args), env=env_for(lane["nodes"].consumer_home), input=b"",
                       capture_output=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode() == lane["local"]["text"] + ("" if lane["local"]["text"].endswith("\n") else "\n")


def test_printer_flushes_every_piece(monkeypatch, tiny_llama):
    import io
    import sys

    from muser_cli.commands.decode import _Printer

    class Out(io.StringIO):
        flushes = 0

        def flush(self):
            Out.flushes += 1

    out = Out()
    monkeypatch.setattr(sys, "stdout", out)
    p = _Printer(str(tiny_llama.path))
    ids = [72, 101, 108, 108, 111, 32, 119, 111]
    writes = []
    for t in ids:
        before = out.getvalue()
        p.push(t)
        writes.append(out.getvalue()[len(before):])
    from muser_cli.model.tokens import decode_text

    text = decode_text(tiny_llama, ids)
    p.finish(text)
    assert out.getvalue() == text
    assert sum(1 for w in writes if w) >= 2 and Out.flushes >= sum(1 for w in writes if w)


@pytest.mark.slow
def test_the_real_model_through_a_producer_equals_decode(real_model, tmp_path):
    """Done-when, on the embedded model: `decode --serve -m default --producer` with the openai
    client gives the text of `muser decode --prompt` for the same prompt, through the producer."""
    with pull_lane(tmp_path, "default", prompt=PROMPT, common=["-m", "default", "--threads", "2"],
                   check_exit=False) as lane:
        local = local_decode(lane["nodes"].consumer_home, *lane["common"], "--prompt", str(lane["prompt"]), "-n",
                             str(N), "--no-reuse", "--json")
        consumer = Consumer(lane["nodes"].consumer_home, *lane["common"], "--producer", lane["producer"].address,
                            "--no-reuse")
        try:
            raw = complete(consumer.client())
            assert raw.parse().choices[0].text == local["text"]
            assert raw.headers["x-muser-source"] == "handoff"
        finally:
            assert consumer.stop() == 0


def test_a_silent_producer_costs_at_most_the_deadline(lane):
    """A producer that accepts and never answers: after --prefill-deadline the request is
    prefilled here, with the same text; a request may ask for a shorter wait."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    c = Consumer(lane["nodes"].consumer_home, *lane["common"], "--producer", address, "--no-reuse",
                 "--prefill-deadline", "3")
    try:
        t0 = time.monotonic()
        raw = complete(c.client())
        took = time.monotonic() - t0
        assert raw.parse().choices[0].text == lane["local"]["text"]
        # Given up on the silent producer (a state: the pull timed out) and prefilled here. The
        # stopwatch is only a ceiling that catches a hang: the local prefill after the deadline
        # takes what a loaded machine makes it take.
        assert raw.headers["x-muser-source"] == "local" and took < HANG_S, took
        assert "timed out" in raw.parse().model_extra["muser"]["fallback_reason"], raw.parse().model_extra
        raw = c.client().completions.with_raw_response.create(
            model="default", prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"muser_prefill_deadline": 0.5})
        assert raw.parse().choices[0].text == lane["local"]["text"]
    finally:
        assert c.stop() == 0
        silent.close()
