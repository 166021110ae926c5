"""MLX as a muser consumer, on the embedded model (float32, CPU), three figures:

1. decode: muser's MLX consumer (install kvpack rows, then decode) tok/s divided by
   mlx-lm's own loop (``mlx_lm.generate.generate_step``, the loop under
   ``mlx_lm.generate``) on the same model object and prompt; side by side, A B A B,
   one uncounted warm-up pair, >= 5 counted pairs; median and CV of each and of the ratio.
   Aim (docs/benchmarking.md): >= 0.95.
2. agreement: greedy tokens torch -> MLX over >= 20 prompts x 32 new tokens (torch
   prefills, both engines decode the same rows); whole-sequence matches, tokens agreeing
   before the first divergence, first-step logit max diff.
3. BLAS: fp32 matmul GFLOP/s, and MLX consumer decode tok/s, with the BLAS in use vs
   the reference BLAS bundled with ``mlx[cpu]``, each in a fresh subprocess, alternated.

    python benchmarks/bench_mlx.py [--reps 5] [--new 64] [--depth 128] [--prompts 20] [--threads 1]

Writes a JSON receipt under benchmarks/results/ (mlx-<time>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from muser_cli.engines.mlx import blas as mlx_blas  # noqa: E402

mlx_blas.ensure_fast_blas()  # before anything imports mlx.core

from _common import corpus_ids, summarize, write_receipt  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about rivers.",
    "Explain photosynthesis to a child.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a haiku about autumn.",
    "What does a compiler do?",
    "Name the planets of the solar system.",
    "How do I boil an egg?",
    "Describe a cat in two sentences.",
    "What is the difference between weather and climate?",
    "Write a Python function that reverses a string.",
    "Who wrote Romeo and Juliet?",
    "Suggest a name for a bakery.",
    "What is the boiling point of water at sea level?",
    "Summarize the plot of Cinderella.",
    "What are prime numbers?",
    "How many legs does a spider have?",
    "Tell me a fun fact about octopuses.",
    "What is machine learning?",
    "Recommend a book for a long train ride.",
    "How does a bicycle stay upright?",
]

GEMM_PROBE = """
import json, time, statistics
from muser_cli.engines.mlx import blas as mlx_blas
info = mlx_blas.ensure_fast_blas()
import mlx.core as mx
n = {n}
a = mx.random.normal((n, n)); b = mx.random.normal((n, n)); mx.eval(a, b)
mx.eval(a @ b)
times = []
for _ in range(5):
    t = time.perf_counter(); mx.eval(a @ b); times.append(time.perf_counter() - t)
print(json.dumps({{"blas": info.name, "gflops": 2 * n ** 3 / statistics.median(times) / 1e9}}))
"""

DECODE_PROBE = """
import json
from muser_cli.engines.mlx import blas as mlx_blas
info = mlx_blas.ensure_fast_blas()
from muser_cli.engines.registry import get_engine
from muser_cli.models import resolve_model
from muser_cli.tokens import encode_prompt
model = resolve_model("default")
eng = get_engine("mlx", model, dtype="float32", threads={threads})
ids = encode_prompt(model, "Write one sentence about rivers.", chat=True)
layers = eng.prefill(ids[:-1], chunk_tokens=512)
kw = dict(rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens={new}, stop_on_eos=False)
eng.decode(layers, **kw)
out = eng.decode(layers, **kw)
print(json.dumps({{"blas": out.stats["blas"], "tok_s": (len(out.token_ids) - 1) / out.decode_s}}))
"""


def decode_ratio(info, mlx_eng, torch_eng, args) -> dict:
    """A = muser MLX consumer from installed rows, B = mlx_lm generate_step from the prompt."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    ids = corpus_ids(info, args.depth)
    rows = len(ids) - 1
    layers = torch_eng.prefill(ids[:-1], chunk_tokens=512)  # the handoff the consumer receives
    new = args.new

    def ours() -> tuple[float, list[int]]:
        out = mlx_eng.decode(layers, rows=rows, next_tokens=ids[-1:], max_new_tokens=new, stop_on_eos=False)
        return (len(out.token_ids) - 1) / out.decode_s, out.token_ids

    def theirs() -> tuple[float, list[int]]:
        tokens, first = [], None
        for token, _ in generate_step(mx.array(ids), mlx_eng.model, max_tokens=new, prefill_step_size=512):
            tokens.append(int(token))
            if first is None:
                first = time.perf_counter()
        return (len(tokens) - 1) / (time.perf_counter() - first), tokens

    a_rates, b_rates, ratios = [], [], []
    same_tokens = True
    for rep in range(args.reps + 1):  # rep 0: uncounted warm-up pair
        a, ta = ours()
        b, tb = theirs()
        same_tokens &= ta == tb
        if rep:
            a_rates.append(a)
            b_rates.append(b)
            ratios.append(a / b)
        print(f"  rep {rep}{' (warm-up)' if not rep else ''}: muser mlx {a:.2f} tok/s, mlx_lm {b:.2f} tok/s, "
              f"ratio {a / b:.3f}", flush=True)
    return {"depth": len(ids), "new_tokens": new, "muser_mlx_tok_s": summarize(a_rates),
            "mlx_lm_tok_s": summarize(b_rates), "ratio": summarize(ratios), "same_tokens": same_tokens}


def agreement(info, mlx_eng, torch_eng, args) -> dict:
    import numpy as np

    from muser_cli.tokens import encode_prompt

    rows_out = []
    for prompt in PROMPTS[: args.prompts]:
        ids = encode_prompt(info, prompt, chat=True)
        layers = torch_eng.prefill(ids[:-1], chunk_tokens=512)
        kw = dict(rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=args.agree_tokens, stop_on_eos=False)
        t = torch_eng.decode(layers, **kw).token_ids
        m = mlx_eng.decode(layers, **kw).token_ids
        prefix = next((i for i, (x, y) in enumerate(zip(t, m)) if x != y), len(t))
        lt = torch_eng.step_logits(layers, rows=kw["rows"], next_tokens=ids[-1:])
        lm = mlx_eng.step_logits(layers, rows=kw["rows"], next_tokens=ids[-1:])
        rows_out.append({"prompt": prompt, "tokens": len(ids), "match": t == m, "agree_prefix": prefix,
                         "logit_max_diff": float(np.abs(lt - lm).max())})
        print(f"  {'=' if t == m else 'x'} {prefix:>2}/{len(t)}  {prompt}", flush=True)
    return {"prompts": len(rows_out), "new_tokens": args.agree_tokens,
            "sequences_identical": sum(r["match"] for r in rows_out),
            "tokens_agreeing": sum(r["agree_prefix"] for r in rows_out),
            "tokens_total": args.agree_tokens * len(rows_out),
            "logit_max_diff": {"median": statistics.median(r["logit_max_diff"] for r in rows_out),
                               "max": max(r["logit_max_diff"] for r in rows_out)},
            "rows": rows_out}


def blas_gflops(reps: int, n: int) -> dict:
    code = GEMM_PROBE.format(n=n)
    fast_env = {**os.environ}
    ref_env = {**os.environ, mlx_blas.ENV_VAR: "reference"}
    ref_env.pop("LD_PRELOAD", None)
    out: dict[str, list[float]] = {}
    for _ in range(reps):
        for env in (fast_env, ref_env):
            res = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                            check=True).stdout)
            out.setdefault(res["blas"], []).append(res["gflops"])
    return {name: summarize(values) for name, values in out.items()}


def blas_decode(reps: int, new: int, threads: int) -> dict:
    """MLX consumer decode tok/s with the BLAS in use vs the bundled reference, fresh processes, alternated."""
    code = DECODE_PROBE.format(threads=threads, new=new)
    ref_env = {**os.environ, mlx_blas.ENV_VAR: "reference"}
    ref_env.pop("LD_PRELOAD", None)
    out: dict[str, list[float]] = {}
    for _ in range(reps):
        for env in (dict(os.environ), ref_env):
            res = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                            check=True).stdout.strip().splitlines()[-1])
            out.setdefault(res["blas"], []).append(res["tok_s"])
    return {name: summarize(values) for name, values in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--depth", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gemm", type=int, default=512)
    ap.add_argument("--blas-decode-tokens", type=int, default=16)
    ap.add_argument("--skip", default="", help="comma list of: decode, agreement, blas")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    from muser_cli.engines.registry import get_engine
    from muser_cli.engines.mlx.engine import _versions
    from muser_cli.models import resolve_model

    info = resolve_model("default")
    mlx_eng = get_engine("mlx", info, dtype="float32", threads=args.threads)
    torch_eng = get_engine("torch", info, dtype="float32", threads=args.threads)
    blas = mlx_blas.active_blas()
    print(f"model {info.name}, float32, threads {args.threads}, BLAS {blas.name} ({blas.how})", flush=True)
    payload = {"model": info.name, "fingerprint": info.fingerprint, "dtype": "float32", "threads": args.threads,
               "blas": blas.to_json(), "versions": _versions(), "args": vars(args)}
    if "decode" not in skip:
        print(f"decode ratio, depth {args.depth}, {args.new} new tokens, A B A B x {args.reps}:", flush=True)
        payload["decode"] = d = decode_ratio(info, mlx_eng, torch_eng, args)
        print(f"decode: muser mlx {d['muser_mlx_tok_s']['median']:.2f} tok/s (cv {d['muser_mlx_tok_s']['cv']:.1%}), "
              f"mlx_lm {d['mlx_lm_tok_s']['median']:.2f} tok/s (cv {d['mlx_lm_tok_s']['cv']:.1%}), ratio median "
              f"{d['ratio']['median']:.3f} (cv {d['ratio']['cv']:.1%}); same tokens: {d['same_tokens']}", flush=True)
    if "agreement" not in skip:
        print(f"agreement torch -> mlx, {args.prompts} prompts x {args.agree_tokens} tokens:", flush=True)
        payload["agreement"] = g = agreement(info, mlx_eng, torch_eng, args)
        print(f"agreement: {g['sequences_identical']}/{g['prompts']} sequences identical, "
              f"{g['tokens_agreeing']}/{g['tokens_total']} tokens before first divergence, first-step logit "
              f"max diff median {g['logit_max_diff']['median']:.2e} max {g['logit_max_diff']['max']:.2e}", flush=True)
    if "blas" not in skip:
        payload["gemm_gflops"] = gf = blas_gflops(args.reps, args.gemm)
        print("gemm fp32 %d^3: " % args.gemm + ", ".join(f"{k} {v['median']:.1f} GFLOP/s (cv {v['cv']:.1%})"
                                                          for k, v in gf.items()), flush=True)
        payload["decode_tok_s_by_blas"] = bd = blas_decode(args.reps, args.blas_decode_tokens, args.threads)
        print(f"decode by BLAS ({args.blas_decode_tokens} tokens, fresh processes): " + ", ".join(
            f"{k} {v['median']:.2f} tok/s (cv {v['cv']:.1%})" for k, v in bd.items()), flush=True)
    path = write_receipt("mlx", payload)
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
