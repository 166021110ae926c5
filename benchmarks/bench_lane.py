"""TTFT by lane on the embedded model: local prefill vs a handoff over loopback mutual TLS.

    python benchmarks/bench_lane.py [--depths 512,2048,8064] [--reps 5] [--dtype float32]
                                    [--codec none|zstd+bytegroup] [--wire-seconds 1.0]
    python benchmarks/bench_lane.py --wire-only 100     # the wire figure alone, no model

Per depth, alternating A B A B in one run (docs/benchmarking.md), after one uncounted warm-up:

  local    prefill(prompt[:-1]) + the first decode step: the fallback lane's TTFT
  handoff  prefill + pack + send (read and check the kvpack, sign, TLS 1.3 to a receiver
           *process* on 127.0.0.1 that verifies every frame, fsyncs its replay ledger and
           publishes atomically) + read_pack of the published file + the first decode step

and the ratios that matter:

  lane overhead = (pack + send + read) / prefill               aim <= 1 % at 8k tokens
  wire          = send payload rate / probe-link rate (up)      aim >= 90 %, loopback

On one host the producer's prefill runs on the consumer's own CPU, so the handoff TTFT
here is always local TTFT + overhead; the figure to carry to a two-machine lane is the
overhead, in seconds and as a fraction of prefill. Receipt: benchmarks/results/lane-*.json.
"""

from __future__ import annotations

import argparse
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


def start_receiver(home: Path, out_dir: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, MUSER_HOME=str(home), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "muser_cli.commands", "receive", "--listen", "127.0.0.1:0", "-o", str(out_dir)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if select.select([proc.stderr], [], [], 0.5)[0]:
            line = proc.stderr.readline().decode()
            m = re.search(r"listening on (\S+)", line)
            if m:
                return proc, m.group(1)
            if not line:
                break
    proc.kill()
    raise SystemExit("bench_lane: the receiver did not start")


def synthetic_pack(megabytes: int):
    """(header, layers) of a random bfloat16 kvpack of about ``megabytes`` MB (16 layers, 4x128)."""
    import numpy as np

    from muser_cli.kvpack import LayerKV, LayerSpec, PackHeader, RopeSpec

    layers = tuple(LayerSpec("full", 4, 128, 128, rope=RopeSpec(10000.0, 128)) for _ in range(16))
    tokens = max(2, megabytes * 1_000_000 // (16 * 4 * 256 * 2)) + 1
    header = PackHeader("sha256:" + "a" * 64, "sha256:" + "b" * 64, tuple(range(1, tokens + 1)), layers,
                        "bfloat16", 512, model_name="synthetic")
    rng = np.random.default_rng(0)
    rows = [LayerKV(rng.integers(0, 1 << 16, (4, tokens - 1, 128), dtype=np.uint16),
                    rng.integers(0, 1 << 16, (4, tokens - 1, 128), dtype=np.uint16)) for _ in layers]
    return header, rows


def measure_wire(src: Path, to: str, producer, *, reps: int, seconds: float) -> dict:
    """Installed payload rate over probe-link's raw TLS rate (up), alternated A B A B."""
    from muser_cli.handoff.sender import prepare_handoff, probe_link, transmit

    probe_link(to, producer, seconds=seconds)  # warm-up, uncounted
    transmit(prepare_handoff(src, producer), to=to, identity=producer)
    probes, sends = [], []
    for _ in range(reps):
        probes.append(probe_link(to, producer, seconds=seconds).up_Bps)
        sends.append(transmit(prepare_handoff(src, producer), to=to, identity=producer).payload_rate_Bps)
    ratios = [a / b for a, b in zip(sends, probes)]
    wire = {"bytes": src.stat().st_size, "probe_up_Bps": summarize(probes), "payload_rate_Bps": summarize(sends),
            "ratio": summarize(ratios)}
    print(f"wire ({wire['bytes'] / 1e6:.1f} MB): payload rate {wire['payload_rate_Bps']['median'] / 1e6:.0f} MB/s "
          f"(cv {wire['payload_rate_Bps']['cv']:.0%}), probe up {wire['probe_up_Bps']['median'] / 1e6:.0f} MB/s "
          f"(cv {wire['probe_up_Bps']['cv']:.0%}), ratio {wire['ratio']['median']:.0%} (cv {wire['ratio']['cv']:.0%})",
          flush=True)
    return wire


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="512,2048,8064")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--codec", default="none", choices=["none", "zstd+bytegroup"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--wire-seconds", type=float, default=1.0, help="probe-link seconds per direction")
    ap.add_argument("--wire-only", type=int, metavar="MB", default=0,
                    help="only the wire figure, on a synthetic kvpack of about MB megabytes (no model)")
    args = ap.parse_args()

    from muser_cli.handoff import node
    from muser_cli.handoff.sender import prepare_handoff, transmit
    from muser_cli.kvpack import read_pack, write_pack

    work = Path(tempfile.mkdtemp(prefix="bench-lane-"))
    consumer_home, producer_home = work / "consumer", work / "producer"
    node.init_node(consumer_home / "config" / "node", name="consumer")
    bundle, _ = node.export_producer(consumer_home / "config" / "node", producer="producer")
    node.join_node(producer_home / "config" / "node", bundle)
    producer = node.load_identity(producer_home / "config" / "node")
    out_dir = work / "inbox"
    out_dir.mkdir()
    proc, to = start_receiver(consumer_home, out_dir)

    if args.wire_only:
        try:
            src = work / "wire.kvpack"
            with open(src, "wb") as f:
                write_pack(f, *synthetic_pack(args.wire_only))
            wire = measure_wire(src, to, producer, reps=args.reps, seconds=args.wire_seconds)
        finally:
            proc.kill()
            proc.wait()
        path = write_receipt("wire", {"model": "synthetic", "link": "loopback mTLS 1.3", "wire": wire})
        print(f"receipt: {path}")
        return 0

    from muser_cli.engines.registry import get_engine
    from muser_cli.models import resolve_model
    from muser_cli.schedule import build_header

    info = resolve_model("default")
    eng = get_engine("torch", info, dtype=args.dtype, threads=args.threads)
    rows = []
    try:
        for depth in [int(d) for d in args.depths.split(",")]:
            ids = corpus_ids(info, depth)
            header = build_header(info, ids, dtype=args.dtype, chunk_tokens=512, engine="torch", threads=args.threads)

            def first_token(layers) -> tuple[int, float]:
                t0 = time.perf_counter()
                out = eng.decode(layers, rows=depth - 1, next_tokens=[ids[-1]], max_new_tokens=1, stop_on_eos=False)
                return out.token_ids[0], time.perf_counter() - t0

            def local() -> dict:
                t0 = time.perf_counter()
                layers = eng.prefill(ids[:-1], chunk_tokens=512)
                t_pre = time.perf_counter() - t0
                tok, t_first = first_token(layers)
                return {"prefill": t_pre, "first": t_first, "ttft": t_pre + t_first, "token": tok}

            def handoff() -> dict:
                t0 = time.perf_counter()
                layers = eng.prefill(ids[:-1], chunk_tokens=512)
                t_pre = time.perf_counter() - t0
                src = work / "out.kvpack"
                t1 = time.perf_counter()
                with open(src, "wb") as f:
                    write_pack(f, header, layers, codec=args.codec)
                t_pack = time.perf_counter() - t1
                t2 = time.perf_counter()
                prep = prepare_handoff(src, producer)
                res = transmit(prep, to=to, identity=producer)
                t_send = time.perf_counter() - t2
                got = out_dir / f"{prep.header.handoff_id}.kvpack"
                t3 = time.perf_counter()
                with open(got, "rb") as f:
                    pack = read_pack(f)
                t_read = time.perf_counter() - t3
                tok, t_first = first_token(pack.layers)
                got.unlink()
                overhead = t_pack + t_send + t_read
                return {"prefill": t_pre, "pack": t_pack, "send": t_send, "read": t_read, "first": t_first,
                        "ttft": t_pre + overhead + t_first, "consumer_ttft": t_read + t_first,
                        "overhead": overhead, "overhead_frac": overhead / t_pre, "bytes": prep.header.payload_size,
                        "payload_rate_Bps": res.payload_rate_Bps, "ack_wait": res.ack_wait_s, "token": tok}

            local(), handoff()  # warm-up, uncounted
            loc, hand = [], []
            for _ in range(args.reps):  # A B A B
                loc.append(local())
                hand.append(handoff())
            assert len({r["token"] for r in loc + hand}) == 1, "lanes disagree on the first token"

            def s(rs, key):
                return summarize([r[key] for r in rs])

            row = {"depth": depth, "bytes": hand[0]["bytes"], "local": {k: s(loc, k) for k in ("prefill", "first", "ttft")},
                   "handoff": {k: s(hand, k) for k in ("prefill", "pack", "send", "read", "first", "ttft",
                                                       "consumer_ttft", "overhead", "overhead_frac",
                                                       "payload_rate_Bps", "ack_wait")}}
            rows.append(row)
            h, lo = row["handoff"], row["local"]
            print(f"{depth:>6} tok {row['bytes'] / 1e6:7.2f} MB | local TTFT {lo['ttft']['median'] * 1e3:8.1f} ms "
                  f"(cv {lo['ttft']['cv']:.1%}) | handoff TTFT {h['ttft']['median'] * 1e3:8.1f} ms | overhead "
                  f"{h['overhead']['median'] * 1e3:6.1f} ms = {h['overhead_frac']['median']:.2%} of prefill "
                  f"(pack {h['pack']['median'] * 1e3:.1f}, send {h['send']['median'] * 1e3:.1f}, "
                  f"read {h['read']['median'] * 1e3:.1f}) | consumer TTFT {h['consumer_ttft']['median'] * 1e3:.1f} ms",
                  flush=True)

        # Wire: the installed payload rate against raw TLS, alternated, on the largest pack.
        src = work / "wire.kvpack"
        with open(src, "wb") as f:
            write_pack(f, header, eng.prefill(ids[:-1], chunk_tokens=512), codec=args.codec)
        wire = measure_wire(src, to, producer, reps=args.reps, seconds=args.wire_seconds)
    finally:
        proc.kill()
        proc.wait()
    path = write_receipt("lane", {"model": info.name, "fingerprint": info.fingerprint, "dtype": args.dtype,
                                  "threads": args.threads, "codec": args.codec, "link": "loopback mTLS 1.3",
                                  "rows": rows, "wire": wire})
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
