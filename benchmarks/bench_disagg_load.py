"""The disaggregated payoff under load, with the default route (issue #47, "Measure").

    .venv/bin/python benchmarks/bench_disagg_load.py [--clients 8,16] [--reps 2] [--prompt-tokens 1000,2000]
        [--max-tokens 32] [--configs alone,pair,pair-producer,mlx-lm] [--engine mlx]
        [--consumer-blas auto|reference] [--model default]

On this 2-core host, every configuration started cold (fresh homes: nothing learned before; each
service calibrates itself before it listens, as a new user's would), one after another, for each
client count and rep (A B C D A B C D):

  alone          muser decode --serve 127.0.0.1:0 --engine E --threads 1 --max-batch C   (core 1)
  pair           the same with --producer ADDR (the default route, MUSER_ROUTE unset) and a
                 resident muser prefill --serve 127.0.0.1:0 --engine E --threads 1 (core 0),
                 enrolled (node init / export / join in fresh homes)
  pair-producer  the pair with MUSER_ROUTE=producer (every request asked of the producer)
  mlx-lm         python -m mlx_lm.server on both cores (MKL preloaded, two threads): the peer
                 gets the same two cores the pair has

C concurrent streaming clients (the real ``openai`` client, this process), released together,
each one distinct prompt of a length drawn in ``--prompt-tokens`` (slices of the project's docs,
the same prompts for every configuration of a rep), ``--max-tokens`` out, temperature 0.
Reported per configuration and client count (median over reps, with the spread): TTFT p50/p90
(release to first content chunk), ITL p50 (per request (last - first chunk) / (tokens - 1),
median), aggregate tok/s, and how many requests each side computed (the ``muser`` field of the
stream: ``source``; ``route.choice``/``taken``/``explore``). ``--consumer-blas reference``
makes the consumer the slow machine of a heterogeneous pair (MLX's bundled reference BLAS).
The receipt (benchmarks/results/disagg-load-*.json) keeps every request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import write_receipt

from bench_serve_concurrency import Server, make_prompts  # the same servers and prompts
from muser_cli.bench.common import quantile

CONFIGS = ("alone", "pair", "pair-producer", "mlx-lm")


def one(client, model: str, prompt: str, max_tokens: int, release: float) -> dict:
    """One streamed completion, timed from ``release``; what the answer says of its route."""
    chunks, usage, muser, error = [], None, None, None
    try:
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                chunks.append(time.perf_counter() - release)
            if getattr(chunk, "usage", None):
                usage = chunk.usage
            extra = getattr(chunk, "model_extra", None) or {}
            if extra.get("muser"):
                muser = extra["muser"]
    except Exception as exc:  # noqa: BLE001 - the receipt says which request failed and how
        error = f"{type(exc).__name__}: {exc}"
    tokens = usage.completion_tokens if usage else len(chunks)
    route = (muser or {}).get("route") or {}
    out = {"ttft_s": chunks[0] if chunks else None, "done_s": time.perf_counter() - release, "tokens": tokens,
           "itl_s": (chunks[-1] - chunks[0]) / (tokens - 1) if len(chunks) > 1 and tokens > 1 else None,
           "source": (muser or {}).get("source"), "choice": route.get("choice"), "taken": route.get("taken"),
           "predicted": route.get("predicted"), "explore": route.get("explore"), "paths": route.get("paths"),
           "fallback_reason": (muser or {}).get("fallback_reason")}
    if error:
        out["error"] = error
    return out


def run_clients(url: str, prompts: list[str], max_tokens: int, model: str = "default") -> dict:
    import openai

    n = len(prompts)
    clients = [openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600) for _ in range(n)]
    results: list[dict | None] = [None] * n
    barrier = threading.Barrier(n + 1)
    release = [0.0]

    def go(i: int) -> None:
        barrier.wait()
        results[i] = one(clients[i], model, prompts[i], max_tokens, release[0])

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    release[0] = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    reqs = [r for r in results if r is not None]
    ok = [r for r in reqs if "error" not in r and r["ttft_s"] is not None]
    wall = max(r["done_s"] for r in reqs)
    ttfts = [r["ttft_s"] for r in ok]
    itls = [r["itl_s"] for r in ok if r["itl_s"] is not None]
    remote = sum(1 for r in ok if r["source"] in ("handoff", "delta", "partial+local"))
    return {"clients": n, "wall_s": wall, "agg_tok_s": sum(r["tokens"] for r in ok) / wall if wall else None,
            "ttft_p50_s": quantile(ttfts, 0.5) if ttfts else None, "ttft_p90_s": quantile(ttfts, 0.9) if ttfts else None,
            "itl_p50_s": statistics.median(itls) if itls else None, "errors": len(reqs) - len(ok),
            "producer_computed": remote, "consumer_computed": len(ok) - remote,
            "explored": sum(1 for r in ok if r.get("explore")), "requests": reqs}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--engine", default="mlx", choices=["mlx", "torch"])
    ap.add_argument("--clients", default="8,16")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompt-tokens", default="1000,2000")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--consumer-blas", default="auto", help="MUSER_MLX_BLAS for the consumer (reference: the slow one)")
    args = ap.parse_args()
    from muser_cli.bench.agent import wait_url
    from muser_cli.bench.common import pinning, resolve_bench_model
    from muser_cli.bench.loopback import MUSER, drain_in_background, make_nodes, node_env, wait_listening
    from muser_cli.paths import models_dir

    # fresh homes learn nothing before the run, but share the converted model (a first run's
    # ~20 s GGUF conversion is no route's cost)
    os.environ["MUSER_MODELS"] = str(models_dir())

    info = resolve_bench_model(args.model)
    pins = pinning(True)
    counts = [int(c) for c in args.clients.split(",")]
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    configs = [c for c in args.configs.split(",") if c]
    model_ref = str(info.path) if args.model == "tiny" else args.model  # tiny: the bench's own folder
    common = ["-m", model_ref, "--threads", "1", "--engine", args.engine]
    work = Path(tempfile.mkdtemp(prefix="muser-bench-disagg-"))
    rows: dict[str, dict[int, list[dict]]] = {c: {n: [] for n in counts} for c in configs}
    pool = make_prompts(info, hi, sum(counts) * args.reps + 8)
    rng = random.Random(47)
    partial = Path(tempfile.gettempdir()) / "muser-disagg-load-partial.json"  # every run so far, should one fail
    try:
        at = 0
        for rep in range(args.reps):
            for n in counts:
                prompts = []
                for k in range(n):  # distinct prompts of a length in [lo, hi] (whole characters)
                    text = pool[at + k]
                    prompts.append(text[: int(len(text) * rng.randint(lo, hi) / hi)])
                at += n
                for config in configs:
                    started: list[subprocess.Popen] = []
                    server = None
                    try:
                        if config == "mlx-lm":
                            server = Server("mlx-lm", info.path, max_batch=n, max_queue=n, max_tokens=args.max_tokens,
                                            server_cpu=None, work=work, threads=2)  # both cores, two threads
                            url = server.url
                        else:
                            nodes = make_nodes(work / f"nodes-{config}-{rep}-{n}")
                            argv = [*MUSER, "decode", "--serve", "127.0.0.1:0", "--max-batch", str(n), "--max-queue",
                                    str(n), "--no-reuse", *common]
                            env = node_env(nodes.consumer_home, threads=1)
                            env.pop("MUSER_ROUTE", None)
                            env["MUSER_MLX_BLAS"] = args.consumer_blas
                            if config != "alone":
                                prod = subprocess.Popen(pins.command("producer", [*MUSER, "prefill", "--serve",
                                                                                  "127.0.0.1:0", *common]),
                                                        env=node_env(nodes.producer_home, threads=1),
                                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                        stderr=subprocess.PIPE)
                                started.append(prod)
                                address = wait_listening(prod, "producer", timeout=900)
                                drain_in_background(prod)
                                argv += ["--producer", address]
                                if config == "pair-producer":
                                    env["MUSER_ROUTE"] = "producer"
                            proc = subprocess.Popen(pins.command("consumer", argv), env=env, stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                            started.append(proc)
                            url = wait_url(proc, config, timeout=900)
                        got = run_clients(url, prompts, args.max_tokens,
                                          server.model_name if server is not None else "default")
                        got["rep"] = rep
                        rows[config][n].append(got)
                        def num(v, scale=1.0, fmt="{:.1f}"):
                            return "-" if v is None else fmt.format(v * scale)

                        print(f"rep {rep} clients {n} {config}: ttft p50 {num(got['ttft_p50_s'])} s p90 "
                              f"{num(got['ttft_p90_s'])} s, itl p50 {num(got['itl_p50_s'], 1000, '{:.0f}')} ms, "
                              f"{num(got['agg_tok_s'])} tok/s, producer {got['producer_computed']} / consumer "
                              f"{got['consumer_computed']}, explored {got['explored']}, errors {got['errors']}"
                              + (f" ({next(r['error'] for r in got['requests'] if 'error' in r)[:300]})"
                                 if got["errors"] else ""), file=sys.stderr, flush=True)
                        partial.write_text(json.dumps({"args": vars(args), "runs": rows}, default=str))
                    finally:
                        if server is not None:
                            server.stop()
                        for p in started:
                            with contextlib.suppress(OSError):
                                p.terminate()
                        for p in started:
                            with contextlib.suppress(subprocess.TimeoutExpired):
                                p.wait(60)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(config: str, n: int, key: str) -> dict | None:
        vals = [r[key] for r in rows[config][n] if r.get(key) is not None]
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None

    summary = {c: {n: {k: med(c, n, k) for k in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "agg_tok_s",
                                                  "producer_computed", "consumer_computed", "explored")}
                   for n in counts} for c in configs}
    path = write_receipt("disagg-load", {"args": vars(args), "pins": str(pins), "summary": summary, "runs": rows})
    print(f"receipt: {path}", file=sys.stderr)
    for n in counts:
        print(f"\n{n} clients (median [min-max] over {args.reps} reps)")
        for c in configs:
            s = summary[c][n]

            def f(k: str, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
                v = s[k]
                return "-" if v is None else (fmt.format(v["median"] * scale) + " [" + fmt.format(v["min"] * scale)
                                              + "-" + fmt.format(v["max"] * scale) + "]")

            print(f"  {c:14} ttft p50 {f('ttft_p50_s')} s  p90 {f('ttft_p90_s')} s  itl p50 "
                  f"{f('itl_p50_s', 1000, '{:.0f}')} ms  {f('agg_tok_s')} tok/s  producer {f('producer_computed', 1, '{:.0f}')}"
                  f"  consumer {f('consumer_computed', 1, '{:.0f}')}  explored {f('explored', 1, '{:.0f}')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
