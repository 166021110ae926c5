"""A producer that writes a synthetic kvpack frame by frame, like ``muser prefill`` streaming.

Run as a script (``python tests/stream_producer.py ...``) it writes the pack to stdout,
flushing after the header and after every frame, optionally stopping after ``--gate-after``
frames until ``--gate`` exists (so a test can prove the consumer saw frames before the
producer finished, or kill something mid-stream). Imported, :func:`pack_bytes` builds the
identical bytes in memory for comparison. Rows are deterministic per frame, so memory
stays one frame whatever the pack size.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvpack_factory import FP_A, FP_B  # noqa: E402
from muser_cli.kvpack import LayerSpec, PackHeader, PackWriter, RopeSpec  # noqa: E402


def make_header(tokens: int, layers: int, heads: int, head_dim: int, frame: int) -> PackHeader:
    specs = tuple(LayerSpec("full", heads, head_dim, head_dim, rope=RopeSpec(10000.0, head_dim)) for _ in range(layers))
    return PackHeader(FP_A, FP_B, tuple(range(1, tokens + 1)), specs, "bfloat16", frame,
                      model_name="synthetic", architecture="test")


def write(out, header: PackHeader, *, seed: int = 0, gate_after: int | None = None, gate: str | None = None,
          delay: float = 0.0, stamp: str | None = None) -> None:
    w = PackWriter(out, header, codec="none")
    out.flush()
    for n, (layer, start, count) in enumerate(header.frame_plan()):
        if gate_after is not None and n == gate_after and gate:
            while not os.path.exists(gate):
                time.sleep(0.01)
        spec = header.layers[layer]
        rng = np.random.default_rng((seed, layer, start))
        k = rng.integers(0, 1 << 16, (spec.kv_heads, count, spec.head_dim), dtype=np.uint16)
        v = rng.integers(0, 1 << 16, (spec.kv_heads, count, spec.v_head_dim), dtype=np.uint16)
        w.write_frame(layer, start, k, v)
        out.flush()
        if delay:
            time.sleep(delay)
    w.finish()
    out.flush()
    if stamp:  # when the last byte left the producer (Unix time), for tail measurements
        Path(stamp).write_text(repr(time.time()))


def pack_bytes(tokens: int, layers: int, heads: int = 2, head_dim: int = 16, frame: int = 16, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    write(buf, make_header(tokens, layers, heads, head_dim, frame), seed=seed)
    return buf.getvalue()


def frame_ends(data: bytes) -> list[int]:
    """Byte offsets where the kvpack header and each data frame end, read from the layout
    itself (docs/kvpack.md 1), independently of the handoff code; the last entry is the
    start of the end frame."""
    import struct

    hlen = struct.unpack_from("<I", data, 12)[0]
    pos = 16 + hlen
    pos += (-pos) % 64
    ends = [pos]
    while data[pos : pos + 4] == b"KVFR":
        stored = struct.unpack_from("<Q", data, pos + 32)[0]
        pos += 64 + stored + (-stored) % 64 + 64
        ends.append(pos)
    assert data[pos : pos + 4] == b"KVND" and pos + 128 == len(data)
    return ends


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--frame", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gate-after", type=int)
    ap.add_argument("--gate")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--stamp")
    a = ap.parse_args()
    header = make_header(a.tokens, a.layers, a.heads, a.head_dim, a.frame)
    try:
        write(sys.stdout.buffer, header, seed=a.seed, gate_after=a.gate_after, gate=a.gate, delay=a.delay,
              stamp=a.stamp)
    except BrokenPipeError:
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
