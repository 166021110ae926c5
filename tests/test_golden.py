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

GOLDEN = Path(__file__).resolve().parent / "golden"
MANIFEST = json.loads((GOLDEN / "MANIFEST.json").read_text())  # v1.0
MANIFEST.update(json.loads((GOLDEN / "MANIFEST-v1_1.json").read_text()))
DOCS = (Path(__file__).resolve().parent.parent / "docs" / "kvpack.md").read_text()


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
    return replace(golden_header(layer_class), minor=minor, digest=digest)


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
        if "int8" in name:
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


def test_a_newer_minor_is_refused_by_version_not_as_corruption():
    data = bytearray((GOLDEN / "v1_1-full-rope-none-blake3.kvpack").read_bytes())
    data[10:12] = struct.pack("<H", 2)
    for read in (read_pack_bytes, lambda d: read_pack(io.BytesIO(d))):
        with pytest.raises(KVPackError, match=r"version 1\.2 is newer than this reader's 1\.1"):
            read(bytes(data))


# ------------------------------------------------------------------ a verifier from the spec alone
def _spec_verify(data: bytes) -> dict:
    """docs/kvpack.md 1, 2.1, 2.3, 2.4 and nothing else: returns the digests it computed."""
    import blake3

    assert data[:8] == b"\x89KVPACK\n"
    major, minor, hlen = struct.unpack_from("<HHI", data, 8)
    assert major == 1 and minor in (0, 1)
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
    """docs/kvpack.md 2.5 prints d_header, p_0, d_0 and the root of these two files."""
    got = _spec_verify((GOLDEN / name).read_bytes())
    for value in (got["d_header"], got["frames"][0]["p"], got["frames"][0]["d"], got["root"]):
        assert value in DOCS, f"{name}: {value} missing from docs/kvpack.md"
