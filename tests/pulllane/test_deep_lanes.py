"""Every lane but push at depth (issue #50): a tiny random model with 132k positions, a
prompt of DEPTH tokens, and each way a consumer can get its rows — pulled from a resident
producer, warm from its own store, a delta over the first half it holds, the delta pulled —
decodes the local fallback's tokens. (The push lane at 131,072 tokens, with its memory bound,
is tests/produce/test_live_lane_long.py.)

DEPTH is as deep as the lanes fit in about a minute on two cores (32,768: 50 s here);
``MUSER_TEST_DEPTH=130815`` runs it at the seed's depth (passed: 2 min on two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from handoff_kit import HANG_S, env_for, muser_cmd, pull_lane, without_store

DEPTH = int(os.environ.get("MUSER_TEST_DEPTH", "32768"))
CHUNK = 4096
if not 2 * CHUNK <= DEPTH <= 130_815:
    raise ValueError(f"MUSER_TEST_DEPTH={DEPTH}: from {2 * CHUNK} (half held is a whole chunk) to 130815 (the model's room)")


@pytest.fixture(scope="module")
def deep(tmp_path_factory, _session_env):
    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tiny import _CORPUS, make_tiny_long_llama
    from muser_cli.model.tokens import decode_text, encode_prompt

    root = tmp_path_factory.mktemp("deep")
    info = resolve_model(make_tiny_long_llama(root / "tiny-long-llama"))
    text = _CORPUS
    while len(encode_prompt(info, text)) < DEPTH:
        text *= 2
    ids = encode_prompt(info, text)
    docs = {}
    for name, n in (("doc", DEPTH), ("half", DEPTH // 2 + 1)):  # a pack holds prompt[:-1]
        docs[name] = root / f"{name}.txt"
        docs[name].write_text(decode_text(info, ids[:n]))
        assert len(encode_prompt(info, docs[name].read_text())) == n  # the text round-trips to its tokens
    common = ["-m", str(info.path), "--threads", "2", "--dtype", "float32"]
    with pull_lane(root / "lane", info.path, common=common) as lane:
        lane.update(docs)
        lane["ask"] = [*common, "--chunk", str(CHUNK), "--prompt", str(docs["doc"]), "-n", "4", "--json"]
        yield lane


def _decode(env: dict, *args: str) -> dict:
    r = subprocess.run(muser_cmd("decode", *args), env=env, input=b"", capture_output=True, timeout=max(HANG_S, 3000))
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_pull_store_and_delta_at_depth_decode_the_local_fallbacks_tokens(deep, tmp_path: Path):
    home = without_store(deep["nodes"].consumer_home, tmp_path / "consumer")
    env = {**env_for(home), "MUSER_ROUTE": "producer"}  # ask whatever the cost model says of a tiny model
    local = _decode(env, *deep["ask"], "--no-reuse")
    assert local["source"] == "local" and local["prompt_tokens"] == DEPTH

    # pulled whole from the resident producer, kept in the store (decode --store)
    pulled = _decode(env, *deep["ask"], "--no-reuse", "--producer", deep["producer"].address, "--store")
    assert pulled["source"] == "handoff" and pulled["token_ids"] == local["token_ids"], pulled
    # warm: the same prompt again from the store, nothing computed
    warm = _decode(env, *deep["ask"])
    assert warm["source"] == "store" and warm["reuse"]["computed_tokens"] == 0
    assert warm["token_ids"] == local["token_ids"]

    # a consumer that holds the first half: the producer sends only the second half's rows
    home2 = without_store(deep["nodes"].consumer_home, tmp_path / "consumer-half")
    env2 = {**env_for(home2), "MUSER_ROUTE": "producer"}
    half = subprocess.run(muser_cmd("prefill", *deep["ask"][:8], str(deep["half"]), "--store", "-o",
                                    str(tmp_path / "half.kvpack")), env=env2, capture_output=True,
                          timeout=max(HANG_S, 3000))
    assert half.returncode == 0, half.stderr[-2000:]
    have = subprocess.run(muser_cmd("reuse", "have", *deep["ask"][:2], str(deep["doc"])), env=env2,
                          capture_output=True, timeout=HANG_S)
    assert have.returncode == 0, have.stderr
    held = json.loads(have.stdout)["held_tokens"]
    assert held == DEPTH // 2 - DEPTH // 2 % CHUNK  # the half's whole chunks
    delta = _decode(env2, *deep["ask"], "--producer", deep["producer"].address)
    assert delta["reuse"]["held_tokens"] == held and delta["token_ids"] == local["token_ids"], delta
    assert delta["source"] == "delta", delta
