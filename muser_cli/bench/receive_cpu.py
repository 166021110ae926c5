"""The receiver at wire speed, where a loaded machine cannot blur it: the receiving
process's own CPU seconds per byte, a handoff against raw TLS (``benchmarks/bench_receive_cpu.py``).

A real ``muser receive --listen 127.0.0.1:0 -o DIR`` process (mutual TLS 1.3) and,
alternated A B A B after one uncounted round: an upload probe (the receiving half of
``probe-link``: Data frames parsed, counted and dropped) for about ``probe_seconds``; a
handoff of a synthetic bf16 kvpack of about ``mb`` MB, uncompressed (every frame verified,
spooled, the ledger fsynced, the pack fsynced and published, Ack). For each, the
receiver's CPU seconds (user + sys, every thread, /proc/PID/stat) over the bytes it took
in; ``cpu_ratio`` = probe CPU s per byte / handoff CPU s per byte (aim >= 0.9).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from muser_cli.bench.common import Pinning, Progress, no_progress, summarize
from muser_cli.bench.loopback import make_nodes, receiver_process
from muser_cli.bench.wire import synthetic_pack
from muser_cli.errors import ProtocolError
from muser_cli.handoff.push.sender import DEFAULT_DATA_CHUNK, open_link, prepare_handoff, transmit
from muser_cli.handoff.wire.protocol import Data, ProbeEnd, ProbeResult, ProbeUp
from muser_cli.kvpack import write_pack

FIGURES = ("probe_cpu_per_GB", "handoff_cpu_per_GB", "cpu_ratio", "probe_Bps", "handoff_e2e_Bps", "wall_ratio")


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def upload_probe(to: str, identity, seconds: float) -> tuple[int, float]:
    """(bytes sent, the receiver's counted rate in B/s): the upload half of probe-link."""

    link, _ready, _ = open_link(to, identity, total_s=4 * seconds + 60)
    block = os.urandom(DEFAULT_DATA_CHUNK)
    sent, result = 0, None
    try:
        link.send(ProbeUp(seconds), "starting the upload probe")
        while result is None:
            ev = link.poll_event()
            if isinstance(ev, ProbeResult):
                result = ev
            elif ev is not None:
                raise ProtocolError(f"unexpected {type(ev).__name__} in the probe")
            else:
                link.send(Data(block), "in the upload probe")
                sent += len(block)
        link.send(ProbeEnd(), "ending the upload probe")
    finally:
        link.close()
    up_s = float(result.info.get("seconds", 0.0))
    return sent, (int(result.info.get("bytes", 0)) / up_s if up_s > 0 else 0.0)


def _one_round(pid: int, to: str, nodes, src: Path, inbox: Path, probe_seconds: float) -> dict[str, float]:
    c0 = proc_cpu(pid)
    sent, probe_rate = upload_probe(to, nodes.producer, probe_seconds)
    time.sleep(0.05)  # the receiver finishes its drain
    c1 = proc_cpu(pid)
    prep = prepare_handoff(src, nodes.producer)
    res = transmit(prep, to=to, identity=nodes.producer)
    time.sleep(0.05)
    c2 = proc_cpu(pid)
    (inbox / f"{prep.header.handoff_id}.kvpack").unlink(missing_ok=True)
    p, h = (c1 - c0) / sent * 1e9, (c2 - c1) / src.stat().st_size * 1e9
    e2e = res.payload_bytes / res.total_s if res.total_s else 0.0
    return {"probe_cpu_per_GB": p, "handoff_cpu_per_GB": h, "cpu_ratio": p / h if h else 0.0,
            "probe_Bps": probe_rate, "handoff_e2e_Bps": e2e, "wall_ratio": e2e / probe_rate if probe_rate else 0.0}


def run_receive_cpu(mb: float, *, reps: int = 5, probe_seconds: float = 1.0, spool: str | None = None,
                    progress: Progress = no_progress) -> dict:
    """The receipt's payload: every figure's summary, and the machine's load before and after."""

    work = Path(tempfile.mkdtemp(prefix="muser-bench-recv-"))
    inbox = Path(spool) / f"muser-bench-recv-{os.getpid()}" if spool else work / "inbox"
    rows: dict[str, list[float]] = {k: [] for k in FIGURES}
    load0 = os.getloadavg()
    try:
        nodes = make_nodes(work)
        src = work / "payload.kvpack"
        with open(src, "wb") as f:
            write_pack(f, *synthetic_pack(mb), codec="none")
        size = src.stat().st_size
        with receiver_process(nodes, inbox, Pinning(None, None, None)) as (to, proc):
            for rnd in range(reps + 1):
                got = _one_round(proc.pid, to, nodes, src, inbox, probe_seconds)
                progress(f"rep {rnd}{' (warm-up)' if not rnd else ''}: cpu_ratio {got['cpu_ratio']:.3f}")
                if rnd:
                    for k, v in got.items():
                        rows[k].append(v)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if spool:
            shutil.rmtree(inbox, ignore_errors=True)
    return {"payload_bytes": size, "probe_seconds": probe_seconds, "reps": reps, "warmup": 1,
            "spool": str(inbox.parent), "figures": {k: summarize(v) for k, v in rows.items()},
            "kv": "synthetic bf16, uncompressed (muser_cli/bench/wire.py)",
            "link": "loopback mutual TLS 1.3, receiver a separate muser receive process, not pinned",
            "loadavg_before": load0, "loadavg_after": os.getloadavg()}
