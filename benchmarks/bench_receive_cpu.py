"""The receiver at wire speed (issue 14, part 3), measured where a loaded machine cannot blur it:
the receiving process's own CPU seconds per byte, handoff against raw TLS.

    python benchmarks/bench_receive_cpu.py [--mb 64] [--reps 5] [--probe-seconds 1] [--spool DIR]

A real ``muser receive --listen 127.0.0.1:0 -o DIR`` process (mutual TLS 1.3, Handoff V3)
and, alternated A B A B after one uncounted round:

  * an upload probe (the receiving half of ``probe-link``: TLS records in, Data frames
    parsed, bytes counted and dropped) for about ``--probe-seconds``;
  * a handoff of a synthetic bf16 kvpack of about ``--mb`` MB, uncompressed: every frame
    verified, spooled, the ledger fsynced, the pack fsynced and published, Ack.

For each, the receiver's CPU seconds (user + sys, every thread, from /proc/PID/stat)
while it ran, over the bytes it took in. ``cpu_ratio`` = (probe CPU s per byte) /
(handoff CPU s per byte): the share of the raw TLS rate a receiver whose core is the
bottleneck keeps while it verifies and stores (aim >= 0.9). The wall-clock rates
(probe: timed at the receiver; handoff: connect to Ack at the sender) are kept too, but
on a shared, loaded machine only the CPU figure is steady. Receipt:
benchmarks/results/receive-cpu-*.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import summarize, write_receipt  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def upload_probe(to: str, identity, seconds: float) -> tuple[int, float]:
    """(bytes sent, the receiver's counted rate in B/s): the upload half of probe-link."""
    from muser_cli.handoff.protocol import Data, ProbeEnd, ProbeResult, ProbeUp
    from muser_cli.handoff.sender import DEFAULT_DATA_CHUNK, open_link

    link, _ready, _ = open_link(to, identity, total_s=4 * seconds + 60)
    block = os.urandom(DEFAULT_DATA_CHUNK)
    sent = 0
    try:
        link.send(ProbeUp(seconds), "starting the upload probe")
        result = None
        while result is None:
            ev = link.poll_event()
            if isinstance(ev, ProbeResult):
                result = ev
            elif ev is not None:
                raise SystemExit(f"unexpected {type(ev).__name__} in the probe")
            else:
                link.send(Data(block), "in the upload probe")
                sent += len(block)
        link.send(ProbeEnd(), "ending the upload probe")
    finally:
        link.close()
    up_s = float(result.info.get("seconds", 0.0))
    return sent, (int(result.info.get("bytes", 0)) / up_s if up_s > 0 else 0.0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=64.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--probe-seconds", type=float, default=1.0)
    ap.add_argument("--spool", default="", help="the receiver's output folder (default: a temporary folder on disk)")
    ap.add_argument("--label", default="", help="a note for the receipt (e.g. which tree)")
    args = ap.parse_args()

    from muser_cli.bench.loopback import MUSER, make_nodes, node_env, wait_listening
    from muser_cli.bench.wire import synthetic_pack
    from muser_cli.handoff.sender import prepare_handoff, transmit
    from muser_cli.kvpack import write_pack

    work = Path(tempfile.mkdtemp(prefix="muser-bench-recv-"))
    inbox = Path(args.spool) / f"muser-bench-recv-{os.getpid()}" if args.spool else work / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    nodes = make_nodes(work)
    src = work / "payload.kvpack"
    with open(src, "wb") as f:
        write_pack(f, *synthetic_pack(args.mb), codec="none")
    size = src.stat().st_size
    proc = subprocess.Popen([*MUSER, "receive", "--listen", "127.0.0.1:0", "-o", str(inbox)],
                            env=node_env(nodes.consumer_home), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rows: dict[str, list[float]] = {k: [] for k in ("probe_cpu_per_GB", "handoff_cpu_per_GB", "cpu_ratio",
                                                   "probe_Bps", "handoff_e2e_Bps", "wall_ratio")}
    load0 = os.getloadavg()
    try:
        to = wait_listening(proc, "bench")
        import threading

        threading.Thread(target=lambda: [None for _ in iter(lambda: proc.stderr.read(65536), b"")], daemon=True).start()
        for rep in range(args.reps + 1):
            c0 = proc_cpu(proc.pid)
            sent, probe_rate = upload_probe(to, nodes.producer, args.probe_seconds)
            time.sleep(0.05)  # the receiver finishes its drain
            c1 = proc_cpu(proc.pid)
            prep = prepare_handoff(src, nodes.producer)
            res = transmit(prep, to=to, identity=nodes.producer)
            time.sleep(0.05)
            c2 = proc_cpu(proc.pid)
            (inbox / f"{prep.header.handoff_id}.kvpack").unlink(missing_ok=True)
            if not rep:
                continue
            p, h = (c1 - c0) / sent * 1e9, (c2 - c1) / size * 1e9
            e2e = res.payload_bytes / res.total_s if res.total_s else 0.0
            for k, v in (("probe_cpu_per_GB", p), ("handoff_cpu_per_GB", h), ("cpu_ratio", p / h if h else 0.0),
                         ("probe_Bps", probe_rate), ("handoff_e2e_Bps", e2e),
                         ("wall_ratio", e2e / probe_rate if probe_rate else 0.0)):
                rows[k].append(v)
            print(f"rep {rep}: receiver CPU s/GB probe {p:.3f}, handoff {h:.3f} -> {p / h:.3f}; "
                  f"wall probe {probe_rate / 1e6:.0f} MB/s, handoff end to end {e2e / 1e6:.0f} MB/s", flush=True)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)
        if args.spool:
            shutil.rmtree(inbox, ignore_errors=True)
    out = {k: summarize(v) for k, v in rows.items()}
    path = write_receipt("receive-cpu", {
        "label": args.label, "payload_bytes": size, "kv": "synthetic bf16, uncompressed (muser_cli/bench/wire.py)",
        "probe_seconds": args.probe_seconds, "reps": args.reps, "warmup": 1, "spool": str(inbox.parent),
        "link": "loopback mutual TLS 1.3, receiver a separate muser receive process, not pinned",
        "figures": out, "loadavg_before": load0, "loadavg_after": os.getloadavg(),
        "note": "shared machine: 2 CPUs, other agents' jobs running; CPU seconds per byte of the receiving process"})
    r = out["cpu_ratio"]
    print(f"cpu_ratio median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}, cv {r['cv']:.1%}); "
          f"wall ratio median {out['wall_ratio']['median']:.3f}; load {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
