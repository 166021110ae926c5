"""One method for kvpack speed (issue 25 item 7): ``muser bench pack`` and
``benchmarks/bench_kvpack.py`` run the same library rounds; the script only adds cases.

Real parts: the tiny random long-context Llama prefilled by the torch engine, real files
with fsync, real child interpreters for the fresh-process loads. Nothing asserts a speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from muser_cli.bench.pack import DIGESTS, Study, mlx_arrays
from muser_cli.bench.pack_study import MemorySink
from muser_cli.errors import MuserError, UsageError
from handoff_kit import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def test_memory_sink_hands_out_the_pack_read_only_and_refuses_to_overflow():
    from muser_cli.kvpack import read_pack_bytes

    golden = (ROOT / "tests" / "golden" / "v1_1-full-rope-none-blake3.kvpack").read_bytes()
    sink = MemorySink(len(golden))
    sink.write(golden)
    view = sink.view()
    assert view.readonly and bytes(view) == golden
    # Parsed in place, the same pack as from bytes.
    a, b = read_pack_bytes(view), read_pack_bytes(golden)
    assert a.root_digest == b.root_digest and len(a.layers) == len(b.layers)
    with pytest.raises(MuserError, match="too small"):
        sink.write(b"x")


def test_study_adds_cases_to_bench_packs_rounds(tmp_path):
    from muser_cli.bench.api import bench_pack

    plain = bench_pack(model="tiny", depths="48", reps=1, receipt=tmp_path / "plain.json")
    study = bench_pack(model="tiny", depths="48", reps=1, receipt=tmp_path / "study.json",
                       study=Study(digests=tuple(DIGESTS), floor=True, tmpfs=True, fresh_reps=1))
    (p,), (s,) = plain.payload["rows"], study.payload["rows"]
    # Every case of bench pack is in the study, in the same order, measured the same way.
    assert [c for c in s["cases"] if c in p["cases"]] == p["cases"]
    assert {"hash only, no copy (the floor)", "pack none [v1.0 sha256]", "load kvpack none [v1.1 sha256]",
            "pack none -> tmpfs file"} <= set(s["cases"]) - set(p["cases"])
    assert p["bytes"]["pack none"] == s["bytes"]["pack none"] == s["bytes"]["file kvpack none"]
    for row in (p, s):  # wall clock and CPU seconds of every case
        assert set(row["GB_per_cpu_s"]) == set(row["seconds"]) and row["cpu_vs_memcpy"]["memcpy"] == 1.0
    assert set(s["load_fresh_process"]) == {n[5:] for n in s["cases"] if n.startswith("load ")}
    assert "load_fresh_process" not in p
    receipt = json.loads((tmp_path / "study.json").read_text())
    assert receipt["benchmark"] == "pack" and receipt["study"]["fresh_reps"] == 1


def test_unknown_study_digest_is_a_usage_error(tmp_path):
    from muser_cli.bench.api import bench_pack

    out = tmp_path / "receipts"
    out.mkdir()
    with pytest.raises(UsageError):
        bench_pack(model="tiny", depths="48", reps=1, receipt=out, study=Study(digests=("md5",)))
    assert not list(out.iterdir())


def test_mlx_load_is_evaluated_array_by_array():
    """What a load must evaluate: the key and value arrays, never the cache's int offset."""

    class Cache:
        keys, values, offset = "k", "v", 3

    assert mlx_arrays([Cache(), Cache()]) == [["k", "v"], ["k", "v"]]


def test_bench_kvpack_script_is_a_caller_of_the_library(tmp_path):
    """The script's receipt is the library's kind (``pack``), with the study's cases."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "MUSER_HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kvpack.py"), "-m", "tiny", "--depths", "40",
                          "--reps", "1", "--fresh-reps", "0", "--no-cli"], capture_output=True, text=True, env=env,
                         timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [l for l in out.stdout.splitlines() if l.startswith("receipt: ")][-1]
    path = Path(line.split(" ", 1)[1])
    try:
        receipt = json.loads(path.read_text())
        assert receipt["benchmark"] == "pack" and receipt["method"] == "muser_cli/bench/pack.py"
        assert "hash only, no copy (the floor)" in receipt["rows"][0]["cases"]
    finally:
        path.unlink()
