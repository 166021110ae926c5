"""``muser pack`` hashes each payload once: a frame passed on unchanged links the payload
digest its reader verified; a re-encoded frame is hashed once, as written (issue 14).

Every input byte is still verified (a flipped bit is refused and no end frame is
written), and the output's chain is over the output's bytes: the output verifies on its
own and equals what the writer makes from the same rows.
"""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest

from kvpack_factory import frame_offsets, llama_layers, make_header, make_rows, pipe_in_pieces
from muser_cli.errors import KVPackError
from muser_cli.kvpack import PackWriter, read_pack_bytes, write_pack
from muser_cli.kvpack import digest as digest_mod
from muser_cli.kvpack.format import FRAME_HEADER
from muser_cli.produce.pack import pack

VERSIONS = {"v1.0": (0, "sha256"), "v1.1-blake3": (1, "blake3"), "v1.1-sha256": (1, "sha256")}


def _header(version: str, n: int = 70, chunk: int = 16):
    minor, digest = VERSIONS[version]
    return replace(make_header(n, chunk=chunk, layers=llama_layers(3)), minor=minor, digest=digest)


def _compressible(rows):
    """Rows zstd shrinks (random rows are stored raw even in a zstd pack)."""
    from muser_cli.kvpack import LayerKV

    return [LayerKV(l.keys % 8, l.values % 8, l.first_row) for l in rows]


def _written(header, rows, codec: str) -> bytes:
    buf = io.BytesIO()
    write_pack(buf, header, rows, codec=codec)
    return buf.getvalue()


def _packed(data: bytes, codec: str) -> bytes:
    out = io.BytesIO()
    pack(io.BytesIO(data), out, codec=codec)
    return out.getvalue()


class _Counter:
    """Bytes hashed as payloads (p = H(payload), v1.1) while it is installed."""

    def __init__(self, monkeypatch) -> None:
        self.bytes = 0
        real = digest_mod.payload_digest

        def counting(h, parts):
            parts = list(parts)
            self.bytes += sum(len(memoryview(p).cast("B")) for p in parts)
            return real(h, parts)

        monkeypatch.setattr(digest_mod, "payload_digest", counting)


def _stored_total(data: bytes) -> int:
    return read_pack_bytes(data).stored_bytes


@pytest.mark.parametrize("version", sorted(VERSIONS))
@pytest.mark.parametrize("codec_in,codec_out", [("none", "none"), ("zstd+bytegroup", "none"),
                                                ("none", "zstd+bytegroup"), ("zstd", "zstd+bytegroup")])
def test_output_is_what_the_writer_makes_and_verifies(version, codec_in, codec_out):
    header = _header(version)
    rows = _compressible(make_rows(header, 3))
    data = _written(header, rows, codec_in)
    got = _packed(data, codec_out)
    assert got == _written(replace(header, codec={"name": codec_out}), rows, codec_out)  # pack names no level
    back = read_pack_bytes(got)  # the output's own chain, over its own bytes
    assert all(np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values) for a, b in zip(back.layers, rows))
    if codec_in == codec_out == "none":
        assert got == data and back.root_digest == read_pack_bytes(data).root_digest


@pytest.mark.parametrize("digest", ["blake3", "sha256"])
def test_an_unchanged_frame_is_hashed_once(monkeypatch, digest):
    header = replace(_header("v1.1-blake3"), digest=digest)
    data = _written(header, make_rows(header, 1), "none")
    stored = _stored_total(data)
    count = _Counter(monkeypatch)
    assert _packed(data, "none") == data
    assert count.bytes == stored  # the reader's verification only; the writer linked its digests


def test_a_re_encoded_frame_is_hashed_once_on_each_side(monkeypatch):
    header = _header("v1.1-blake3")
    rows = _compressible(make_rows(header, 2))
    zdata = _written(header, rows, "zstd+bytegroup")
    raw = _written(header, rows, "none")
    assert _stored_total(zdata) < _stored_total(raw) // 2  # the frames really were compressed
    count = _Counter(monkeypatch)
    assert _packed(zdata, "none") == raw
    assert count.bytes == _stored_total(zdata) + _stored_total(raw)  # input as stored, output as written


def _payload_offsets(data: bytes) -> list[int]:
    """Offset of the first stored byte of every data frame."""
    return [o + FRAME_HEADER.size for o in frame_offsets(data)]


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_a_flipped_payload_bit_is_refused_and_no_end_frame_written(version):
    header = _header(version)
    data = _written(header, make_rows(header, 4), "none")
    offsets = _payload_offsets(data)
    assert len(offsets) == len(list(header.frame_plan()))
    for at in (offsets[0], offsets[len(offsets) // 2] + 5, offsets[-1] + 31):
        bad = bytearray(data)
        bad[at] ^= 0x10
        out = io.BytesIO()
        with pytest.raises(KVPackError, match="digest mismatch"):
            pack(io.BytesIO(bytes(bad)), out, codec="none")
        with pytest.raises(KVPackError):
            read_pack_bytes(out.getvalue())  # what was written before the bad frame never ends


def test_a_pipe_in_pieces_streams_the_same_bytes():
    header = _header("v1.1-blake3", n=90, chunk=8)
    data = _written(header, make_rows(header, 6), "none")
    out = io.BytesIO()
    with pipe_in_pieces(data, 1000) as src:
        res = pack(src, out, codec="none")
    assert out.getvalue() == data and res.bytes_in == len(data) and res.bytes_out == len(data)


def test_trailing_bytes_after_the_end_frame_are_refused():
    header = _header("v1.1-blake3")
    data = _written(header, make_rows(header, 7), "none")
    with pytest.raises(KVPackError, match="after the end frame"):
        pack(io.BytesIO(data + b"\0"), io.BytesIO(), codec="none")


@pytest.mark.parametrize("name", ["sha256", None])
def test_write_stored_hashes_itself_unless_the_digest_is_this_packs(monkeypatch, name):
    """A digest under another hash (or none) is never linked: the writer hashes the payload."""
    header = _header("v1.1-blake3", n=20, chunk=32)
    rows = make_rows(header, 8)
    ref = _written(header, rows, "none")
    buf = io.BytesIO()
    w = PackWriter(buf, header, codec="none")
    for layer, start, count in header.frame_plan():
        lk = rows[layer]
        stored = memoryview(np.concatenate([lk.keys.ravel(), lk.values.ravel()]).view(np.uint8))
        w.write_stored(layer, start, count, stored, payload_digest=b"\0" * 32, digest=name)
    w.finish()
    assert buf.getvalue() == ref  # the bogus digest was not used


def test_write_stored_refuses_a_payload_of_the_wrong_size():
    header = _header("v1.1-blake3", n=20, chunk=32)
    w = PackWriter(io.BytesIO(), header, codec="none")
    layer, start, count = next(iter(header.frame_plan()))
    with pytest.raises(KVPackError, match="expected"):
        w.write_stored(layer, start, count, memoryview(b"\0" * 10))
    with pytest.raises(KVPackError, match="out of plan"):
        w.write_stored(layer + 1, start, count, memoryview(b"\0" * 10))



# ------------------------------------------------------------------ a regular file is mapped
@pytest.fixture(params=["inline", "pool"])
def mapped_path(request, monkeypatch):
    """Both ways a mapped input is read: inline (small packs), and on the pool in runs of
    a few frames (the thresholds that keep these small packs inline lowered)."""
    if request.param == "pool":
        from muser_cli.kvpack import buffer as buffer_mod

        monkeypatch.setenv("MUSER_KVPACK_THREADS", "2")
        monkeypatch.setattr(buffer_mod, "PARALLEL_MIN_BYTES", 0)
        monkeypatch.setattr(buffer_mod, "task_bytes", lambda total: 2000)
    return request.param


def _packed_file(tmp_path, data: bytes, codec: str) -> tuple[bytes, object]:
    src = tmp_path / "in.kvpack"
    src.write_bytes(data)
    out = io.BytesIO()
    with open(src, "rb") as f:
        res = pack(f, out, codec=codec)
        assert f.tell() == len(data)  # the input is left at its end, as a stream read leaves it
    return out.getvalue(), res


@pytest.mark.parametrize("version", sorted(VERSIONS))
@pytest.mark.parametrize("codec_in,codec_out", [("none", "none"), ("zstd+bytegroup", "none"), ("none", "zstd+bytegroup")])
def test_a_file_input_gives_the_bytes_a_stream_input_gives(tmp_path, version, codec_in, codec_out, mapped_path):
    header = _header(version, n=90, chunk=8)
    rows = _compressible(make_rows(header, 3))
    data = _written(header, rows, codec_in)
    got, res = _packed_file(tmp_path, data, codec_out)
    assert got == _packed(data, codec_out)
    assert res.bytes_in == len(data) and res.bytes_out == len(got) and res.frames == len(list(header.frame_plan()))


def test_a_file_input_hashes_each_unchanged_payload_once(tmp_path, monkeypatch, mapped_path):
    header = _header("v1.1-blake3", n=200, chunk=8)
    data = _written(header, make_rows(header, 1), "none")
    stored = _stored_total(data)
    count = _Counter(monkeypatch)
    got, _ = _packed_file(tmp_path, data, "none")
    assert got == data and count.bytes == stored


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_a_flipped_bit_in_a_file_input_is_refused_and_no_end_frame_written(tmp_path, version, mapped_path):
    header = _header(version)
    data = _written(header, make_rows(header, 4), "none")
    offsets = _payload_offsets(data)
    for at in (offsets[0], offsets[len(offsets) // 2] + 5, offsets[-1] + 31):
        bad = bytearray(data)
        bad[at] ^= 0x10
        src = tmp_path / "bad.kvpack"
        src.write_bytes(bytes(bad))
        out = io.BytesIO()
        with open(src, "rb") as f, pytest.raises(KVPackError, match="digest mismatch"):
            pack(f, out, codec="none")
        with pytest.raises(KVPackError):
            read_pack_bytes(out.getvalue())
        bad_frame_start = max(o for o in offsets if o <= at) - FRAME_HEADER.size
        assert len(out.getvalue()) <= bad_frame_start  # nothing of the bad frame went out


@pytest.mark.parametrize("cut", ["trailing", "truncated"])
def test_a_file_input_with_bytes_after_or_missing_is_refused_as_a_stream_is(tmp_path, cut, mapped_path):
    header = _header("v1.1-blake3")
    data = _written(header, make_rows(header, 7), "none")
    bad = data + b"\0" if cut == "trailing" else data[:-70]
    src = tmp_path / "x.kvpack"
    src.write_bytes(bad)
    with pytest.raises(KVPackError) as streamed:
        pack(io.BytesIO(bad), io.BytesIO(), codec="none")
    with open(src, "rb") as f, pytest.raises(KVPackError) as mapped:
        pack(f, io.BytesIO(), codec="none")
    assert str(mapped.value) == str(streamed.value)


def test_a_quantized_file_input_is_refused_as_a_quantized_stream_is(tmp_path, mapped_path):
    from muser_cli.errors import UsageError

    header = _header("v1.1-blake3")
    plain = _written(header, _compressible(make_rows(header, 8)), "none")  # finite values
    quantized = io.BytesIO()
    pack(io.BytesIO(plain), quantized, codec="none", quant="int8")
    src = tmp_path / "q.kvpack"
    src.write_bytes(quantized.getvalue())
    with pytest.raises(UsageError, match="already quantized") as streamed:
        pack(io.BytesIO(quantized.getvalue()), io.BytesIO(), codec="none")
    out = io.BytesIO()
    with open(src, "rb") as f, pytest.raises(UsageError, match="already quantized") as mapped:
        pack(f, out, codec="none")
    assert str(mapped.value) == str(streamed.value)
    with pytest.raises(KVPackError):
        read_pack_bytes(out.getvalue())  # nothing usable was written
