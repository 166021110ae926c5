"""kvpack v1: round trips and the malformed/integrity catalog (docs/reliability.md A1-A9, B11-B13),
for every version a writer may produce (v1.0; v1.1 with blake3 and with sha256), and the
v1.1 readers' no-copy paths: memory maps, readinto, writev, the worker pool."""

from __future__ import annotations

import io
import json
import struct
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muser_cli.errors import KVPackError
from muser_cli.kvpack import PackReader, read_pack_bytes
from muser_cli.kvpack.format import FRAME_HEADER, MAGIC, PREAMBLE, canonical_json, pad_len

import kvpack_factory
from kvpack_factory import corrupted, fed_root, llama_layers, make_pack, pipe_in_pieces, verdict

VERSIONS = {"v1.0": (0, "sha256", 0), "v1.1-blake3": (1, "blake3", 0), "v1.1-sha256": (1, "sha256", 0),
            "v1.2-ring": (2, "blake3", 1), "v1.3-latent": (3, "blake3", 1), "v1.4-chunked": (4, "blake3", 1)}


def _as_version(h, minor: int, digest: str, ring_extra: int):
    """``h`` written as a version; v1.2 adds ring rows wherever the header has a sliding layer;
    v1.3 also makes every full layer a latent (MLA) one of the same row width; v1.4 instead
    makes every sliding layer a chunked one whose chunk is the window."""
    from muser_cli.kvpack.layers import chunked_spec, latent_spec

    ring = ring_extra if any(s.kind == "sliding" for s in h.layers) else 0
    layers = h.layers
    if minor >= 4:
        layers = tuple(chunked_spec(s.kv_heads, s.head_dim, s.v_head_dim, s.window, s.rope) if s.kind == "sliding" else s
                       for s in h.layers)
    elif minor >= 3:
        layers = tuple(latent_spec(s.kv_heads * s.head_dim, s.kv_heads * s.v_head_dim, s.rope) if s.kind == "full" else s
                       for s in h.layers)
    return replace(h, minor=minor, digest=digest, ring_extra=ring, layers=layers)


@pytest.fixture(autouse=True, scope="module", params=sorted(VERSIONS))
def version(request):
    """Every test of this module runs once per version: the factory's packs are written as it."""
    minor, digest, ring = VERSIONS[request.param]
    plain = kvpack_factory.make_header
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kvpack_factory, "make_header", lambda *a, **kw: _as_version(plain(*a, **kw), minor, digest, ring))
        yield request.param


def _same(a, b):
    return all(np.array_equal(x.keys, y.keys) and np.array_equal(x.values, y.values) and x.first_row == y.first_row
               for x, y in zip(a, b))


def _split(data: bytes):
    """(preamble, header_json, frames_start)"""
    _, _, _, hlen = PREAMBLE.unpack(data[:16])
    start = 16 + hlen + pad_len(16 + hlen)
    return data[:16], data[16:16 + hlen], start


def _frame_spans(data: bytes):
    _, _, pos = _split(data)
    spans = []
    while pos < len(data):
        fields = FRAME_HEADER.unpack(data[pos:pos + 64])
        stored = fields[9]
        end = pos + 64 + stored + pad_len(stored) + 64
        spans.append((pos, end, fields[0]))
        pos = end
    return spans


def _rebuild(pre: bytes, obj: dict) -> bytes:
    hjson = canonical_json(obj)
    pre = pre[:12] + struct.pack("<I", len(hjson))
    return pre + hjson + bytes(pad_len(16 + len(hjson)))


@pytest.mark.parametrize("codec", ["none", "zstd", "zstd+bytegroup"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_round_trip_bytes_identical(codec, dtype):
    data, header, rows = make_pack(41, codec=codec, dtype=dtype)
    pack = read_pack_bytes(data)
    assert pack.header == header or pack.header.codec["name"] == codec
    assert _same(pack.layers, rows)
    # sliding layers carry window-1 rows (and ring_extra more in v1.2), full layers every row of prompt[:-1]
    ring = header.ring_extra
    assert [l.keys.shape[1] for l in pack.layers] == [7 + ring, 7 + ring, 40]
    assert pack.total_bytes == len(data)


def test_uncompressed_frames_are_64_byte_aligned():
    data, _, _ = make_pack(100, codec="none")
    for start, _, tag in _frame_spans(data):
        assert start % 64 == 0
    assert len(data) % 64 == 0


def test_one_byte_at_a_time_gives_same_events():
    data, _, rows = make_pack(41, codec="zstd+bytegroup")
    reader = PackReader()
    events = []
    for i in range(len(data)):
        events += reader.feed(data[i:i + 1])
    reader.finish()
    assert reader.done and type(events[0]).__name__ == "HeaderEvent" and type(events[-1]).__name__ == "EndEvent"


def test_frame_plan_is_chunk_major():
    _, header, _ = make_pack(41)
    plan = list(header.frame_plan())
    # chunks of 16: [0,16) [16,32) [32,40); sliding layers hold rows 33..39 only (v1.2: from 32)
    first = 33 - header.ring_extra
    assert plan == [(2, 0, 16), (2, 16, 16), (0, first, 40 - first), (1, first, 40 - first), (2, 32, 8)]


# ------------------------------------------------------------------ A: malformed
@pytest.mark.parametrize("data", [b"", b"\x89KV", MAGIC, MAGIC + b"\x01\x00"])
def test_a1_empty_or_short(data):
    with pytest.raises(KVPackError):
        read_pack_bytes(data)


def test_a1_garbage_is_not_a_kvpack():
    with pytest.raises(KVPackError, match="bad magic"):
        read_pack_bytes(b"hello, this is not a pack at all")


@pytest.mark.parametrize("hlen", [0xFFFFFFFF, 8 * 1024 * 1024 + 1])
def test_a2_header_length_caps_reject_before_reading(hlen):
    import tracemalloc

    data = PREAMBLE.pack(MAGIC, 1, 0, hlen) + b"{}"
    tracemalloc.start()
    with pytest.raises(KVPackError, match="header length"):
        read_pack_bytes(data)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 10 * 1024 * 1024


def test_a3_lengths_past_input():
    data, _, _ = make_pack(41)
    pre = PREAMBLE.pack(MAGIC, 1, 0, len(data))  # header "longer" than the file
    with pytest.raises(KVPackError, match="truncated"):
        read_pack_bytes(pre + data[16:])


def test_a3_frame_stored_length_overflow():
    data, _, _ = make_pack(41)
    start, _, _ = _frame_spans(data)[0]
    fields = list(FRAME_HEADER.unpack(data[start:start + 64]))
    fields[9] = (1 << 64) - 1
    bad = data[:start] + FRAME_HEADER.pack(*fields) + data[start + 64:]
    with pytest.raises(KVPackError, match="stored length"):
        read_pack_bytes(bad)


@pytest.mark.parametrize("header", [
    b"\xff\xfe{}", b"not json", b'{"format":"kvpack","format":"kvpack"}', b"[" * 10000 + b"]" * 10000,
    b'{"format": "kvpack"}', b"{}", b'"kvpack"', b'{"a":NaN}',
])
def test_a4_header_not_utf8_json_dupes_deep(header):
    data = PREAMBLE.pack(MAGIC, 1, 0, len(header)) + header + bytes(pad_len(16 + len(header)))
    with pytest.raises(KVPackError):
        read_pack_bytes(data)


def test_a4_duplicate_keys_rejected_even_if_valid_otherwise():
    data, _, _ = make_pack(41)
    pre, hjson, start = _split(data)
    dup = hjson[:-1] + b',"dtype":"bfloat16"}'
    bad = pre[:12] + struct.pack("<I", len(dup)) + dup + bytes(pad_len(16 + len(dup))) + data[start:]
    with pytest.raises(KVPackError, match="canonical"):
        read_pack_bytes(bad)


def _mutate_header(data: bytes, fn) -> bytes:
    pre, hjson, start = _split(data)
    obj = json.loads(hjson)
    fn(obj)
    return _rebuild(pre, obj) + data[start:]


def test_a5_frames_reordered_duplicated_missing():
    data, _, _ = make_pack(41)
    spans = _frame_spans(data)
    f = [data[a:b] for a, b, _ in spans]
    head = data[:spans[0][0]]
    for bad in (head + f[1] + f[0] + b"".join(f[2:]),          # swapped
                head + f[0] + f[0] + b"".join(f[1:]),          # duplicated
                head + b"".join(f[:2] + f[3:])):               # missing
        with pytest.raises(KVPackError):
            read_pack_bytes(bad)


def test_a5_frame_out_of_range():
    data, _, _ = make_pack(41)
    start, _, _ = _frame_spans(data)[0]
    fields = list(FRAME_HEADER.unpack(data[start:start + 64]))
    fields[2] = 99  # layer 99
    bad = data[:start] + FRAME_HEADER.pack(*fields) + data[start + 64:]
    with pytest.raises(KVPackError, match="plan"):
        read_pack_bytes(bad)


@pytest.mark.parametrize("mutate", [
    lambda o: o["layers"][0].update(kv_heads=2**40),
    lambda o: o["layers"][0].update(head_dim=2**62),
    lambda o: o["layers"].extend([o["layers"][0]] * 2000),
    lambda o: o["tokens"].update(count=2**63),
])
def test_a6_shape_products_that_overflow(mutate):
    data, _, _ = make_pack(41)
    with pytest.raises(KVPackError):
        read_pack_bytes(_mutate_header(data, mutate))


def test_a6_huge_declared_total_rejected():
    data, _, _ = make_pack(41, layers=llama_layers(1))

    def mutate(o):
        o["layers"] = [dict(o["layers"][0], kv_heads=1024, head_dim=4096, v_head_dim=4096)] * 1024
    with pytest.raises(KVPackError):
        read_pack_bytes(_mutate_header(data, mutate))


def test_a7_payload_length_not_what_header_implies():
    data, _, _ = make_pack(41)
    # claim 3 kv heads: every frame's raw length now disagrees with the header
    with pytest.raises(KVPackError, match="raw length"):
        read_pack_bytes(_mutate_header(data, lambda o: [l.update(kv_heads=3) if "kv_heads" in l  # a latent row (1.3):
                                                        else l.update(kv_lora_rank=l["kv_lora_rank"] + 1)  # its rank
                                                        for l in o["layers"]]))


@pytest.mark.parametrize("mutate,needle", [
    (lambda o: o.update(dtype="float8"), "float8"),
    (lambda o: o["layers"][0].update(kind="linear"), "linear"),
    (lambda o: o["codec"].update(name="lz4"), "lz4"),
    (lambda o: o["quant"].update(scheme="int3"), "int3"),
    (lambda o: o["layers"][0]["rope"].update(style="yarn-magic"), "yarn-magic"),
])
def test_a8_unknown_values_are_named(mutate, needle):
    data, _, _ = make_pack(41)
    with pytest.raises(KVPackError, match=needle):
        read_pack_bytes(_mutate_header(data, mutate))


def test_a8_unknown_major_version_named():
    data, _, _ = make_pack(41)
    bad = data[:8] + struct.pack("<H", 2) + data[10:]
    with pytest.raises(KVPackError, match="major version 2"):
        read_pack_bytes(bad)


def test_a8_unknown_codec_id_in_frame():
    data, _, _ = make_pack(41)
    start, _, _ = _frame_spans(data)[0]
    fields = list(FRAME_HEADER.unpack(data[start:start + 64]))
    fields[5] = 9
    with pytest.raises(KVPackError, match="codec id 9"):
        read_pack_bytes(data[:start] + FRAME_HEADER.pack(*fields) + data[start + 64:])


def test_a9_bytes_after_end_frame():
    data, _, _ = make_pack(41)
    with pytest.raises(KVPackError, match="after the end"):
        read_pack_bytes(data + b"\x00")


# ------------------------------------------------------------------ B: integrity
def test_b11_truncation_everywhere():
    data, _, _ = make_pack(41, codec="zstd")
    spans = _frame_spans(data)
    cuts = {0, 1, 15, 16, len(data) - 1, spans[0][0], spans[1][0], spans[1][0] + 70, spans[-1][0]}
    for cut in sorted(cuts):
        with pytest.raises(KVPackError):
            read_pack_bytes(data[:cut])


def test_b12_every_bit_flip_is_caught():
    data, _, _ = make_pack(21, codec="zstd+bytegroup", layers=llama_layers(2))
    rng = np.random.default_rng(1)
    positions = set(rng.integers(0, len(data), 300).tolist()) | {0, 8, 12, 20, len(data) - 40, len(data) - 64}
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(KVPackError):
            read_pack_bytes(bytes(bad))


def test_b13_swapped_frames_with_valid_own_digests():
    """Re-chain each frame so its own digest is 'valid' in isolation: the sequence number
    and the chain from the header still reject a swap."""
    data, _, _ = make_pack(41, layers=llama_layers(2))
    spans = _frame_spans(data)
    a, b = data[spans[0][0]:spans[0][1]], data[spans[1][0]:spans[1][1]]
    bad = data[:spans[0][0]] + b + a + data[spans[1][1]:]
    with pytest.raises(KVPackError, match="sequence|plan"):
        read_pack_bytes(bad)


# ------------------------------------------------------------------ properties
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 70), chunk=st.integers(1, 33), codec=st.sampled_from(["none", "zstd", "zstd+bytegroup"]),
       seed=st.integers(0, 2**16))
def test_property_round_trip(n, chunk, codec, seed):
    data, header, rows = make_pack(n, codec=codec, chunk=chunk, seed=seed)
    assert _same(read_pack_bytes(data).layers, rows)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_any_corruption_is_one_typed_error(data):
    blob, _, _ = make_pack(19, codec="zstd", layers=llama_layers(2), chunk=8)
    kind = data.draw(st.sampled_from(["flip", "cut", "insert", "overwrite"]))
    pos = data.draw(st.integers(0, len(blob) - 1))
    b = bytearray(blob)
    if kind == "flip":
        b[pos] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "cut":
        del b[pos:]
    elif kind == "insert":
        b[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    else:
        new = data.draw(st.binary(min_size=1, max_size=8))
        if bytes(b[pos:pos + len(new)]) == new[: len(b) - pos]:
            return
        b[pos:pos + len(new)] = new
    with pytest.raises(KVPackError):
        read_pack_bytes(bytes(b))


def test_reader_memory_bounded_by_received_bytes():
    """A header that declares gigabytes but delivers nothing allocates nothing big."""
    import tracemalloc

    data, _, _ = make_pack(41, layers=llama_layers(1))

    def mutate(o):
        o["tokens"]["ids"] = list(range(1, 200001))
        o["tokens"]["count"] = 200000
        o["tokens"]["digest"] = __import__("muser_cli.kvpack", fromlist=["token_digest"]).token_digest(o["tokens"]["ids"])
        o["positions"]["end"] = 199999
        o["layers"] = [dict(o["layers"][0], kv_heads=64, head_dim=256, v_head_dim=256)] * 16
    bad = _mutate_header(data, mutate)
    pre, hjson, start = _split(bad)
    tracemalloc.start()
    with pytest.raises(KVPackError):
        read_pack_bytes(bad[:start] + data[_split(data)[2]:])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 1024 * 1024  # header JSON parse only; declared KV is ~100 GB


# ------------------------------------------------------------------ int8
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int8_pack_records_error_and_stays_close(dtype):
    import io as _io

    from muser_cli.produce.pack import pack
    from kvpack_factory import make_header, make_rows
    from muser_cli.kvpack import write_pack
    from muser_cli.kvpack.quant import from_float32, to_float32

    header = make_header(41, dtype=dtype, layers=llama_layers(2))
    rng = np.random.default_rng(3)
    rows = []
    for i, spec in enumerate(header.layers):
        f = rng.standard_normal((spec.kv_heads, header.layer_rows(i), spec.head_dim)).astype(np.float32) * 3
        g = rng.standard_normal((spec.kv_heads, header.layer_rows(i), spec.v_head_dim)).astype(np.float32)
        from muser_cli.kvpack import LayerKV
        rows.append(LayerKV(from_float32(f, dtype), from_float32(g, dtype), 0))
    src = _io.BytesIO()
    write_pack(src, header, rows)
    src.seek(0)
    out = _io.BytesIO()
    res = pack(src, out, codec="zstd+bytegroup", quant="int8")
    q = read_pack_bytes(out.getvalue())
    err = q.header.quant["error"]
    assert q.header.quant["scheme"] == "int8" and err["k_max_abs"] > 0
    worst = 0.0
    for a, b in zip(q.layers, rows):
        d = np.abs(to_float32(a.keys, dtype) - to_float32(b.keys, dtype)).max()
        worst = max(worst, d)
    assert worst == pytest.approx(err["k_max_abs"], rel=1e-5)
    assert worst <= err["max_abs_value"] / 127 * 0.51 + 1e-2  # half a step, plus bf16 rounding
    assert res.bytes_out < len(src.getvalue()) / (1.2 if dtype == "bfloat16" else 2)  # tiny dims: scales cost 25%
    # re-quantizing is refused
    with pytest.raises(Exception, match="already quantized"):
        pack(_io.BytesIO(out.getvalue()), _io.BytesIO(), quant="int8")


def test_zstd_bomb_is_refused_before_allocation():
    """A frame whose zstd stream declares (or produces) more than raw_len never expands."""
    import tracemalloc

    import zstandard

    from muser_cli.kvpack.codec import decode_payload
    from muser_cli.kvpack.format import CODEC_ZSTD

    bomb_sized = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * (64 << 20))
    bomb_unsized = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20))
    tracemalloc.start()
    for bomb in (bomb_sized, bomb_unsized):
        with pytest.raises(KVPackError):
            decode_payload(bomb, CODEC_ZSTD, raw_len=4096, elem=2)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8 << 20


# ------------------------------------------------------------------ v1.1 header rules
def test_pack_is_written_in_the_version_under_test(version):
    data, header, _ = make_pack(41)
    minor, digest, ring = VERSIONS[version]
    _, _, got_minor, _ = PREAMBLE.unpack(data[:16])
    assert got_minor == minor
    h = read_pack_bytes(data).header
    assert (h.minor, h.digest) == (minor, digest)
    assert ("digest" in json.loads(_split(data)[1])) == (minor >= 1)
    assert json.loads(_split(data)[1]).get("ring_extra", 0) == h.ring_extra == ring


def test_v1_1_header_must_name_a_known_digest(version):
    if version == "v1.0":
        data, _, _ = make_pack(41)
        with pytest.raises(KVPackError, match="unknown key"):  # a v1.0 header has no digest key
            read_pack_bytes(_mutate_header(data, lambda o: o.update(digest="sha256")))
        return
    data, _, _ = make_pack(41)
    with pytest.raises(KVPackError, match="md5"):
        read_pack_bytes(_mutate_header(data, lambda o: o.update(digest="md5")))
    with pytest.raises(KVPackError, match="missing header.digest"):
        read_pack_bytes(_mutate_header(data, lambda o: o.pop("digest")))


def test_a_digest_swapped_in_the_header_is_refused(version):
    """Naming the other digest over the same frames breaks the chain from the header on."""
    if version == "v1.0":
        return
    other = {"blake3": "sha256", "sha256": "blake3"}[VERSIONS[version][1]]
    data, _, _ = make_pack(41)
    with pytest.raises(KVPackError, match="digest mismatch"):
        read_pack_bytes(_mutate_header(data, lambda o: o.update(digest=other)))


# ------------------------------------------------------------------ the readers agree
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_whole_buffer_and_streaming_readers_agree(data):
    """read_buffer (parallel digests, in place) and PackReader (in pieces) give one verdict."""
    codec = data.draw(st.sampled_from(["none", "zstd", "zstd+bytegroup"]))
    blob, _, _ = make_pack(23, codec=codec, layers=llama_layers(2), chunk=4)
    blob = corrupted(data, blob)

    def pieces():
        return fed_root(blob, data.draw(st.integers(1, 300)))

    def events():
        from muser_cli.kvpack import EndEvent, buffer_events

        return [ev for ev in buffer_events(blob) if isinstance(ev, EndEvent)][0].root_digest

    whole = verdict(lambda: read_pack_bytes(blob).root_digest)
    assert whole == verdict(pieces)
    assert whole == verdict(events)
    assert whole == verdict(lambda: __import__("muser_cli.kvpack", fromlist=["read_pack"]).read_pack(io.BytesIO(blob)).root_digest)


def test_fuzz_harness_short_run():
    """The atheris harness' own target on 1,500 deterministic inputs (no atheris needed):
    only KVPackError, and the readers agree on every input."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("fuzz_kvpack", Path(__file__).resolve().parents[1] / "fuzz" / "fuzz_kvpack.py")
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)  # type: ignore[union-attr]
    rng = np.random.default_rng(14)
    for _ in range(1500):
        fuzz.one_input(rng.integers(0, 256, int(rng.integers(0, 48)), dtype=np.uint8).tobytes())


# ------------------------------------------------------------------ no needless copies, safely
def _pack_file(tmp_path, **kw):
    data, header, rows = make_pack(**kw)
    path = tmp_path / "p.kvpack"
    with open(path, "wb") as fh:
        fh.write(data)
    return path, data, rows


def _base_object(arr):
    while isinstance(arr, np.ndarray) and arr.base is not None:
        arr = arr.base
    return arr.obj if isinstance(arr, memoryview) else arr


def test_mapped_file_rows_are_read_only_views_of_the_map(tmp_path):
    import mmap

    from muser_cli.kvpack import read_pack

    # one frame per layer (chunk >= rows): each layer's rows are used in place
    path, data, rows = _pack_file(tmp_path, n_tokens=41, codec="none", layers=llama_layers(2), chunk=64)
    with open(path, "rb") as fh:
        pack = read_pack(fh)
        assert fh.tell() == len(data)
    assert _same(pack.layers, rows)
    for lk in pack.layers:
        assert isinstance(_base_object(lk.keys), mmap.mmap) and not lk.keys.flags.writeable
    # several frames per layer: assembled into arrays of their own
    path, _, rows = _pack_file(tmp_path, n_tokens=41, codec="none", layers=llama_layers(2), chunk=8)
    with open(path, "rb") as fh:
        pack = read_pack(fh)
    assert _same(pack.layers, rows)
    assert not isinstance(_base_object(pack.layers[0].keys), mmap.mmap)


@pytest.mark.parametrize("where", ["payload", "digest", "root", "tail"])
def test_mapped_views_are_never_handed_out_before_the_root_verified(tmp_path, where):
    """A flip anywhere, even in the last byte of the root: read_pack raises, and the
    progress callback (which sees frames) was never called."""
    from muser_cli.kvpack import read_pack

    path, data, _ = _pack_file(tmp_path, n_tokens=41, codec="none", layers=llama_layers(2), chunk=8)
    spans = _frame_spans(data)
    pos = {"payload": spans[0][0] + 64 + 5, "digest": spans[1][1] - 60, "root": len(data) - 33,
           "tail": len(data) - 1}[where]
    bad = bytearray(data)
    bad[pos] ^= 0x10
    path.write_bytes(bytes(bad))
    seen = []
    with open(path, "rb") as fh, pytest.raises(KVPackError):
        read_pack(fh, progress=lambda *a: seen.append(a))
    assert seen == []


def test_streaming_reader_over_a_map_hands_out_only_verified_frames(tmp_path):
    """PackReader fed a memory map: frame k's event comes only after frame k's digest verified."""
    import mmap

    path, data, _ = _pack_file(tmp_path, n_tokens=41, codec="none", layers=llama_layers(2), chunk=8)
    spans = _frame_spans(data)
    bad = bytearray(data)
    bad[spans[3][0] + 64] ^= 1  # first payload byte of frame 3
    path.write_bytes(bytes(bad))
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    reader = PackReader()
    view = memoryview(mm)
    frames = []
    with pytest.raises(KVPackError, match="frame 3 .*digest mismatch"):
        for a, b, _ in [(0, spans[0][0], None)] + spans:
            frames += [ev for ev in reader.feed(view[a:b]) if type(ev).__name__ == "FrameEvent"]
    assert [ev.seq for ev in frames] == [0, 1, 2]
    assert all(isinstance(_base_object(ev.keys), mmap.mmap) for ev in frames)  # in place, no copy


def test_writable_input_is_copied_unless_handed_over():
    data, _, rows = make_pack(41, codec="none", layers=llama_layers(1), chunk=64)
    buf = bytearray(data)
    events = PackReader().feed(buf)
    buf[:] = bytes(len(buf))  # the caller reuses its buffer
    frame = [ev for ev in events if type(ev).__name__ == "FrameEvent"][0]
    assert np.array_equal(frame.keys, rows[0].keys)
    owned = bytearray(data)
    frame = [ev for ev in PackReader().feed(owned, owned=True) if type(ev).__name__ == "FrameEvent"][0]
    assert np.shares_memory(frame.keys, np.frombuffer(owned, np.uint8))


def test_pipe_reads_with_readinto_into_buffers_of_each_step(tmp_path):
    from muser_cli.kvpack import read_pack

    data, _, rows = make_pack(41, codec="zstd+bytegroup")
    with pipe_in_pieces(data, 777) as src:
        pack = read_pack(src)  # a pipe: not mapped, read step by step
    assert _same(pack.layers, rows) and pack.total_bytes == len(data)


@pytest.mark.parametrize("codec", ["none", "zstd", "zstd+bytegroup"])
def test_writer_output_is_the_same_to_a_file_a_pipe_and_memory_on_any_pool(tmp_path, codec, monkeypatch):
    """writev to a file, writes to a pipe, BytesIO; pool of 1 or 4; write_pack or frame by frame."""
    import os
    import threading

    from muser_cli.kvpack import PackWriter, write_pack
    from kvpack_factory import make_header, make_rows

    header = make_header(70, chunk=8, layers=llama_layers(3))
    rows = make_rows(header, 5)
    ref = io.BytesIO()
    monkeypatch.setenv("MUSER_KVPACK_THREADS", "1")
    write_pack(ref, header, rows, codec=codec)
    monkeypatch.setenv("MUSER_KVPACK_THREADS", "4")
    par = io.BytesIO()
    write_pack(par, header, rows, codec=codec)
    assert par.getvalue() == ref.getvalue()
    path = tmp_path / "w.kvpack"
    with open(path, "wb") as fh:
        fh.write(b"")  # a buffered file object: the writer flushes it, then writev
        write_pack(fh, header, rows, codec=codec)
    assert path.read_bytes() == ref.getvalue()
    one = io.BytesIO()
    writer = PackWriter(one, header, codec=codec)
    for layer, start, count in header.frame_plan():
        lk = rows[layer]
        a = start - lk.first_row
        writer.write_frame(layer, start, lk.keys[:, a:a + count], lk.values[:, a:a + count])
    writer.finish()
    assert one.getvalue() == ref.getvalue()
    r, w = os.pipe()
    got = bytearray()

    def drain():
        with os.fdopen(r, "rb") as src:
            while chunk := src.read(65536):
                got.extend(chunk)

    t = threading.Thread(target=drain)
    t.start()
    with os.fdopen(w, "wb") as out:
        write_pack(out, header, rows, codec=codec)
    t.join()
    assert bytes(got) == ref.getvalue()


def test_writer_sends_views_of_the_callers_arrays():
    from muser_cli.kvpack.writer import _views

    keys = np.arange(2 * 40 * 16, dtype=np.uint16).reshape(2, 40, 16)
    whole = _views(keys, np.dtype("<u2"))
    assert len(whole) == 1 and np.shares_memory(np.frombuffer(whole[0], np.uint16), keys)
    part = _views(keys[:, 8:16], np.dtype("<u2"))  # a frame of a longer cache: one view per head
    assert len(part) == 2 and all(np.shares_memory(np.frombuffer(v, np.uint16), keys) for v in part)
    assert b"".join(bytes(v) for v in part) == np.ascontiguousarray(keys[:, 8:16]).tobytes()


def test_big_frames_hashed_while_written_give_the_same_bytes(tmp_path, monkeypatch):
    """Frames over the overlap threshold are hashed on the pool while their bytes go out
    (write_frame), or ahead of them (write_pack): same bytes as one thread, and they read."""
    from muser_cli.kvpack import LayerSpec, PackWriter, RopeSpec, read_pack, write_pack
    from muser_cli.kvpack.writer import OVERLAP_MIN_BYTES
    from kvpack_factory import make_header, make_rows

    header = make_header(1100, chunk=512, layers=(LayerSpec("full", 4, 128, 128, rope=RopeSpec(1e4, 128)),) * 2)
    rows = make_rows(header, 9)
    assert header.row_bytes(0) * 512 > OVERLAP_MIN_BYTES
    monkeypatch.setenv("MUSER_KVPACK_THREADS", "1")
    ref = io.BytesIO()
    write_pack(ref, header, rows)
    monkeypatch.setenv("MUSER_KVPACK_THREADS", "3")
    path = tmp_path / "big.kvpack"
    with open(path, "wb") as fh:
        writer = PackWriter(fh, header)
        for layer, start, count in header.frame_plan():
            writer.write_frame(layer, start, rows[layer].keys[:, start:start + count],
                               rows[layer].values[:, start:start + count])
        writer.finish()
    assert path.read_bytes() == ref.getvalue()
    par = io.BytesIO()
    write_pack(par, header, rows)
    assert par.getvalue() == ref.getvalue()
    with open(path, "rb") as fh:
        assert _same(read_pack(fh).layers, rows)
