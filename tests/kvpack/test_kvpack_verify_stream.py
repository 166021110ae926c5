"""PackReader(decode=False), the verify-only reader of relays, the receiver and the store:
payloads are hashed piece by piece as they arrive, never gathered (issue 14, part 3).

Same verdicts as the decoding readers on every input, in any split; the events mark the
same byte boundaries; a frame's bytes are not held (memory, and no view of the input).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpack_factory
from kvpack_factory import corrupted, llama_layers, verdict
from muser_cli.kvpack import EndEvent, FrameEvent, HeaderEvent, PackReader, read_pack_bytes

VERSIONS = {"v1.0": (0, "sha256"), "v1.1-blake3": (1, "blake3"), "v1.1-sha256": (1, "sha256")}


def _pack(version: str, n: int = 23, codec: str = "none", chunk: int = 4, layers: int = 2, seed: int = 0) -> bytes:
    minor, digest = VERSIONS[version]
    header = replace(kvpack_factory.make_header(n, chunk=chunk, layers=llama_layers(layers)), minor=minor, digest=digest)
    import io

    from muser_cli.kvpack import write_pack

    buf = io.BytesIO()
    write_pack(buf, header, kvpack_factory.make_rows(header, seed), codec=codec)
    return buf.getvalue()


_verdict = verdict


def _fed(blob: bytes, step: int, *, decode: bool, writable: bool = False):
    reader = PackReader(decode=decode)
    marks = []  # (event, the feed call that produced it)
    for n, i in enumerate(range(0, len(blob), step)):
        piece = bytearray(blob[i:i + step]) if writable else blob[i:i + step]
        events = reader.feed(piece)
        if writable:
            piece[:] = bytes(len(piece))  # the caller reuses its buffer at once
        marks += [(type(e).__name__, n) for e in events]
    reader.finish()
    return reader.root_digest, marks


@pytest.mark.parametrize("version", sorted(VERSIONS))
@pytest.mark.parametrize("codec", ["none", "zstd+bytegroup"])
@pytest.mark.parametrize("step", [1, 7, 64, 200, 1 << 20])
def test_same_root_and_event_boundaries_as_the_decoding_reader(version, codec, step):
    blob = _pack(version, codec=codec)
    want = read_pack_bytes(blob).root_digest
    root, marks = _fed(blob, step, decode=False)
    root_d, marks_d = _fed(blob, step, decode=True)
    assert root == root_d == want
    assert marks == marks_d  # every event as soon as its last byte was fed, as before


def test_frame_events_carry_the_payload_digest_and_no_rows():
    blob = _pack("v1.1-blake3")
    events = PackReader(decode=False).feed(blob)
    frames = [e for e in events if isinstance(e, FrameEvent)]
    decoded = [e for e in PackReader().feed(blob) if isinstance(e, FrameEvent)]
    assert [f.payload_digest for f in frames] == [f.payload_digest for f in decoded]
    assert all(f.payload_digest is not None and f.stored is None and f.keys.size == 0 for f in frames)
    assert isinstance(events[0], HeaderEvent) and isinstance(events[-1], EndEvent)


def test_writable_input_reused_by_the_caller_does_not_change_the_verdict():
    """decode=False keeps no view of what it was fed, so it need not copy writable input."""
    blob = _pack("v1.1-blake3", n=40)
    for step in (5, 333, 4096):
        assert _fed(blob, step, decode=False, writable=True)[0] == read_pack_bytes(blob).root_digest


def test_a_large_frame_is_not_held():
    """A frame of 2 MiB fed in 64 KiB pieces: the reader's memory stays small."""
    import tracemalloc

    blob = _pack("v1.1-blake3", n=16385, chunk=16384, layers=1)  # one frame of 2 MiB
    step = 64 << 10
    pieces = [blob[i:i + step] for i in range(0, len(blob), step)]
    reader = PackReader(decode=False)
    tracemalloc.start()
    base = 0
    for p in pieces:
        if any(isinstance(e, HeaderEvent) for e in reader.feed(p)):
            tracemalloc.reset_peak()  # the header (16,385 token ids) is not what is measured
            base = tracemalloc.get_traced_memory()[0]
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    reader.finish()
    assert reader.root_digest == read_pack_bytes(blob).root_digest
    assert peak < 256 << 10  # the decoding reader gathers the whole 2 MiB frame


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_every_bit_flip_and_cut_is_refused_with_the_same_message(version):
    blob = _pack(version, n=21, codec="zstd+bytegroup")
    rng = np.random.default_rng(3)
    for pos in sorted(set(rng.integers(0, len(blob), 150).tolist()) | {0, 16, len(blob) - 40, len(blob) - 1}):
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        bad = bytes(bad)
        whole = _verdict(lambda: read_pack_bytes(bad).root_digest)
        assert whole[0] == "refused"
        assert _verdict(lambda: _fed(bad, 13, decode=False)[0]) == whole
        cut = blob[:pos]
        assert _verdict(lambda: _fed(cut, 29, decode=False)[0]) == _verdict(lambda: read_pack_bytes(cut).root_digest)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_verify_only_and_decoding_readers_agree(data):
    version = data.draw(st.sampled_from(sorted(VERSIONS)))
    codec = data.draw(st.sampled_from(["none", "zstd", "zstd+bytegroup"]))
    blob = corrupted(data, _pack(version, codec=codec))
    step = data.draw(st.integers(1, 300))
    whole = _verdict(lambda: read_pack_bytes(blob).root_digest)
    assert _verdict(lambda: _fed(blob, step, decode=False)[0]) == whole
