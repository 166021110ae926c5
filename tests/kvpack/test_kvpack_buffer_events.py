"""``buffer_events`` on its pool path: payloads hashed (and decoded) in runs of several
frames, a few runs ahead of the consumer, give exactly the events and the verdict of the
streaming ``PackReader`` fed one parser step at a time; a failure inside a run is
reported in stream order; and the pool never runs far ahead of the consumer.

The packs here are small, so the thresholds that keep small packs inline are lowered:
every pack below goes through the pool, in runs of a few frames each.
"""

from __future__ import annotations

import io
import time
from dataclasses import replace

import pytest

from kvpack_factory import frame_offsets, llama_layers, make_header, make_rows
from muser_cli.errors import KVPackError
from muser_cli.kvpack import EndEvent, FrameEvent, HeaderEvent, PackReader, buffer_events, write_pack
from muser_cli.kvpack import buffer as buffer_mod
from muser_cli.kvpack.format import FRAME_HEADER
from handoff_kit import HANG_S

RUN_BYTES = 3000  # a run: a few of the frames below


@pytest.fixture(autouse=True)
def _pool_path(monkeypatch):
    monkeypatch.setenv("MUSER_KVPACK_THREADS", "2")
    monkeypatch.setattr(buffer_mod, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(buffer_mod, "task_bytes", lambda total: RUN_BYTES)


def _pack(version: str, codec: str = "none", n: int = 120) -> bytes:
    minor, digest = {"v1.0": (0, "sha256"), "v1.1": (1, "blake3")}[version]
    header = replace(make_header(n, chunk=4, layers=llama_layers(3)), minor=minor, digest=digest)
    rows = make_rows(header, 11)
    if codec != "none":  # rows zstd can shrink, so the frames really are compressed
        from muser_cli.kvpack import LayerKV

        rows = [LayerKV(l.keys % 4, l.values % 4, l.first_row) for l in rows]
    buf = io.BytesIO()
    write_pack(buf, header, rows, codec=codec)
    return buf.getvalue()


def _key(ev) -> tuple:
    if isinstance(ev, HeaderEvent):
        return ("header", ev.header.encode())
    if isinstance(ev, FrameEvent):
        return ("frame", ev.seq, ev.layer, ev.start, ev.count, ev.codec, ev.stored_bytes, ev.payload_digest,
                ev.keys.tobytes(), ev.values.tobytes())
    return ("end", ev.root_digest, ev.total_bytes, ev.raw_bytes)


def _streamed(data: bytes) -> tuple[list, str | None]:
    """PackReader's events, fed exactly what it asks for at each step, and its verdict."""
    reader, events, pos = PackReader(), [], 0
    try:
        while True:
            need = 1 if reader.done else max(1, reader.want())
            chunk = data[pos : pos + need]
            pos += len(chunk)
            if not chunk:
                reader.finish()
                return events, None
            events += [_key(ev) for ev in reader.feed(chunk)]
    except KVPackError as exc:
        return events, str(exc)


def _mapped(data: bytes) -> tuple[list, str | None]:
    events = []
    try:
        for ev in buffer_events(data):
            events.append(_key(ev))
        return events, None
    except KVPackError as exc:
        return events, str(exc)


@pytest.mark.parametrize("version", ["v1.0", "v1.1"])
@pytest.mark.parametrize("codec", ["none", "zstd+bytegroup"])
def test_the_events_and_verdict_are_the_streaming_readers(version, codec):
    data = _pack(version, codec)
    offsets = frame_offsets(data)
    assert len(offsets) >= 60
    cases = {"intact": data}
    for name, at in (("a payload bit, mid-run", offsets[len(offsets) // 2] + FRAME_HEADER.size + 3),
                     ("a payload bit, last frame", offsets[-1] + FRAME_HEADER.size + 1),
                     ("a frame header's layer", offsets[7] + 9),
                     ("a frame's digest", offsets[20] - 40)):
        bad = bytearray(data)
        bad[at] ^= 0x04
        cases[name] = bytes(bad)
    cases["truncated mid-frame"] = data[: offsets[33] + 100]
    cases["trailing byte"] = data + b"\0"
    for name, blob in cases.items():
        streamed, mapped = _streamed(blob), _mapped(blob)
        if name == "trailing byte":  # PackReader gives the end event, then refuses what follows;
            assert streamed[0][-1][0] == "end"  # buffer_events refuses before any end event
            streamed = (streamed[0][:-1], streamed[1])
        assert mapped == streamed, name
        if name == "intact":
            assert mapped[1] is None and mapped[0][-1][0] == "end"
        else:
            assert mapped[1] is not None and all(k[0] != "end" for k in mapped[0]), name


def test_an_unexpected_failure_of_a_frame_is_raised_after_its_digest(monkeypatch):
    data = _pack("v1.1")
    offsets = frame_offsets(data)
    real = buffer_mod.decode_frame
    calls = {"n": 0}

    def failing(header, layer, count, codec, stored, raw_len, decode):
        calls["n"] += 1
        if calls["n"] == 30:  # mid-run
            raise MemoryError("no room for frame 29")
        return real(header, layer, count, codec, stored, raw_len, decode)

    monkeypatch.setattr(buffer_mod, "decode_frame", failing)
    got = []
    with pytest.raises(MemoryError, match="frame 29"):
        for ev in buffer_events(data):
            got.append(ev)
    assert [ev.seq for ev in got if isinstance(ev, FrameEvent)] == list(range(29))

    calls["n"] = 0  # the same frame also corrupt: the corruption is what is reported
    bad = bytearray(data)
    bad[offsets[29] + FRAME_HEADER.size + 2] ^= 1
    with pytest.raises(KVPackError, match="frame 29 .*digest mismatch"):
        list(buffer_events(bytes(bad)))


def test_the_pool_runs_only_a_few_runs_ahead_of_the_consumer(monkeypatch):
    data = _pack("v1.1", n=400)
    total = len(frame_offsets(data))
    real = buffer_mod.decode_frame
    decoded = []

    def counting(*args):
        decoded.append(1)
        return real(*args)

    monkeypatch.setattr(buffer_mod, "decode_frame", counting)
    events = buffer_events(data)
    assert isinstance(next(events), HeaderEvent)
    first = next(events)
    assert isinstance(first, FrameEvent) and first.seq == 0
    time.sleep(0.2)  # let the pool do whatever it was given
    frame_bytes = first.stored_bytes + FRAME_HEADER.size
    per_run = -(-RUN_BYTES // first.stored_bytes)
    ahead = 2 * 2 + 1  # runs submitted: the one being consumed and 2 x workers more
    assert len(decoded) <= ahead * per_run < total, (len(decoded), per_run, total, frame_bytes)
    rest = list(events)  # and the whole pack still comes out, in order
    assert isinstance(rest[-1], EndEvent)
    assert [ev.seq for ev in rest if isinstance(ev, FrameEvent)] == list(range(1, total))
    events.close()


def test_stopping_early_leaves_nothing_queued(monkeypatch):
    data = _pack("v1.1", n=400)
    events = buffer_events(data)
    next(events), next(events)
    events.close()  # what was not started is cancelled; nothing raises
    pool = buffer_mod.pool()
    assert pool is not None
    assert pool.submit(lambda: 7).result(timeout=HANG_S) == 7  # the pool is free again
