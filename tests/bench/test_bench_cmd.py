"""``muser bench lane|pack|wire|depth`` through the command line, on tiny settings.

Real parts only: a tiny random model prefilled by the torch engine, a real ``muser
receive`` process on 127.0.0.1 over mutual TLS, real files with fsync, matplotlib's own
PNG opened back with Pillow. Nothing here asserts on speed: the figures are checked for
shape (medians, every rep, CV, the machine), never for value.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from muser_cli.commands import app
from handoff_kit import HANG_S

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory) -> Path:
    from muser_cli.model.tiny import make_tiny_long_llama

    return make_tiny_long_llama(tmp_path_factory.mktemp("bench-models") / "tiny-long")


def bench(*args: str):
    return runner.invoke(app, ["bench", *args])


def check_png(path: Path) -> None:
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG"
        w, h = im.size
        assert w >= 600 and h >= 300, im.size
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 10, "a blank chart"
        # Not just a white page with a frame: a fair share of pixels are not background.
        inked = sum(n for n, c in colours if c != (255, 255, 255))
        assert inked > 0.02 * w * h


def check_stats(s: dict, reps: int) -> None:
    assert set(s) >= {"median", "cv", "min", "max", "reps"}
    assert len(s["reps"]) == reps
    assert all(isinstance(v, float) and math.isfinite(v) for v in s["reps"])
    assert min(s["reps"]) == s["min"] <= s["median"] <= s["max"] == max(s["reps"])
    assert s["cv"] >= 0


def check_machine(receipt: dict) -> None:
    m = receipt["machine"]
    assert {"python", "platform", "cpus", "numpy", "date", "git", "loadavg"} <= set(m)
    assert m["cpus"] >= 1
    assert {"git", "loadavg", "date"} <= set(receipt["started"])


def only_file(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, found
    return found[0]


def test_bench_pack_receipt_and_chart(tmp_path):
    png = tmp_path / "pack.png"
    res = bench("pack", "-m", "tiny", "--reps", "2", "--depths", "64", "--plot", str(png), "--receipt",
                str(tmp_path), "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    path = only_file(tmp_path, "pack-*.json")
    assert out["receipt"] == str(path) and out["plot"] == str(png)
    receipt = json.loads(path.read_text())
    check_machine(receipt)
    assert receipt["benchmark"] == "pack" and receipt["reps"] == 2 and receipt["warmup"] == 1
    (row,) = receipt["rows"]
    assert row["depth"] == 64 and row["prompt_digest"].startswith("sha256:")
    for name in ("memcpy", "pack none", "unpack none", "pack zstd+bytegroup", "unpack zstd+bytegroup",
                 "save kvpack none", "load kvpack none"):
        check_stats(row["seconds"][name], 2)
        check_stats(row["GBps"][name], 2)
    assert row["vs_memcpy"]["memcpy"] == 1.0
    # The uncompressed pack holds every raw byte of the KV, plus its header and digests.
    assert row["bytes"]["pack none"] > row["raw_kv_bytes"] > 0
    assert row["bytes"]["file kvpack none"] == row["bytes"]["pack none"]
    if receipt["mlx_lm"]:
        check_stats(row["seconds"]["save mlx-lm prompt cache"], 2)
        assert row["bytes_vs_mlx_lm"]["mlx-lm prompt cache"] == 1.0
    check_png(png)
    # The same chart again from the receipt alone; a receipt of something else is refused.
    again = tmp_path / "again.png"
    res = bench("chart", str(path), "--plot", str(again))
    assert res.exit_code == 0, res.output
    check_png(again)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**receipt, "benchmark": "os.system"}))
    res = bench("chart", str(other), "--plot", str(tmp_path / "no.png"))
    assert res.exit_code == 65 and not (tmp_path / "no.png").exists()
    assert len(res.stderr.strip().splitlines()) == 1
    other.write_text(json.dumps({"benchmark": "lane", "rows": [{"depth": 8}]}))
    res = bench("chart", str(other), "--plot", str(tmp_path / "no.png"))
    assert res.exit_code == 65 and not (tmp_path / "no.png").exists(), res.output


def thread_affinities() -> set[frozenset[int]]:
    import os

    out = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            out.add(frozenset(os.sched_getaffinity(int(tid))))
        except OSError:
            pass
    return out


def test_bench_lane_table_receipt_and_chart(tiny_long, tmp_path):
    import os

    png, rec = tmp_path / "lane.png", tmp_path / "lane.json"
    before = os.sched_getaffinity(0)
    res = bench("lane", "-m", str(tiny_long), "--reps", "2", "--depths", "32,96", "--plot", str(png),
                "--receipt", str(rec))
    assert res.exit_code == 0, res.output
    # Pinned phase by phase, then every thread of this process (workers it started included) let go.
    assert thread_affinities() == {frozenset(before)}
    lines = res.stdout.strip().splitlines()
    assert "local TTFT" in lines[0] and len(lines) == 3
    assert lines[1].split("|")[0].strip() == "32" and lines[2].split("|")[0].strip() == "96"
    receipt = json.loads(rec.read_text())
    check_machine(receipt)
    assert receipt["lanes"] == ["local", "handoff"]
    assert "cpu" in receipt["pinning"] or "not pinned" in receipt["pinning"]
    for row in receipt["rows"]:
        for key in ("prefill", "first", "ttft"):
            check_stats(row["local"][key], 2)
        for key in ("prefill", "pack", "send", "read", "ttft", "overhead", "overhead_frac"):
            check_stats(row["handoff"][key], 2)
        check_stats(row["handoff_over_local"], 2)
        assert row["bytes"] > 0 and isinstance(row["token"], int)
        assert row["prompt_digest"].startswith("sha256:")
    check_png(png)


def test_bench_wire_receipt_and_chart(tmp_path):
    png = tmp_path / "wire.png"
    res = bench("wire", "--sizes", "1,2", "--reps", "2", "--probe-seconds", "0.1", "--plot", str(png),
                "--receipt", str(tmp_path), "--json")
    assert res.exit_code == 0, res.output
    receipt = json.loads(only_file(tmp_path, "wire-*.json").read_text())
    check_machine(receipt)
    assert [r["megabytes"] for r in receipt["rows"]] == [1, 2]
    for row in receipt["rows"]:
        for key in ("probe_up_Bps", "payload_rate_Bps", "end_to_end_Bps", "ratio", "end_to_end_ratio"):
            check_stats(row[key], 2)
        assert row["bytes"] > 0.9e6 * row["megabytes"]
    check_png(png)


def test_bench_depth_every_path_receipt_and_chart(tiny_long, tmp_path):
    """One shallow depth, one rep: every path ran as whole processes and gave the local first
    token (the bench refuses otherwise), each stage's peak RSS is its own, the delta carried
    exactly the rows the consumer lacked."""
    png, rec = tmp_path / "depth.png", tmp_path / "depth.json"
    res = bench("depth", "-m", str(tiny_long), "--depths", "160", "--chunk", "32", "--reps", "1", "--plot", str(png),
                "--receipt", str(rec))
    assert res.exit_code == 0, res.output
    assert "store ÷ local" in res.stdout
    receipt = json.loads(rec.read_text())
    check_machine(receipt)
    (row,) = receipt["rows"]
    assert row["depth"] == row["prompt_tokens"] == 160
    assert row["sources"] == {"local": ["local"], "push": ["handoff"], "store": ["store"], "delta": ["delta"],
                              "pull": ["handoff"]}
    for path in ("local", "push", "store", "delta", "pull"):
        check_stats(row[path]["ttft"], 1)
    assert row["store"]["computed_tokens"] == 0
    assert row["delta"]["held_tokens"] == 64  # the half: 81 tokens, 80 rows, two whole chunks of 32
    assert row["delta"]["kv_over_minimum"] == pytest.approx(1.0, abs=1e-12)
    assert row["delta"]["kv_over_ring_minimum"] == pytest.approx(1.0, abs=1e-12)  # no sliding layer: the same
    rss = {k: v["median"] for k, v in row["push"]["rss"].items()}
    # the streaming stages load no model: each figure is that process's own peak (tens of MB),
    # not this test process's (hundreds: torch and the model loaded) as a forked child would read
    assert all(rss[k] < min(rss["decode"], 150e6) for k in ("send", "receive", "verify")), rss
    assert rss["decode"] > 150e6  # torch and the model
    check_png(png)


@pytest.mark.parametrize(("args", "status", "words"), [
    (["pack", "--depths", "abc"], 2, "--depths"),
    (["lane", "--depths", "512,,8"], 2, "--depths"),
    (["lane", "--reps", "0"], 2, "--reps"),
    (["wire", "--sizes", "1,x"], 2, "--sizes"),
    (["lane", "--codec", "lz4"], 2, "--codec"),
    (["pack", "--plot", "{tmp}/chart.jpg"], 2, ".png"),
    (["pack", "--plot", "{tmp}"], 2, "directory"),
    (["lane", "--plot", "{tmp}/no/such/folder/x.png"], 66, "does not exist"),
    (["wire", "--receipt", "{tmp}/no/such/folder/r.json"], 66, "does not exist"),
    (["lane", "-m", "tiny", "--depths", "200000"], 2, "context"),
    (["depth", "--chunk", "4"], 2, "--chunk"),
    (["depth", "--depths", "2"], 2, "--depths"),
])
def test_bad_inputs_one_line_and_nothing_written(tmp_path, args, status, words):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    res = bench(*args, "--receipt", str(tmp_path)) if "--receipt" not in args else bench(*args)
    assert res.exit_code == status, res.output
    lines = [line for line in res.stderr.splitlines() if line.startswith("muser: error:")]
    assert len(lines) == 1 and words in lines[0], res.stderr
    assert "Traceback" not in res.output
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "muser-home") == \
        [n for n in before if n != "muser-home"]


def test_plot_without_matplotlib_is_one_line_78_before_measuring(tmp_path):
    """matplotlib made unimportable in a real process: exit 78 with the install hint, nothing written."""
    code = ("import sys; sys.modules['matplotlib'] = None; from muser_cli.commands import main; "
            "sys.argv = ['muser'] + sys.argv[1:]; main()")
    png = tmp_path / "x.png"
    p = subprocess.run([sys.executable, "-c", code, "bench", "wire", "--sizes", "1", "--plot", str(png),
                        "--receipt", str(tmp_path)], capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 78, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("muser: error:") and "muser[plot]" in line
    assert list(tmp_path.iterdir()) == []


def test_statistics_are_the_documented_ones():
    from muser_cli.bench.common import parse_ints, summarize

    s = summarize([3.0, 1.0, 2.0, 10.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 10.0 and s["reps"] == [3.0, 1.0, 2.0, 10.0]
    mean = 4.0
    pstdev = math.sqrt(sum((x - mean) ** 2 for x in (3, 1, 2, 10)) / 4)
    assert s["cv"] == pytest.approx(pstdev / mean)
    assert summarize([5.0])["cv"] == 0.0
    assert parse_ints(" 512, 2048 ,8064", what="--depths") == [512, 2048, 8064]


def test_pinning_moves_every_thread_phase_by_phase():
    """A consumer phase runs with the worker threads on the consumer's core too, and release
    gives them all back (real threads, real affinity; skipped on one core)."""
    import os
    import threading

    from muser_cli.bench.common import pinning

    pins = pinning()
    if not pins.pinned:
        pytest.skip("one core: nothing is pinned")
    go, done, seen = threading.Event(), threading.Event(), {}

    def worker():
        go.wait(HANG_S)
        seen["in phase"] = os.sched_getaffinity(0)
        done.wait(HANG_S)
        seen["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    try:
        pins.enter("producer")
        pins.enter("consumer")
        go.set()
        while "in phase" not in seen and t.is_alive():
            t.join(0.01)
    finally:
        pins.release()
        done.set()
        t.join(HANG_S)
    assert seen == {"in phase": {pins.consumer}, "after": set(pins.original)}
