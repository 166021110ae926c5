"""The pull lane against the one-shot push lane and a local prefill, whole processes as a
user runs them, plus a follow-up question shipped as a delta.

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

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import corpus_ids, summarize, write_receipt  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--settle", type=float, default=10.0)
    ap.add_argument("--follow-up", action="store_true")
    args = ap.parse_args()
    from muser_cli.bench.common import pinning, resolve_bench_model
    from muser_cli.bench.loopback import MUSER, make_nodes, node_env, wait_listening
    from muser_cli.tokens import decode_text

    info = resolve_bench_model("default")
    pins = pinning(True)
    work = Path(tempfile.mkdtemp(prefix="muser-bench-pull-"))
    nodes = make_nodes(work)
    cons, prod = node_env(nodes.consumer_home, threads=1), node_env(nodes.producer_home, threads=1)
    doc = work / "doc.txt"

    def new_document(rnd: int) -> None:
        """Each round asks about another document (the corpus from another offset), so the
        resident producer never holds the rows from an earlier round (its memory of the last
        request would otherwise serve most of a repeated prompt)."""
        skip = 211 * rnd
        doc.write_text(decode_text(info, corpus_ids(info, args.depth + skip)[skip:]), encoding="utf-8")

    new_document(0)
    common = ["-m", "default", "--threads", "1", "--dtype", "float32"]
    server = subprocess.Popen(pins.command("producer", [*MUSER, "prefill", "--serve", "127.0.0.1:0", "--json",
                                                        *common]),
                              env=prod, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        addr = wait_listening(server, "bench pull (producer)", timeout=300)

        def ttft_of(out: bytes, t_start: float) -> tuple[float, dict]:
            d = json.loads(out)
            return d["started_unix"] + d["first_token_s"] - t_start, d

        def pull(prompt: Path, extra: list[str]) -> dict:
            t0 = time.time()
            p = subprocess.run(pins.command("consumer", [*MUSER, "decode", "--producer", addr, "--prompt",
                                                         str(prompt), "-n", "1", "--json", *common, *extra]),
                               env=cons, stdin=subprocess.DEVNULL, capture_output=True)
            if p.returncode:
                raise SystemExit(f"pull failed: {p.stderr.decode(errors='replace')[-400:]}")
            ttft, d = ttft_of(p.stdout, t0)
            return {"ttft": ttft, "token": d["token_ids"][0], "source": d["source"], "d": d}

        def local() -> dict:
            t0 = time.time()
            p = subprocess.run(pins.command("consumer", [*MUSER, "decode", "--prompt", str(doc), "-n", "1", "--json",
                                                         "--no-reuse", *common]),
                               env=cons, stdin=subprocess.DEVNULL, capture_output=True)
            if p.returncode:
                raise SystemExit(f"local failed: {p.stderr.decode(errors='replace')[-400:]}")
            ttft, d = ttft_of(p.stdout, t0)
            return {"ttft": ttft, "token": d["token_ids"][0], "source": d["source"]}

        def push() -> dict:
            recv = subprocess.Popen(pins.command("consumer", [*MUSER, "receive", "--listen", "127.0.0.1:0", "--once",
                                                              "--timeout", "600"]),
                                    env=cons, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            dec = subprocess.Popen(pins.command("consumer", [*MUSER, "decode", "-n", "1", "--json", *common]),
                                   env=cons, stdin=recv.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            recv.stdout.close()
            try:
                to = wait_listening(recv, "bench pull (push receiver)")
                time.sleep(args.settle)  # the consumer is resident
                t0 = time.time()
                pre = subprocess.Popen(pins.command("producer", [*MUSER, "prefill", *common, str(doc)]), env=prod,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                snd = subprocess.run(pins.command("producer", [*MUSER, "send", "--to", to]), env=prod,
                                     stdin=pre.stdout, capture_output=True)
                pre.stdout.close()
                pre.wait()
                out, err = dec.communicate(timeout=600)
                recv.wait(timeout=60)
            finally:
                for proc in (recv, dec):
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
            if pre.returncode or snd.returncode or dec.returncode:
                raise SystemExit(f"push failed: {err.decode(errors='replace')[-400:]}")
            ttft, d = ttft_of(out, t0)
            return {"ttft": ttft, "token": d["token_ids"][0], "source": d["source"]}

        lanes = {"pull": lambda: pull(doc, ["--no-reuse"]), "push": push, "local": local}
        got: dict[str, list[dict]] = {k: [] for k in lanes}
        for rnd in range(args.reps + 1):
            print(f"pull bench {args.depth}: " + ("warm-up" if rnd == 0 else f"rep {rnd}/{args.reps}"),
                  file=sys.stderr, flush=True)
            new_document(rnd)
            firsts = set()
            for name, fn in lanes.items():
                r = fn()
                firsts.add(r["token"])
                if rnd:
                    got[name].append(r)
            if len(firsts) != 1:
                raise SystemExit(f"round {rnd}: the lanes decoded different first tokens: {firsts}")
        rows = {name: summarize([r["ttft"] for r in rs]) for name, rs in got.items()}
        sources = {name: sorted({r["source"] for r in rs}) for name, rs in got.items()}
        payload = {"what": "pull vs push vs local TTFT, whole processes (bench_pull.py)", "args": vars(args),
                   "pinning": pins.describe(), "depth": args.depth, "ttft_s": rows, "sources": sources}
        for name, s in rows.items():
            print(f"{name:5s}: TTFT {s['median']:.2f}s ({s['min']:.2f}-{s['max']:.2f})", flush=True)

        if args.follow_up:
            q1, q2 = work / "q1.txt", work / "q2.txt"
            text = doc.read_text(encoding="utf-8")
            q1.write_text(text + "\n\nQuestion: what does the consumer check first?", encoding="utf-8")
            q2.write_text(text + "\n\nQuestion: and what happens when the producer is down?", encoding="utf-8")
            first = pull(q1, ["--store"])  # a full handoff, kept in the consumer's store
            follow = pull(q2, ["--store"])  # the producer holds the document: a delta
            payload["follow_up"] = {
                "first": {"ttft_s": first["ttft"], "source": first["source"],
                          "engine_stats": first["d"].get("engine_stats"), "reuse": first["d"].get("reuse")},
                "follow_up": {"ttft_s": follow["ttft"], "source": follow["source"],
                              "reuse": follow["d"].get("reuse")}}
            print(f"follow-up: first {first['source']} {first['ttft']:.2f}s, follow-up {follow['source']} "
                  f"{follow['ttft']:.2f}s {follow['d'].get('reuse')}", flush=True)
    finally:
        server.terminate()
        try:
            _, err = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            _, err = server.communicate()
        shutil.rmtree(work, ignore_errors=True)
    events = []
    for line in err.decode(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("event") in ("request", "served", "done") or "shipped_rows" in str(ev):
            events.append(ev)
    payload["producer_events"] = events[-8:]
    payload["load_average"] = os.getloadavg()
    path = write_receipt("pull", payload)
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
