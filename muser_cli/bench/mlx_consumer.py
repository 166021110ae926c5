"""MLX as a muser consumer: decode against mlx-lm's own loop, torch -> MLX agreement, and the
BLAS in use against the bundled one (``benchmarks/bench_mlx.py`` calls these; see its docstring).

Call ``muser_cli.engines.mlx.blas.ensure_fast_blas()`` before this module's functions
import mlx. Nothing here prints or exits: progress goes through a callback; the probes
run as child processes that print one JSON line each for this module to read.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from muser_cli.bench.common import Progress, corpus_ids, no_progress, summarize
from muser_cli.engines.mlx import blas as mlx_blas
from muser_cli.model.tokens import encode_prompt

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
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tokens import encode_prompt
model = resolve_model("default")
eng = get_engine("mlx", model, dtype="float32", threads={threads})
ids = encode_prompt(model, "Write one sentence about rivers.", chat=True)
layers = eng.prefill(ids[:-1], chunk_tokens=512)
kw = dict(rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens={new}, stop_on_eos=False)
eng.decode(layers, **kw)
out = eng.decode(layers, **kw)
print(json.dumps({{"blas": out.stats["blas"], "tok_s": (len(out.token_ids) - 1) / out.decode_s}}))
"""


def decode_ratio(info, mlx_eng, torch_eng, *, depth: int, new: int, reps: int,
                 progress: Progress = no_progress) -> dict:
    """A = muser MLX consumer from installed rows, B = mlx_lm generate_step from the prompt."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    ids = corpus_ids(info, depth)
    rows = len(ids) - 1
    layers = torch_eng.prefill(ids[:-1], chunk_tokens=512)  # the handoff the consumer receives

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
    for rep in range(reps + 1):  # rep 0: uncounted warm-up pair
        a, ta = ours()
        b, tb = theirs()
        same_tokens &= ta == tb
        if rep:
            a_rates.append(a)
            b_rates.append(b)
            ratios.append(a / b)
        progress(f"  rep {rep}{' (warm-up)' if not rep else ''}: muser mlx {a:.2f} tok/s, mlx_lm {b:.2f} tok/s, "
                 f"ratio {a / b:.3f}")
    return {"depth": len(ids), "new_tokens": new, "muser_mlx_tok_s": summarize(a_rates),
            "mlx_lm_tok_s": summarize(b_rates), "ratio": summarize(ratios), "same_tokens": same_tokens}


def agreement(info, mlx_eng, torch_eng, *, prompts: int, new: int, progress: Progress = no_progress) -> dict:
    """Greedy tokens torch -> MLX from the same rows, and the first step's logits."""
    import numpy as np


    rows_out = []
    for prompt in PROMPTS[:prompts]:
        ids = encode_prompt(info, prompt, chat=True)
        layers = torch_eng.prefill(ids[:-1], chunk_tokens=512)
        kw = dict(rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=new, stop_on_eos=False)
        t = torch_eng.decode(layers, **kw).token_ids
        m = mlx_eng.decode(layers, **kw).token_ids
        prefix = next((i for i, (x, y) in enumerate(zip(t, m)) if x != y), len(t))
        lt = torch_eng.step_logits(layers, rows=kw["rows"], next_tokens=ids[-1:])
        lm = mlx_eng.step_logits(layers, rows=kw["rows"], next_tokens=ids[-1:])
        rows_out.append({"prompt": prompt, "tokens": len(ids), "match": t == m, "agree_prefix": prefix,
                         "logit_max_diff": float(np.abs(lt - lm).max())})
        progress(f"  {'=' if t == m else 'x'} {prefix:>2}/{len(t)}  {prompt}")
    return {"prompts": len(rows_out), "new_tokens": new,
            "sequences_identical": sum(r["match"] for r in rows_out),
            "tokens_agreeing": sum(r["agree_prefix"] for r in rows_out),
            "tokens_total": new * len(rows_out),
            "logit_max_diff": {"median": statistics.median(r["logit_max_diff"] for r in rows_out),
                               "max": max(r["logit_max_diff"] for r in rows_out)},
            "rows": rows_out}


def blas_gflops(reps: int, n: int) -> dict:
    """fp32 matmul GFLOP/s with the BLAS in use vs the bundled reference, fresh processes, alternated."""

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
