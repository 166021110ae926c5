"""Who owns a miss (issue #39 item 4): every answer of ``muser decode --serve`` records its TTFT
split into components -- consumer queue, producer queue, producer compute, wire, local prefill,
install, gate, first step -- which add up to its TTFT; each is a histogram on /metrics, and an
answer over its budget names the component that overran. Real processes on 127.0.0.1: a
resident producer and the service, the tiny model."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from handoff_kit import HANG_S, LANE_PROMPT as PROMPT, ServiceProcess, muser_cmd, pull_lane  # noqa: E402
from serve_kit import DecodeServer  # noqa: E402

_LISTEN = re.compile(r"listening on http://(\S+)/v1")


@pytest.fixture(scope="module")
def lane(tmp_path_factory, tiny_llama):
    with pull_lane(tmp_path_factory.mktemp("split"), tiny_llama.path, prompt=PROMPT) as lane:
        yield lane


def _check_split(record: dict) -> dict:
    budget = record["budget"]
    split = budget["split_ms"]
    assert set(split) == {"consumer_queue", "producer_queue", "producer_compute", "wire", "local_prefill", "install",
                          "gate", "first_step"}, split
    assert all(v >= 0 for v in split.values()), split
    assert sum(split.values()) == pytest.approx(record["ttft_ms"], abs=0.05), (split, record["ttft_ms"])
    return split


def test_the_budget_split_adds_up_to_the_ttft(lane):
    server = DecodeServer(lane["nodes"].consumer_home, *lane["common"], "--producer", lane["producer"].address,
                          "--no-reuse", "--turn-memory", "0")  # both pulled: the turn memory would hold the second
    try:
        client = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=HANG_S)
        for _ in range(2):
            client.completions.create(model="default", prompt=PROMPT, max_tokens=4, temperature=0)
        records = server.wait_events(2, "request")
        assert [r["source"] for r in records] == ["handoff", "handoff"], records
        for record in records:
            split = _check_split(record)
            assert split["producer_queue"] > 0 and split["producer_compute"] + split["wire"] > 0, split
            assert split["local_prefill"] == 0, split
            route = record["route"]
            assert route["mode"] == "producer" and {"local", "remote_whole"} <= set(route["paths"]), route
        text = httpx.get(f"http://{server.address}/metrics", timeout=HANG_S).text
        for component in ("consumer_queue", "producer_queue", "producer_compute", "first_step"):
            m = re.search(rf'^muser_budget_seconds_count{{component="{component}"}} (\S+)$', text, re.M)
            assert m and float(m.group(1)) == 2, (component, text[:2000])
    finally:
        server.stop()


def test_a_short_prompt_stays_local_and_its_split_is_local(lane):
    server = ServiceProcess(lane["nodes"].consumer_home,
                            muser_cmd("decode", "--serve", "127.0.0.1:0", *lane["common"], "--producer",
                                      lane["producer"].address, "--no-reuse"),
                            _LISTEN, extra_env={"MUSER_ROUTE": "fastest"})
    try:
        before = len(lane["producer"].events("request")) + len(lane["producer"].events("promise"))
        client = openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="unused", max_retries=0,
                               timeout=HANG_S)
        client.completions.create(model="default", prompt="Hi there.", max_tokens=3, temperature=0)
        record = server.wait_events(1, "request")[0]
        assert record["source"] == "local" and record["route"]["choice"] == "local", record
        assert "route: local predicted faster" in record["fallback_reason"], record
        split = _check_split(record)
        assert split["producer_queue"] == split["producer_compute"] == split["wire"] == 0, split
        assert split["local_prefill"] > 0, split
        assert len(lane["producer"].events("request")) + len(lane["producer"].events("promise")) == before
    finally:
        server.stop()
