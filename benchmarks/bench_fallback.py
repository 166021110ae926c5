"""Fallback latency of the pull lane: what a consumer pays when its producer is down
(connection refused) or hung (accepts TCP, never answers), against a plain local decode.

    .venv/bin/python benchmarks/bench_fallback.py [--depth 512] [--hung-timeout 1] [--reps 5]

One process, the embedded model resident (float32, one thread), a consumer node enrolled
with a producer (muser_cli.bench.loopback.make_nodes), loopback only. Alternated A B C:
``local`` (decode --prompt, no producer), ``down`` (decode --producer at a port nobody
listens on) and ``hung`` (a TCP listener on 127.0.0.1 that accepts and never speaks;
``--timeout`` given). Reported: the time until the pull gives up (its reader's end of
input) and decode's TTFT; all three must decode the same tokens (checked).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from _common import corpus_ids, summarize, write_receipt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--hung-timeout", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import tempfile

    from muser_cli.bench.fallback import EndTimed, failing_producers
    from muser_cli.bench.loopback import make_nodes
    from muser_cli.consumer.decode import decode
    from muser_cli.engines.torch.engine import TorchEngine
    from muser_cli.model.resolve import resolve_model
    from muser_cli.consumer.pull import start_pull_pipe
    from muser_cli.model.tokens import decode_text

    work = Path(tempfile.mkdtemp(prefix="muser-bench-fallback-"))
    nodes = make_nodes(work)
    os.environ["MUSER_HOME"] = str(nodes.consumer_home)
    info = resolve_model("default")
    eng = TorchEngine(info, dtype="float32", threads=1)
    prompt = decode_text(info, corpus_ids(info, args.depth))

    def run(kind: str) -> dict:
        t0 = time.perf_counter()
        src = None
        if kind != "local":
            addr = down_addr if kind == "down" else hung_addr
            pulling = start_pull_pipe(addr, prompt=prompt, model="default", chat=False, chunk_tokens=None,
                                      dtype="float32", engine="torch",
                                      timeout=args.hung_timeout if kind == "hung" else None, have=False)
            src = EndTimed(pulling.reader, t0)
        out = decode(src, model="default", prompt=prompt, max_new_tokens=2, dtype="float32", threads=1,
                     resident=eng, reuse=False, fallback_reason="no producer")
        return {"gave_up_s": src.end if src is not None else None, "ttft_s": out.ttft_s,
                "wall_s": time.perf_counter() - t0, "tokens": out.token_ids, "source": out.source,
                "reason": out.reason}

    got: dict[str, list[dict]] = {"local": [], "down": [], "hung": []}
    with failing_producers() as (down_addr, hung_addr):
        for rnd in range(args.reps + 1):
            for kind in got:
                r = run(kind)
                if rnd:
                    got[kind].append(r)
    tokens = {tuple(r["tokens"]) for rs in got.values() for r in rs}
    if len(tokens) != 1:
        raise SystemExit(f"the three decoded different tokens: {tokens}")
    rows = {kind: {"source": rs[0]["source"], "reason": rs[0]["reason"],
                   "gave_up_s": summarize([r["gave_up_s"] for r in rs if r["gave_up_s"] is not None]),
                   "ttft_s": summarize([r["ttft_s"] for r in rs]), "wall_s": summarize([r["wall_s"] for r in rs])}
            for kind, rs in got.items()}
    for kind, row in rows.items():
        gu = row["gave_up_s"]
        print(f"{kind:5s}: gave up after {gu['median'] * 1e3 if gu['median'] is not None else 0:.1f} ms, "
              f"wall {row['wall_s']['median']:.2f}s ({row['wall_s']['min']:.2f}-{row['wall_s']['max']:.2f}) "
              f"[{row['source']}: {row['reason']}]", file=sys.stderr, flush=True)
    path = write_receipt("fallback", {"what": "pull-lane fallback latency: producer down / hung vs local "
                                      "(bench_fallback.py)", "args": vars(args), "load_average": os.getloadavg(),
                                      "rows": rows})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
