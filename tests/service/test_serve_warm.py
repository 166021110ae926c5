"""Issue 39 item 5: ``decode --serve`` warms its engine before it says it listens (a real
process on 127.0.0.1): one throwaway request on the local path, logged as ``warmed`` before the
``listening`` line, leaving nothing in the store; the first client is then served as usual."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from handoff_kit import HANG_S, ServiceProcess, lane_flags, muser_cmd  # noqa: E402

_LISTEN = re.compile(r"listening on http://(\S+)/v1")


def test_decode_serve_warms_before_listening_and_leaves_nothing_behind(tmp_path, tiny_llama):
    home = tmp_path / "home"
    service = ServiceProcess(home, muser_cmd("decode", "--serve", "127.0.0.1:0", *lane_flags(tiny_llama.path)), _LISTEN)
    try:
        lines = list(service.lines)
        listening = next(k for k, line in enumerate(lines) if _LISTEN.search(line))
        warmed = [(k, json.loads(line)) for k, line in enumerate(lines) if line.startswith("{")
                  and json.loads(line).get("event") == "warmed"]
        assert len(warmed) == 1 and warmed[0][0] < listening and warmed[0][1]["warm_s"] > 0, lines
        store = home / "data" / "store"
        assert not store.exists() or not any(store.rglob("*.kvpack")), sorted(store.rglob("*"))  # no rows kept
        r = httpx.post(f"http://{service.address}/v1/completions", timeout=HANG_S,
                       json={"model": tiny_llama.path.name, "prompt": "The bridge over the river", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert service.wait_events(1)[0]["source"] == "local", service.lines
    finally:
        assert service.stop() == 0, "".join(service.lines)
