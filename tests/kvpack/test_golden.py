"""Golden kvpack files of every version: every later reader must still read them, to the
byte; the writer still writes each version byte for byte; and a verifier written from
docs/kvpack.md alone (struct + hashlib + blake3, no muser code) accepts them."""

from __future__ import annotations

import hashlib
import io
import json
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from golden_rows import golden_header, golden_rows
from muser_cli.errors import KVPackError
from muser_cli.kvpack import PackReader, read_pack, read_pack_bytes, write_pack
from muser_cli.kvpack.quant import to_float32

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
MANIFEST = json.loads((GOLDEN / "MANIFEST.json").read_text())  # v1.0
MANIFEST.update(json.loads((GOLDEN / "MANIFEST-v1_1.json").read_text()))
MANIFEST.update(json.loads((GOLDEN / "MANIFEST-v1_2.json").read_text()))
MANIFEST.update(json.loads((GOLDEN / "MANIFEST-v1_3.json").read_text()))
MANIFEST.update(json.loads((GOLDEN / "MANIFEST-v1_4.json").read_text()))
DOCS = (Path(__file__).resolve().parents[2] / "docs" / "kvpack.md").read_text()


def _parts(name: str) -> tuple[int, str, str, str]:
    """(minor, layer class, codec, digest) from a golden file name."""
    stem = name[: -len(".kvpack")]
    version, rest = stem.split("-", 1)
    minor = int(version.split("_")[1])
    bits = rest.split("-")
    if minor == 0:
        return 0, "-".join(bits[:2]), bits[2], "sha256"
    return minor, "-".join(bits[:2]), bits[2], bits[3]


def _header(name: str):
    minor, layer_class, _, digest = _parts(name)
    return replace(golden_header(layer_class), minor=minor, digest=digest, ring_extra=1 if minor in (2, 4) else 0)


@pytest.mark.parametrize("name", sorted(MANIFEST))
@pytest.mark.parametrize("how", ["bytes", "file", "stream"])
def test_golden_file_reads_to_the_expected_rows(name, how, tmp_path):
    data = (GOLDEN / name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == MANIFEST[name], "golden files must never change"
    expect_header = _header(name)
    expect = golden_rows(expect_header)
    if how == "bytes":
        pack = read_pack_bytes(data)
    elif how == "file":  # memory-mapped
        with open(GOLDEN / name, "rb") as fh:
            pack = read_pack(fh)
    else:  # the streaming reader, as a pipe would feed it
        pack = read_pack(io.BytesIO(data))
    assert pack.header.token_ids == expect_header.token_ids
    assert pack.header.layers == expect_header.layers
    assert pack.header.minor == expect_header.minor and pack.header.digest == expect_header.digest
    for got, want in zip(pack.layers, expect):
        assert got.first_row == want.first_row
        if hasattr(want, "tensors"):  # a state layer (1.3): the newest snapshot only, never quantized
            assert got.position == want.position == pack.header.rows_end and set(got.tensors) == set(want.tensors)
            assert all(np.array_equal(got.tensors[k], want.tensors[k]) for k in want.tensors)
        elif "int8" in name:
            err = pack.header.quant["error"]
            assert np.abs(to_float32(got.keys, "bfloat16") - to_float32(want.keys, "bfloat16")).max() <= err["k_max_abs"] + 1e-6
        else:
            assert np.array_equal(got.keys, want.keys) and np.array_equal(got.values, want.values)


@pytest.mark.parametrize("name", sorted(n for n in MANIFEST if "-none" in n))
def test_writer_still_writes_each_version_uncompressed_byte_for_byte(name):
    header = _header(name)
    buf = io.BytesIO()
    write_pack(buf, header, golden_rows(header))
    assert buf.getvalue() == (GOLDEN / name).read_bytes()


@pytest.mark.parametrize("name", sorted(n for n in MANIFEST if n.startswith("v1_1")))
def test_a_reader_limited_to_v1_0_refuses_v1_1_naming_both_versions(name):
    data = (GOLDEN / name).read_bytes()
    with pytest.raises(KVPackError, match=r"version 1\.1 is newer than this reader's 1\.0"):
        PackReader(max_minor=0).feed(data)


@pytest.mark.parametrize("name", sorted(n for n in MANIFEST if n.startswith("v1_2")))
def test_a_reader_limited_to_v1_1_refuses_v1_2_naming_both_versions(name):
    data = (GOLDEN / name).read_bytes()
    with pytest.raises(KVPackError, match=r"version 1\.2 is newer than this reader's 1\.1"):
        PackReader(max_minor=1).feed(data)
    with pytest.raises(KVPackError, match=r"version 1\.2 is newer than this reader's 1\.1"):
        read_pack_bytes(data, max_minor=1)


@pytest.mark.parametrize("name, minor, adds", [
    *((n, 3, r"1\.3 adds layer kinds latent and state") for n in sorted(MANIFEST) if n.startswith("v1_3")),
    *((n, 4, r"1\.4 adds layer kind chunked") for n in sorted(MANIFEST) if n.startswith("v1_4")),
])
def test_a_reader_one_minor_older_refuses_the_file_naming_what_the_minor_adds(name, minor, adds):
    """1.2 readers refuse 1.3 (latent, state), 1.3 readers refuse 1.4 (chunked), by version."""
    data = (GOLDEN / name).read_bytes()
    older = minor - 1
    for read in (lambda: PackReader(max_minor=older).feed(data), lambda: read_pack_bytes(data, max_minor=older)):
        with pytest.raises(KVPackError, match=rf"version 1\.{minor} is newer than this reader's 1\.{older} .*{adds}"):
            read()


def test_a_1_3_header_holding_a_chunked_layer_is_refused_by_the_kinds_name():
    from muser_cli.kvpack.format import canonical_json
    from muser_cli.kvpack.validate import parse_header

    data = (GOLDEN / "v1_4-chunked-rope-none-blake3.kvpack").read_bytes()
    obj = json.loads(data[16:16 + struct.unpack_from("<I", data, 12)[0]])
    with pytest.raises(KVPackError, match=r"layers\[0\]\.kind 'chunked' needs kvpack 1\.4 \(this header is 1\.3\)"):
        parse_header(canonical_json({**obj, "version": [1, 3]}), 1, 3)
    assert parse_header(canonical_json(obj), 1, 4).layers[0].chunk == 5
    for bad, msg in (({"chunk": 1}, r"chunk=1 outside \[2, "), ({"window": 5}, "must have exactly the keys"),
                     ({"chunk": None}, r"chunk has the wrong type")):
        layer = {**obj["layers"][0], **bad}
        with pytest.raises(KVPackError, match=msg):
            parse_header(canonical_json({**obj, "layers": [layer, obj["layers"][1]]}), 1, 4)


def test_v1_4_chunked_layers_carry_the_current_chunk_and_the_ring_row():
    """21 tokens (end 20), chunk 5: the chunk of position 20 starts at 20, so without ring_extra
    the chunked layer carries nothing; with ring_extra 1 it carries the chunk of position 19,
    [15, 20), so the last position can be recomputed from the pack (docs/kvpack.md 1.3)."""
    pack = read_pack_bytes((GOLDEN / "v1_4-chunked-rope-none-blake3.kvpack").read_bytes())
    h = pack.header
    assert h.ring_extra == 1 and h.raw["ring_extra"] == 1 and h.layer_first_row(0) == 15 and h.layer_rows(0) == 5
    assert pack.layers[0].first_row == 15 and pack.layers[0].keys.shape == (2, 5, 8)
    assert [f for f in h.frame_plan() if f[0] == 0] == [(0, 15, 1), (0, 16, 4)]
    assert replace(h, ring_extra=0).layer_rows(0) == 0  # what a decoding cache holds after 20 positions
    spec = h.layers[0]
    assert [spec.carried_rows(n) for n in (0, 1, 4, 5, 6, 9, 10, 11)] == [0, 1, 4, 0, 1, 4, 0, 1]
    assert [spec.carried_rows(n, 1) for n in (0, 1, 4, 5, 6, 9, 10, 11)] == [0, 1, 4, 5, 1, 4, 5, 1]
    assert [spec.carried_rows(n, 3) for n in (5, 6, 7, 8)] == [5, 6, 7, 3]


@pytest.mark.parametrize("kind", ["latent", "state"])
def test_a_1_2_header_holding_a_1_3_kind_is_refused_by_the_kinds_name(kind):
    """A header that claims 1.2 but holds a 1.3 layer kind names the kind and the version it needs."""
    from muser_cli.kvpack.format import canonical_json
    from muser_cli.kvpack.validate import parse_header

    name = {"latent": "v1_3-latent-rope-none-blake3.kvpack", "state": "v1_3-hybrid-state-none-blake3.kvpack"}[kind]
    data = (GOLDEN / name).read_bytes()
    obj = json.loads(data[16:16 + struct.unpack_from("<I", data, 12)[0]])
    with pytest.raises(KVPackError, match=rf"layers\[0\]\.kind '{kind}' needs kvpack 1\.3 \(this header is 1\.2\)"):
        parse_header(canonical_json({**obj, "version": [1, 2]}), 1, 2)


def test_v1_3_state_files_carry_a_snapshot_per_chunk_and_hand_out_the_newest():
    """The hybrid file's state layer has one frame per grid chunk (8, 16, 20: 21 tokens, grid 8),
    each a whole snapshot; its raw bytes count every snapshot, readers keep the last."""
    data = (GOLDEN / "v1_3-hybrid-state-none-blake3.kvpack").read_bytes()
    pack = read_pack_bytes(data)
    h = pack.header
    plan = [f for f in h.frame_plan() if f[0] == 0]
    assert plan == [(0, 0, 8), (0, 8, 8), (0, 16, 4)] and h.layer_frames(0) == 3
    assert h.layers[0].state_bytes == 12 * 4 * 2 + 2 * 4 * 4 * 4 == 224
    assert h.total_raw_bytes() == 3 * 224 + 20 * 32 and h.total_logical_bytes() == 224 + 20 * 32
    assert pack.layers[0].position == 20 and pack.layers[0].tensors["recurrent"].dtype == np.dtype("<f4")


def test_v1_2_sliding_layers_carry_ring_extra_rows_more():
    """The v1.2 files' sliding layers (window 6) hold 6 rows where v1.1's hold 5."""
    new = read_pack_bytes((GOLDEN / "v1_2-sliding-rope-none-blake3.kvpack").read_bytes())
    old = read_pack_bytes((GOLDEN / "v1_1-sliding-rope-none-blake3.kvpack").read_bytes())
    assert new.header.ring_extra == 1 and new.header.raw["ring_extra"] == 1 and old.header.ring_extra == 0
    assert "ring_extra" not in old.header.raw
    for a, b in zip(new.layers, old.layers):
        assert a.keys.shape[1] == b.keys.shape[1] + 1 == 6 and a.first_row == b.first_row - 1
        assert np.array_equal(a.keys[:, 1:], b.keys) and np.array_equal(a.values[:, 1:], b.values)


def test_ring_extra_is_refused_where_it_has_no_place():
    """Only a 1.2 header may hold ring_extra, only > 0 (absent means 0), only with a sliding layer."""
    data = (GOLDEN / "v1_2-sliding-rope-none-blake3.kvpack").read_bytes()
    hlen = struct.unpack_from("<I", data, 12)[0]
    obj = json.loads(data[16:16 + hlen])
    from muser_cli.kvpack.validate import parse_header

    def canon(o):
        return json.dumps(o, sort_keys=True, separators=(",", ":")).encode()
    assert parse_header(canon(obj), 1, 2).ring_extra == 1
    as_1_1 = {**obj, "version": [1, 1]}
    with pytest.raises(KVPackError, match=r"unknown key\(s\) \['ring_extra'\] for version 1\.1"):
        parse_header(canon(as_1_1), 1, 1)
    with pytest.raises(KVPackError, match=r"ring_extra=0 outside \[1, "):
        parse_header(canon({**obj, "ring_extra": 0}), 1, 2)
    full = {**obj, "layers": [{**l, "kind": "full", "window": None} for l in obj["layers"]]}
    with pytest.raises(KVPackError, match="ring_extra needs a sliding or chunked layer"):
        parse_header(canon(full), 1, 2)


def test_a_newer_minor_is_refused_by_version_not_as_corruption():
    data = bytearray((GOLDEN / "v1_2-sliding-rope-none-blake3.kvpack").read_bytes())
    data[10:12] = struct.pack("<H", 5)  # one past the newest (1.4 since the chunked kind)
    for read in (read_pack_bytes, lambda d: read_pack(io.BytesIO(d))):
        with pytest.raises(KVPackError, match=r"version 1\.5 is newer than this reader's 1\.4"):
            read(bytes(data))


# ------------------------------------------------------------------ a verifier from the spec alone
def _spec_verify(data: bytes) -> dict:
    """docs/kvpack.md 1, 2.1, 2.3, 2.4 and nothing else: returns the digests it computed."""
    import blake3

    assert data[:8] == b"\x89KVPACK\n"
    major, minor, hlen = struct.unpack_from("<HHI", data, 8)
    assert major == 1 and minor in (0, 1, 2, 3, 4)
    hjson = data[16:16 + hlen]
    obj = json.loads(hjson)
    assert json.dumps(obj, sort_keys=True, separators=(",", ":")).encode() == hjson
    name = obj.get("digest", "sha256") if minor >= 1 else "sha256"
    H = {"sha256": hashlib.sha256, "blake3": blake3.blake3}[name]
    d = hashlib.sha256(b"kvpack/v1 header\0" + data[:16] + hjson).digest()
    out = {"digest": name, "d_header": d.hex(), "frames": []}
    pos = 16 + hlen + (-(16 + hlen) % 64)
    seq = 0
    while True:
        fh = data[pos:pos + 64]
        tag, fseq, _layer, _start, _count, _codec, _fl, _rs, _raw, stored_len = struct.unpack("<4sIIIIBBHQQ24x", fh)
        assert fseq == seq
        if tag == b"KVND":
            root = H(d + fh).digest()
            assert data[pos + 64:pos + 96] == root and data[pos + 96:pos + 128] == bytes(32)
            assert pos + 128 == len(data)
            out["root"] = root.hex()
            return out
        payload = data[pos + 64:pos + 64 + stored_len]
        if minor == 0:
            d = hashlib.sha256(d + fh + payload).digest()
        else:
            p = H(payload).digest()
            d = H(d + fh + p).digest()
            out["frames"].append({"p": p.hex(), "d": d.hex()})
        pos += 64 + stored_len + (-stored_len % 64)
        assert data[pos:pos + 32] == d and data[pos + 32:pos + 64] == bytes(32)
        pos += 64
        seq += 1


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_a_verifier_written_from_the_spec_alone_accepts_every_golden_file(name):
    data = (GOLDEN / name).read_bytes()
    got = _spec_verify(data)
    assert got["root"] == read_pack_bytes(data).root_digest.hex()
    assert got["digest"] == _parts(name)[3]


@pytest.mark.parametrize("name", ["v1_1-full-nope-none-blake3.kvpack", "v1_1-full-nope-none-sha256.kvpack"])
def test_the_spec_test_vectors_are_these_files(name):
    """docs/kvpack.md 2.6 prints d_header, p_0, d_0 and the root of these two files."""
    got = _spec_verify((GOLDEN / name).read_bytes())
    for value in (got["d_header"], got["frames"][0]["p"], got["frames"][0]["d"], got["root"]):
        assert value in DOCS, f"{name}: {value} missing from docs/kvpack.md"
