"""MLX as a muser consumer, on the embedded model (float32, CPU), three figures (the measuring
is muser_cli/bench/mlx_consumer.py):

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

from muser_cli.engines.mlx import blas as mlx_blas

mlx_blas.ensure_fast_blas()  # before anything imports mlx.core

from _common import write_receipt  # noqa: E402

from muser_cli.bench.mlx_consumer import agreement, blas_decode, blas_gflops, decode_ratio  # noqa: E402


def note(line: str) -> None:
    print(line, flush=True)


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
    from muser_cli.model.resolve import resolve_model

    info = resolve_model("default")
    mlx_eng = get_engine("mlx", info, dtype="float32", threads=args.threads)
    torch_eng = get_engine("torch", info, dtype="float32", threads=args.threads)
    blas = mlx_blas.active_blas()
    print(f"model {info.name}, float32, threads {args.threads}, BLAS {blas.name} ({blas.how})", flush=True)
    payload = {"model": info.name, "fingerprint": info.fingerprint, "dtype": "float32", "threads": args.threads,
               "blas": blas.to_json(), "versions": _versions(), "args": vars(args)}
    if "decode" not in skip:
        print(f"decode ratio, depth {args.depth}, {args.new} new tokens, A B A B x {args.reps}:", flush=True)
        payload["decode"] = d = decode_ratio(info, mlx_eng, torch_eng, depth=args.depth, new=args.new,
                                                     reps=args.reps, progress=note)
        print(f"decode: muser mlx {d['muser_mlx_tok_s']['median']:.2f} tok/s (cv {d['muser_mlx_tok_s']['cv']:.1%}), "
              f"mlx_lm {d['mlx_lm_tok_s']['median']:.2f} tok/s (cv {d['mlx_lm_tok_s']['cv']:.1%}), ratio median "
              f"{d['ratio']['median']:.3f} (cv {d['ratio']['cv']:.1%}); same tokens: {d['same_tokens']}", flush=True)
    if "agreement" not in skip:
        print(f"agreement torch -> mlx, {args.prompts} prompts x {args.agree_tokens} tokens:", flush=True)
        payload["agreement"] = g = agreement(info, mlx_eng, torch_eng, prompts=args.prompts, new=args.agree_tokens,
                                                 progress=note)
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
