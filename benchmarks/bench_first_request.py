"""A heterogeneous pair's first long request, from fresh homes (issue #47, "Measure").

    .venv/bin/python benchmarks/bench_first_request.py [--requests 3] [--tokens 1200] [--reps 2]
        [--consumer-engine mlx] [--consumer-blas reference] [--producer-engine torch] [--serve]

A slow consumer and a fast producer on one host: the consumer on cpu 1 with ``--consumer-engine``
(MLX with its bundled reference BLAS, ``MUSER_MLX_BLAS=reference``: ~10x slower prefill, the
decode machine of the pair), a resident producer ``muser prefill --serve --engine
--producer-engine`` (torch, MKL) on cpu 0; one compute thread each, float32, the embedded model.
Each rep starts from fresh homes (nothing learned on either side): the producer calibrates
before it listens, then ``--requests`` distinct prompts of ~``--tokens`` tokens go one after
another through ``muser decode --producer ADDR --prompt FILE -n 1 --json`` (one-shot
processes; ``--serve``: through one ``decode --serve --producer ADDR`` started fresh instead,
which calibrates itself first), with the default route. Then each prompt alone on the consumer
(``decode --prompt FILE`` with no producer): its local path.

Reported per request index (median over reps, spread): TTFT (one-shot: ``first_token_s``, from
the ``decode`` process's start to its first token, its model load included on every path; a
service: ``ttft_ms``, from the request's arrival), where its rows came from (``source``,
``route.choice``/``taken``) and its local TTFT; the aims: the first request to the producer,
its TTFT within 1.5x of the later (warm) ones', none slower than its local path by more than
the route's margin (1.25x: the budget's headroom). Receipt: benchmarks/results/first-request-*.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import write_receipt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1200)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--consumer-engine", default="mlx", choices=["mlx", "torch"])
    ap.add_argument("--consumer-blas", default="reference")
    ap.add_argument("--producer-engine", default="torch", choices=["mlx", "torch"])
    ap.add_argument("--serve", action="store_true", help="the consumer is a decode --serve service")
    ap.add_argument("--no-local", dest="local", action="store_false", help="skip the local-path runs")
    args = ap.parse_args()
    from muser_cli.bench.agent import wait_url
    from muser_cli.bench.common import corpus_ids, pinning, resolve_bench_model
    from muser_cli.bench.loopback import MUSER, drain_in_background, make_nodes, node_env, wait_listening
    from muser_cli.paths import models_dir

    # fresh homes learn nothing before the run, but share the converted model (a first run's
    # ~20 s GGUF conversion is no route's cost)
    os.environ["MUSER_MODELS"] = str(models_dir())
    from muser_cli.model.tokens import decode_text

    info = resolve_bench_model(args.model)
    model_ref = str(info.path) if args.model == "tiny" else args.model
    pins = pinning(True)
    ids = corpus_ids(info, args.tokens * args.requests * args.reps + 8192)[8192:]
    work = Path(tempfile.mkdtemp(prefix="muser-bench-first-"))
    runs: list[list[dict]] = []
    locals_: list[list[dict]] = []

    def consumer_env(home: Path) -> dict:
        env = node_env(home, threads=1)
        env.pop("MUSER_ROUTE", None)
        env["MUSER_MLX_BLAS"] = args.consumer_blas
        return env

    try:
        for rep in range(args.reps):
            prompts = []
            for k in range(args.requests):
                at = (rep * args.requests + k) * args.tokens
                f = work / f"p-{rep}-{k}.txt"
                f.write_text(decode_text(info, ids[at:at + args.tokens]).strip("\ufffd"))
                prompts.append(f)
            nodes = make_nodes(work / f"nodes-{rep}")
            prod = subprocess.Popen(pins.command("producer", [*MUSER, "prefill", "--serve", "127.0.0.1:0", "-m",
                                                              model_ref, "--engine", args.producer_engine,
                                                              "--threads", "1", "--dtype", "float32"]),
                                    env=node_env(nodes.producer_home, threads=1), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            got: list[dict] = []
            service = None
            try:
                address = wait_listening(prod, "producer", timeout=900)
                drain_in_background(prod)
                common = ["-m", model_ref, "--engine", args.consumer_engine, "--threads", "1", "--dtype", "float32"]
                if args.serve:
                    import openai

                    service = subprocess.Popen(pins.command("consumer", [*MUSER, "decode", "--serve", "127.0.0.1:0",
                                                                         "--producer", address, "--no-reuse",
                                                                         "--turn-memory", "0", *common]),
                                               env=consumer_env(nodes.consumer_home), stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                    client = openai.OpenAI(base_url=wait_url(service, "consumer", timeout=1800), api_key="unused",
                                           max_retries=0, timeout=1800)
                for k, f in enumerate(prompts):
                    if service is not None:
                        out = client.completions.create(model="default", prompt=f.read_text(), max_tokens=1,
                                                        temperature=0)
                        m = out.model_extra["muser"]
                        rec = {"ttft_s": m["ttft_ms"] / 1000, "source": m.get("source"), "route": m.get("route"),
                               "fallback_reason": m.get("fallback_reason")}
                    else:
                        r = subprocess.run(pins.command("consumer", [*MUSER, "decode", "--producer", address,
                                                                     "--prompt", str(f), "--no-reuse", "-n", "1",
                                                                     "--json", *common]),
                                           env=consumer_env(nodes.consumer_home), capture_output=True, text=True,
                                           timeout=3600)
                        if r.returncode != 0:
                            raise SystemExit(f"decode failed ({r.returncode}): {r.stderr[-800:]}")
                        j = json.loads(r.stdout)
                        # from the process's start to its first token: the model load counted on every path
                        rec = {"ttft_s": j.get("first_token_s"), "load_s": j.get("load_s"),
                               "source": j.get("source"), "route": j.get("route"),
                               "fallback_reason": j.get("fallback_reason")}
                    rec["request"] = k
                    got.append(rec)
                    route = rec.get("route") or {}
                    print(f"rep {rep} request {k}: ttft {rec['ttft_s']:.2f} s from {rec['source']} (choice "
                          f"{route.get('choice')}, taken {route.get('taken')})", file=sys.stderr, flush=True)
            finally:
                for p in (service, prod):
                    if p is not None:
                        with contextlib.suppress(OSError):
                            p.terminate()
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            p.wait(60)
            runs.append(got)
            if args.local:
                mine = []
                for k, f in enumerate(prompts):
                    r = subprocess.run(pins.command("consumer", [*MUSER, "decode", "--prompt", str(f), "--no-reuse",
                                                                 "-n", "1", "--json", "-m", model_ref, "--engine",
                                                                 args.consumer_engine, "--threads", "1", "--dtype",
                                                                 "float32"]),
                                       env=consumer_env(work / f"local-{rep}-{k}"), capture_output=True, text=True,
                                       timeout=3600)
                    j = json.loads(r.stdout)
                    mine.append({"request": k, "ttft_s": j.get("first_token_s"), "load_s": j.get("load_s")})
                    print(f"rep {rep} request {k} alone: ttft {mine[-1]['ttft_s']:.2f} s", file=sys.stderr, flush=True)
                locals_.append(mine)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def stat(vals: list[float]) -> dict:
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    summary = []
    for k in range(args.requests):
        row = {"request": k, "ttft_s": stat([r[k]["ttft_s"] for r in runs]),
               "sources": [r[k]["source"] for r in runs]}
        if locals_:
            row["local_ttft_s"] = stat([r[k]["ttft_s"] for r in locals_])
        summary.append(row)
    path = write_receipt("first-request", {"args": vars(args), "pins": str(pins), "summary": summary, "runs": runs,
                                           "local": locals_})
    print(f"receipt: {path}", file=sys.stderr)
    for row in summary:
        t = row["ttft_s"]
        loc = row.get("local_ttft_s")
        print(f"request {row['request']}: ttft {t['median']:.2f} s [{t['min']:.2f}-{t['max']:.2f}] from "
              f"{','.join(map(str, row['sources']))}" + (f"; local alone {loc['median']:.2f} s "
                                                       f"[{loc['min']:.2f}-{loc['max']:.2f}]" if loc else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
