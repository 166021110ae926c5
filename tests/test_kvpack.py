"""kvpack v1: round trips and the malformed/integrity catalog (docs/reliability.md A1-A9, B11-B13)."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muser_cli.errors import KVPackError
from muser_cli.kvpack import PackReader, read_pack_bytes
from muser_cli.kvpack.format import FRAME_HEADER, MAGIC, PREAMBLE, canonical_json, pad_len

from kvpack_factory import llama_layers, make_pack


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
    # sliding layers carry window-1 rows, full layers every row of prompt[:-1]
    assert [l.keys.shape[1] for l in pack.layers] == [7, 7, 40]
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
    # chunks of 16: [0,16) [16,32) [32,40); sliding layers hold rows 33..39 only
    assert plan == [(2, 0, 16), (2, 16, 16), (0, 33, 7), (1, 33, 7), (2, 32, 8)]


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
        read_pack_bytes(_mutate_header(data, lambda o: [l.update(kv_heads=3) for l in o["layers"]]))


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

    from muser_cli.pack import pack
    from kvpack_factory import make_header, make_rows
    from muser_cli.kvpack import write_pack
    from muser_cli.kvpack.quant import from_float32, to_float32

    header = make_header(41, dtype=dtype, layers=llama_layers(2))
    rng = np.random.default_rng(3)
    rows = []
    for i, spec in enumerate(header.layers):
        f = rng.standard_normal((2, header.layer_rows(i), 16)).astype(np.float32) * 3
        g = rng.standard_normal((2, header.layer_rows(i), 16)).astype(np.float32)
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
