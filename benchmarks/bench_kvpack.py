"""kvpack at memory speed and against mlx-lm's prompt cache: ``muser bench pack``'s method
(muser_cli/bench/pack.py) with the longer study's cases in the same rounds.

    python benchmarks/bench_kvpack.py [--depths 512,2048,8064] [--reps 5] [--synthetic]
    python benchmarks/bench_kvpack.py --cli-only --cli-pack FILE [--baseline DIR]

Beside ``bench pack``'s cases (memcpy; pack into a preallocated buffer / unpack in place,
both codecs; save + fsync / load, kvpack against mlx-lm with both loads evaluated): every
digest (v1.1 blake3, v1.1 sha256, v1.0 sha256), the floor (every row hashed once, no
copy), pack to / unpack from a tmpfs file, and each saved file loaded in a fresh
interpreter (``--fresh-reps``). Then ``muser pack --no-zstd`` against ``cat`` on the
deepest pack (process start subtracted; ``--baseline DIR`` times an older tree's
``muser pack`` in the same rounds: DIR holds its muser_cli/, e.g. ``git archive REV
muser_cli | tar -x -C DIR``). Receipts: results/pack-*.json (the kind ``muser bench chart``
draws) and results/pack-cli-*.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _common import RESULTS, write_receipt


def cli_compare(args, info) -> int:
    """``muser pack --no-zstd`` against ``cat`` on ``--cli-pack``, or on a pack of synthetic bf16
    rows of the deepest depth (the codec is none: the rows' values do not matter)."""
    from muser_cli.bench.pack import fsync_write, synthetic_kv
    from muser_cli.bench.pack_study import pack_vs_cat
    from muser_cli.kvpack import write_pack
    from muser_cli.produce.pipeline import pack_header

    with tempfile.TemporaryDirectory(prefix="muser-bench-") as tmp:
        big = Path(args.cli_pack) if args.cli_pack else Path(tmp) / "big.kvpack"
        depth = None if args.cli_pack else max(int(d) for d in args.depths.split(","))
        if depth:
            ids, layers = synthetic_kv(info, depth)
            header = pack_header(info, ids, dtype="bfloat16", chunk_tokens=512, engine="torch", threads=1)
            fsync_write(big, lambda fh: write_pack(fh, header, layers, codec="none"))
        res = pack_vs_cat(big, reps=args.cli_reps or args.reps, baseline=args.baseline or None)
    cat = res["cat"]["GBps"]["median"]
    for name in (k for k in res if k.startswith("ratio ")):
        print(f"{name[6:]} vs cat, {res['bytes'] / 1e6:.1f} MB: {res[name[6:]]['GBps']['median']:.2f} vs {cat:.2f}"
              f" GB/s = {res[name]:.3f}x wall; per CPU-second {res['cpu ' + name]:.3f}x")
    print(f"receipt: {write_receipt('pack-cli', {'depth': depth, 'pack': args.cli_pack or None, **res})}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", "-m", default="default")
    ap.add_argument("--depths", default="512,2048,8064")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--synthetic", action="store_true", help="random bf16 rows of the model's shape")
    ap.add_argument("--fresh-reps", type=int, default=-1, help="fresh-process loads per file (default: --reps)")
    ap.add_argument("--plot", default=None, help="a .png chart (needs matplotlib)")
    ap.add_argument("--no-cli", action="store_true", help="skip muser pack vs cat")
    ap.add_argument("--cli-only", action="store_true", help="only muser pack --no-zstd vs cat")
    ap.add_argument("--cli-pack", default="", help="the pack to time muser pack and cat on")
    ap.add_argument("--baseline", default="", help="a folder holding an older muser_cli/, timed in turn")
    ap.add_argument("--cli-reps", type=int, default=0, help="counted rounds of the CLI comparison (default: reps)")
    args = ap.parse_args()

    from muser_cli.bench.api import bench_pack
    from muser_cli.bench.common import resolve_bench_model
    from muser_cli.bench.pack import DIGESTS, Study
    from muser_cli.errors import MuserError

    try:
        if not args.cli_only:
            study = Study(digests=tuple(DIGESTS), floor=True, tmpfs=True,
                          fresh_reps=args.reps if args.fresh_reps < 0 else args.fresh_reps)
            res = bench_pack(model=args.model, depths=args.depths, reps=args.reps, synthetic=args.synthetic,
                             plot=args.plot, receipt=RESULTS, study=study,
                             progress=lambda line: print(line, file=sys.stderr, flush=True))
            print("\n".join(res.table))
            print(f"receipt: {res.receipt}")
        return 0 if args.no_cli else cli_compare(args, resolve_bench_model(args.model))
    except MuserError as exc:
        print(f"bench_kvpack: {exc}" + (f" (hint: {exc.hint})" if exc.hint else ""), file=sys.stderr)
        return exc.exit_status


if __name__ == "__main__":
    raise SystemExit(main())
