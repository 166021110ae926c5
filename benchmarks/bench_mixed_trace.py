"""One latency budget on a mixed trace (issue #39, "Measure"): short chat turns and long
document prompts, replayed against a consumer service in three ways, with one producer.

    .venv/bin/python benchmarks/bench_mixed_trace.py [--short 8] [--long 4] [--long-tokens 1024,2048]
        [--short-tokens 10,200] [--gap-ms 400] [--reps 2] [--engine torch] [--model default]
        [--consumers 1|2] [--no-alone]

Processes, each started once per mode (model loaded once), one compute thread each, float32:

  producer   muser prefill --serve 127.0.0.1:0                      (pinned to the first core)
  consumer   muser decode --serve 127.0.0.1:0 [--producer ADDR]      (pinned to the second core)
             --no-reuse --turn-memory 0: every request's rows come from a path, nothing held
             --consumers 2: two such services, both on the second core, both asking the one
             producer; request i of the trace goes to consumer i mod 2 (each sends its share)

Modes (the consumer's way to answer):

  local      no --producer: every prompt prefilled on the consumer
  producer   --producer ADDR, MUSER_ROUTE=producer: every prompt asked of the producer
  fastest    --producer ADDR, MUSER_ROUTE=fastest (the default): the cost model's choice
  oracle     not run: per request, the better of its local and producer TTFTs (from the two
             modes above, same prompt, same arrival)

Alone runs (unless ``--no-alone``), the fairer oracle: the same requests sent one at a time (each
after the previous answer: no overlap, nothing queued) to one consumer, in three modes:
``alone-local``, ``alone-producer`` and ``alone-fastest``. ``oracle-alone``: per request, the
faster of its alone-local and alone-producer TTFTs, a well-defined best path; reported: how often
``fastest``'s choice agrees with it, alone (``alone-fastest``: the prediction without load) and
in the trace (``fastest``: the prediction with the queues).

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
prediction error per path and mode (each answer's predicted TTFT of the path it took,
``muser.route.paths``, local or remote, against its TTFT measured in the same run; the
prediction includes the consumer's own queue, ``muser.route.parts[path].consumer_queue``). The
receipt (benchmarks/results/mixed-trace-*.json) keeps every request.

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
ALONE = ("alone-local", "alone-producer", "alone-fastest")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def took(record: dict) -> str:
    """The path an answer's rows took: ``local`` (computed on the consumer) or ``remote``."""
    return "local" if record.get("source") in ("local", "store", "held") else "remote"


def predicted(record: dict) -> float | None:
    """The predicted TTFT of the path the answer took (``muser.route.paths``)."""
    paths = record.get("paths") or {}
    if took(record) == "local":
        return paths.get("local", paths.get("store"))
    remote = [v for k, v in paths.items() if k.startswith("remote")]
    if record.get("choice") in paths and str(record.get("choice")).startswith("remote"):
        return paths[record["choice"]]
    return min(remote) if remote else None


def errors_of(runs: list[list[dict]]) -> dict[str, dict[str, float]]:
    """Prediction error (predicted minus measured, seconds) by the path taken, over ``runs``."""
    got: dict[str, list[float]] = {"local": [], "remote": []}
    for one in runs:
        for r in one:
            p = predicted(r)
            if p is not None:
                got[took(r)].append(p - r["ttft_s"])
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)} for k, v in got.items() if v}


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
    ap.add_argument("--consumers", type=int, default=1, choices=[1, 2],
                    help="consumer services sharing the trace (both on the consumer core)")
    ap.add_argument("--no-alone", dest="alone", action="store_false",
                    help="skip the alone runs (each request sent alone: the fairer oracle)")
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
    model_ref = str(info.path) if args.model == "tiny" else args.model  # tiny: the bench's own model folder
    common = ["-m", model_ref, "--threads", "1", "--dtype", "float32", "--engine", args.engine]
    modes = MODES + (ALONE if args.alone else ())

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
    results: dict[str, list[list[dict]]] = {m: [] for m in modes}
    warmups: dict[str, list[list[dict]]] = {m: [] for m in modes}
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
            for mode in modes:
                alone = mode.startswith("alone-")
                path = mode.removeprefix("alone-")
                count = 1 if alone else args.consumers
                started: list[subprocess.Popen] = []
                try:
                    clients = []
                    for c in range(count):
                        home = work / f"home-{mode}-{rep}-{c}"
                        shutil.copytree(nodes.consumer_home, home, symlinks=True)
                        argv = [*MUSER, "decode", "--serve", "127.0.0.1:0", "--no-reuse", "--turn-memory", "0", *common]
                        if path != "local":
                            argv += ["--producer", address]
                        env = node_env(home, threads=1)
                        env["MUSER_ROUTE"] = "producer" if path == "producer" else "fastest"
                        proc = subprocess.Popen(pins.command("consumer", argv), env=env, stdin=subprocess.DEVNULL,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                        started.append(proc)
                        url = wait_url(proc, f"{mode} #{c}")
                        clients.append(openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=900))

                    def ask(r: dict, c: int) -> dict:
                        out = clients[c].completions.create(model="default", prompt=r["prompt"], max_tokens=4,
                                                            temperature=0)
                        m = out.model_extra["muser"]
                        route = m.get("route") or {}
                        queue = {k: v.get("consumer_queue") for k, v in (route.get("parts") or {}).items()}
                        return {"kind": r["kind"], "tokens": r["tokens"], "consumer": c, "ttft_s": m["ttft_ms"] / 1000.0,
                                "source": m.get("source"), "choice": route.get("choice"),
                                "paths": route.get("paths"), "consumer_queue": queue, "share": route.get("share"),
                                "fallback_reason": m.get("fallback_reason")}

                    for c in range(count):  # each consumer's cost model taught the same way (kept: what it taught)
                        warmups[mode].append([ask(r, c) for r in warm])
                    got: list[dict | None] = [None] * len(requests)
                    if alone:  # one at a time: nothing overlaps
                        for i, r in enumerate(requests):
                            got[i] = ask(r, 0)
                    else:
                        def send(i: int) -> None:
                            got[i] = ask(requests[i], i % count)

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
                    for proc in started:
                        proc.terminate()
                    for proc in started:
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

    def agreement(chooser: str, local: str, remote: str) -> float | None:
        """How often ``chooser``'s path was the faster of ``local``'s and ``remote``'s, per request."""
        if chooser not in results or local not in results:
            return None
        hits = []
        for rep in range(args.reps):
            for a, b, f in zip(results[local][rep], results[remote][rep], results[chooser][rep]):
                hits.append(("local" if a["ttft_s"] <= b["ttft_s"] else "remote") == took(f))
        return sum(hits) / max(1, len(hits))

    def near(chooser: str, local: str, remote: str, within: float = 0.10) -> float | None:
        """How often ``chooser``'s path was the faster one or within ``within`` of it (a near tie,
        where which is faster is the run's noise), per request."""
        if chooser not in results or local not in results:
            return None
        hits = []
        for rep in range(args.reps):
            for a, b, f in zip(results[local][rep], results[remote][rep], results[chooser][rep]):
                mine = a if took(f) == "local" else b
                hits.append(mine["ttft_s"] <= min(a["ttft_s"], b["ttft_s"]) * (1 + within))
        return sum(hits) / max(1, len(hits))

    def calibration(chooser: str, local: str, remote: str) -> dict[str, dict[str, float]]:
        """Every path's prediction in ``chooser``'s answers (the path taken and the one not) against
        that path's TTFT measured for the same request in the single-path runs ``local``/``remote``
        (meaningful alone: the runs then share no load)."""
        got: dict[str, list[float]] = {"local": [], "remote": []}
        for rep in range(args.reps):
            for a, b, f in zip(results[local][rep], results[remote][rep], results[chooser][rep]):
                paths = f.get("paths") or {}
                if "local" in paths:
                    got["local"].append(paths["local"] - a["ttft_s"])
                if "remote_whole" in paths:
                    got["remote"].append(paths["remote_whole"] - b["ttft_s"])
        return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
                for k, v in got.items() if v}

    def over_local(chooser: str, local: str, margin: float = 0.25) -> int | None:
        """Requests whose TTFT in ``chooser`` exceeded the same request's TTFT in ``local`` by more
        than the budget's margin (the service's own: a quarter and 5 ms)."""
        if chooser not in results or local not in results:
            return None
        return sum(1 for rep in range(args.reps) for a, f in zip(results[local][rep], results[chooser][rep])
                   if f["ttft_s"] > a["ttft_s"] * (1 + margin) + 0.005)

    def requests_of(mode: str) -> list[dict]:
        return [g for rep in results.get(mode, []) for g in rep]

    def oracle(local: str, remote: str) -> list[list[float]]:
        return [[min(a["ttft_s"], b["ttft_s"]) for a, b in zip(results[local][rep], results[remote][rep])]
                for rep in range(args.reps)]

    summary: dict[str, dict] = {}
    oracles = {"oracle": oracle("local", "producer")}
    if args.alone:
        oracles["oracle-alone"] = oracle("alone-local", "alone-producer")
    for mode in (*modes, *oracles):
        reps = oracles[mode] if mode in oracles else [[g["ttft_s"] for g in r] for r in results[mode]]
        p50s, p90s = [pct(r, 0.5) for r in reps], [pct(r, 0.9) for r in reps]
        summary[mode] = {"p50_s": statistics.median(p50s), "p50_spread": [min(p50s), max(p50s)],
                         "p90_s": statistics.median(p90s), "p90_spread": [min(p90s), max(p90s)]}
    best_p50 = min(summary["local"]["p50_s"], summary["producer"]["p50_s"])
    best_p90 = min(summary["local"]["p90_s"], summary["producer"]["p90_s"])
    verdict = {"fastest_p50_over_better": summary["fastest"]["p50_s"] / best_p50,
               "fastest_p90_over_better": summary["fastest"]["p90_s"] / best_p90,
               "oracle_agreement": agreement("fastest", "local", "producer"),
               "oracle_alone_agreement": {"fastest": agreement("fastest", "alone-local", "alone-producer"),
                                          "alone-fastest": agreement("alone-fastest", "alone-local",
                                                                     "alone-producer")} if args.alone else None,
               "oracle_near_agreement": near("fastest", "local", "producer"),
               "oracle_alone_near_agreement": {
                   "fastest": near("fastest", "alone-local", "alone-producer"),
                   "alone-fastest": near("alone-fastest", "alone-local", "alone-producer")} if args.alone else None,
               "calibration_alone_s": calibration("alone-fastest", "alone-local", "alone-producer")
               if args.alone else None,
               "over_local_by_margin": {"fastest": over_local("fastest", "local"),
                                        "alone-fastest": over_local("alone-fastest", "alone-local")
                                        if args.alone else None},
               "prediction_error_s": errors_of(results["fastest"]),
               "prediction_error_by_mode_s": {m: errors_of(results[m]) for m in modes}}
    print(f"consumers: {args.consumers} (the producer on core {pins.producer}, "
          f"{'both consumers' if args.consumers == 2 else 'the consumer'} on core {pins.consumer})")
    print(f"{'mode':>14} {'TTFT p50 s':>22} {'TTFT p90 s':>22}")
    for mode, s in summary.items():
        print(f"{mode:>14} {s['p50_s']:>10.3f} [{s['p50_spread'][0]:.3f}-{s['p50_spread'][1]:.3f}] "
              f"{s['p90_s']:>10.3f} [{s['p90_spread'][0]:.3f}-{s['p90_spread'][1]:.3f}]")
    print(f"fastest / better of local and producer: p50 {verdict['fastest_p50_over_better']:.2f}x, "
          f"p90 {verdict['fastest_p90_over_better']:.2f}x (aim <= 0.95)")
    print(f"fastest chose the (trace) oracle's path on {verdict['oracle_agreement']:.0%} of requests (aim >= 90%)")
    print(f"... or a path within 10% of it: {verdict['oracle_near_agreement']:.0%}")
    if verdict["oracle_alone_agreement"]:
        for who, share in verdict["oracle_alone_agreement"].items():
            print(f"{who} chose the alone oracle's path on {share:.0%} of requests "
                  f"(or one within 10% of it: {verdict['oracle_alone_near_agreement'][who]:.0%})")
    n = len(requests_of("fastest"))
    for who, count in verdict["over_local_by_margin"].items():
        if count is not None:
            print(f"{who}: {count} of {n} requests slower than the same request's local TTFT by more than "
                  f"a quarter and 5 ms (aim: none)")
    for k, e in (verdict["calibration_alone_s"] or {}).items():
        print(f"calibration alone, {k} predicted (taken or not) minus measured alone: median "
              f"{e['median'] * 1000:+.0f} ms [{e['min'] * 1000:+.0f}, {e['max'] * 1000:+.0f}] (n={e['n']})")
    for mode, errs in verdict["prediction_error_by_mode_s"].items():
        for k, e in errs.items():
            print(f"prediction error, {mode}, {k}: median {e['median'] * 1000:+.0f} ms "
                  f"[{e['min'] * 1000:+.0f}, {e['max'] * 1000:+.0f}] (n={e['n']})")
    path = write_receipt("mixed-trace", {"args": vars(args), "machine": machine(), "pinning": pins.__dict__,
                                         "summary": summary, "verdict": verdict, "raw": results,
                                         "warmup": warmups})
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    run(main)
