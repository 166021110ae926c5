"""What a served answer tells an HTTP client (issue #49, items 4 and 5): ``decode --serve`` with
a ``--producer`` that cannot be pulled from (this node has no identity): the answer is
computed here and its ``muser.fallback_reason`` says what happened, with no command-line
advice (the pull error's hint: ``muser node init``, ``decode with --prompt``, ...); the hint
is the request's log line's (``pull_hint``), for the operator. And a stream's ``muser`` field
is on the chunk with the ``finish_reason``, the usage chunk after it (docs/serve.md). Real
process on 127.0.0.1, the real ``openai`` client, a tiny model."""

from __future__ import annotations

import re
import time

import pytest

from serve_kit import DecodeServer  # first: the module skipped without the serve extra

pytest.importorskip("openai")
import httpx  # noqa: E402

from handoff_kit import HANG_S  # noqa: E402

PROMPT = "The committee met on a grey Tuesday to decide where the new bridge would go."
ADVICE = re.compile(r"muser |--[a-z]|`|decode with|node init|hint")  # what a command line is told to do


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    s = DecodeServer(tmp_path_factory.mktemp("answers") / "home", "-m", str(tiny_llama.path), "--threads", "1",
                     "--dtype", "float32", "--no-reuse", "--turn-memory", "0", "--producer", "127.0.0.1:1")
    yield s
    s.stop()


def _reason_of(raw) -> str:
    return raw.model_extra["muser"]["fallback_reason"]


def test_a_served_fallback_reason_gives_no_command_line_advice(server):
    client = server.client()
    done = client.completions.create(model="default", prompt=PROMPT, max_tokens=3, temperature=0)
    chat = client.chat.completions.create(model="default", max_tokens=3, temperature=0,
                                          messages=[{"role": "user", "content": PROMPT}])
    msg = httpx.post(f"http://{server.address}/v1/messages", timeout=HANG_S, json={
        "model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": PROMPT}]}).json()
    reasons = [_reason_of(done), _reason_of(chat), msg["muser"]["fallback_reason"]]
    first = reasons[0]  # the pull failed (the next ones find no producer up)
    assert first.startswith("pull from 127.0.0.1:1 failed:") and "identity" in first, first
    for reason in reasons:
        assert reason and not ADVICE.search(reason), reason
    end = time.monotonic() + HANG_S  # the log lines come through the server's stderr, read on a thread
    while len(server.records()) < 3 and time.monotonic() < end:
        time.sleep(0.05)
    line = server.records()[0]  # the operator's line keeps what to do
    assert line["status"] == 200 and line["fallback_reason"] == first, line
    assert "muser node init" in line["pull_hint"], line
    assert "pull_hint" not in done.model_extra["muser"]


def test_a_streams_muser_field_is_on_its_finish_reason_chunk(server):
    chunks = list(server.client().chat.completions.create(
        model="default", max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": PROMPT}]))
    finishing = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason]
    carrying = [i for i, c in enumerate(chunks) if (c.model_extra or {}).get("muser")]
    assert len(finishing) == 1 and carrying == finishing, (finishing, carrying)
    assert chunks[-1].usage is not None and not chunks[-1].choices  # the usage chunk comes after it
    assert chunks[finishing[0]].model_extra["muser"]["source"] == "local"
