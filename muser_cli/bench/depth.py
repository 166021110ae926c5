"""Every path to a first token by prompt depth, with each stage's time, bytes and peak memory
(``muser bench depth``; issue #50).

Whole processes, as a user runs them: the producer's commands on one core, the consumer's on
another (``taskset``), one compute thread each, mutual TLS on 127.0.0.1. Per depth, each round
(one uncounted warm-up, then ``reps``) runs, on a document of exactly that many tokens:

  local   consumer$ decode --prompt doc --no-reuse -n 1              (the fallback: a local prefill)
  push    producer$ prefill doc -o pack       consumer$ receive --listen --once -o got
          producer$ send pack --to ADDR       consumer$ verify got; decode got -n 1
  store   consumer$ reuse put got; decode --prompt doc -n 1         (warm: the rows from its store)
  delta   consumer$ prefill half --store (held: the first half, in whole chunks); reuse have doc
          producer$ prefill doc --have HAVE -o delta    consumer$ decode delta -n 1
  pull    producer$ prefill --serve (started anew each round, so it holds none of the document)
          consumer$ decode --producer ADDR --prompt doc -n 1
          (MUSER_ROUTE=producer: the lane taken whatever the cost model predicts)

Every path must give the local prefill's first token. Kept per stage: seconds (the command's
own figure where it reports one, else wall), bytes, and the process's peak RSS (``wait4``).
TTFT is the decode's ``ttft_s``: from its model being loaded (or, reading a pack, its first
byte) to the first token, the figure that compares paths (each process pays the same start and
load besides; ``first_token_s``, from the process's start, is kept too) -- except the pull
lane's, which is its whole process's (the wait for the producer is the lane's cost); its
exposed overhead is that TTFT over the consumer's start and load (the local path's) plus the
producer's prefill (the push path's). The local TTFT by depth is fitted as fixed + linear +
quadratic (:func:`muser_cli.costcurve.fit_curve`).

Nothing here prints or exits: progress through a callback, a failed process is a MuserError.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from muser_cli.bench.common import BenchResult, Progress, corpus_ids, no_progress, pinning, summarize
from muser_cli.bench.loopback import MUSER, drain_in_background, make_nodes, node_env, wait_listening
from muser_cli.costcurve import fit_curve
from muser_cli.errors import DataError, MuserError
from muser_cli.kvpack import HeaderEvent, PackReader
from muser_cli.kvpack.reader import read_step
from muser_cli.model.tokens import decode_text

PATHS = ("local", "push", "store", "delta", "pull")


@dataclass
class Ran:
    """One finished process: exit status, stdout, stderr, wall seconds, peak RSS in bytes."""
    rc: int
    out: bytes
    err: bytes
    wall: float
    rss: int

    def json(self) -> dict[str, Any]:
        try:
            return json.loads(self.out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError, UnicodeDecodeError):
            raise DataError(f"bench depth: not one JSON object: {self.out[-300:]!r}") from None


# A process forked from this one starts with this process's peak RSS as its own (Linux keeps
# the high-water mark across fork and exec), so each command runs under a small Python that
# reports its child's peak: the figure then starts from that wrapper's few MB, not ours.
_PEAK = ("import resource, subprocess, sys\n"
         "rc = subprocess.call(sys.argv[2:])\n"
         "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
         "sys.exit(rc)")


def peak_rss_argv(argv: list[str], rss_file: Path) -> list[str]:
    """``argv`` run under the wrapper that writes its peak RSS (KiB) to ``rss_file``."""
    return [sys.executable, "-c", _PEAK, str(rss_file), *argv]


#: The longest any one command may take (a hang ends the bench, it does not stall it).
HANG_S = 4 * 3600.0


def kill_group(proc: subprocess.Popen) -> None:
    """End ``proc`` and its child (the wrapper and the command it runs: one process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
    proc.wait()


def reap(proc: subprocess.Popen, t0: float, out, err, rss_file: Path, what: str) -> Ran:
    """Wait for ``proc`` (under :func:`peak_rss_argv`) and read what it wrote."""
    try:
        proc.wait(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise MuserError(f"bench depth: {what} did not end within {HANG_S:.0f} s") from None
    wall = time.perf_counter() - t0
    out.seek(0)
    got = Ran(proc.returncode, out.read(), b"", wall, 0)
    if err is not None:
        err.seek(0)
        got.err = err.read()
    if got.rc:
        raise MuserError(f"bench depth: {what} exited {got.rc}: {got.err.decode(errors='replace')[-600:]}")
    got.rss = int(rss_file.read_text()) * 1024
    rss_file.unlink()
    return got


def run_one(argv: list[str], env: dict[str, str], what: str, rss_file: Path) -> Ran:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(peak_rss_argv(argv, rss_file), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err, start_new_session=True)
        try:
            return reap(proc, t0, out, err, rss_file, what)
        finally:
            kill_group(proc)  # on any way out (an interrupt included), nothing of it left running


def _header(path: Path):
    """A kvpack's header, read and checked without its payload."""
    reader = PackReader()
    with open(path, "rb") as f:
        while len(chunk := read_step(f, reader)):
            for ev in reader.feed(chunk, owned=True):
                if isinstance(ev, HeaderEvent):
                    return ev.header
    raise DataError(f"bench depth: {path} ended before its header")


def delta_bytes(path: Path) -> tuple[int, int, int]:
    """What a delta of rows [held, end) carries (its KV in the header's dtype), and the least it
    must carry, two ways:
    every layer's new rows (a consumer whose stored layers hold every row they computed, the
    sliding history included, needs no more), and docs/benchmarking.md's rule, new
    full-attention rows + each sliding layer's whole ring (``min(end, window - 1)`` rows: what a
    consumer that keeps only the rings needs). A state layer counts as the snapshot it carries."""
    h = _header(path)
    held, end = h.rows_start, h.rows_end
    every = ring = 0
    for i, spec in enumerate(h.layers):
        if spec.kind == "state":
            every += h.layer_logical_bytes(i)
            ring += h.layer_logical_bytes(i)
            continue
        row = h.logical_row_bytes(i)
        every += row * (end - held)
        ring += row * (min(end, spec.window - 1) if spec.kind == "sliding" else end - held)
    return h.total_logical_bytes(), every, ring


class Depth:
    """The nodes, the documents and the resident producer of one depth."""

    def __init__(self, info, model: str, depth: int, work: Path, chunk: int, dtype: str) -> None:
        self.info, self.model, self.depth, self.work, self.chunk = info, model, depth, work, chunk
        self.pins = pinning(True)
        self.nodes = make_nodes(work)
        self.cons = node_env(self.nodes.consumer_home, threads=1)
        self.prod = node_env(self.nodes.producer_home, threads=1)
        self.common = ["-m", model, "--threads", "1", "--dtype", dtype, "--chunk", str(chunk)]  # --chunk last
        ids = corpus_ids(info, depth)
        self.doc, self.half = work / "doc.txt", work / "half.txt"
        self.doc.write_text(decode_text(info, ids), encoding="utf-8")
        self.half.write_text(decode_text(info, ids[: depth // 2 + 1]), encoding="utf-8")  # a pack holds prompt[:-1]
        self.server: subprocess.Popen | None = None

    def cmd(self, role: str, *args: str) -> list[str]:
        return self.pins.command(role, [*MUSER, *args])

    def consumer(self, what: str, *args: str) -> Ran:
        return run_one(self.cmd("consumer", *args), self.cons, what, self.work / "rss")

    def producer(self, what: str, *args: str) -> Ran:
        return run_one(self.cmd("producer", *args), self.prod, what, self.work / "rss")

    def ship(self, pack: Path, got: Path) -> tuple[Ran, Ran, Path]:
        """``send PACK`` (producer) to a ``receive --listen --once -o GOT`` process (consumer):
        (send, receive, the kvpack receive published)."""
        with tempfile.TemporaryFile() as rout:
            t0 = time.perf_counter()
            recv = subprocess.Popen(peak_rss_argv(self.cmd("consumer", "receive", "--listen", "127.0.0.1:0", "--once",
                                                           "--timeout", "3600", "-o", str(got), "--json"),
                                                  self.work / "recv.rss"), env=self.cons,
                                    stdin=subprocess.DEVNULL, stdout=rout, stderr=subprocess.PIPE,
                                    start_new_session=True)
            try:
                addr = wait_listening(recv, "bench depth (receive)", timeout=300)
                drain_in_background(recv)
                snd = self.producer("send", "send", str(pack), "--to", addr, "--json")
                rc = reap(recv, t0, rout, None, self.work / "recv.rss", "receive")
            finally:
                kill_group(recv)  # the wrapper and the receiver under it
        files = [p for p in got.iterdir() if p.suffix == ".kvpack"]
        if len(files) != 1:
            raise MuserError(f"bench depth: receive wrote {len(files)} kvpacks")
        return snd, rc, files[0]

    def clear_store(self) -> None:
        shutil.rmtree(self.nodes.consumer_home / "data" / "store", ignore_errors=True)

    def decode(self, what: str, *args: str, env: dict[str, str] | None = None) -> tuple[dict, Ran]:
        r = run_one(self.cmd("consumer", "decode", *self.common, "-n", "1", "--json", *args), env or self.cons, what,
                    self.work / "rss")
        return r.json(), r

    # ------------------------------------------------------------------ the paths
    def local(self) -> dict:
        self.clear_store()
        d, r = self.decode("local decode", "--prompt", str(self.doc), "--no-reuse")
        return {"ttft": d["ttft_s"], "first_token_s": d["first_token_s"], "rss": r.rss, "token": d["token_ids"][0],
                "source": d["source"], "prompt_tokens": d["prompt_tokens"]}

    def push(self) -> dict:
        pack, got = self.work / "pack.kvpack", self.work / "got"
        for p in (pack, got):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        got.mkdir()
        pre = self.producer("prefill", "prefill", *self.common, str(self.doc), "-o", str(pack), "--json")
        pj = pre.json()
        snd, rc, received = self.ship(pack, got)
        ver = self.consumer("verify", "verify", "-m", self.model, str(received), "--json")
        vj = ver.json()
        if not vj.get("ok"):
            raise DataError(f"bench depth: the received pack failed verify: {vj}")
        self.clear_store()
        d, dec = self.decode("decode (ready pack)", str(received))
        self.received = received
        sj, rj = snd.json(), rc.json()
        return {"ttft": d["ttft_s"], "first_token_s": d["first_token_s"], "token": d["token_ids"][0],
                "source": d["source"], "pack_bytes": pack.stat().st_size, "kv_bytes": vj["summary"]["kv_bytes"],
                "rows": pj["rows"], "prefill_s": pj["prefill_s"], "send_s": snd.wall, "send_json": sj,
                "receive_json": rj, "verify_s": vj["seconds"], "install_s": d["engine_stats"].get("install_s"),
                "rss": {"prefill": pre.rss, "send": snd.rss, "receive": rc.rss, "verify": ver.rss, "decode": dec.rss}}

    def store(self) -> dict:
        self.clear_store()
        self.consumer("reuse put", "reuse", "put", "-m", self.model, str(self.received), "--json")
        d, r = self.decode("decode (warm store)", "--prompt", str(self.doc))
        return {"ttft": d["ttft_s"], "first_token_s": d["first_token_s"], "rss": r.rss, "token": d["token_ids"][0],
                "source": d["source"], "computed_tokens": (d.get("reuse") or {}).get("computed_tokens")}

    def delta(self) -> dict:
        self.clear_store()
        self.consumer("prefill (the held half)", "prefill", *self.common, str(self.half), "--store", "-o", os.devnull)
        have, delta = self.work / "have.json", self.work / "delta.kvpack"
        self.consumer("reuse have", "reuse", "have", "-m", self.model, str(self.doc), "-o", str(have))
        held = json.loads(have.read_text())["held_tokens"]
        pre = self.producer("prefill (delta)", "prefill", *self.common, str(self.doc), "--have", str(have), "-o",
                            str(delta), "--json")
        d, r = self.decode("decode (delta)", str(delta))  # decode verifies it (and merges its base)
        kv, minimum, ring = delta_bytes(delta)
        return {"ttft": d["ttft_s"], "first_token_s": d["first_token_s"], "rss": r.rss, "token": d["token_ids"][0],
                "source": d["source"], "held_tokens": held, "pack_bytes": delta.stat().st_size, "kv_bytes": kv,
                "minimum_bytes": minimum, "kv_over_minimum": kv / minimum if minimum else None,
                "pack_over_minimum": delta.stat().st_size / minimum if minimum else None,
                "ring_minimum_bytes": ring, "kv_over_ring_minimum": kv / ring if ring else None,
                "producer_s": pre.json()["prefill_s"]}

    def start_producer(self) -> str:
        self.server = subprocess.Popen(self.cmd("producer", "prefill", "--serve", "127.0.0.1:0", "--json",
                                                *self.common[:-2]), env=self.prod, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.addr = wait_listening(self.server, "bench depth (producer)", timeout=1800)
        drain_in_background(self.server)
        return self.addr

    def pull(self) -> dict:
        """A producer started for this request (listening: loaded, calibrated), so that it holds
        none of the document's rows: a resident producer keeps what it computed, and the same
        document asked again would measure its memory, not the lane."""
        self.clear_store()
        self.stop()
        self.start_producer()
        d, r = self.decode("decode --producer", "--prompt", str(self.doc), "--no-reuse", "--producer", self.addr,
                           env={**self.cons, "MUSER_ROUTE": "producer"})
        # its ttft_s counts from the first byte of the stream; the lane's TTFT counts from the
        # request, so this path's figure is the whole process's (start and load included)
        return {"ttft": d["first_token_s"], "first_token_s": d["first_token_s"], "rss": r.rss,
                "token": d["token_ids"][0], "source": d["source"]}

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()


def _one_depth(info, model: str, depth: int, reps: int, chunk: int, dtype: str, progress: Progress) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"muser-bench-depth-{depth}-"))
    lane = None
    got: dict[str, list[dict]] = {p: [] for p in PATHS}
    try:
        lane = Depth(info, model, depth, work, chunk, dtype)
        for rnd in range(reps + 1):
            progress(f"depth {depth}: " + ("warm-up" if rnd == 0 else f"rep {rnd}/{reps}"))
            r = {"local": lane.local(), "push": lane.push()}
            r["store"] = lane.store()
            r["delta"] = lane.delta()
            r["pull"] = lane.pull()
            firsts = {p: x["token"] for p, x in r.items()}
            if len(set(firsts.values())) != 1:
                raise DataError(f"depth {depth}, round {rnd}: the paths decoded different first tokens: {firsts}")
            if rnd:
                for p in PATHS:
                    got[p].append(r[p])
    finally:
        if lane is not None:
            lane.stop()
        shutil.rmtree(work, ignore_errors=True)
    return _row(depth, got)


def _row(depth: int, got: dict[str, list[dict]]) -> dict[str, Any]:
    def s(path: str, key: str) -> dict:
        return summarize([x[key] for x in got[path]])

    push = got["push"]
    row: dict[str, Any] = {"depth": depth, "prompt_tokens": got["local"][0]["prompt_tokens"],
                           "sources": {p: sorted({x["source"] for x in got[p]}) for p in PATHS}}
    for p in PATHS:
        row[p] = {"ttft": s(p, "ttft"), "first_token_s": s(p, "first_token_s")}
    row["local"]["rss"] = s("local", "rss")
    row["store"]["rss"] = s("store", "rss")
    row["store"]["computed_tokens"] = got["store"][0]["computed_tokens"]
    row["pull"]["rss"] = s("pull", "rss")
    row["push"].update({"pack_bytes": push[0]["pack_bytes"], "kv_bytes": push[0]["kv_bytes"], "rows": push[0]["rows"],
                        "prefill_s": s("push", "prefill_s"), "send_s": s("push", "send_s"),
                        "verify_s": s("push", "verify_s"),
                        "rss": {k: summarize([x["rss"][k] for x in push]) for k in push[0]["rss"]},
                        "send_json": push[-1]["send_json"], "receive_json": push[-1]["receive_json"]})
    d = got["delta"]
    row["delta"].update({k: d[0][k] for k in ("held_tokens", "pack_bytes", "kv_bytes", "minimum_bytes",
                                              "kv_over_minimum", "pack_over_minimum", "ring_minimum_bytes",
                                              "kv_over_ring_minimum")})
    row["delta"]["rss"] = s("delta", "rss")
    row["delta"]["producer_s"] = s("delta", "producer_s")
    loc = row["local"]["ttft"]["median"]
    row["store_over_local"] = row["store"]["ttft"]["median"] / loc if loc else None
    # the live lane's exposed overhead: its whole-process TTFT over (the consumer's start and
    # load, as the local path paid them) + (the producer's prefill, as the push path timed it)
    pre = row["push"]["prefill_s"]["median"]
    start = row["local"]["first_token_s"]["median"] - loc
    row["consumer_start_s"] = start
    row["pull_exposed"] = (row["pull"]["ttft"]["median"] - start - pre) / pre if pre else None
    return row


def fit(rows: Sequence[dict]) -> dict[str, float] | None:
    """Local TTFT = fixed + token_s * n + depth_s * n^2 / 2 over the depths (least squares,
    relative error, coefficients non-negative: :func:`muser_cli.costcurve.fit_curve`)."""
    obs = [(0, r["prompt_tokens"], r["local"]["ttft"]["median"]) for r in rows]
    if len(obs) < 3:
        return None
    fixed, token_s, depth_s = fit_curve(obs)
    return {"fixed_s": fixed, "token_s": token_s, "depth_s": depth_s,
            "residuals": [t - (fixed + token_s * n + depth_s * n * n / 2) for _, n, t in obs]}


def run_depth(info, model: str, depths: Sequence[int], *, reps: int = 3, chunk: int = 4096, dtype: str = "float32",
              progress: Progress = no_progress) -> BenchResult:
    rows = [_one_depth(info, model, d, reps, chunk, dtype, progress) for d in depths]
    payload = {"what": "TTFT by depth on every path, each stage's time, bytes and peak RSS (muser bench depth)",
               "model": getattr(info, "name", model), "model_ref": model, "dtype": dtype, "chunk": chunk,
               "reps": reps, "threads": 1, "pinning": pinning(True).describe(), "rows": rows, "fit": fit(rows)}
    return BenchResult("depth", payload, depth_table(payload))


def _mb(b: float) -> str:
    return f"{b / 1e6:,.1f} MB"


def depth_table(payload: dict) -> list[str]:
    def t(st: dict) -> str:
        return f"{st['median']:.3f} s ({st['min']:.3f}–{st['max']:.3f})"

    out = ["| depth | local prefill | ready pack | store, warm | delta, half held | store ÷ local | "
           "local, whole process | pull, whole process | pull exposed |", "|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        ratio = f"1/{1 / r['store_over_local']:,.0f}" if r["store_over_local"] else "—"
        out.append(f"| {r['depth']:,} | {t(r['local']['ttft'])} | {t(r['push']['ttft'])} | {t(r['store']['ttft'])} | "
                   f"{t(r['delta']['ttft'])} | {ratio} | {t(r['local']['first_token_s'])} | "
                   f"{t(r['pull']['ttft'])} | "
                   + (f"{r['pull_exposed']:+.1%}" if r["pull_exposed"] is not None else "—") + " |")
    out += ["", "| depth | kvpack | delta kv ÷ its new rows (÷ new rows + rings) | peak RSS: prefill / send / receive / verify / decode "
            "(pack) | decode local / store / delta / pull |", "|---|---|---|---|---|"]
    for r in payload["rows"]:
        rss = r["push"]["rss"]
        over, ring = r["delta"]["kv_over_minimum"], r["delta"].get("kv_over_ring_minimum")
        out.append(f"| {r['depth']:,} | {_mb(r['push']['pack_bytes'])} | "
                   + (f"{over:.4f}" if over is not None else "—")
                   + (f" ({ring:.4f})" if ring is not None else "") + " | "
                   + " / ".join(_mb(rss[k]["median"]) for k in ("prefill", "send", "receive", "verify", "decode"))
                   + " | " + " / ".join(_mb(r[k]["rss"]["median"]) for k in ("local", "store", "delta", "pull"))
                   + " |")
    f = payload.get("fit")
    if f:
        out.append(f"\nlocal prefill TTFT ≈ {f['fixed_s']:.3f} s + {f['token_s'] * 1e6:.2f} µs·n + "
                   f"{f['depth_s'] * 1e9:.4f} ns·n²/2")
    return out
