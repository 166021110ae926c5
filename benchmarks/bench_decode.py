"""Decode speed from installed rows: ms per generated token at several context depths,
the torch engine's sized cache against transformers' growing ``DynamicCache``, and both
against the bandwidth floor.

    .venv/bin/python benchmarks/bench_decode.py [--depths 512,2048,8064] [--new 32] [--reps 5]

The floor is what one token must at least move: every weight byte and the K and V bytes
of the context, read once, at this machine's memcpy rate (numpy copy of 256 MiB, measured
in the same run). Per depth the rows are prefilled once (embedded model, float32, chunk
512), then the two caches decode ``--new`` greedy tokens alternately A B A B, one thread,
``--reps`` counted after one warm-up each; the tokens of both must be equal (checked).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import corpus_ids, summarize, write_receipt  # noqa: E402


def memcpy_rate(mib: int = 256, reps: int = 5) -> float:
    a = np.ones(mib << 20, dtype=np.uint8)
    b = np.empty_like(a)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return a.nbytes / float(np.median(times[1:]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="512,2048,8064")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    import torch

    from muser_cli.engines.torch.engine import TorchEngine
    from muser_cli.models import resolve_model

    info = resolve_model(args.model)
    sized = TorchEngine(info, dtype="float32", threads=args.threads)
    grown = TorchEngine(info, dtype="float32", threads=args.threads)
    grown.model = sized.model
    grown.sized_cache = False
    weight_bytes = sum(p.numel() * p.element_size() for p in sized.model.parameters())
    rate = memcpy_rate()
    rows_out = []
    for depth in [int(d) for d in args.depths.split(",")]:
        ids = corpus_ids(info, depth)
        t = time.perf_counter()
        layers = sized.prefill(ids[:-1], chunk_tokens=512)
        prefill_s = time.perf_counter() - t
        kv_bytes = sum(kv.keys.nbytes + kv.values.nbytes for kv in layers)
        floor_s = (weight_bytes + kv_bytes) / rate
        per: dict[str, list[float]] = {"sized": [], "grown": []}
        tokens: dict[str, list[int]] = {}
        for rep in range(args.reps + 1):
            for name, eng in (("sized", sized), ("grown", grown)):
                out = eng.decode(layers, rows=depth - 1, next_tokens=[ids[-1]], max_new_tokens=args.new,
                                 stop_on_eos=False)
                tokens.setdefault(name, out.token_ids)
                if out.token_ids != tokens[name]:
                    raise SystemExit(f"{name}: tokens changed between reps")
                if rep:
                    per[name].append(out.decode_s / (len(out.token_ids) - 1))
        if tokens["sized"] != tokens["grown"]:
            raise SystemExit(f"depth {depth}: the sized and the growing cache decoded different tokens")
        row = {"depth": depth, "prefill_s": round(prefill_s, 3), "kv_bytes": kv_bytes, "floor_ms": 1e3 * floor_s,
               "sized_ms": summarize([1e3 * x for x in per["sized"]]),
               "grown_ms": summarize([1e3 * x for x in per["grown"]])}
        row["sized_over_floor"] = row["sized_ms"]["median"] / row["floor_ms"]
        row["grown_over_floor"] = row["grown_ms"]["median"] / row["floor_ms"]
        rows_out.append(row)
        s, g = row["sized_ms"], row["grown_ms"]
        print(f"depth {depth:5d}: sized {s['median']:.1f} ms/token ({s['min']:.1f}-{s['max']:.1f}), "
              f"growing {g['median']:.1f} ({g['min']:.1f}-{g['max']:.1f}), floor {row['floor_ms']:.1f} ms: "
              f"{row['sized_over_floor']:.2f}x vs {row['grown_over_floor']:.2f}x", file=sys.stderr, flush=True)
    path = write_receipt("decode", {
        "what": "decode ms/token from installed rows: sized cache vs transformers' DynamicCache vs the bandwidth "
                "floor (bench_decode.py)",
        "args": vars(args), "load_average": os.getloadavg(), "torch_threads": torch.get_num_threads(),
        "weight_bytes": weight_bytes, "memcpy_bytes_per_s": rate, "rows": rows_out})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
