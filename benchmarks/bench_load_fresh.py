"""The load a consumer process pays: one ``read_pack`` of a pack file in a new interpreter
(``muser_cli.bench.pack_study.fresh_load``, the study's fresh-process load).

    python benchmarks/bench_load_fresh.py PACK [PACK ...] [--tree DIR ...] [--reps 7]

Each child imports muser_cli, then times one verified read (memory map, every payload
hashed, rows handed out): no interpreter start, no imports, no heap left by earlier reads
-- the case of ``muser decode --pack FILE``. ``--tree DIR`` (repeatable; DIR holds its
muser_cli/, e.g. a ``git worktree``) is timed in the same rounds, trees in turn, A B A B,
after one uncounted round. Receipt: results/load-fresh-*.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from _common import summarize, write_receipt

from muser_cli.bench.common import SOURCE_ROOT
from muser_cli.bench.pack_study import fresh_load


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("packs", nargs="+")
    ap.add_argument("--tree", action="append", default=[], help="another tree to time in the same rounds")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    trees = [SOURCE_ROOT, *[Path(t).resolve() for t in args.tree]]
    packs = [str(Path(p).resolve()) for p in args.packs]
    seconds = {p: {str(t): [] for t in trees} for p in packs}
    for rep in range(args.reps + 1):
        for p in packs:
            for t in trees:
                s = fresh_load("kvpack", Path(p), t)
                if rep:
                    seconds[p][str(t)].append(s)
    gits = {str(t): subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                                   text=True).stdout.strip() or None for t in trees}
    result = {p: {t: summarize(v) for t, v in by_tree.items()} for p, by_tree in seconds.items()}
    for p, by_tree in result.items():
        print(f"== {Path(p).name} ({os.path.getsize(p) / 1e6:.1f} MB)")
        for t, s in by_tree.items():
            print(f"  {gits[t] or t:<12} {s['median'] * 1e3:8.1f} ms  [{s['min'] * 1e3:.1f} - {s['max'] * 1e3:.1f}]")
    path = write_receipt("load-fresh", {"packs": {p: {"file_bytes": os.path.getsize(p)} for p in packs},
                                        "trees": gits, "reps": args.reps, "seconds": result,
                                        "raw_seconds": seconds, "loadavg_at_end": os.getloadavg()})
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
