"""The pull lane with a recurrent-state hybrid (issue 27): real processes, mutual TLS on 127.0.0.1.

A consumer that stored a document asks a resident producer for a follow-up question on it:
the producer ships a delta (the suffix's rows and the state snapshots after the held chunk
boundary), the consumer merges it with its stored snapshot at that boundary, and decodes the
local fallback's tokens; a producer killed mid-stream leaves verified chunks that resume.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from handoff_kit import (LANE_CHUNK as CHUNK, LANE_PROMPT as PROMPT, HANG_S, env_for, local_decode, muser_cmd,
                         prefill_stored, pull_lane, serving, without_store)


@pytest.fixture(scope="module")
def lane(tmp_path_factory, tiny_family):
    with pull_lane(tmp_path_factory.mktemp("pull-state"), tiny_family("qwen3_next").path, prompt=PROMPT) as lane:
        lane["follow"] = lane["root"] / "follow.txt"
        lane["follow"].write_text(PROMPT + "\n\nWhere did they put the bridge?")
        lane["decode"] = [*lane["common"], "--chunk", str(CHUNK), "--prompt", str(lane["follow"]), "-n", "8", "--json"]
        lane["tokens"] = local_decode(lane["nodes"].consumer_home, *lane["decode"], "--no-reuse")["token_ids"]
        yield lane


def test_pull_lane_delta_from_a_stored_snapshot_equals_the_local_fallback(lane, tmp_path):
    from muser_cli.kvpack import read_pack

    env = env_for(without_store(lane["nodes"].consumer_home, tmp_path / "consumer"))
    prefill_stored(env, lane["prompt"], tmp_path / "doc.kvpack", *lane["common"], "--chunk", str(CHUNK))
    delta_path = tmp_path / "delta.kvpack"
    got = subprocess.run(muser_cmd("receive", "--from", lane["producer"].address, str(lane["follow"]), "-m",
                                   lane["model"], "--chunk", str(CHUNK), "-o", str(delta_path), "--json"),
                         env=env, capture_output=True, timeout=HANG_S)
    assert got.returncode == 0, got.stderr
    held = json.loads(got.stdout)["held_tokens"]
    with open(delta_path, "rb") as f:
        pack = read_pack(f)
    assert held >= CHUNK and held % CHUNK == 0 and pack.header.rows_start == held
    state = [i for i, s in enumerate(pack.header.layers) if s.kind == "state"]
    assert state and all(f[1] >= held for f in pack.header.frame_plan() if f[0] in state)
    merged = subprocess.run(muser_cmd("decode", str(delta_path), *lane["decode"]), env=env, capture_output=True,
                            timeout=HANG_S)
    assert merged.returncode == 0, merged.stderr
    out = json.loads(merged.stdout)
    assert out["source"] == "delta" and out["token_ids"] == lane["tokens"], out
    # the pull lane in one call: decode --producer asks for the delta itself
    pulled = subprocess.run(muser_cmd("decode", *lane["decode"], "--producer", lane["producer"].address), env=env,
                            input=b"", capture_output=True, timeout=HANG_S)
    assert pulled.returncode == 0, pulled.stderr
    out = json.loads(pulled.stdout)
    assert out["token_ids"] == lane["tokens"] and out["reuse"]["held_tokens"] == held, out


def test_a_producer_with_state_every_serves_spaced_snapshots_with_the_same_tokens(lane, tmp_path):
    """``prefill --serve --state-every 3``: every pack it serves carries the state snapshots
    every third chunk (and at the end), so fewer bytes for the same rows; ``decode --producer``
    decodes the local fallback's tokens, whole and as a delta from a stored document."""
    from muser_cli.kvpack import read_pack

    with serving(lane["nodes"].producer_home, *lane["common"], "--state-every", "3") as prod:
        env = env_for(without_store(lane["nodes"].consumer_home, tmp_path / "consumer"))
        ask = ["receive", "--from", prod.address, str(lane["follow"]), "-m", lane["model"], "--chunk", str(CHUNK),
               "--no-reuse", "--json"]
        spaced = subprocess.run(muser_cmd(*ask, "-o", str(tmp_path / "spaced.kvpack")), env=env, capture_output=True,
                                timeout=HANG_S)
        assert spaced.returncode == 0, spaced.stderr
        every = subprocess.run(muser_cmd(*[a.replace(prod.address, lane["producer"].address) for a in ask], "-o",
                                         str(tmp_path / "every.kvpack")), env=env, capture_output=True, timeout=HANG_S)
        assert every.returncode == 0, every.stderr
        with open(tmp_path / "spaced.kvpack", "rb") as f:
            header = read_pack(f).header
        assert header.state_every == 3 and header.rows_start == 0
        assert json.loads(spaced.stdout)["payload_bytes"] < json.loads(every.stdout)["payload_bytes"]
        whole = subprocess.run(muser_cmd("decode", *lane["decode"], "--no-reuse", "--producer", prod.address), env=env,
                               input=b"", capture_output=True, timeout=HANG_S)
        assert whole.returncode == 0, whole.stderr
        out = json.loads(whole.stdout)
        assert out["source"] == "handoff" and out["token_ids"] == lane["tokens"], out
        prefill_stored(env, lane["prompt"], tmp_path / "doc.kvpack", *lane["common"], "--chunk", str(CHUNK))
        delta = subprocess.run(muser_cmd("decode", *lane["decode"], "--producer", prod.address), env=env, input=b"",
                               capture_output=True, timeout=HANG_S)
        assert delta.returncode == 0, delta.stderr
        out = json.loads(delta.stdout)
        assert out["token_ids"] == lane["tokens"] and out["reuse"]["held_tokens"] >= CHUNK, out
