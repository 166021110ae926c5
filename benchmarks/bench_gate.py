"""What the sampled numeric gate costs (issue 30): TTFT of decoding a foreign pack with the
default gate (32 positions sampled across the prompt in every layer, plus the last position
fused into the first step) against the same decode with the gate skipped (``--no-audit``),
and the sampled check's own time, as a share of the first token; the local prefill it saves
for scale.

    .venv/bin/python benchmarks/bench_gate.py [--depths 2048,8064] [--reps 3] [--threads 1]

Per depth the embedded model prefills the corpus once in bfloat16 (torch, chunk 512; timed:
the local prefill a fallback would pay); the pack is re-labelled as made by vLLM (every
digest re-made). One resident torch engine then decodes it through ``muser_cli.decode.decode``
(read + verify from memory, install, gate, first token, ``--new`` tokens) with and without
the gate, alternately A B A B, ``--reps`` counted after one warm-up round.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import corpus_ids, summarize, write_receipt  # noqa: E402
from bench_spot_check import foreign_pack  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="2048,8064")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    import torch

    from muser_cli.decode import decode
    from muser_cli.engines.registry import get_engine
    from muser_cli.models import resolve_model

    info = resolve_model(args.model)
    eng = get_engine("torch", info, dtype="bfloat16", threads=args.threads)
    rows_out = []
    for depth in [int(d) for d in args.depths.split(",")]:
        t = time.perf_counter()
        data, rows = foreign_pack(info, corpus_ids(info, depth), threads=args.threads)
        prefill_s = time.perf_counter() - t
        ttft: dict[str, list[float]] = {"gate": [], "none": []}
        sampled_ms: list[float] = []
        worst: list[float] = []
        for rep in range(args.reps + 1):
            for mode in ("gate", "none"):
                out = decode(io.BytesIO(data), model=args.model, max_new_tokens=args.new, engine="torch",
                             dtype="bfloat16", threads=args.threads, resident=eng, audit=0 if mode == "none" else None)
                spot = out.spot_check or {}
                if mode == "gate":
                    s = spot.get("sampled") or {}
                    if not (spot.get("ok") and s.get("ok") and len(s.get("positions", [])) == 32):
                        raise SystemExit(f"unexpected gate record {spot}")
                    if rep:
                        sampled_ms.append(float(s["ms"]))
                        worst.append(float(s["worst_rel"]))
                if rep:
                    ttft[mode].append(out.ttft_s * 1e3)
        row = {"depth": depth, "rows": rows, "pack_bytes": len(data), "local_prefill_s": round(prefill_s, 2),
               "ttft_ms": {m: summarize(v) for m, v in ttft.items()}, "sampled_check_ms": summarize(sampled_ms),
               "worst_rel": max(worst)}
        g, n = row["ttft_ms"]["gate"]["median"], row["ttft_ms"]["none"]["median"]
        row["extra_ms"] = g - n
        row["extra_pct_of_ttft"] = 100.0 * (g - n) / g
        row["sampled_pct_of_ttft"] = 100.0 * row["sampled_check_ms"]["median"] / g
        row["sampled_pct_of_local_prefill"] = 100.0 * row["sampled_check_ms"]["median"] / (1e3 * prefill_s)
        rows_out.append(row)
        print(f"depth {depth}: TTFT gate {g:.0f} ms, none {n:.0f} ms (extra {g - n:.0f} ms, "
              f"{row['extra_pct_of_ttft']:.0f} %); sampled check {row['sampled_check_ms']['median']:.0f} ms "
              f"({row['sampled_pct_of_ttft']:.0f} % of TTFT, {row['sampled_pct_of_local_prefill']:.2f} % of the "
              f"{prefill_s:.1f} s local prefill)", file=sys.stderr, flush=True)
    path = write_receipt("gate", {
        "what": "TTFT of a foreign (vLLM-labelled) bf16 pack with the default numeric gate (32 sampled positions "
                "in every layer + the fused last position) vs --no-audit (bench_gate.py)",
        "args": vars(args), "load_average": os.getloadavg(), "torch_threads": torch.get_num_threads(),
        "rows": rows_out})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
