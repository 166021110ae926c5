"""The live lane as a user runs it: whole processes, two "machines" on one host (a thin
caller of ``muser bench lane --live``; the measuring is in muser_cli/bench/lane.py).

    python benchmarks/bench_live_lane.py [--depths 512,2048,8064] [--reps 5] [--settle 8]

Producer and consumer are pinned to different cores (``taskset -c``), one compute thread
each (docs/benchmarking.md). Per depth, after one uncounted warm-up of each, alternated
A B C D: the in-process local and stop-and-wait handoff lanes, then

  streamed  consumer$ receive --listen --once | decode -n 1 --json   (started first, resident)
            producer$ prefill --json | send --to ...                  (frames leave per chunk)
  file      producer$ prefill -o f.kvpack && send f.kvpack            (stop-and-wait)
            consumer$ receive --once -o in.kvpack && decode in.kvpack -n 1 --json

  lane TTFT = consumer's first token - producer's prefill start (Unix times each process reports)
  exposed   = (lane TTFT - producer prefill_s) / producer prefill_s     aim <= 1 % at 8064
  tail_s    = last frame's arrival -> first token (decode --json)

Receipt: benchmarks/results/lane-*.json (lanes: local, handoff, streamed, file).
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="default")
    ap.add_argument("--depths", default="512,2048,8064")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--settle", type=float, default=8.0, help="seconds the consumer gets to load its model")
    ap.add_argument("--plot", default=None, help="a .png chart (needs matplotlib)")
    args = ap.parse_args()

    from muser_cli.bench.api import bench_lane
    from muser_cli.errors import MuserError

    try:
        res = bench_lane(model=args.model, depths=args.depths, reps=args.reps, live=True, settle=args.settle,
                         plot=args.plot, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except MuserError as exc:
        print(f"bench_live_lane: {exc}" + (f" (hint: {exc.hint})" if exc.hint else ""), file=sys.stderr)
        return exc.exit_status
    print("\n".join(res.table))
    print(f"receipt: {res.receipt}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
