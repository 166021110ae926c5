"""``muser batch`` against a shell loop of ``muser decode`` (issue 15's measurement;
``benchmarks/bench_batch.py`` calls :func:`run_batch_vs_loop`, see its docstring).

Whole processes: the consumer on one core and a resident ``prefill --serve`` producer on
another (``taskset -c``), one compute thread each, every run from an empty store. Nothing
here prints or exits: progress goes through a callback, a failed process is a MuserError.
"""

from __future__ import annotations

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
from typing import Any

from muser_cli import paths
from muser_cli.bench.common import Progress, corpus_text, no_progress
from muser_cli.errors import MuserError, TempFailure
from muser_cli.handoff.trust import node
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tokens import decode_text, encode_prompt

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


def env_for(home: Path, models: str | None) -> dict[str, str]:
    env = dict(os.environ, MUSER_HOME=str(home), MUSER_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MUSER_STORE", None)
    if models:
        env["MUSER_MODELS"] = models
    return env


def make_document(model: str | None, n_tokens: int) -> str:
    info = resolve_model(model)
    text = corpus_text()
    while len(encode_prompt(info, text)) < n_tokens:
        text += "\n\n" + text
    return decode_text(info, encode_prompt(info, text)[:n_tokens])


class Producer:
    """A resident ``muser prefill --serve`` process; its JSON events are kept."""

    def __init__(self, home: Path, model: str, core: int | None, models: str | None) -> None:
        self.proc = subprocess.Popen(pinned(core, muser("prefill", "--serve", "127.0.0.1:0", "-m", model, "--threads",
                                                        "1", "--json")),
                                     env=env_for(home, models), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.address = None
        self.events: list[dict] = []
        got = threading.Event()
        threading.Thread(target=self._pump, args=(got,), daemon=True).start()
        got.wait(300)
        if self.address is None:
            self.stop()
            raise TempFailure("bench batch: the producer did not start")

    def _pump(self, got: threading.Event) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            m = re.search(r"listening on (\S+)", line)
            if m and self.address is None:
                self.address = m.group(1)
                got.set()
            if line.startswith("{"):
                self.events.append(json.loads(line))
        got.set()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


class Lab:
    """Two nodes (consumer and producer homes) under one work folder, the jobs file, one
    prompt file per question, and the runs measured so far."""

    def __init__(self, root: Path, model: str, doc_tokens: int, questions: int, max_tokens: int,
                 chunk: int | None, progress: Progress) -> None:

        cores = sorted(os.sched_getaffinity(0))
        self.producer_core, self.consumer_core = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
        self.root, self.ch, self.ph, self.progress = root, root / "consumer", root / "producer", progress
        self.model, self.max_tokens = model, max_tokens
        node.init_node(self._keys(self.ch), name="consumer")
        bundle, _ = node.export_producer(self._keys(self.ch), producer="bench-producer")
        node.join_node(self._keys(self.ph), bundle)
        os.environ.pop("MUSER_HOME", None)
        self.models = str(paths.models_dir())  # make_document converts the model here, once, untimed
        doc = make_document(model, doc_tokens)
        (root / "doc.txt").write_text(doc)
        self.qs = QUESTION_TEXTS[:questions]
        with open(root / "jobs.jsonl", "w") as fh:
            for i, q in enumerate(self.qs):
                fh.write(json.dumps({"id": f"q{i}", "prompt_file": "doc.txt", "question": q,
                                     "max_tokens": max_tokens}) + "\n")
                (root / f"p{i}.txt").write_text(f"{doc.rstrip()}\n\n{q}")
        self.common = ["-m", model, "--threads", "1"] + (["--chunk", str(chunk)] if chunk else [])
        self.runs: dict[str, dict[str, Any]] = {}
        self.tokens: dict[str, dict[str, list[int]]] = {}

    @staticmethod
    def _keys(home: Path) -> Path:
        os.environ["MUSER_HOME"] = str(home)
        return paths.keys_dir()

    def run(self, cmd: list[str], env: dict[str, str] | None = None, **kw) -> tuple[float, subprocess.CompletedProcess]:
        t0 = time.perf_counter()
        r = subprocess.run(pinned(self.consumer_core, cmd), env={**env_for(self.ch, self.models), **(env or {})},
                           capture_output=True, **kw)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            raise MuserError(f"{' '.join(cmd[:6])}... exited {r.returncode}: {r.stderr.decode()[-2000:]}")
        return dt, r

    def fresh_store(self) -> None:
        shutil.rmtree(self.ch / "data" / "store", ignore_errors=True)

    def batch(self, name: str, reps: int, *extra: str) -> None:
        walls, shipped = [], []
        for rep in range(reps):
            self.fresh_store()
            res = self.root / f"{name}-{rep}.jsonl"
            # with a producer: every job asked (the lane's speed measured, not the route's choice)
            dt, r = self.run(muser("batch", str(self.root / "jobs.jsonl"), *self.common, "-o", str(res), "--json",
                                   *extra), env={"MUSER_ROUTE": "producer"} if "--producer" in extra else None)
            lines = [json.loads(x) for x in res.read_bytes().splitlines()]
            self.tokens[name] = {x["id"]: x["token_ids"] for x in lines}
            walls.append(dt)
            shipped.append(sum(x.get("shipped_bytes", 0) for x in lines))
            summary = json.loads(r.stdout)
            self.progress(f"{name} rep {rep}: {dt:.1f} s, sources {summary['sources']}, shipped {shipped[-1]}")
        self.runs[name] = {"wall_s": walls, "median_s": statistics.median(walls), "min_s": min(walls),
                           "max_s": max(walls), "shipped_bytes": shipped, "sources": summary["sources"]}

    def loop(self, name: str, loop_questions: int, *extra: str) -> None:
        """A shell loop of decode, one process a question; the first ``loop_questions`` only
        (0: all), the rest scaled from their median per job, said so in the receipt."""
        self.fresh_store()
        per: list[float] = []
        self.tokens[name] = {}
        t0 = time.perf_counter()
        for i in range(min(loop_questions or len(self.qs), len(self.qs))):
            dt, r = self.run(muser("decode", *self.common, "--prompt", str(self.root / f"p{i}.txt"), "-n",
                                   str(self.max_tokens), "--json", *extra), input=b"")
            got = json.loads(r.stdout)
            self.tokens[name][f"q{i}"] = got["token_ids"]
            per.append(dt)
            self.progress(f"{name} q{i}: {dt:.1f} s ({got['source']})")
        wall = time.perf_counter() - t0
        scaled = len(per) < len(self.qs)
        if scaled:
            wall = statistics.median(per) * len(self.qs)
        self.runs[name] = {"wall_s": [wall], "median_s": wall, "jobs_measured": len(per), "scaled_from_median": scaled,
                           "per_job_s": per, "per_job_median_s": statistics.median(per), "per_job_min_s": min(per),
                           "per_job_max_s": max(per)}


def run_batch_vs_loop(*, model: str = "default", doc_tokens: int = 6000, questions: int = 16, max_tokens: int = 32,
                      reps: int = 3, chunk: int | None = None, skip_loops: bool = False, loop_questions: int = 0,
                      progress: Progress = no_progress) -> dict[str, Any]:
    """The receipt's payload: the four runs, whether every job's tokens agree, and the ratios."""
    root = Path(tempfile.mkdtemp(prefix="muser-bench-batch-"))
    try:
        lab = Lab(root, model, doc_tokens, questions, max_tokens, chunk, progress)
        prod = Producer(lab.ph, model, lab.producer_core, lab.models)
        try:
            lab.batch("batch-local", reps)
            lab.batch("batch-pull", reps, "--producer", prod.address)
            if not skip_loops:
                lab.loop("loop-local", loop_questions)
                lab.loop("loop-pull", loop_questions, "--producer", prod.address)
        finally:
            prod.stop()
        out = {"chunk": chunk or 512, "doc_tokens": doc_tokens, "questions": len(lab.qs), "max_tokens": max_tokens,
               "model": model, "cores": {"producer": lab.producer_core, "consumer": lab.consumer_core},
               "runs": lab.runs, "full_handoff_bytes": _full_handoff_bytes(prod.events)}
        return _ratios(out, lab.tokens)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _full_handoff_bytes(events: list[dict]) -> float | None:
    served = [e for e in events if e.get("event") == "request" and e.get("outcome") == "served"]
    full = [e["bytes"] for e in served if e.get("held_rows") == 0]
    return statistics.median(full) if full else None


def _ratios(out: dict[str, Any], tokens: dict[str, dict[str, list[int]]]) -> dict[str, Any]:
    names = list(tokens)
    out["tokens_equal"] = all(tokens[n][q] == tokens[names[0]][q] for n in names for q in tokens[n])
    r, n_q = out["runs"], out["questions"]
    if "loop-local" in r:
        out["speedup_local"] = r["loop-local"]["median_s"] / r["batch-local"]["median_s"]
        out["speedup_pull"] = r["loop-pull"]["median_s"] / r["batch-pull"]["median_s"]
    if out["full_handoff_bytes"]:
        out["bytes_vs_full_handoffs"] = (statistics.median(r["batch-pull"]["shipped_bytes"])
                                         / (out["full_handoff_bytes"] * n_q))
    for v in r.values():
        v["questions_per_min"] = 60 * n_q / v["median_s"]
    return out
