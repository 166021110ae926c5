"""pack --info: verify and describe a pack without a model."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvpack_factory import make_pack
from muser_cli.commands import app


def test_info_human_and_json(tmp_path):
    data, header, _ = make_pack(41, codec="zstd+bytegroup")
    path = tmp_path / "p.kvpack"
    path.write_bytes(data)
    r = CliRunner().invoke(app, ["pack", "--info", str(path)])
    assert r.exit_code == 0, r.output
    assert "verified" in r.stdout and "2 sliding, 1 full" in r.stdout and "zstd+bytegroup" in r.stdout
    j = CliRunner().invoke(app, ["pack", "--info", "--json", str(path)])
    d = json.loads(j.stdout)
    assert d["tokens"] == 41 and d["layers"] == {"sliding": 2, "full": 1} and d["verified"] is True
    assert d["kv_bytes"] == header.total_logical_bytes() and d["pack_bytes"] == len(data)
    assert d["kv_bytes_by_kind"]["sliding"] == 2 * 7 * header.logical_row_bytes(0)


def test_info_refuses_a_damaged_pack(tmp_path):
    data, _, _ = make_pack(41)
    path = tmp_path / "p.kvpack"
    path.write_bytes(data[:-10])
    r = CliRunner().invoke(app, ["pack", "--info", str(path)])
    assert r.exit_code == 65 and "truncated" in r.stderr and r.stdout == ""
