"""Both services with ``--json`` (issue #49, item 4): every stderr line is one JSON object, so a
log shipper reads them all — ``decode --serve --json`` (no ``listening on`` text line; uvicorn's
own warning about a malformed request as a ``server_log`` record; an error at start as an
``error`` record) and ``prefill --serve --json`` (its ``listening`` and ``metrics`` lines, an error
at start). Real processes on 127.0.0.1, a tiny model."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time

import pytest

from serve_kit import DecodeServer  # noqa: F401 - first: the module skipped without the serve extra

import httpx  # noqa: E402

from handoff_kit import HANG_S, ServiceProcess, env_for, make_nodes, muser_cmd  # noqa: E402


def _all_json(lines: list[str]) -> list[dict]:
    records = []
    for line in lines:
        assert line.startswith("{"), f"a text line among the JSON log lines: {line!r}"
        records.append(json.loads(line))
    assert all(r.get("ts") and r.get("event") for r in records), records
    return records


def _wait(proc: ServiceProcess, test, timeout: float = HANG_S) -> None:
    end = time.monotonic() + timeout
    while not test() and time.monotonic() < end and proc.proc.poll() is None:
        time.sleep(0.05)


def test_decode_serve_json_writes_only_json_lines(tmp_path, tiny_llama):
    server = ServiceProcess(tmp_path / "home", muser_cmd("decode", "--serve", "127.0.0.1:0", "--json", "-m",
                                                         str(tiny_llama.path), "--threads", "1", "--no-reuse"),
                            re.compile(r'"address": "([^"]+)", "engine": "torch", "event": "listening"'))
    try:
        r = httpx.post(f"http://{server.address}/v1/completions", timeout=HANG_S,
                       json={"prompt": "The committee met on a grey Tuesday.", "max_tokens": 2})
        assert r.status_code == 200, r.text
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=HANG_S) as raw:  # not HTTP: uvicorn warns
            raw.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            raw.recv(4096)
        _wait(server, lambda: any('"server_log"' in line for line in server.lines))
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(HANG_S) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    records = _all_json(server.lines)
    events = [r["event"] for r in records]
    assert events[:2] == ["warmed", "listening"] and events[-1] == "stopped", events
    assert any(r["event"] == "request" and r["status"] == 200 for r in records), records
    logged = [r for r in records if r["event"] == "server_log"]
    assert logged and logged[0]["level"] == "warning" and "Invalid HTTP request" in logged[0]["message"], logged


def test_decode_serve_json_reports_an_error_at_start_as_json(tmp_path, tiny_llama):
    r = subprocess.run(muser_cmd("decode", "--serve", "0.0.0.0:0", "--json", "-m", str(tiny_llama.path)),
                       env=env_for(tmp_path / "home"), capture_output=True, timeout=HANG_S)
    assert r.returncode == 2
    [record] = _all_json(r.stderr.decode().splitlines())
    assert record["event"] == "error" and "API key" in record["error"] and record["exit_status"] == 2, record


@pytest.mark.parametrize("enrolled", [True, False])
def test_prefill_serve_json_writes_only_json_lines(tmp_path, tiny_llama, enrolled):
    home = make_nodes(tmp_path).producer_home if enrolled else tmp_path / "bare"
    argv = muser_cmd("prefill", "--serve", "127.0.0.1:0", "--json", "-m", str(tiny_llama.path), "--threads", "1",
                     "--metrics", "127.0.0.1:0")
    if not enrolled:  # no identity: refused at start (78), in one JSON line
        r = subprocess.run(argv, env=env_for(home), capture_output=True, timeout=HANG_S)
        assert r.returncode == 78
        records = _all_json(r.stderr.decode().splitlines())
        record = records[-1]
        assert record["event"] == "error" and "identity" in record["error"] and record["exit_status"] == 78, records
        return
    producer = ServiceProcess(home, argv, re.compile(r'listening on ([^\s"]+)'))
    try:
        assert producer.proc.poll() is None
        producer.proc.send_signal(signal.SIGTERM)
        assert producer.proc.wait(HANG_S) == 0
    finally:
        if producer.proc.poll() is None:
            producer.proc.kill()
    records = _all_json(producer.lines)
    by = {r["event"]: r for r in records}
    assert by["listening"]["address"] == producer.address and by["metrics"]["address"], records
    assert "draining" in by and list(by)[-1] == "stopped", records
