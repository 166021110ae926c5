"""kvpack <-> mlx-lm prompt cache: muser's export/import vs mlx-lm's own save/load
(the measuring is muser_cli/bench/interop.py).

    python benchmarks/bench_interop.py --tokens 2048 [--tokens 8064] [--reps 5]

Rows: a real torch prefill of the embedded model (float32, chunk 512) over a prompt of
exactly N tokens taken from the project's docs. Each rep runs, alternated A B A B:

* muser export: verify + read an uncompressed kvpack, write the mlx-lm file;
* mlx-lm save: ``save_prompt_cache`` of the same cache (loaded from that file, evaluated);
* muser import: parse + check an mlx-lm file written by ``save_prompt_cache``, write a kvpack
  (uncompressed, and zstd+bytegroup level 1);
* mlx-lm load: ``load_prompt_cache`` of that file, every array evaluated.

Files go to a temporary folder (no fsync on either side). One warm-up, median and CV,
JSON receipt in benchmarks/results/interop-*.json.
"""

from __future__ import annotations

import argparse
import sys

from _common import write_receipt

from muser_cli.engines.mlx import blas as mlx_blas

mlx_blas.ensure_fast_blas()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, action="append")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    from muser_cli.bench.interop import run_interop
    from muser_cli.model.resolve import resolve_model

    info = resolve_model("default")
    results = run_interop(info, args.tokens or [2048], reps=args.reps,
                          progress=lambda line: print(line, file=sys.stderr, flush=True))
    for n, r in results.items():
        for k, s in r.items():
            if k != "sizes":
                print(f"{n:>6} {k:<20} median {s['median'] * 1000:8.1f} ms  CV {s['cv'] * 100:5.1f} %")
        print(f"{n:>6} sizes {r['sizes']}")
    path = write_receipt("interop", {"model": info.name, "dtype": "float32", "reps": args.reps, "results": results,
                                     "note": "2 shared cores, other agents running"})
    print(path)


if __name__ == "__main__":
    main()
