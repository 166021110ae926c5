"""Spine figures on the embedded model: prefill time, kvpack write/read time, bytes per
token, decode ms/token at 512, 2048 and 8k tokens (torch, float32 by default: no bf16 matmul units on this CPU).

    python benchmarks/bench_spine.py [--depths 512,2048,8064] [--reps 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import io
import os
import time

from _common import corpus_ids, measure, summarize, write_receipt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="512,2048,8064")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--decode-tokens", type=int, default=16)
    args = ap.parse_args()

    from muser_cli.engines.registry import get_engine
    from muser_cli.kvpack import read_pack_bytes, write_pack
    from muser_cli.model.resolve import resolve_model
    from muser_cli.produce.pipeline import pack_header

    info = resolve_model("default")
    eng = get_engine("torch", info, dtype=args.dtype, threads=args.threads)
    rows = []
    for depth in [int(d) for d in args.depths.split(",")]:
        ids = corpus_ids(info, depth)
        header = pack_header(info, ids, dtype=args.dtype, chunk_tokens=512, engine="torch", threads=args.threads)
        state = {}

        def do_prefill():
            state["layers"] = eng.prefill(ids[:-1], chunk_tokens=512)

        pre = measure(do_prefill, reps=args.reps)
        layers = state["layers"]
        res = {}
        for codec in ("none", "zstd+bytegroup"):
            def do_write():
                buf = io.BytesIO()
                write_pack(buf, header, layers, codec=codec)
                state["blob"] = buf.getvalue()

            w = measure(do_write, reps=args.reps)
            blob = state["blob"]
            r = measure(lambda: read_pack_bytes(blob), reps=args.reps)
            res[codec] = {"write": w, "read": r, "bytes": len(blob), "bytes_per_token": len(blob) / depth}
        dec_times = []
        for i in range(args.reps + 1):
            out = eng.decode(layers, rows=depth - 1, next_tokens=[ids[-1]], max_new_tokens=args.decode_tokens,
                             stop_on_eos=False)
            if i:
                dec_times.append(out.decode_s / max(1, len(out.token_ids) - 1))
        row = {"depth": depth, "prefill": pre, "pack": res, "decode_s_per_token": summarize(dec_times)}
        rows.append(row)
        print(f"{depth:>6} tok  prefill {pre['median']:.3f}s (cv {pre['cv']:.2%})  "
              f"write raw {res['none']['write']['median']*1e3:.1f}ms zstd {res['zstd+bytegroup']['write']['median']*1e3:.1f}ms  "
              f"read raw {res['none']['read']['median']*1e3:.1f}ms zstd {res['zstd+bytegroup']['read']['median']*1e3:.1f}ms  "
              f"B/tok raw {res['none']['bytes_per_token']:.0f} zstd {res['zstd+bytegroup']['bytes_per_token']:.0f}  "
              f"decode {row['decode_s_per_token']['median']*1e3:.1f} ms/tok", flush=True)
    path = write_receipt("spine", {"model": info.name, "fingerprint": info.fingerprint, "dtype": args.dtype,
                                   "threads": args.threads, "rows": rows})
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
