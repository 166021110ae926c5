"""``muser batch`` vs a shell loop of ``muser decode`` (issue 15's measurement).

One document of ~DOC_TOKENS tokens (the project's own docs) asked QUESTIONS questions:

  * loop-local : ``for q: muser decode --prompt doc+q``            (every job: process, load, full prefill)
  * batch-local: ``muser batch jobs.jsonl``                        (one load; the document prefilled once)
  * loop-pull  : ``for q: muser decode --producer P --prompt doc+q`` (every job: process, load, full handoff)
  * batch-pull : ``muser batch jobs.jsonl --producer P``           (one handoff, then deltas, pulls overlapped)

The consumer runs on one core and the resident producer on another (``taskset -c``), one
compute thread each; every run starts from an empty store. Whole-process wall times; the
batches are repeated --reps times (the loops once: each is already QUESTIONS runs). The
tokens of every job are checked equal across the four. Receipt: benchmarks/results/batch-*.json.

    .venv/bin/python benchmarks/bench_batch.py -m default            # the measurement (~20 min)
    .venv/bin/python benchmarks/bench_batch.py -m TINY --doc-tokens 600 --questions 4 --reps 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, write_receipt  # noqa: E402

QUESTION_TEXTS = [
    "Question: what does the consumer check before decoding?", "Question: what is a kvpack?",
    "Question: what happens when the producer is gone?", "Question: what does verify refuse?",
    "Question: how is a handoff authenticated?", "Question: what is the canonical schedule?",
    "Question: what does the store keep?", "Question: what is a delta pack?",
    "Question: which exit status means temporary failure?", "Question: what does pack --zstd do?",
    "Question: what is Handoff V3?", "Question: how does decode fall back?",
    "Question: what does the spot-check compare?", "Question: what is a have manifest?",
    "Question: which engines are supported?", "Question: how are producers enrolled?",
]


def muser(*args: str) -> list[str]:
    return [sys.executable, "-m", "muser_cli.commands", *args]


def pinned(core: int | None, cmd: list[str]) -> list[str]:
    return (["taskset", "-c", str(core)] + cmd) if core is not None else cmd


MODELS: str | None = None  # one converted-models folder for every process (converted before timing)


def env_for(home: Path) -> dict[str, str]:
    env = dict(os.environ, MUSER_HOME=str(home), MUSER_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MUSER_STORE", None)
    if MODELS:
        env["MUSER_MODELS"] = MODELS
    return env


def make_document(model: str | None, n_tokens: int) -> str:
    from muser_cli.bench.common import _corpus_text
    from muser_cli.models import resolve_model
    from muser_cli.tokens import decode_text, encode_prompt

    info = resolve_model(model)
    text = _corpus_text()
    while len(encode_prompt(info, text)) < n_tokens:
        text += "\n\n" + text
    ids = encode_prompt(info, text)[:n_tokens]
    return decode_text(info, ids)


class Producer:
    def __init__(self, home: Path, model: str, core: int | None) -> None:
        self.proc = subprocess.Popen(pinned(core, muser("prefill", "--serve", "127.0.0.1:0", "-m", model, "--threads",
                                                        "1", "--json")),
                                     env=env_for(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.address = None
        self.events: list[dict] = []
        got = threading.Event()

        def pump() -> None:
            for raw in self.proc.stderr:
                line = raw.decode(errors="replace")
                m = re.search(r"listening on (\S+)", line)
                if m and self.address is None:
                    self.address = m.group(1)
                    got.set()
                if line.startswith("{"):
                    self.events.append(json.loads(line))
            got.set()

        threading.Thread(target=pump, daemon=True).start()
        got.wait(300)
        if self.address is None:
            raise SystemExit("producer did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def run(cmd: list[str], home: Path, **kw) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env_for(home), capture_output=True, **kw)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])}... exited {r.returncode}: {r.stderr.decode()[-2000:]}")
    return dt, r


def fresh_store(home: Path) -> None:
    shutil.rmtree(home / "data" / "store", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--doc-tokens", type=int, default=6000)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("-n", "--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None, help="the canonical schedule's chunk (default: muser's, 512)")
    ap.add_argument("--skip-loops", action="store_true", help="measure the batches only")
    ap.add_argument("--loop-questions", type=int, default=0,
                    help="run the loops on the first K questions only and scale their median per job to all "
                         "(every loop job is the same work: a process, a load, a full prefill); 0 = all")
    args = ap.parse_args()
    cores = os.sched_getaffinity(0)
    producer_core, consumer_core = (sorted(cores)[0], sorted(cores)[1]) if len(cores) > 1 else (None, None)
    root = Path(tempfile.mkdtemp(prefix="muser-bench-batch-"))
    from muser_cli.handoff import node
    from muser_cli import paths

    def keys(home: Path) -> Path:
        os.environ["MUSER_HOME"] = str(home)
        return paths.keys_dir()

    ch, ph = root / "consumer", root / "producer"
    node.init_node(keys(ch), name="consumer")
    bundle, _ = node.export_producer(keys(ch), producer="bench-producer")
    node.join_node(keys(ph), bundle)
    os.environ.pop("MUSER_HOME", None)
    global MODELS
    MODELS = str(paths.models_dir())  # make_document converts the model here, once, untimed
    doc = make_document(args.model, args.doc_tokens)
    (root / "doc.txt").write_text(doc)
    qs = QUESTION_TEXTS[: args.questions]
    with open(root / "jobs.jsonl", "w") as fh:
        for i, q in enumerate(qs):
            fh.write(json.dumps({"id": f"q{i}", "prompt_file": "doc.txt", "question": q,
                                 "max_tokens": args.max_tokens}) + "\n")
            (root / f"p{i}.txt").write_text(f"{doc.rstrip()}\n\n{q}")
    common = ["-m", args.model, "--threads", "1"] + (["--chunk", str(args.chunk)] if args.chunk else [])
    out: dict = {"chunk": args.chunk or 512, "doc_tokens": args.doc_tokens, "questions": len(qs), "max_tokens": args.max_tokens,
                 "model": args.model, "cores": {"producer": producer_core, "consumer": consumer_core},
                 "runs": {}}
    tokens: dict[str, dict[str, list[int]]] = {}
    prod = Producer(ph, args.model, producer_core)
    try:
        def batch(name: str, *extra: str) -> None:
            walls, shipped = [], []
            for rep in range(args.reps):
                fresh_store(ch)
                res = root / f"{name}-{rep}.jsonl"
                dt, r = run(pinned(consumer_core, muser("batch", str(root / "jobs.jsonl"), *common, "-o", str(res),
                                                        "--json", *extra)), ch)
                lines = [json.loads(x) for x in res.read_bytes().splitlines()]
                tokens[name] = {x["id"]: x["token_ids"] for x in lines}
                walls.append(dt)
                shipped.append(sum(x.get("shipped_bytes", 0) for x in lines))
                summary = json.loads(r.stdout)
                print(f"{name} rep {rep}: {dt:.1f} s, sources {summary['sources']}, shipped {shipped[-1]}",
                      flush=True)
            out["runs"][name] = {"wall_s": walls, "median_s": statistics.median(walls),
                                 "min_s": min(walls), "max_s": max(walls), "shipped_bytes": shipped,
                                 "sources": summary["sources"]}

        def loop(name: str, *extra: str) -> None:
            fresh_store(ch)
            per, shipped = [], 0
            tokens[name] = {}
            t0 = time.perf_counter()
            k = args.loop_questions or len(qs)
            for i in range(min(k, len(qs))):
                dt, r = run(pinned(consumer_core, muser("decode", *common, "--prompt", str(root / f"p{i}.txt"), "-n",
                                                        str(args.max_tokens), "--json", *extra)), ch, input=b"")
                got = json.loads(r.stdout)
                tokens[name][f"q{i}"] = got["token_ids"]
                per.append(dt)
                print(f"{name} q{i}: {dt:.1f} s ({got['source']})", flush=True)
            wall = time.perf_counter() - t0
            measured = len(per)
            if measured < len(qs):  # scaled, and said so in the receipt
                wall = statistics.median(per) * len(qs)
            out["runs"][name] = {"wall_s": [wall], "median_s": wall, "jobs_measured": measured,
                                 "scaled_from_median": measured < len(qs), "per_job_s": per,
                                 "per_job_median_s": statistics.median(per), "per_job_min_s": min(per),
                                 "per_job_max_s": max(per)}

        batch("batch-local")
        batch("batch-pull", "--producer", prod.address)
        if not args.skip_loops:
            loop("loop-local")
            loop("loop-pull", "--producer", prod.address)
        served = [e for e in prod.events if e.get("event") == "request" and e.get("outcome") == "served"]
        full = [e["bytes"] for e in served if e.get("held_rows") == 0]
        out["full_handoff_bytes"] = statistics.median(full) if full else None
    finally:
        prod.stop()
    names = list(tokens)
    out["tokens_equal"] = all(tokens[n][q] == tokens[names[0]][q] for n in names for q in tokens[n])
    out["machine"] = machine()
    r = out["runs"]
    if "loop-local" in r:
        out["speedup_local"] = r["loop-local"]["median_s"] / r["batch-local"]["median_s"]
        out["speedup_pull"] = r["loop-pull"]["median_s"] / r["batch-pull"]["median_s"]
    if out["full_handoff_bytes"]:
        out["bytes_vs_full_handoffs"] = (statistics.median(r["batch-pull"]["shipped_bytes"])
                                         / (out["full_handoff_bytes"] * len(qs)))
    for name, v in r.items():
        out["runs"][name]["questions_per_min"] = 60 * len(qs) / v["median_s"]
    path = write_receipt("batch", out)
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1))
    print(f"receipt: {path}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
