"""TTFT by lane: local prefill vs a handoff over loopback mutual TLS (a thin caller of
``muser bench lane`` / ``muser bench wire``; the measuring is in muser_cli/bench/lane.py).

    python benchmarks/bench_lane.py [--depths 512,2048,8064] [--reps 5] [--model default]
                                    [--dtype float32] [--codec none|zstd+bytegroup] [--plot ttft.png]
    python benchmarks/bench_lane.py --wire-only 100     # the wire figure alone, no model

Per depth, alternated A B A B after one uncounted warm-up, producer and consumer pinned to
two different cores when two are available (docs/benchmarking.md):

  local    prefill(prompt[:-1]) + the first decode step: the fallback lane's TTFT
  handoff  prefill + pack + send (TLS 1.3 to a receiver *process* on 127.0.0.1 that verifies
           every frame, fsyncs its replay ledger and publishes atomically) + read_pack of the
           published file + the first decode step

  lane overhead = (pack + send + read) / prefill               aim <= 1 % at 8k tokens
  wire          = send payload rate / probe-link rate (up)      aim >= 90 %, loopback

Receipts: benchmarks/results/lane-*.json, wire-*.json.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", "-m", default="default")
    ap.add_argument("--depths", default="512,2048,8064")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--codec", default="none", choices=["none", "zstd+bytegroup"])
    ap.add_argument("--threads", type=int, default=0, help="per side (0: 1 when pinned, else the CPUs up to 8)")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--plot", default=None, help="a .png chart (needs matplotlib)")
    ap.add_argument("--wire-seconds", type=float, default=1.0, help="probe-link seconds per rep")
    ap.add_argument("--wire-only", type=int, metavar="MB", default=0,
                    help="only the wire figure, on a synthetic kvpack of about MB megabytes (no model)")
    args = ap.parse_args()

    from muser_cli.bench.api import bench_lane, bench_wire
    from muser_cli.errors import MuserError

    def note(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        if args.wire_only:
            res = bench_wire(sizes=str(args.wire_only), reps=args.reps, probe_seconds=args.wire_seconds,
                             pin=not args.no_pin, plot=args.plot, progress=note)
        else:
            res = bench_lane(model=args.model, depths=args.depths, reps=args.reps, dtype=args.dtype,
                             codec=args.codec, threads=args.threads, pin=not args.no_pin, plot=args.plot,
                             progress=note)
    except MuserError as exc:
        print(f"bench_lane: {exc}" + (f" (hint: {exc.hint})" if exc.hint else ""), file=sys.stderr)
        return exc.exit_status
    print("\n".join(res.table))
    print(f"receipt: {res.receipt}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
