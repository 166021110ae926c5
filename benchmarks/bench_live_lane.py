"""The live lane as a user runs it: whole processes, two "machines" on one host.

    python benchmarks/bench_live_lane.py [--depths 512,2048,8064] [--reps 5]

Producer and consumer are pinned to different cores (``taskset -c 0`` / ``taskset -c 1``),
one compute thread each, so neither steals the other's CPU (docs/benchmarking.md). Per
depth, after one uncounted warm-up of each, alternating A B A B:

  streamed  consumer$ receive --listen --once | decode -n 1 --json   (started first)
            producer$ prefill --json | send --to ...                  (frames leave per chunk)
  file      producer$ prefill -o f.kvpack && send f.kvpack            (stop-and-wait)
            consumer$ receive --once -o in.kvpack && decode in.kvpack -n 1 --json

The consumer is resident in both: its model is loaded before the first frame can arrive
(decode --dtype loads it before the header; the producer starts once it has). Figures:

  lane TTFT      = consumer's first token - producer's prefill start (Unix times each
                   process reports: decode started_unix + first_token_s, prefill started_unix
                   + prefill_start_s; the file lane's consumer starts decoding when receive
                   exits, and its model load is taken out)
  exposed        = (lane TTFT - producer prefill_s) / producer prefill_s     aim <= 1 % at 8064
  tail_s         = last frame's arrival -> first token (decode --json)

Receipt: benchmarks/results/live-lane-*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from _common import corpus_ids, summarize, write_receipt  # noqa: E402

MUSER = [sys.executable, "-m", "muser_cli.commands"]
PRODUCER_CPU, CONSUMER_CPU = "0", "1"


def pinned(cpu: str, *args: str) -> list[str]:
    return ["taskset", "-c", cpu, *MUSER, *args]


def env_for(home: Path) -> dict:
    return dict(os.environ, MUSER_HOME=str(home), MUSER_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def wait_listening(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([proc.stderr], [], [], 0.5)[0]:
            line = proc.stderr.readline().decode()
            m = re.search(r"listening on (\S+)", line)
            if m:
                return m.group(1)
            if not line:
                break
    proc.kill()
    raise SystemExit("bench_live_lane: the receiver did not start")


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"bench_live_lane: no JSON in: {text[-500:]}")


def streamed(doc: Path, cons: dict, prod: dict, settle: float) -> dict:
    recv = subprocess.Popen(pinned(CONSUMER_CPU, "receive", "--listen", "127.0.0.1:0", "--once", "--timeout", "600"),
                            env=cons, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    dec = subprocess.Popen(pinned(CONSUMER_CPU, "decode", "-m", "default", "-n", "1", "--json", "--dtype", "float32",
                                  "--threads", "1"), env=cons, stdin=recv.stdout, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    recv.stdout.close()
    addr = wait_listening(recv)
    time.sleep(settle)  # the consumer is resident: its model is loaded before the producer starts
    pre = subprocess.Popen(pinned(PRODUCER_CPU, "prefill", "-m", "default", str(doc), "--threads", "1", "--json"),
                           env=prod, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    snd = subprocess.run(pinned(PRODUCER_CPU, "send", "--to", addr, "--json"), env=prod, stdin=pre.stdout,
                         capture_output=True)
    pre.stdout.close()
    pre_err = pre.stderr.read().decode()
    pre.wait()
    out, err = dec.communicate()
    recv.wait()
    if pre.returncode or snd.returncode or dec.returncode:
        raise SystemExit(f"streamed lane failed: {pre_err[-300:]} {snd.stderr[-300:]} {err[-500:]}")
    p, d = last_json(pre_err), json.loads(out)
    start = p["started_unix"] + p["prefill_start_s"]
    ttft = d["started_unix"] + d["first_token_s"] - start
    return {"prefill": p["prefill_s"], "ttft": ttft, "exposed": (ttft - p["prefill_s"]) / p["prefill_s"],
            "tail": d["tail_s"], "first_frame_after_start": p["first_frame_s"] - p["prefill_start_s"],
            "consumer_ttft": d["ttft_s"], "token": d["token_ids"][0], "tokens": d["prompt_tokens"],
            "bytes": p["bytes"]}


def file_lane(doc: Path, cons: dict, prod: dict, work: Path) -> dict:
    inbox = work / "in.kvpack"
    inbox.unlink(missing_ok=True)
    recv = subprocess.Popen(pinned(CONSUMER_CPU, "receive", "--listen", "127.0.0.1:0", "--once", "--timeout", "600",
                                   "-o", str(inbox)), env=cons, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    addr = wait_listening(recv)
    f = work / "out.kvpack"
    pre = subprocess.run(pinned(PRODUCER_CPU, "prefill", "-m", "default", str(doc), "--threads", "1", "-o", str(f),
                                "--json"), env=prod, capture_output=True)
    snd = subprocess.run(pinned(PRODUCER_CPU, "send", str(f), "--to", addr), env=prod, capture_output=True)
    recv.wait()
    t_received = time.time()
    dec = subprocess.run(pinned(CONSUMER_CPU, "decode", str(inbox), "-m", "default", "-n", "1", "--json",
                                "--threads", "1"), env=cons, capture_output=True)
    if pre.returncode or snd.returncode or dec.returncode or recv.returncode:
        raise SystemExit(f"file lane failed: {pre.stderr[-300:]} {snd.stderr[-300:]} {dec.stderr[-300:]}")
    p, d = json.loads(pre.stdout), json.loads(dec.stdout)
    start = p["started_unix"] + p["prefill_start_s"]
    ttft = t_received + d["ttft_s"] - start  # the consumer is resident: its model load is not counted
    return {"prefill": p["prefill_s"], "ttft": ttft, "exposed": (ttft - p["prefill_s"]) / p["prefill_s"],
            "consumer_ttft": d["ttft_s"], "token": d["token_ids"][0], "tokens": d["prompt_tokens"], "bytes": p["bytes"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="512,2048,8064")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--settle", type=float, default=8.0, help="seconds the consumer gets to load its model")
    args = ap.parse_args()

    from muser_cli.models import resolve_model
    from muser_cli.tokens import decode_text

    work = Path(tempfile.mkdtemp(prefix="bench-live-lane-"))
    cons_home, prod_home = work / "consumer", work / "producer"
    cons, prod = env_for(cons_home), env_for(prod_home)
    subprocess.run([*MUSER, "-q", "node", "init", "--name", "consumer"], env=cons, check=True)
    subprocess.run([*MUSER, "-q", "node", "export", "--producer", "producer", "-o", str(work / "p.bundle")],
                   env=cons, check=True)
    subprocess.run([*MUSER, "-q", "node", "join", str(work / "p.bundle")], env=prod, check=True)
    info = resolve_model("default")
    rows = []
    for depth in [int(d) for d in args.depths.split(",")]:
        doc = work / f"doc-{depth}.txt"
        doc.write_text(decode_text(info, corpus_ids(info, depth)))
        streamed(doc, cons, prod, args.settle), file_lane(doc, cons, prod, work)  # warm-up, uncounted
        a, b = [], []
        for _ in range(args.reps):  # A B A B
            a.append(streamed(doc, cons, prod, args.settle))
            b.append(file_lane(doc, cons, prod, work))
        assert len({r["token"] for r in a + b}) == 1, "the lanes disagree on the first token"

        def s(rs, key):
            return summarize([r[key] for r in rs if r.get(key) is not None])

        row = {"depth": a[0]["tokens"], "bytes": a[0]["bytes"],
               "streamed": {k: s(a, k) for k in ("prefill", "ttft", "exposed", "tail", "first_frame_after_start",
                                                 "consumer_ttft")},
               "file": {k: s(b, k) for k in ("prefill", "ttft", "exposed", "consumer_ttft")}}
        rows.append(row)
        st, fl = row["streamed"], row["file"]
        print(f"{row['depth']:>6} tok | prefill {st['prefill']['median']:7.2f} s | streamed TTFT "
              f"{st['ttft']['median']:7.2f} s exposed {st['exposed']['median']:+.2%} (cv of TTFT "
              f"{st['ttft']['cv']:.1%}) tail {st['tail']['median'] * 1e3:.0f} ms | file TTFT {fl['ttft']['median']:7.2f} s "
              f"exposed {fl['exposed']['median']:+.2%}", flush=True)
    path = write_receipt("live-lane", {"model": info.name, "dtype": "float32", "threads": "1 per side",
                                       "pinning": f"producer cpu {PRODUCER_CPU}, consumer cpu {CONSUMER_CPU}",
                                       "link": "loopback mTLS 1.3 (Handoff V3)", "rows": rows})
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
