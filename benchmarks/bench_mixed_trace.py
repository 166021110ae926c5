"""One latency budget on a mixed trace (issue #39, "Measure"): short chat turns and long
document prompts, replayed against a consumer service in three ways, with one producer.

    .venv/bin/python benchmarks/bench_mixed_trace.py [--short 8] [--long 4] [--long-tokens 1024,2048]
        [--short-tokens 10,200] [--gap-ms 400] [--reps 2] [--engine torch] [--model default]

Processes, each started once per mode (model loaded once), one compute thread each, float32:

  producer   muser prefill --serve 127.0.0.1:0                      (pinned to the first core)
  consumer   muser decode --serve 127.0.0.1:0 [--producer ADDR]      (pinned to the second core)
             --no-reuse --turn-memory 0: every request's rows come from a path, nothing held

Modes (the consumer's way to answer):

  local      no --producer: every prompt prefilled on the consumer
  producer   --producer ADDR, MUSER_ROUTE=producer: every prompt asked of the producer
  fastest    --producer ADDR, MUSER_ROUTE=fastest (the default): the cost model's choice
  oracle     not run: per request, the better of its local and producer TTFTs (from the two
             modes above, same prompt, same arrival)

The trace: ``--short`` prompts of a length drawn in ``--short-tokens`` and ``--long`` of one in
``--long-tokens`` (distinct slices of the project's docs: no prefix shared, so no store or
memory helps), in a shuffled order fixed by the rep, each sent ``--gap-ms`` after the one
before (open loop: a request does not wait for the previous answer), by this process with the
real ``openai`` client (non-streamed, ``max_tokens`` 4, temperature 0). Before each mode's trace,
an uncounted warm-up of two short and one long prompt teaches the consumer's cost model (its
rates are kept per process and in its home's cost file; each mode starts from a fresh home).
TTFT: the answer's ``muser.ttft_ms`` (from the request's arrival at the service to its first
token: the consumer's queue included). Reported per mode: TTFT p50 and p90 over the trace
(median over reps, with spread), how often ``fastest`` chose the oracle's path, and the
prediction error per path (in the ``fastest`` run, each request's predicted TTFT of the path it
took, ``muser.route.paths[choice]``, against its TTFT measured there). The receipt
(benchmarks/results/mixed-trace-*.json) keeps every request.

Caveat on the oracle: it is built from the two single-path runs, where every request queues
behind all the others on one machine; ``fastest`` spreads the trace over both, so its requests
queue less than in either single-path run and can beat this oracle, and "the oracle's path" is
then a weak reference for the agreement figure.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from _common import run, write_receipt

MODES = ("local", "producer", "fastest")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--engine", default="torch", choices=["torch", "mlx"])
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--short-tokens", default="10,200")
    ap.add_argument("--long-tokens", default="1024,2048")
    ap.add_argument("--gap-ms", type=float, default=400.0)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    import openai

    from muser_cli.bench.agent import wait_url
    from muser_cli.bench.common import machine, pinning, resolve_bench_model
    from muser_cli.bench.loopback import MUSER, drain_in_background, make_nodes, node_env, wait_listening
    from muser_cli.model.tokens import decode_text
    from muser_cli.bench.common import corpus_ids

    info = resolve_bench_model(args.model)
    pins = pinning(True)
    short_lo, short_hi = (int(x) for x in args.short_tokens.split(","))
    long_lo, long_hi = (int(x) for x in args.long_tokens.split(","))
    total = (args.short * short_hi + args.long * long_hi + 3 * long_hi) * (args.reps + 1)
    ids = corpus_ids(info, total)
    common = ["-m", args.model, "--threads", "1", "--dtype", "float32", "--engine", args.engine]

    def trace(rep: int) -> tuple[list[dict], list[dict]]:
        """(warm-up, trace) of ``rep``: each {"kind", "tokens", "prompt"}; distinct slices."""
        rng = random.Random(1000 + rep)
        at = rep * (total // (args.reps + 1))
        out = []
        for kind, n, lo, hi in (("short", args.short + 2, short_lo, short_hi), ("long", args.long + 1, long_lo, long_hi)):
            for _ in range(n):
                k = rng.randint(lo, hi)
                out.append({"kind": kind, "tokens": k, "prompt": decode_text(info, ids[at:at + k])})
                at += k
        warm = [out[0], out[1], out[args.short + 2]]
        rest = [r for r in out if not any(r is w for w in warm)]
        rng.shuffle(rest)
        return warm, rest

    work = Path(tempfile.mkdtemp(prefix="muser-bench-mixed-"))
    nodes = make_nodes(work)
    results: dict[str, list[list[dict]]] = {m: [] for m in MODES}
    procs: list[subprocess.Popen] = []
    try:
        producer = subprocess.Popen(pins.command("producer", [*MUSER, "prefill", "--serve", "127.0.0.1:0", *common]),
                                    env=node_env(nodes.producer_home, threads=1), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs.append(producer)
        address = wait_listening(producer, "producer", timeout=600)
        drain_in_background(producer)
        for rep in range(args.reps):
            warm, requests = trace(rep)
            for mode in MODES:
                home = work / f"home-{mode}-{rep}"
                shutil.copytree(nodes.consumer_home, home, symlinks=True)
                argv = [*MUSER, "decode", "--serve", "127.0.0.1:0", "--no-reuse", "--turn-memory", "0", *common]
                if mode != "local":
                    argv += ["--producer", address]
                env = node_env(home, threads=1)
                env["MUSER_ROUTE"] = "producer" if mode == "producer" else "fastest"
                proc = subprocess.Popen(pins.command("consumer", argv), env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                try:
                    url = wait_url(proc, mode)
                    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=900)

                    def ask(r: dict, client=client) -> dict:
                        out = client.completions.create(model="default", prompt=r["prompt"], max_tokens=4,
                                                        temperature=0)
                        m = out.model_extra["muser"]
                        route = m.get("route") or {}
                        return {"kind": r["kind"], "tokens": r["tokens"], "ttft_s": m["ttft_ms"] / 1000.0,
                                "source": m.get("source"), "choice": route.get("choice"),
                                "paths": route.get("paths"), "fallback_reason": m.get("fallback_reason")}

                    for r in warm:
                        ask(r)
                    got: list[dict | None] = [None] * len(requests)

                    def send(i: int) -> None:
                        got[i] = ask(requests[i])

                    threads = []
                    for i in range(len(requests)):
                        t = threading.Thread(target=send, args=(i,))
                        t.start()
                        threads.append(t)
                        time.sleep(args.gap_ms / 1000.0)
                    for t in threads:
                        t.join()
                    results[mode].append([g for g in got if g is not None])
                finally:
                    proc.terminate()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(60)
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(60)
        shutil.rmtree(work, ignore_errors=True)

    summary: dict[str, dict] = {}
    oracle_reps, agree, errors = [], [], {"local": [], "remote": []}
    for rep in range(args.reps):
        loc, pro, fast = (results[m][rep] for m in MODES)
        oracle = [min(a["ttft_s"], b["ttft_s"]) for a, b in zip(loc, pro)]
        oracle_reps.append(oracle)
        for a, b, f in zip(loc, pro, fast):
            best = "local" if a["ttft_s"] <= b["ttft_s"] else "remote"
            took = "local" if f["source"] in ("local", "store") else "remote"
            agree.append(best == took)
            paths = f.get("paths") or {}
            predicted = paths.get(f.get("choice") or "")
            if predicted is not None:  # the chosen path's prediction against its TTFT in the same run
                errors[took].append(predicted - f["ttft_s"])
    for mode in (*MODES, "oracle"):
        reps = oracle_reps if mode == "oracle" else [[g["ttft_s"] for g in r] for r in results[mode]]
        p50s, p90s = [pct(r, 0.5) for r in reps], [pct(r, 0.9) for r in reps]
        summary[mode] = {"p50_s": statistics.median(p50s), "p50_spread": [min(p50s), max(p50s)],
                         "p90_s": statistics.median(p90s), "p90_spread": [min(p90s), max(p90s)]}
    best_p50 = min(summary["local"]["p50_s"], summary["producer"]["p50_s"])
    best_p90 = min(summary["local"]["p90_s"], summary["producer"]["p90_s"])
    verdict = {"fastest_p50_over_better": summary["fastest"]["p50_s"] / best_p50,
               "fastest_p90_over_better": summary["fastest"]["p90_s"] / best_p90,
               "oracle_agreement": sum(agree) / max(1, len(agree)),
               "prediction_error_s": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                                      for k, v in errors.items() if v}}
    print(f"{'mode':>9} {'TTFT p50 s':>22} {'TTFT p90 s':>22}")
    for mode, s in summary.items():
        print(f"{mode:>9} {s['p50_s']:>10.3f} [{s['p50_spread'][0]:.3f}-{s['p50_spread'][1]:.3f}] "
              f"{s['p90_s']:>10.3f} [{s['p90_spread'][0]:.3f}-{s['p90_spread'][1]:.3f}]")
    print(f"fastest / better of local and producer: p50 {verdict['fastest_p50_over_better']:.2f}x, "
          f"p90 {verdict['fastest_p90_over_better']:.2f}x (aim <= 0.95)")
    print(f"fastest chose the oracle's path on {verdict['oracle_agreement']:.0%} of requests (aim >= 90%)")
    for k, e in verdict["prediction_error_s"].items():
        print(f"prediction error, {k}: median {e['median'] * 1000:+.0f} ms [{e['min'] * 1000:+.0f}, {e['max'] * 1000:+.0f}]")
    path = write_receipt("mixed-trace", {"args": vars(args), "machine": machine(), "pinning": pins.__dict__,
                                         "summary": summary, "verdict": verdict, "raw": results})
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    run(main)
