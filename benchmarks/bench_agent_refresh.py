"""The agent-refresh workload (issue 28): an agent on the decode machine refreshes a growing
context turn after turn through the OpenAI client, against ``muser decode --serve``.

    .venv/bin/python benchmarks/bench_agent_refresh.py [--turns 10] [--start 2048] [--end 7800] [--reps 3]
                                                       [--mlx-lm]   # also mlx_lm.server on the same prompts
                                                       [--engine torch|mlx] [--lanes producer,local]
    # issue #38's short chat: three short turns, MLX against mlx_lm.server
    .venv/bin/python benchmarks/bench_agent_refresh.py --turns 3 --start 48 --end 200 --engine mlx --mlx-lm
    # issue #37: four agents at once against one server, beside one agent alone
    .venv/bin/python benchmarks/bench_agent_refresh.py --agents 4 --turns 4 --start 256 --end 1024 --engine mlx \
        --lanes local --mlx-lm
    .venv/bin/python benchmarks/bench_agent_refresh.py --turns 3 --start 48 --end 200 --engine mlx --mlx-lm

One conversation: turn 1 sends a document of ``--start`` tokens; every later turn appends
the model's answer and a new slice of the document, growing to ``--end`` tokens. Each turn
is a streamed chat completion; its TTFT is from sending the request to the first content
chunk (client side, so queueing and HTTP are included). Lanes, each a resident server
started once (model loaded once), the conversation run ``--reps`` times on new documents
(another corpus offset, so no store holds it):

  producer  consumer$ muser decode --serve --store --producer ADDR   (producer$ prefill --serve --store)
  local     consumer$ muser decode --serve --store                  (no producer: prefilled here)
  mlx-lm    mlx_lm.server --model PATH                              (with --mlx-lm, if installed)

Producer on one core, consumer on another (``taskset``), one compute thread each, loopback
mutual TLS, float32. Reported per turn: median TTFT and its spread for each lane, and for
the producer lane the source (``x-muser-source``) and the bytes shipped, and for each muser
lane the rows its turn memory held and the rows it computed (the ``muser`` field of the last
chunk: ``held_rows``, ``computed_rows``). The aim: every turn after the first ships or computes
only its new tokens and its TTFT is under the local one (and, issue #38, no more than
mlx_lm.server's, which keeps the whole conversation's cache).

``--agents N`` (issue #37): after the one-agent reps, each server gets N conversations at once
(each its own document, all started together, each going turn after turn), ``--reps`` times;
``mlx_lm.server`` then runs with ``--decode-concurrency N --prompt-concurrency N``. Reported per
turn: the N agents' TTFT p50 and p90 (over agents and reps) and p90 against N x the one-agent
median (the aim: at most 1, sharing the machine costs no more than taking turns whole).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from _common import corpus_ids, run, summarize, write_receipt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--start", type=int, default=2048)
    ap.add_argument("--end", type=int, default=7800)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--mlx-lm", action="store_true")
    ap.add_argument("--engine", default="torch", choices=["torch", "mlx"], help="the muser lanes' engine")
    ap.add_argument("--lanes", default="producer,local", help="the muser lanes to run (producer, local)")
    ap.add_argument("--agents", type=int, default=1, help="also run this many conversations at once (issue #37)")
    args = ap.parse_args()
    import openai

    from muser_cli.bench.agent import agents_at_once, conversation, mlx_lm_conversations, wait_url
    from muser_cli.bench.common import machine, pinning, quantile, resolve_bench_model
    from muser_cli.bench.loopback import MUSER, drain_in_background, make_nodes, node_env, wait_listening
    from muser_cli.model.tokens import decode_text

    info = resolve_bench_model(args.model)
    pins = pinning(True)
    work = Path(tempfile.mkdtemp(prefix="muser-bench-agent-"))
    nodes = make_nodes(work)
    common = ["-m", args.model, "--threads", "1", "--dtype", "float32", "--engine", args.engine]
    step = (args.end - args.start) // max(1, args.turns - 1)

    def slices(rep: int) -> list[str]:
        skip = 977 * (rep + 1)
        ids = corpus_ids(info, args.end + skip)[skip:]
        cuts = [0, args.start] + [args.start + step * k for k in range(1, args.turns)]
        return [decode_text(info, ids[a:b]) for a, b in zip(cuts, cuts[1:])]

    procs: list[subprocess.Popen] = []
    lanes: dict[str, list[list[dict]]] = {}
    many: dict[str, list[list[dict]]] = {}  # --agents: each agent's conversation, every rep
    failures: dict[str, str] = {}
    try:
        producer = subprocess.Popen(pins.command("producer", [*MUSER, "prefill", "--serve", "127.0.0.1:0", "--store",
                                                              *common]),
                                    env=node_env(nodes.producer_home, threads=1), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs.append(producer)
        address = wait_listening(producer, "producer", timeout=600)
        drain_in_background(producer)
        servers = {
            "producer": [*MUSER, "decode", "--serve", "127.0.0.1:0", "--store", "--producer", address, *common],
            "local": [*MUSER, "decode", "--serve", "127.0.0.1:0", "--store", *common],
        }
        wanted = [lane.strip() for lane in args.lanes.split(",") if lane.strip()]
        servers = {lane: argv for lane, argv in servers.items() if lane in wanted}
        for lane, argv in servers.items():
            home = work / f"home-{lane}"
            shutil.copytree(nodes.consumer_home, home, symlinks=True)  # each lane its own (empty) store
            proc = subprocess.Popen(pins.command("consumer", argv), env=node_env(home, threads=1),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            procs.append(proc)
            url = wait_url(proc, lane)
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
            conversation(client, "default", slices(-1)[:2], args.max_tokens)  # warm-up
            lanes[lane] = [conversation(client, "default", slices(r), args.max_tokens) for r in range(args.reps)]
            if args.agents > 1:
                many[lane] = agents_at_once(client, "default", slices, reps=args.reps, agents=args.agents,
                                            max_tokens=args.max_tokens)
        if args.mlx_lm:
            try:
                got = mlx_lm_conversations(str(info.path), pins, slices, reps=args.reps, max_tokens=args.max_tokens,
                                           agents=args.agents)
                lanes["mlx-lm"] = got["one"]
                if "many" in got:
                    many["mlx-lm"] = got["many"]
            except Exception as exc:  # keep the muser lanes' figures: the receipt says what failed
                failures["mlx-lm"] = f"{type(exc).__name__}: {exc}"
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(60)
        shutil.rmtree(work, ignore_errors=True)
    table = {lane: [summarize([rep[t]["ttft_s"] for rep in reps]) for t in range(args.turns)]
             for lane, reps in lanes.items()}
    muser_lanes = [lane for lane in ("producer", "local") if lane in lanes]
    print(f"{'turn':>4} " + " ".join(f"{lane + ' ttft s':>22}" for lane in table) +
          "".join(f"  {lane}: source/bytes/held/computed" for lane in muser_lanes))
    for t in range(args.turns):
        cells = " ".join(f"{s['median']:>10.3f} [{s['min']:.3f}-{s['max']:.3f}]" for s in (v[t] for v in table.values()))
        rows = "".join(f"  {r['source']}/{r['bytes']}/{r.get('held_rows')}/{r.get('computed_rows')}"
                       for r in (lanes[lane][0][t] for lane in muser_lanes))
        print(f"{t + 1:>4} {cells}{rows}")
    together = {}
    if many:
        print(f"{args.agents} agents at once: per turn TTFT p50 / p90 s, and p90 / ({args.agents} x one agent's median)")
    for lane, convs in many.items():
        rows = []
        for t in range(args.turns):
            ttfts = [c[t]["ttft_s"] for c in convs]
            s = {**summarize(ttfts), "p90": quantile(ttfts, 0.9)}
            alone = table[lane][t]["median"]
            rows.append({**s, "vs_turns_whole": s["p90"] / (args.agents * alone) if alone else None})
        together[lane] = rows
        print(f"  {lane:>9}: " + "  ".join(f"{r['median']:.2f}/{r['p90']:.2f} ({r['vs_turns_whole']:.2f}x)"
                                          for r in rows))
    path = write_receipt("agent-refresh", {"args": vars(args), "machine": machine(), "pinning": pins.__dict__,
                                           "turns": table, "raw": lanes, "together": together, "raw_together": many,
                                           "failures": failures})
    for lane, why in failures.items():
        print(f"{lane}: not measured ({why})")
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    run(main)
