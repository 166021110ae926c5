"""How far the route's predictions are from what each path then takes (issue #47, "Measure").

    .venv/bin/python benchmarks/bench_route_error.py [--depths 64,256,1024,2048,4096,8000] [--passes 2]
        [--engine torch] [--model default]

From fresh homes (nothing learned), one resident producer (``prefill --serve``, cpu 0) and two
consumer services on cpu 1, one after the other for each request (never at once): ``remote``
(``decode --serve --producer ADDR`` with ``MUSER_ROUTE=producer``: every request's rows from the
producer) and ``local`` (``decode --serve`` without a producer). Each calibrates itself before
it listens (the producer too). Then, pass by pass, one prompt of each depth (distinct slices of
the project's docs, no prefix shared, ``--no-reuse``, turn memory off), ascending, to each
service, ``max_tokens`` 1. The remote service's answer carries the route's prediction of both
paths (``route.paths``: ``local`` and ``remote_whole``, TTFT in seconds from the request's
arrival), the local service's its own local path; each is compared with that path's TTFT
measured for the same prompt (``muser.ttft_ms`` of the remote and of the local service): the
paths taken (local by the local service, remote by the remote one) and the one not taken (the
remote service's local prediction, from its calibration alone). Pass 1 is cold (each service just calibrated; a
depth's prediction has seen only the shallower prompts before it), later passes warm.
Reported per pass and depth: predicted / measured for each path (1.0: exact). Aims: within 2x
cold, within 25 % warm. Receipt: benchmarks/results/route-error-*.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import write_receipt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--engine", default="torch", choices=["torch", "mlx"])
    ap.add_argument("--depths", default="64,256,1024,2048,4096,8000")
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    import openai

    from muser_cli.bench.agent import wait_url
    from muser_cli.bench.common import corpus_ids, pinning, resolve_bench_model
    from muser_cli.bench.loopback import MUSER, drain_in_background, make_nodes, node_env, wait_listening
    from muser_cli.model.tokens import decode_text
    from muser_cli.paths import models_dir

    os.environ["MUSER_MODELS"] = str(models_dir())  # fresh homes share the converted model
    info = resolve_bench_model(args.model)
    model_ref = str(info.path) if args.model == "tiny" else args.model
    depths = [int(d) for d in args.depths.split(",")]
    depths = [min(d, info.max_positions - 8) for d in depths]
    pins = pinning(True)
    ids = corpus_ids(info, sum(depths) * args.passes + 8192 + 64)[8192:]
    work = Path(tempfile.mkdtemp(prefix="muser-bench-route-"))
    common = ["-m", model_ref, "--engine", args.engine, "--threads", "1", "--dtype", "float32", "--no-reuse",
              "--turn-memory", "0"]
    procs: list[subprocess.Popen] = []
    rows = []
    try:
        nodes = make_nodes(work / "nodes")
        prod = subprocess.Popen(pins.command("producer", [*MUSER, "prefill", "--serve", "127.0.0.1:0", "-m", model_ref,
                                                          "--engine", args.engine, "--threads", "1", "--dtype",
                                                          "float32"]),
                                env=node_env(nodes.producer_home, threads=1), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs.append(prod)
        address = wait_listening(prod, "producer", timeout=900)
        drain_in_background(prod)
        clients = {}
        for name in ("remote", "local"):
            home = work / f"home-{name}"
            shutil.copytree(nodes.consumer_home, home, symlinks=True)
            env = node_env(home, threads=1)
            argv = [*MUSER, "decode", "--serve", "127.0.0.1:0", *common]
            if name == "remote":
                argv += ["--producer", address]
                env["MUSER_ROUTE"] = "producer"
            p = subprocess.Popen(pins.command("consumer", argv), env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            procs.append(p)
            clients[name] = openai.OpenAI(base_url=wait_url(p, name, timeout=900), api_key="unused", max_retries=0,
                                          timeout=3600)
        at = 0
        for pas in range(args.passes):
            for d in depths:
                prompt = decode_text(info, ids[at:at + d]).strip("\ufffd")
                at += d
                got = {}
                for name in ("remote", "local"):
                    out = clients[name].completions.create(model="default", prompt=prompt, max_tokens=1, temperature=0)
                    got[name] = out.model_extra["muser"]
                route = got["remote"].get("route") or {}
                paths = route.get("paths") or {}
                own = ((got["local"].get("route") or {}).get("paths") or {}).get("local")
                row = {"pass": pas, "depth": d, "remote_source": got["remote"].get("source"),
                       "local_source": got["local"].get("source"),
                       "measured": {"local": got["local"]["ttft_ms"] / 1000, "remote_whole": got["remote"]["ttft_ms"] / 1000},
                       # local: the local service's own prediction (the path it takes); local_not_taken: the
                       # remote service's prediction of a path it never takes (only its calibration)
                       "predicted": {"local": own, "remote_whole": paths.get("remote_whole"),
                                     "local_not_taken": paths.get("local")},
                       "known": route.get("known"), "calibrated": route.get("calibrated")}
                meas = {"local": "local", "remote_whole": "remote_whole", "local_not_taken": "local"}
                row["ratio"] = {k: (row["predicted"][k] / row["measured"][m]) if row["predicted"][k] else None
                                for k, m in meas.items()}
                rows.append(row)
                r = row["ratio"]
                print(f"pass {pas} depth {d}: local predicted/measured {r['local'] or float('nan'):.2f} "
                      f"({row['predicted']['local']} / {row['measured']['local']:.3f} s), remote "
                      f"{r['remote_whole'] or float('nan'):.2f} ({row['predicted']['remote_whole']} / "
                      f"{row['measured']['remote_whole']:.3f} s) from {row['remote_source']}", file=sys.stderr, flush=True)
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(60)
        shutil.rmtree(work, ignore_errors=True)
    path = write_receipt("route-error", {"args": vars(args), "pins": str(pins), "rows": rows})
    print(f"receipt: {path}", file=sys.stderr)
    print("pass depth  local pred/meas  remote pred/meas  local (not taken) pred/meas")
    for row in rows:
        r = row["ratio"]
        print(f"{row['pass']:>4} {row['depth']:>5}  {r['local'] or float('nan'):>15.2f}  {r['remote_whole'] or float('nan'):>16.2f}"
              f"  {r['local_not_taken'] or float('nan'):>27.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
