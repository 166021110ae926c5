"""The pull lane against the one-shot push lane and a local prefill, whole processes as a
user runs them, plus a follow-up question shipped as a delta (the measuring is
muser_cli/bench/pull_lanes.py).

    .venv/bin/python benchmarks/bench_pull.py [--depth 2048] [--reps 5] [--follow-up]

Producer on cpu 0, consumer on cpu 1 (``taskset``), one compute thread each, loopback
mutual TLS, the embedded model in float32. Alternated A B C after one warm-up of each:

  pull   producer$ muser prefill --serve (resident: started once, model loaded once)
         consumer$ muser decode --producer ADDR --prompt doc --no-reuse -n 1 --json
  push   consumer$ muser receive --listen --once | muser decode -n 1 --json  (resident)
         producer$ muser prefill doc | muser send --to ADDR   (one-shot: process start + load)
  local  consumer$ muser decode --prompt doc -n 1 --json       (no producer)

Every round asks about a new document (the producer holds no rows of it). TTFT is from the moment the lane's request begins (pull and local: the consumer's decode
process starts; push: the producer's ``prefill`` process starts) to the first token
(Unix times the processes report). The pull and local consumer pay their own process
start and model load, overlapped with the producer's work for pull; push's consumer is
resident and its producer is not — which is the resident producer's advantage.

``--follow-up``: then, with the consumer's store on, the document is asked for (stored
here), and a second question on it: the producer holds the document's rows, the consumer
sends its have-manifest, and only the suffix is computed and shipped. Reported: bytes
and TTFT of the follow-up vs the full first request.
"""

from __future__ import annotations

import sys

from _common import bench_args, write_receipt


def follow_up(ap) -> None:
    ap.add_argument("--follow-up", action="store_true")


def main() -> int:
    args = bench_args(follow_up, depth=2048, reps=5, settle=10.0)
    from muser_cli.bench.pull_lanes import run_pull

    payload = run_pull(depth=args.depth, reps=args.reps, settle=args.settle, follow_up=args.follow_up,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    payload["args"] = vars(args)
    for name, s in payload["ttft_s"].items():
        print(f"{name:5s}: TTFT {s['median']:.2f}s ({s['min']:.2f}-{s['max']:.2f})", flush=True)
    if "follow_up" in payload:
        f, g = payload["follow_up"]["first"], payload["follow_up"]["follow_up"]
        print(f"follow-up: first {f['source']} {f['ttft_s']:.2f}s, follow-up {g['source']} {g['ttft_s']:.2f}s "
              f"{g['reuse']}", flush=True)
    print(f"receipt: {write_receipt('pull', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
