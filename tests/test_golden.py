"""Golden kvpack v1.0 files: every later version must still read them, to the byte."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from golden_rows import golden_header, golden_rows
from muser_cli.kvpack import read_pack_bytes, write_pack
from muser_cli.kvpack.quant import to_float32

GOLDEN = Path(__file__).resolve().parent / "golden"
MANIFEST = json.loads((GOLDEN / "MANIFEST.json").read_text())


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_golden_file_reads_to_the_expected_rows(name):
    data = (GOLDEN / name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == MANIFEST[name], "golden files must never change"
    layer_class = name.split("-", 1)[1].rsplit("-", 1)[0]
    expect_header = golden_header(layer_class)
    expect = golden_rows(expect_header)
    pack = read_pack_bytes(data)
    assert pack.header.token_ids == expect_header.token_ids
    assert pack.header.layers == expect_header.layers
    for got, want in zip(pack.layers, expect):
        assert got.first_row == want.first_row
        if name.endswith("int8.kvpack"):
            err = pack.header.quant["error"]
            assert np.abs(to_float32(got.keys, "bfloat16") - to_float32(want.keys, "bfloat16")).max() <= err["k_max_abs"] + 1e-6
        else:
            assert np.array_equal(got.keys, want.keys) and np.array_equal(got.values, want.values)


@pytest.mark.parametrize("name", sorted(n for n in MANIFEST if n.endswith("none.kvpack")))
def test_writer_still_writes_v1_0_uncompressed_byte_for_byte(name):
    layer_class = name.split("-", 1)[1].rsplit("-", 1)[0]
    header = golden_header(layer_class)
    buf = io.BytesIO()
    write_pack(buf, header, golden_rows(header))
    assert buf.getvalue() == (GOLDEN / name).read_bytes()
