"""``muser bench lane``: time to first token by prompt depth, local prefill against a handoff.

Per depth, after one uncounted warm-up of each lane, alternated A B (C) A B (C):

  local     the consumer prefills prompt[:-1] itself and takes the first decode step: the
            fallback lane's TTFT
  handoff   the producer prefills, writes the kvpack, signs it and sends it over mutual
            TLS 1.3 to a real ``muser receive`` process on 127.0.0.1 (which verifies every
            frame, fsyncs its replay ledger and publishes atomically); the consumer reads
            the published pack and takes the first decode step. Stop-and-wait: one phase
            after the other.
  streamed  (``live=True``) the live lane as a user runs it, whole processes:
            ``receive --once | decode -n 1 --json`` on the consumer's core (started first,
            its model loaded) and ``prefill --json | send`` on the producer's core, frames
            leaving per chunk. TTFT = consumer's first token - producer's prefill start, from
            the Unix times each process reports.
  file      (``live=True``) the same processes, stop-and-wait: ``prefill -o f && send f``, then
            ``receive --once -o in && decode in``; the consumer counted resident (its model
            load taken out).

Two machines on one host (docs/benchmarking.md): with two or more cores, the producer's
phases run on one core and the consumer's (the local baseline included) on another, one
compute thread each; the receiver process runs on the consumer's core. Every lane must
give the same first token, or the run is refused.

  overhead      = pack + send + read (seconds, and as a fraction of the producer's prefill)
  exposed       = (lane TTFT - producer prefill) / producer prefill      aim <= 1 % at 8k
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from muser_cli.bench.common import BenchResult, Pinning, Progress, corpus_ids, no_progress, pinning, summarize
from muser_cli.bench.loopback import MUSER, make_nodes, node_env, push_once, receiver, wait_listening
from muser_cli.engines.registry import get_engine
from muser_cli.errors import DataError, MuserError
from muser_cli.handoff.push.sender import prepare_handoff, transmit
from muser_cli.kvpack import read_pack, write_pack
from muser_cli.model.tokens import decode_text
from muser_cli.produce.pipeline import pack_header


def run_lane(info, depths: Sequence[int], *, reps: int = 5, dtype: str = "float32", codec: str = "none",
             threads: int | None = None, pin: bool = True, live: bool = False, model_ref: str | None = None,
             settle: float = 8.0, progress: Progress = no_progress) -> BenchResult:

    pins = pinning(pin)
    if threads is None or threads < 1:
        threads = 1 if pins.pinned else max(1, min(len(pins.original) or 1, 8))
    work = Path(tempfile.mkdtemp(prefix="muser-bench-lane-"))
    rows: list[dict[str, Any]] = []
    try:
        nodes = make_nodes(work)
        inbox = work / "inbox"
        progress("lane: loading the model")
        eng = get_engine("torch", info, dtype=dtype, threads=threads)
        with receiver(nodes, inbox, pins) as to:
            for depth in depths:
                ids = corpus_ids(info, depth)
                header = pack_header(info, ids, dtype=dtype, chunk_tokens=512, engine="torch", threads=threads)
                doc = None
                if live:
                    doc = work / f"doc-{depth}.txt"
                    doc.write_text(decode_text(info, ids), encoding="utf-8")

                def first_token(layers) -> tuple[int, float]:
                    t0 = time.perf_counter()
                    out = eng.decode(layers, rows=depth - 1, next_tokens=[ids[-1]], max_new_tokens=1,
                                     stop_on_eos=False)
                    return out.token_ids[0], time.perf_counter() - t0

                def local() -> dict[str, Any]:
                    pins.enter("consumer")
                    t0 = time.perf_counter()
                    layers = eng.prefill(ids[:-1], chunk_tokens=512)
                    t_pre = time.perf_counter() - t0
                    tok, t_first = first_token(layers)
                    return {"prefill": t_pre, "first": t_first, "ttft": t_pre + t_first, "token": tok}

                def handoff() -> dict[str, Any]:
                    pins.enter("producer")
                    t0 = time.perf_counter()
                    layers = eng.prefill(ids[:-1], chunk_tokens=512)
                    t_pre = time.perf_counter() - t0
                    src = work / "out.kvpack"
                    t1 = time.perf_counter()
                    with open(src, "wb") as f:
                        write_pack(f, header, layers, codec=codec)
                    t_pack = time.perf_counter() - t1
                    t2 = time.perf_counter()
                    prep = prepare_handoff(src, nodes.producer)
                    res = transmit(prep, to=to, identity=nodes.producer)
                    t_send = time.perf_counter() - t2
                    pins.enter("consumer")
                    got = inbox / f"{prep.header.handoff_id}.kvpack"
                    t3 = time.perf_counter()
                    with open(got, "rb") as f:
                        pack = read_pack(f)
                    t_read = time.perf_counter() - t3
                    tok, t_first = first_token(pack.layers)
                    got.unlink()
                    overhead = t_pack + t_send + t_read
                    return {"prefill": t_pre, "pack": t_pack, "send": t_send, "read": t_read, "first": t_first,
                            "ttft": t_pre + overhead + t_first, "consumer_ttft": t_read + t_first,
                            "overhead": overhead, "overhead_frac": overhead / t_pre if t_pre else None,
                            "bytes": res.payload_bytes, "payload_rate_Bps": res.payload_rate_Bps,
                            "ack_wait": res.ack_wait_s, "token": tok}

                def streamed() -> dict[str, Any]:
                    return streamed_lane(doc, nodes, pins, model_ref or str(info.path), dtype, settle, threads)

                def file() -> dict[str, Any]:
                    return file_lane(doc, nodes, pins, model_ref or str(info.path), dtype, work, threads)

                lanes = {"local": local, "handoff": handoff}
                if live:
                    lanes["streamed"] = streamed
                    lanes["file"] = file
                got: dict[str, list[dict[str, Any]]] = {k: [] for k in lanes}
                for rnd in range(reps + 1):  # round 0 warms up; then A B (C) A B (C)
                    progress(f"lane {depth} tok: " + ("warm-up" if rnd == 0 else f"rep {rnd}/{reps}"))
                    for name, fn in lanes.items():
                        r = fn()
                        if rnd:
                            got[name].append(r)
                pins.release()
                tokens = {r["token"] for rs in got.values() for r in rs}
                if len(tokens) != 1:
                    raise DataError(f"the lanes disagree on the first token at {depth} tokens: {sorted(tokens)}")

                def s(rs: list[dict[str, Any]], key: str) -> dict[str, Any]:
                    return summarize([r[key] for r in rs if r.get(key) is not None])

                row: dict[str, Any] = {
                    "depth": depth, "bytes": got["handoff"][0]["bytes"], "token": tokens.pop(),
                    "prompt_digest": header.token_digest,  # the prompt is the docs: it changes with them
                    "local": {k: s(got["local"], k) for k in ("prefill", "first", "ttft")},
                    "handoff": {k: s(got["handoff"], k) for k in (
                        "prefill", "pack", "send", "read", "first", "ttft", "consumer_ttft", "overhead",
                        "overhead_frac", "payload_rate_Bps", "ack_wait")},
                }
                loc = row["local"]["ttft"]["reps"]
                row["handoff_over_local"] = summarize([h / l for h, l in zip(row["handoff"]["ttft"]["reps"], loc)])
                if live:
                    row["streamed"] = {k: s(got["streamed"], k) for k in (
                        "prefill", "ttft", "exposed", "tail", "first_frame_after_start", "consumer_ttft")}
                    row["streamed_over_local"] = summarize(
                        [a / b for a, b in zip(row["streamed"]["ttft"]["reps"], loc)])
                    row["file"] = {k: s(got["file"], k) for k in ("prefill", "ttft", "exposed", "consumer_ttft")}
                rows.append(row)
    finally:
        pins.release()
        shutil.rmtree(work, ignore_errors=True)
    payload = {"model": info.name, "fingerprint": info.fingerprint, "dtype": dtype, "codec": codec,
               "threads": threads, "pinning": pins.describe(), "reps": reps, "warmup": 1,
               "link": "loopback mutual TLS 1.3 (Handoff V3), receiver a separate muser receive process",
               "lanes": ["local", "handoff"] + (["streamed", "file"] if live else []),
               "settle_s": settle if live else None, "rows": rows}
    return BenchResult("lane", payload, lane_table(rows))


def _last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    raise MuserError(f"bench lane: no JSON from a lane process: {text[-300:]}")


def streamed_lane(doc: Path, nodes, pins: Pinning, model: str, dtype: str, settle: float,
                  threads: int = 1) -> dict[str, Any]:
    """One run of the live lane: consumer pipeline first (resident), then the producer's."""

    receive = [*MUSER, "receive", "--listen", "127.0.0.1:0", "--once", "--timeout", "600"]
    got = push_once(pins.command("consumer", receive),
                    pins.command("consumer", [*MUSER, "decode", "-m", model, "-n", "1", "--json", "--dtype", dtype,
                                              "--threads", str(threads)]),
                    pins.command("producer", [*MUSER, "prefill", "-m", model, str(doc), "--threads", str(threads),
                                              "--dtype", dtype, "--json"]),
                    lambda addr: pins.command("producer", [*MUSER, "send", "--to", addr, "--json"]),
                    cons_env=node_env(nodes.consumer_home, threads=threads),
                    prod_env=node_env(nodes.producer_home, threads=threads), settle=settle,
                    what="bench lane (streamed)", keep_prefill_err=True)  # settle: the consumer is resident
    if got.failed:
        raise MuserError(f"bench lane: the streamed lane failed (prefill {got.prefill}, send {got.send}, "
                         f"decode {got.decode}): {got.err.decode(errors='replace')[-300:].strip()}")
    p, d = _last_json(got.prefill_err), json.loads(got.out)
    start = p["started_unix"] + p["prefill_start_s"]
    ttft = d["started_unix"] + d["first_token_s"] - start
    return {"prefill": p["prefill_s"], "ttft": ttft, "exposed": (ttft - p["prefill_s"]) / p["prefill_s"],
            "tail": d.get("tail_s"), "first_frame_after_start": (p["first_frame_s"] - p["prefill_start_s"])
            if p.get("first_frame_s") is not None else None,
            "consumer_ttft": d["ttft_s"], "token": d["token_ids"][0], "tokens": d["prompt_tokens"],
            "bytes": p["bytes"]}


def file_lane(doc: Path, nodes, pins: Pinning, model: str, dtype: str, work: Path,
              threads: int = 1) -> dict[str, Any]:
    """One run of the stop-and-wait file lane, whole processes: ``prefill -o f && send f`` on the
    producer's core, ``receive --once -o in.kvpack && decode in.kvpack`` on the consumer's. The
    consumer is counted as resident: its decode starts when receive exits, its model load is
    taken out (TTFT = receive's exit + decode's ttft_s - the producer's prefill start)."""

    cons, prod = node_env(nodes.consumer_home, threads=threads), node_env(nodes.producer_home, threads=threads)
    inbox, out = work / "in.kvpack", work / "out.kvpack"
    inbox.unlink(missing_ok=True)
    recv = subprocess.Popen(pins.command("consumer", [*MUSER, "receive", "--listen", "127.0.0.1:0", "--once",
                                                      "--timeout", "600", "-o", str(inbox)]),
                            env=cons, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        addr = wait_listening(recv, "bench lane (file)")
        pre = subprocess.run(pins.command("producer", [*MUSER, "prefill", "-m", model, str(doc), "--threads",
                                                       str(threads), "--dtype", dtype, "-o", str(out), "--json"]),
                             env=prod, stdin=subprocess.DEVNULL, capture_output=True)
        snd = subprocess.run(pins.command("producer", [*MUSER, "send", str(out), "--to", addr]), env=prod,
                             stdin=subprocess.DEVNULL, capture_output=True)
        recv.wait(timeout=600)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    t_received = time.time()
    dec = subprocess.run(pins.command("consumer", [*MUSER, "decode", str(inbox), "-m", model, "-n", "1", "--json",
                                                   "--threads", str(threads)]),
                         env=cons, stdin=subprocess.DEVNULL, capture_output=True)
    if pre.returncode or snd.returncode or dec.returncode or recv.returncode:
        raise MuserError(f"bench lane: the file lane failed (prefill {pre.returncode}, send {snd.returncode}, "
                         f"receive {recv.returncode}, decode {dec.returncode}): "
                         f"{(pre.stderr + snd.stderr + dec.stderr).decode(errors='replace')[-300:].strip()}")
    p, d = json.loads(pre.stdout), json.loads(dec.stdout)
    start = p["started_unix"] + p["prefill_start_s"]
    ttft = t_received + d["ttft_s"] - start
    return {"prefill": p["prefill_s"], "ttft": ttft, "exposed": (ttft - p["prefill_s"]) / p["prefill_s"],
            "consumer_ttft": d["ttft_s"], "token": d["token_ids"][0], "tokens": d["prompt_tokens"],
            "bytes": p["bytes"]}


def _t(stats: dict) -> str:
    """A median time with its CV, in ms below 10 s, else in s."""
    m = stats["median"]
    value = f"{m * 1e3:8.1f} ms" if m < 10 else f"{m:8.2f} s "
    return f"{value} cv {stats['cv']:>5.1%}"


def lane_table(rows: list[dict]) -> list[str]:
    live = any("streamed" in r for r in rows)
    head = f"{'depth':>6} | {'kvpack':>9} | {'local TTFT':>20} | {'handoff TTFT':>20} | {'overhead':>22}"
    if live:
        head += f" | {'streamed TTFT':>20} | {'exposed':>8} | {'file lane TTFT':>20} | {'exposed':>8}"
    out = [head]
    for r in rows:
        lo, h = r["local"], r["handoff"]
        line = (f"{r['depth']:>6} | {r['bytes'] / 1e6:>6.2f} MB | {_t(lo['ttft'])} | {_t(h['ttft'])} | "
                f"{h['overhead']['median'] * 1e3:>8.1f} ms = {h['overhead_frac']['median']:>7.2%}")
        if live:
            st, fl = r["streamed"], r["file"]
            line += (f" | {_t(st['ttft'])} | {st['exposed']['median']:>+8.2%} | {_t(fl['ttft'])} | "
                     f"{fl['exposed']['median']:>+8.2%}")
        out.append(line)
    return out
