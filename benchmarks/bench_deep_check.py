"""One deep prompt on a real model, once: does the lane hold at the model's full context?

    .venv/bin/python benchmarks/bench_deep_check.py -m gemma3-270m --depth 32760 [-n 8]

The local fallback (``decode --prompt --no-reuse``, consumer core) and the producer's
``prefill -o pack`` (producer core) run at the same time, each alone on its core; then the
pack goes over mutual TLS to a ``receive --once`` process, is verified, and decoded
(consumer core). The two answers' tokens must be equal. Kept: each stage's seconds, the
pack's bytes, each process's own peak RSS (``muser_cli/bench/depth.py``'s wrapper). One run,
no repetitions: a check that nothing breaks at depth, with its figures, not a timing series
(``muser bench depth`` is that, and at 32k on this model it takes over an hour).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
from pathlib import Path

from _common import bench_args, write_receipt


def more(ap) -> None:
    ap.add_argument("-m", "--model", default="gemma3-270m")


def main() -> int:
    args = bench_args(more, depth=32760, n=8, chunk=4096, dtype="float32")
    from muser_cli.bench.common import resolve_bench_model
    from muser_cli.bench.depth import Depth, run_one
    from muser_cli.errors import DataError

    info = resolve_bench_model(args.model)
    work = Path(tempfile.mkdtemp(prefix="muser-deep-check-"))
    try:
        ref = "default" if args.model == "default" else str(info.path)
        lane = Depth(info, ref, args.depth, work, args.chunk, args.dtype)
        n = ["-n", str(args.n)]
        local: dict = {}

        def run_local() -> None:
            r = run_one(lane.cmd("consumer", "decode", *lane.common, *n, "--json", "--prompt", str(lane.doc),
                                 "--no-reuse"), lane.cons, "local decode", work / "local.rss")
            local.update(r.json(), rss=r.rss, wall=r.wall)

        t = threading.Thread(target=run_local)
        t.start()
        pack = work / "pack.kvpack"
        pre = lane.producer("prefill", "prefill", *lane.common, str(lane.doc), "-o", str(pack), "--json")
        t.join()
        if not local:
            raise DataError("the local decode did not finish")
        got = work / "got"
        got.mkdir()
        snd, rc, received = lane.ship(pack, got)
        ver = lane.consumer("verify", "verify", "-m", ref, str(received), "--json")
        dec = run_one(lane.cmd("consumer", "decode", *lane.common, *n, "--json", str(received)), lane.cons,
                      "decode (pack)", work / "dec.rss")
        d = dec.json()
        same = d["token_ids"] == local["token_ids"]
        payload = {
            "what": "one deep prompt on a real model: local fallback vs the push lane (bench_deep_check.py)",
            "model": info.name, "args": vars(args), "pinning": lane.pins.describe(), "same_tokens": same,
            "local": {k: local[k] for k in ("ttft_s", "first_token_s", "prompt_tokens", "token_ids", "text", "rss",
                                            "source")},
            "prefill": {**pre.json(), "rss": pre.rss},
            "send": {**snd.json(), "rss": snd.rss}, "receive": {**rc.json(), "rss": rc.rss},
            "verify": {**ver.json(), "rss": ver.rss},
            "decode": {k: d[k] for k in ("ttft_s", "first_token_s", "token_ids", "text", "source", "engine_stats",
                                         "spot_check")} | {"rss": dec.rss},
            "pack_bytes": pack.stat().st_size}
        print(write_receipt("deep-check", payload))
        print(f"local TTFT {local['ttft_s']:.1f} s, RSS {local['rss'] / 1e6:.0f} MB | prefill "
              f"{pre.json()['prefill_s']:.1f} s, RSS {pre.rss / 1e6:.0f} MB | pack {pack.stat().st_size / 1e6:.1f} MB | "
              f"verify RSS {ver.rss / 1e6:.0f} MB | decode TTFT {d['ttft_s']:.3f} s, RSS {dec.rss / 1e6:.0f} MB | "
              f"same tokens: {same}")
        return 0 if same else 65
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
