"""The live lane alone: whole processes, two "machines" on one host, the streamed and the
file lane alternated A B (the in-process lanes of ``muser bench lane --live`` cost two more
prefills a round, which at 8064 tokens on one core is minutes). The lanes are the
library's (muser_cli/bench/lane.py); for all four lanes run ``muser bench lane --live``.

    python benchmarks/bench_live_lane.py [--depths 512,2048,8064] [--reps 5] [--settle 8]

Producer and consumer are pinned to different cores (``taskset -c``), one compute thread
each (docs/benchmarking.md); after one uncounted warm-up of each lane, A B A B. The lanes,
lane TTFT and "exposed" are defined in muser_cli/bench/lane.py's docstring; ``tail_s`` is
the last frame's arrival to the first token (decode --json).
Receipt: benchmarks/results/live-lane-*.json.
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
    ap.add_argument("--live-only", action="store_true", help="accepted for old command lines (always so now)")
    return live_only(ap.parse_args())


def live_only(args) -> int:
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from muser_cli.bench.common import corpus_ids, pinning, resolve_bench_model, summarize
    from muser_cli.bench.lane import file_lane, streamed_lane
    from muser_cli.bench.loopback import make_nodes
    from muser_cli.model.tokens import decode_text

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import write_receipt

    info = resolve_bench_model(args.model)
    model = "default" if args.model == "default" else str(info.path)
    pins = pinning(True)
    work = Path(tempfile.mkdtemp(prefix="muser-live-lane-"))
    rows = []
    try:
        nodes = make_nodes(work)
        for depth in [int(d) for d in args.depths.split(",")]:
            doc = work / f"doc-{depth}.txt"
            doc.write_text(decode_text(info, corpus_ids(info, depth)), encoding="utf-8")
            got: dict = {"streamed": [], "file": []}
            for rnd in range(args.reps + 1):
                print(f"live lane {depth}: " + ("warm-up" if rnd == 0 else f"rep {rnd}/{args.reps}"),
                      file=sys.stderr, flush=True)
                for name in ("streamed", "file"):
                    r = (streamed_lane(doc, nodes, pins, model, "float32", args.settle) if name == "streamed"
                         else file_lane(doc, nodes, pins, model, "float32", work))
                    if rnd:
                        got[name].append(r)
            tokens = {r["token"] for rs in got.values() for r in rs}
            if len(tokens) != 1:
                raise SystemExit(f"the lanes disagree on the first token at {depth} tokens: {sorted(tokens)}")
            row = {"depth": depth, "tokens": got["streamed"][0]["tokens"], "bytes": got["streamed"][0]["bytes"]}
            for name, keys in (("streamed", ("prefill", "ttft", "exposed", "tail", "first_frame_after_start",
                                             "consumer_ttft")), ("file", ("prefill", "ttft", "exposed",
                                                                          "consumer_ttft"))):
                row[name] = {k: summarize([r[k] for r in got[name] if r.get(k) is not None]) for k in keys}
            rows.append(row)
            st, fl = row["streamed"], row["file"]
            print(f"{depth}: prefill {st['prefill']['median']:.2f}s streamed exposed {st['exposed']['median']:+.2%} "
                  f"({st['exposed']['min']:+.2%}..{st['exposed']['max']:+.2%}) tail {st['tail']['median'] * 1e3:.0f} ms"
                  f" | file exposed {fl['exposed']['median']:+.2%} ({fl['exposed']['min']:+.2%}.."
                  f"{fl['exposed']['max']:+.2%})", flush=True)
    finally:
        pins.release()
        shutil.rmtree(work, ignore_errors=True)
    path = write_receipt("live-lane", {"what": "streamed vs file lane, whole processes (bench_live_lane.py "
                                       "--live-only)", "args": vars(args), "pinning": pins.describe(),
                                       "load_average": os.getloadavg(), "rows": rows})
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
