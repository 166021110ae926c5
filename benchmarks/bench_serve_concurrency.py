"""One engine, many clients (issue 37, "Measure"): ``muser decode --serve`` on the MLX and the
torch engine against ``mlx_lm.server``, driven by N concurrent streaming clients.

    .venv/bin/python benchmarks/bench_serve_concurrency.py [--clients 1,4,8] [--reps 3]
        [--servers muser-mlx,muser-torch,mlx-lm] [--baseline-clients 8] [--baseline-engines mlx,torch]
        [--prompt-tokens 256] [--max-tokens 64]
    .venv/bin/python benchmarks/bench_serve_concurrency.py --quick     # a tiny random model, 2 clients, 8 tokens

Servers, each started on the same model folder (the embedded SmolLM2-135M unless ``--model``),
on the same core, one compute thread, one after another:

  muser-mlx     muser decode --serve 127.0.0.1:0 --engine mlx   --max-batch N --no-reuse
  muser-torch   muser decode --serve 127.0.0.1:0 --engine torch --max-batch N --no-reuse
  muser-mlx-exact, muser-torch-exact   the same with --exact (each request decoded alone, in turns)
  mlx-lm        python -m mlx_lm.server --model FOLDER --port P --decode-concurrency N --prompt-concurrency N
  baseline      muser decode --serve ... --max-batch 1 (the old one-request-at-a-time server),
                at --baseline-clients clients only

N is the largest client count. The client is this process: ``c`` threads, each with the real
``openai`` client, released together; each sends one streamed ``/v1/completions`` request
(a distinct ~``--prompt-tokens``-token slice of the project's docs, ``--max-tokens`` out,
temperature 0, usage on the last chunk). The same prompts go to every server (prompt k of
rep r at c clients); no prompt is sent twice to one server, so no prompt cache helps.
Measured per run of ``c`` clients, from the release:

  aggregate tok/s   completion tokens of all requests / wall time (release -> last token)
  TTFT p50 / p90    release -> first content chunk, over the run's requests
  ITL p50           per request (last chunk - first chunk) / (tokens - 1), median over requests
  wall              release -> last request done

``--client aiperf`` runs the same runs with NVIDIA's AIPerf instead (``aiperf profile``, in a
venv of its own: ``python -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf``):
synthetic prompts of exactly ``--prompt-tokens`` tokens of the model's tokenizer, one seed per
(rep, c) shared by every server, its own TTFT, ITL (per request (latency - TTFT) / (tokens - 1))
and output token throughput.

One uncounted warm-up request per server start. ``--reps`` repetitions, each starting every
server afresh in the same order (A B C A B C); each figure is the median over reps with its
spread. Server on one core, client on another (``taskset``), when two are allowed. The receipt
(benchmarks/results/serve-concurrency-*.json, rewritten after every rep) keeps every request.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import RESULTS, run, stderr, summarize

from muser_cli.bench.common import (BenchResult, allowed_cpus, corpus_ids, parse_ints, quantile, receipt_path,
                                    write_receipt)

SERVERS = ("muser-mlx", "muser-torch", "mlx-lm", "muser-mlx-exact", "muser-torch-exact")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process on the server core; ``url`` is its ``/v1`` base; ``stop()`` ends it."""

    def __init__(self, kind: str, model: Path, *, max_batch: int, max_queue: int, max_tokens: int,
                 server_cpu: int | None, work: Path, threads: int = 1) -> None:
        from muser_cli.bench.agent import _wait_health, wait_url
        from muser_cli.bench.loopback import MUSER
        from muser_cli.engines.mlx.blas import preload_env

        self.kind = kind
        taskset = ["taskset", "-c", str(server_cpu)] if server_cpu is not None and shutil.which("taskset") else []
        n = str(threads)  # compute threads (1: one core, as the servers here are pinned)
        threads = {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n,
                   "MUSER_THREADS": n, "PYTHONUNBUFFERED": "1"}
        self.log = work / f"{kind}-{time.monotonic_ns()}.log"
        if kind.startswith("muser-"):
            engine = kind.split("-")[1]
            home = work / f"home-{kind}-{time.monotonic_ns()}"
            home.mkdir(parents=True)
            self.argv = [*MUSER, "decode", "--serve", "127.0.0.1:0", "--engine", engine, "--max-batch", str(max_batch),
                         "--max-queue", str(max_queue), "--no-reuse", "-m", str(model), "--threads", "1",
                         "-n", str(max_tokens)] + (["--exact"] if kind.endswith("-exact") else [])
            env = dict(os.environ, MUSER_HOME=str(home), **threads)
            self.proc = subprocess.Popen([*taskset, *self.argv], env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self.url = wait_url(self.proc, kind)
            self.model_name = "default"
        elif kind == "mlx-lm":
            port = _free_port()
            self.argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--host", "127.0.0.1",
                         "--port", str(port), "--decode-concurrency", str(max_batch), "--prompt-concurrency",
                         str(max_batch), "--max-tokens", str(max_tokens), "--log-level", "WARNING"]
            # the BLAS muser's MLX engine loads in-process (MKL), preloaded: mlx[cpu]'s bundled
            # reference BLAS would make mlx-lm many times slower than it is with a real one
            env = preload_env(dict(os.environ, **threads))
            self._log_file = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
            self.proc = subprocess.Popen([*taskset, *self.argv], env=env, stdin=subprocess.DEVNULL,
                                         stdout=self._log_file, stderr=subprocess.STDOUT)
            _wait_health(f"http://127.0.0.1:{port}/health", self.proc, timeout=600)
            self.url = f"http://127.0.0.1:{port}/v1"
            self.model_name = str(model)
        else:
            raise SystemExit(f"unknown server {kind!r}: one of {', '.join(SERVERS)}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if hasattr(self, "_log_file"):
            self._log_file.close()


def one_request(client, model: str, prompt: str, max_tokens: int, release: float) -> dict:
    """One streamed completion; times from ``release`` (the moment every client was let go)."""
    chunks: list[float] = []
    usage = None
    text: list[str] = []
    error = None
    try:
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                chunks.append(time.perf_counter() - release)
                text.append(chunk.choices[0].text)
            if getattr(chunk, "usage", None):
                usage = chunk.usage
    except Exception as exc:  # the receipt says which request failed and how
        error = f"{type(exc).__name__}: {exc}"
    done = time.perf_counter() - release
    tokens = usage.completion_tokens if usage else len(chunks)
    out = {"ttft_s": chunks[0] if chunks else None, "done_s": done, "tokens": tokens, "chunks": len(chunks),
           "prompt_tokens": usage.prompt_tokens if usage else None, "chars": len("".join(text)),
           "max_gap_s": max((b - a for a, b in zip(chunks, chunks[1:])), default=None)}
    out["itl_s"] = (chunks[-1] - chunks[0]) / (tokens - 1) if len(chunks) > 1 and tokens > 1 else None
    if error:
        out["error"] = error
    return out


def run_clients(server: Server, prompts: list[str], max_tokens: int) -> dict:
    """``len(prompts)`` clients released together, one request each; the run's figures."""
    import openai

    n = len(prompts)
    clients = [openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=1800) for _ in range(n)]
    results: list[dict | None] = [None] * n
    barrier = threading.Barrier(n + 1)
    release = [0.0]

    def client(i: int) -> None:
        barrier.wait()
        results[i] = one_request(clients[i], server.model_name, prompts[i], max_tokens, release[0])

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    release[0] = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    reqs = [r for r in results if r is not None]
    ok = [r for r in reqs if "error" not in r and r["ttft_s"] is not None]
    wall = max(r["done_s"] for r in reqs)
    total = sum(r["tokens"] for r in ok)
    itls = [r["itl_s"] for r in ok if r["itl_s"] is not None]
    ttfts = [r["ttft_s"] for r in ok]
    return {"clients": n, "wall_s": wall, "tokens": total, "agg_tok_s": total / wall if wall else None,
            "ttft_p50_s": quantile(ttfts, 0.5) if ttfts else None, "ttft_p90_s": quantile(ttfts, 0.9) if ttfts else None,
            "itl_p50_s": statistics.median(itls) if itls else None, "errors": len(reqs) - len(ok),
            "short": sum(1 for r in ok if r["tokens"] < max_tokens), "requests": reqs}


AIPERF = Path("/tmp/aiperf-venv/bin/aiperf")


def run_aiperf(server: Server, aiperf: str, c: int, *, seed: int, tokenizer: Path, prompt_tokens: int,
               max_tokens: int, out: Path) -> dict:
    """The same run by NVIDIA's AIPerf (``aiperf profile``): ``c`` concurrent streamed completions,
    one each, synthetic prompts of exactly ``prompt_tokens`` tokens of the model's own tokenizer
    (``seed`` makes them; the same seed gives every server the same prompts), temperature 0,
    server-reported token counts; no server-metrics scraping (it would load the server)."""
    import json

    argv = [aiperf, "profile", "-m", server.model_name, "--url", server.url.removesuffix("/v1"),
            "--endpoint-type", "completions", "--streaming", "--concurrency", str(c), "--request-count", str(c),
            "--synthetic-input-tokens-mean", str(prompt_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(max_tokens), "--output-tokens-stddev", "0",
            "--extra-inputs", "temperature:0", "--tokenizer", str(tokenizer), "--use-server-token-count",
            "--random-seed", str(seed), "--no-server-metrics", "--no-gpu-telemetry", "--ui", "none",
            "--workers-max", "1", "--output-artifact-dir", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=3600)
    summary = out / "profile_export_aiperf.json"
    if done.returncode != 0 or not summary.exists():
        raise RuntimeError(f"aiperf exited {done.returncode}: {(done.stdout + done.stderr)[-600:]}")
    agg = json.loads(summary.read_text())
    reqs = []
    for line in (out / "profile_export.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("metadata", {}).get("benchmark_phase") != "profiling":
            continue
        m = {k: v.get("value") for k, v in (rec.get("metrics") or {}).items() if isinstance(v, dict)}
        ms = (lambda k: m[k] / 1000 if m.get(k) is not None else None)
        reqs.append({"ttft_s": ms("time_to_first_token"), "done_s": ms("request_latency"),
                     "tokens": m.get("output_sequence_length"), "prompt_tokens": m.get("input_sequence_length"),
                     "itl_s": ms("inter_token_latency"),
                     "max_gap_s": max(m.get("inter_chunk_latency") or [0.0]) / 1000,
                     **({"error": str(rec["error"])[:300]} if rec.get("error") else {})})
    get = (lambda k, q: agg[k][q] / 1000 if k in agg and agg[k].get(q) is not None else None)
    wall = agg["benchmark_duration"]["avg"]
    tokens = agg.get("total_output_tokens", {}).get("avg")
    return {"clients": c, "wall_s": wall, "tokens": tokens, "agg_tok_s": agg["output_token_throughput"]["avg"],
            "ttft_p50_s": get("time_to_first_token", "p50"), "ttft_p90_s": get("time_to_first_token", "p90"),
            "itl_p50_s": get("inter_token_latency", "p50"), "errors": sum(1 for r in reqs if "error" in r),
            "short": sum(1 for r in reqs if (r["tokens"] or 0) < max_tokens), "seed": seed,
            "aiperf_version": agg.get("aiperf_version"), "requests": reqs}


def make_prompts(info, n_tokens: int, count: int) -> list[str]:
    """``count`` distinct, non-overlapping ~``n_tokens``-token slices of the project's docs. A slice
    of byte-level tokens can cut a character in two: the half is dropped (a prompt ending in half
    a character made every server answer with undecodable bytes that the streaming detokenizers
    hold back to the end, so that request's first visible text came with its last token)."""
    from muser_cli.model.tokens import decode_text

    ids = corpus_ids(info, n_tokens * count + 4096)[4096:]  # skip the first page (also every warm-up's source)
    return [decode_text(info, ids[k * n_tokens:(k + 1) * n_tokens]).strip("\ufffd") for k in range(count)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--servers", default="muser-mlx,muser-torch,mlx-lm", help="any of " + ", ".join(SERVERS))
    ap.add_argument("--baseline-clients", type=int, default=8, help="clients for the --max-batch 1 baseline (0: none)")
    ap.add_argument("--baseline-engines", default="mlx,torch")
    ap.add_argument("--max-batch", type=int, default=0, help="default: the largest client count")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny random Llama, 2 clients, 8 tokens, 32-token prompts, muser-mlx only, 1 rep, "
                         "receipt in a temporary folder")
    ap.add_argument("--receipt-dir", default=None)
    ap.add_argument("--client", choices=("openai", "aiperf"), default="openai",
                    help="the load generator: this process's threads with the openai client, or AIPerf")
    ap.add_argument("--aiperf", default=str(AIPERF), help="the aiperf executable (its own venv)")
    args = ap.parse_args()

    from muser_cli.model.resolve import resolve_model

    work = Path(tempfile.mkdtemp(prefix="muser-bench-serve-"))
    if args.quick:
        from muser_cli.model.tiny import make_tiny_llama

        args.clients, args.max_tokens, args.prompt_tokens, args.reps = "2", 8, 32, 1
        args.servers = args.servers if args.servers != "muser-mlx,muser-torch,mlx-lm" else "muser-mlx"
        args.baseline_clients = 0 if args.baseline_clients == 8 else args.baseline_clients
        args.model = str(make_tiny_llama(work / "tiny-llama"))
        args.receipt_dir = args.receipt_dir or tempfile.mkdtemp(prefix="muser-bench-serve-quick-")
    info = resolve_model(args.model)
    model = Path(info.path)
    clients = parse_ints(args.clients, what="--clients")
    servers = [s for s in args.servers.split(",") if s]
    for s in servers:
        if s not in SERVERS:
            raise SystemExit(f"--servers: unknown {s!r} (one of {', '.join(SERVERS)})")
    base_engines = [e for e in args.baseline_engines.split(",") if e] if args.baseline_clients else []
    n_batch = args.max_batch or max(clients)

    cpus = allowed_cpus()
    server_cpu = client_cpu = None
    if not args.no_pin and len(cpus) >= 2 and hasattr(os, "sched_setaffinity"):
        client_cpu, server_cpu = cpus[0], cpus[1]
        os.sched_setaffinity(0, {client_cpu})  # this process and every client thread it starts
    pin_text = (f"server taskset -c {server_cpu}, client (this process) on cpu {client_cpu}"
                if server_cpu is not None else "not pinned")
    stderr(f"model {model} ({info.name}); {pin_text}; clients {clients}; servers {servers}; "
           f"baseline --max-batch 1 at {args.baseline_clients} clients on {base_engines}; reps {args.reps}")

    per_rep = sum(clients) + (args.baseline_clients if base_engines else 0)
    prompts = make_prompts(info, args.prompt_tokens, args.reps * per_rep + 1)
    warm = prompts[-1]

    def rep_prompts(rep: int, c: int, base: bool = False) -> list[str]:
        start = rep * per_rep + (sum(clients) if base else sum(x for x in clients if x < c))
        return prompts[start:start + c]

    lanes = [(s, s, clients, n_batch) for s in servers]
    lanes += [(f"muser-{e}-b1", f"muser-{e}", [args.baseline_clients], 1) for e in base_engines]
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in cs} for name, _, cs, _ in lanes}
    failures: dict[str, list[str]] = {}
    path = receipt_path("serve-concurrency", args.receipt_dir or RESULTS)
    versions = {d: _version(d) for d in ("mlx", "mlx-lm", "openai", "torch", "transformers")}
    if args.client == "aiperf":
        got = subprocess.run([args.aiperf, "--version"], capture_output=True, text=True, check=False)
        versions["aiperf"] = got.stdout.strip() or None
    t_start = time.monotonic()

    def table() -> dict:
        out: dict = {}
        for name, kind_runs in runs.items():
            for c, rs in kind_runs.items():
                if rs:
                    out.setdefault(name, {})[str(c)] = {
                        k: summarize([r[k] for r in rs if r[k] is not None])
                        for k in ("agg_tok_s", "ttft_p50_s", "ttft_p90_s", "itl_p50_s", "wall_s")}
        return out

    def save(done: bool) -> Path:
        payload = {"what": "concurrent streaming clients against muser decode --serve (MLX, torch) and "
                           "mlx_lm.server on one model folder and one core", "args": vars(args),
                   "model": {"path": str(model), "name": info.name, "fingerprint": info.fingerprint},
                   "pinning": pin_text, "cpus_before_pinning": cpus, "max_batch": n_batch, "versions": versions,
                   "complete": done,
                   "elapsed_s": time.monotonic() - t_start, "table": table(), "failures": failures,
                   "runs": {name: {str(c): rs for c, rs in kr.items()} for name, kr in runs.items()}}
        return write_receipt(BenchResult("serve-concurrency", payload), path)

    try:
        for rep in range(args.reps):
            for name, kind, cs, batch in lanes:
                t0 = time.monotonic()
                server = None
                try:
                    server = Server(kind, model, max_batch=batch, max_queue=max(8, max(cs)), max_tokens=args.max_tokens,
                                    server_cpu=server_cpu, work=work)
                    run_clients(server, [warm], args.max_tokens)  # warm-up, uncounted
                    for c in cs:
                        if args.client == "aiperf":
                            seed = 1000 * (rep + 1) + c + (500 if batch == 1 else 0)
                            got = run_aiperf(server, args.aiperf, c, seed=seed, tokenizer=model,
                                             prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                                             out=work / f"aiperf-{name}-{rep}-{c}")
                        else:
                            got = run_clients(server, rep_prompts(rep, c, base=batch == 1), args.max_tokens)
                        got["rep"] = rep
                        runs[name][c].append(got)
                        stderr(f"rep {rep + 1}/{args.reps} {name:>14} c={c:<2} {got['agg_tok_s']:6.2f} tok/s  "
                               f"TTFT p50 {got['ttft_p50_s']:.2f} s p90 {got['ttft_p90_s']:.2f} s  "
                               f"ITL p50 {1000 * (got['itl_p50_s'] or 0):.0f} ms  wall {got['wall_s']:.1f} s"
                               + (f"  {got['errors']} errors" if got["errors"] else "")
                               + (f"  {got['short']} short" if got["short"] else ""))
                        if not server.alive():
                            raise RuntimeError(f"{name} exited with {server.proc.returncode}")
                except Exception as exc:  # keep the other servers' figures: the receipt says what failed
                    failures.setdefault(name, []).append(f"rep {rep}: {type(exc).__name__}: {exc}")
                    stderr(f"rep {rep + 1} {name}: FAILED {type(exc).__name__}: {exc}")
                finally:
                    if server is not None:
                        server.stop()
                stderr(f"  ({name} rep {rep + 1}: {time.monotonic() - t0:.0f} s)")
            stderr(f"receipt so far: {save(False)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    final = save(True)

    print(f"{'server':>16} {'c':>3} {'agg tok/s':>22} {'TTFT p50 s':>22} {'TTFT p90 s':>22} {'ITL p50 ms':>18} "
          f"{'wall s':>20}")
    for name, by_c in table().items():
        for c, f in by_c.items():
            def cell(k: str, scale: float = 1.0, w: int = 22) -> str:
                s = f[k]
                if s["median"] is None:
                    return f"{'-':>{w}}"
                return f"{s['median'] * scale:>8.2f} [{s['min'] * scale:.2f}-{s['max'] * scale:.2f}]".rjust(w)
            print(f"{name:>16} {c:>3} {cell('agg_tok_s')} {cell('ttft_p50_s')} {cell('ttft_p90_s')} "
                  f"{cell('itl_p50_s', 1000, 18)} {cell('wall_s', 1, 20)}")
    for name, why in failures.items():
        print(f"{name}: {len(why)} failure(s): {why[0]}")
    print(f"receipt: {final}")
    return 1 if failures else 0


if __name__ == "__main__":
    run(main)
