"""The load a consumer process pays: one ``read_pack`` of a pack file in a new interpreter.

    python benchmarks/bench_load_fresh.py PACK [PACK ...] [--tree DIR ...] [--reps 7]

Each child imports muser_cli first and then times one verified read of the file (memory
map, every payload hashed, rows handed out), so neither the interpreter's start nor its
imports are counted, and no heap or allocator cache is left over from earlier reads -- the
case of ``muser decode --pack FILE``. ``--tree DIR`` (repeatable) times another tree's
muser_cli (DIR holds its muser_cli/, e.g. a ``git worktree``) in the same rounds, in turn:
tree A, tree B, A, B, ... for every pack, after one uncounted round. The packs' pages are
in the page cache (the uncounted round reads them). Receipt: results/load-fresh-*.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import summarize, write_receipt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import sys, time
from muser_cli.kvpack import read_pack
t0 = time.perf_counter()
with open(sys.argv[1], "rb") as fh:
    pack = read_pack(fh)
print(time.perf_counter() - t0, pack.stored_bytes)
"""


def one_load(tree: Path, pack: Path) -> tuple[float, int]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(pack)], env=env, check=True, capture_output=True,
                         text=True, cwd=str(tree)).stdout.split()
    return float(out[0]), int(out[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("packs", nargs="+")
    ap.add_argument("--tree", action="append", default=[], help="another tree to time in the same rounds")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    trees = [ROOT, *[Path(t).resolve() for t in args.tree]]
    packs = [Path(p).resolve() for p in args.packs]
    seconds: dict[str, dict[str, list[float]]] = {str(p): {str(t): [] for t in trees} for p in packs}
    sizes: dict[str, int] = {}
    for rep in range(args.reps + 1):
        for p in packs:
            for t in trees:
                s, stored = one_load(t, p)
                sizes[str(p)] = stored
                if rep:
                    seconds[str(p)][str(t)].append(s)
    gits = {}
    for t in trees:
        try:
            gits[str(t)] = subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            gits[str(t)] = None
    result = {p: {t: summarize(v) for t, v in by_tree.items()} for p, by_tree in seconds.items()}
    for p, by_tree in result.items():
        print(f"== {Path(p).name} ({sizes[p] / 1e6:.1f} MB stored)")
        for t, s in by_tree.items():
            print(f"  {gits[t] or t:<12} {s['median'] * 1e3:8.1f} ms  [{s['min'] * 1e3:.1f} - {s['max'] * 1e3:.1f}]")
    path = write_receipt("load-fresh", {"packs": {p: {"stored_bytes": sizes[p]} for p in seconds}, "trees": gits,
                                        "reps": args.reps, "seconds": result,
                                        "raw_seconds": seconds, "loadavg_at_end": os.getloadavg()})
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
