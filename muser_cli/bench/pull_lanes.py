"""The pull lane against the one-shot push lane and a local prefill, whole processes
(``benchmarks/bench_pull.py`` calls :func:`run_pull`; see its docstring for the lanes).

Producer on one core, consumer on another (``taskset``), one compute thread each,
loopback mutual TLS, the embedded model in float32. Nothing here prints or exits:
progress goes through a callback, a failed process is a MuserError.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from muser_cli.bench.common import Progress, corpus_ids, no_progress, pinning, resolve_bench_model, summarize
from muser_cli.bench.loopback import MUSER, make_nodes, node_env, push_once, wait_listening
from muser_cli.errors import DataError, MuserError
from muser_cli.model.tokens import decode_text

COMMON = ["-m", "default", "--threads", "1", "--dtype", "float32"]


def _ttft_of(out: bytes, t_start: float) -> tuple[float, dict]:
    d = json.loads(out)
    return d["started_unix"] + d["first_token_s"] - t_start, d


def _checked(p, what: str) -> None:
    if p.returncode:
        raise MuserError(f"bench pull: {what} failed: {p.stderr.decode(errors='replace')[-400:]}")


class Lanes:
    """The resident producer (``prefill --serve``), the nodes and the document of this round."""

    def __init__(self, info, work: Path, depth: int, settle: float) -> None:
        self.info, self.work, self.depth, self.settle, self.muser = info, work, depth, settle, MUSER
        self.pins = pinning(True)
        nodes = make_nodes(work)
        self.cons, self.prod = node_env(nodes.consumer_home, threads=1), node_env(nodes.producer_home, threads=1)
        self.doc = work / "doc.txt"
        self.new_document(0)
        self.server = subprocess.Popen(self._cmd("producer", "prefill", "--serve", "127.0.0.1:0", "--json", *COMMON),
                                       env=self.prod, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE)

    def _cmd(self, role: str, *args: str) -> list[str]:
        return self.pins.command(role, [*self.muser, *args])

    def new_document(self, rnd: int) -> None:
        """Each round asks about another document (the corpus from another offset), so the
        resident producer never holds the rows from an earlier round."""

        skip = 211 * rnd
        self.doc.write_text(decode_text(self.info, corpus_ids(self.info, self.depth + skip)[skip:]), encoding="utf-8")

    def start(self) -> None:
        self.addr = wait_listening(self.server, "bench pull (producer)", timeout=300)

    def pull(self, prompt: Path, extra: list[str]) -> dict:
        t0 = time.time()
        p = subprocess.run(self._cmd("consumer", "decode", "--producer", self.addr, "--prompt", str(prompt), "-n", "1",
                                     "--json", *COMMON, *extra), env=self.cons, stdin=subprocess.DEVNULL,
                           capture_output=True)
        _checked(p, "pull")
        ttft, d = _ttft_of(p.stdout, t0)
        return {"ttft": ttft, "token": d["token_ids"][0], "source": d["source"], "d": d}

    def local(self) -> dict:
        t0 = time.time()
        p = subprocess.run(self._cmd("consumer", "decode", "--prompt", str(self.doc), "-n", "1", "--json",
                                     "--no-reuse", *COMMON), env=self.cons, stdin=subprocess.DEVNULL,
                           capture_output=True)
        _checked(p, "local")
        ttft, d = _ttft_of(p.stdout, t0)
        return {"ttft": ttft, "token": d["token_ids"][0], "source": d["source"]}

    def push(self) -> dict:
        """A resident ``receive --once | decode`` and a one-shot ``prefill | send``."""

        got = push_once(self._cmd("consumer", "receive", "--listen", "127.0.0.1:0", "--once", "--timeout", "600"),
                        self._cmd("consumer", "decode", "-n", "1", "--json", *COMMON),
                        self._cmd("producer", "prefill", *COMMON, str(self.doc)),
                        lambda to: self._cmd("producer", "send", "--to", to), cons_env=self.cons, prod_env=self.prod,
                        settle=self.settle, what="bench pull (push receiver)")  # settle: the consumer is resident
        if got.failed:
            raise MuserError(f"bench pull: push failed: {got.err.decode(errors='replace')[-400:]}")
        ttft, d = _ttft_of(got.out, got.t0)
        return {"ttft": ttft, "token": d["token_ids"][0], "source": d["source"]}

    def stop(self) -> list[dict]:
        """Stop the producer; its last request events."""
        self.server.terminate()
        try:
            _, err = self.server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.server.kill()
            _, err = self.server.communicate()
        events = []
        for line in err.decode(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("event") in ("request", "served", "done") or "shipped_rows" in str(ev):
                events.append(ev)
        return events[-8:]


def _rounds(lanes: Lanes, reps: int, progress: Progress) -> dict[str, list[dict]]:
    """pull, push, local in turn each round (A B C), round 0 uncounted; one first token."""
    fns = {"pull": lambda: lanes.pull(lanes.doc, ["--no-reuse"]), "push": lanes.push, "local": lanes.local}
    got: dict[str, list[dict]] = {k: [] for k in fns}
    for rnd in range(reps + 1):
        progress(f"pull bench {lanes.depth}: " + ("warm-up" if rnd == 0 else f"rep {rnd}/{reps}"))
        lanes.new_document(rnd)
        firsts = set()
        for name, fn in fns.items():
            r = fn()
            firsts.add(r["token"])
            if rnd:
                got[name].append(r)
        if len(firsts) != 1:
            raise DataError(f"round {rnd}: the lanes decoded different first tokens: {firsts}")
    return got


def _follow_up(lanes: Lanes) -> dict[str, Any]:
    """A document asked about (a full handoff, stored), then a second question on it (a delta)."""
    q1, q2 = lanes.work / "q1.txt", lanes.work / "q2.txt"
    text = lanes.doc.read_text(encoding="utf-8")
    q1.write_text(text + "\n\nQuestion: what does the consumer check first?", encoding="utf-8")
    q2.write_text(text + "\n\nQuestion: and what happens when the producer is down?", encoding="utf-8")
    first = lanes.pull(q1, ["--store"])
    follow = lanes.pull(q2, ["--store"])
    return {"first": {"ttft_s": first["ttft"], "source": first["source"],
                      "engine_stats": first["d"].get("engine_stats"), "reuse": first["d"].get("reuse")},
            "follow_up": {"ttft_s": follow["ttft"], "source": follow["source"], "reuse": follow["d"].get("reuse")}}


def run_pull(*, depth: int = 2048, reps: int = 5, settle: float = 10.0, follow_up: bool = False,
             progress: Progress = no_progress) -> dict[str, Any]:
    """The receipt's payload: TTFT of each lane, their sources, and the follow-up if asked."""

    info = resolve_bench_model("default")
    work = Path(tempfile.mkdtemp(prefix="muser-bench-pull-"))
    lanes = None
    try:
        lanes = Lanes(info, work, depth, settle)
        lanes.start()
        got = _rounds(lanes, reps, progress)
        payload: dict[str, Any] = {
            "what": "pull vs push vs local TTFT, whole processes (bench_pull.py)", "pinning": lanes.pins.describe(),
            "depth": depth, "ttft_s": {name: summarize([r["ttft"] for r in rs]) for name, rs in got.items()},
            "sources": {name: sorted({r["source"] for r in rs}) for name, rs in got.items()}}
        if follow_up:
            payload["follow_up"] = _follow_up(lanes)
    finally:
        events = lanes.stop() if lanes is not None else []
        shutil.rmtree(work, ignore_errors=True)
    payload["producer_events"] = events
    payload["load_average"] = os.getloadavg()
    return payload
