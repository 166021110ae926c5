"""Coverage-guided fuzzing of the kvpack readers (atheris), v1.0 to v1.4 (1.3: latent and state layers; 1.4: chunked layers).

Contract: any input either parses into a verified pack or raises KVPackError; no other
exception, no hang; and the readers agree -- the whole-buffer reader (read_buffer:
parallel payload digests, in-place views), ``buffer_events`` (the same, as events), and
the sans-IO PackReader fed odd-sized pieces give the same verdict on every input: the
same root digest, or the same message. Run (docs/kvpack.md 4.1 and docs/benchmarks.md
state the counts):

    python tests/fuzz/fuzz_kvpack.py -atheris_runs=1000000 -timeout=10 [-max_len=4096]

``FUZZ_KVPACK_POOL=1`` sends even these small packs through the worker pool, in runs of a
few frames (the thresholds that keep small packs inline are lowered).

tests/kvpack/test_kvpack.py drives :func:`one_input` on 1,500 inputs without atheris (in each version pass).
"""

from __future__ import annotations

import io
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

try:
    import atheris
except ImportError:  # the pytest drive needs none of it
    atheris = None

import contextlib  # noqa: E402
import json  # noqa: E402,F401  (imported first: only muser's own code is instrumented)
from dataclasses import replace  # noqa: E402

import numpy  # noqa: E402,F401
import zstandard  # noqa: E402,F401

# muser's own modules, instrumented when atheris drives this file
with atheris.instrument_imports(include=["muser_cli"]) if atheris is not None else contextlib.nullcontext():
    from muser_cli.errors import KVPackError
    from muser_cli.kvpack import EndEvent, PackReader, buffer_events, read_pack, read_pack_bytes, write_pack

from kvpack_factory import chunked_layers, kinds_layers, llama_layers, make_rows  # noqa: E402
from kvpack_factory import plain_header as make_header  # noqa: E402  (each seed names its own version)


def seed_pack(n: int, minor: int, digest: str, codec: str = "none", **kw) -> bytes:
    h = make_header(n, **kw)
    ring = 1 if minor >= 2 and any(spec.kind in ("sliding", "chunked") for spec in h.layers) else 0  # ring_extra rows
    header = replace(h, minor=minor, digest=digest, ring_extra=ring)
    buf = io.BytesIO()
    write_pack(buf, header, make_rows(header), codec=codec)
    return buf.getvalue()


SEEDS = []
for minor, digest in ((0, "sha256"), (1, "blake3"), (1, "sha256"), (2, "blake3")):
    SEEDS += [seed_pack(5, minor, digest, c, layers=llama_layers(1), chunk=2) for c in ("none", "zstd", "zstd+bytegroup")]
    SEEDS.append(seed_pack(11, minor, digest, chunk=4))
# v1.3: the latent and state kinds (a state layer's snapshot per chunk, superseding the last)
SEEDS += [seed_pack(9, 3, "blake3", c, layers=kinds_layers(), chunk=4) for c in ("none", "zstd+bytegroup")]
SEEDS.append(seed_pack(9, 3, "sha256", layers=kinds_layers(), chunk=4))
# v1.4: the chunked kind (13 tokens, chunk 4: the ring row reaches into the previous chunk)
SEEDS += [seed_pack(13, 4, "blake3", c, layers=chunked_layers(), chunk=4) for c in ("none", "zstd+bytegroup")]
SEEDS.append(seed_pack(13, 4, "sha256", layers=chunked_layers(), chunk=4))


class _Bytes:
    """The few FuzzedDataProvider calls one_input makes, over plain bytes (for pytest)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def ConsumeIntInRange(self, lo: int, hi: int) -> int:  # noqa: N802 (atheris' names)
        span = hi - lo + 1
        width = max(1, (span.bit_length() + 7) // 8)
        raw = self.data[self.pos:self.pos + width]
        self.pos += width
        return lo + int.from_bytes(raw.ljust(width, b"\0"), "little") % span

    def ConsumeBytes(self, n: int) -> bytes:  # noqa: N802
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out


def _verdict(fn) -> tuple[str, str]:
    try:
        return ("ok", fn())
    except KVPackError as exc:
        return ("refused", str(exc))


def _pieces(blob: bytes, decode: bool = True) -> str:
    reader = PackReader(decode=decode)
    step = 1 + (len(blob) % 257)
    for i in range(0, len(blob), step):
        reader.feed(blob[i:i + step])
    reader.finish()
    assert reader.root_digest is not None
    return reader.root_digest.hex()


def _events_root(blob: bytes) -> str:
    """buffer_events' verdict: the root of its EndEvent (which comes last, or not at all)."""
    last = None
    for ev in buffer_events(blob):
        last = ev
    assert isinstance(last, EndEvent)
    return last.root_digest.hex()


if os.environ.get("FUZZ_KVPACK_POOL") == "1":
    # the pool path on these small packs: runs of a few frames, hashed ahead of the consumer
    from muser_cli.kvpack import buffer as _buffer

    os.environ["MUSER_KVPACK_THREADS"] = "2"
    _buffer.PARALLEL_MIN_BYTES = 0
    _buffer.task_bytes = lambda total: 700


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data) if atheris is not None else _Bytes(data)
    mode = fdp.ConsumeIntInRange(0, len(SEEDS))
    if mode == 0:
        blob = fdp.ConsumeBytes(len(data))
    else:
        # mutate a valid pack: structured mutations reach deeper than random bytes
        seed = bytearray(SEEDS[mode - 1])
        for _ in range(fdp.ConsumeIntInRange(1, 4)):
            if not seed:
                break
            pos = fdp.ConsumeIntInRange(0, len(seed) - 1)
            op = fdp.ConsumeIntInRange(0, 2)
            if op == 0:
                seed[pos] ^= 1 << fdp.ConsumeIntInRange(0, 7)
            elif op == 1:
                del seed[pos:]
            else:
                seed[pos:pos] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 8))
        blob = bytes(seed)
    whole = _verdict(lambda: read_pack_bytes(blob).root_digest.hex())
    pieces = _verdict(lambda: _pieces(blob))
    if whole != pieces:
        raise AssertionError(f"readers disagree: whole {whole} vs pieces {pieces}")
    events = _verdict(lambda: _events_root(blob))
    if events != whole:
        raise AssertionError(f"readers disagree: whole {whole} vs buffer_events {events}")
    verify_only = _verdict(lambda: _pieces(blob, decode=False))  # payloads hashed as they arrive
    if verify_only != whole:
        raise AssertionError(f"readers disagree: whole {whole} vs verify-only {verify_only}")
    if mode and len(blob) % 7 == 0:  # now and then the readinto stream path too
        streamed = _verdict(lambda: read_pack(io.BytesIO(blob)).root_digest.hex())
        if streamed != whole:
            raise AssertionError(f"readers disagree: whole {whole} vs stream {streamed}")


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
