"""The live lane at the depth of the system we follow: a tiny random model with 132k
positions streams a 131,072-token lane exactly, `prefill | pack | verify | decode`, and the
middle stages keep their peak memory independent of the pack's size.

The bound, stated: pack and verify hold a few frames at a time (the parser's step, the
frame being written; here 4,096-row frames of 512 KiB), never the pack. Their Python-level
allocations stay flat from frame to frame (tracemalloc: 7.7 MiB throughout a 32-frame
stream); their peak RSS at 131,072 tokens is measured against their peak at 16,384
tokens (same frames, eight times the pack, 14.5 MiB more) and must grow by less than
three quarters of what the pack grew — a stage that held the pack would grow by all of it
(seen here: +8 MiB, allocator and thread-pool pages, not frames kept).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from handoff_kit import HANG_S

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parents[1]  # tests/, where the kits live
CHUNK = "4096"


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, _session_env):
    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tiny import make_tiny_long_llama

    return resolve_model(make_tiny_long_llama(tmp_path_factory.mktemp("long") / "tiny-long-llama"))


def _doc(info, n: int, path: Path) -> Path:
    from muser_cli.model.tiny import _CORPUS
    from muser_cli.model.tokens import decode_text, encode_prompt

    text = _CORPUS
    while len(encode_prompt(info, text)) < n:
        text *= 2
    path.write_text(decode_text(info, encode_prompt(info, text)[:n]))
    assert len(encode_prompt(info, path.read_text())) == n
    return path


def _lane(model: str, doc: Path, tmp: Path) -> tuple[dict, int, int, int]:
    """(decode --json, pack peak KiB, verify peak KiB, kvpack bytes)."""
    mu = [sys.executable, "-m", "muser_cli.commands"]
    rss = [sys.executable, str(HERE / "peak_rss.py")]
    common = ["-m", model, "--threads", "2"]
    pack_rss, verify_rss, size = tmp / "pack.rss", tmp / "verify.rss", tmp / "size"
    pre = subprocess.Popen([*mu, "prefill", *common, "--dtype", "float32", "--chunk", CHUNK, str(doc)],
                           stdout=subprocess.PIPE)
    pk = subprocess.Popen([*rss, str(pack_rss), "--", *mu, "pack", "--no-zstd"], stdin=pre.stdout,
                          stdout=subprocess.PIPE)
    pre.stdout.close()
    tee = subprocess.Popen([sys.executable, "-c", "import sys,shutil\nn=0\nwhile b:=sys.stdin.buffer.read1(1<<20):\n"
                            " n+=len(b); sys.stdout.buffer.write(b)\nsys.stdout.flush(); open(sys.argv[1],'w').write(str(n))",
                            str(size)], stdin=pk.stdout, stdout=subprocess.PIPE)
    pk.stdout.close()
    ve = subprocess.Popen([*rss, str(verify_rss), "--", *mu, "verify", "-m", model], stdin=tee.stdout,
                          stdout=subprocess.PIPE)
    tee.stdout.close()
    de = subprocess.run([*mu, "decode", *common, "-n", "4", "--json", "--dtype", "float32"], stdin=ve.stdout,
                        capture_output=True, timeout=max(HANG_S, 3000))
    ve.stdout.close()
    for p in (pre, pk, tee, ve):
        assert p.wait(timeout=HANG_S) == 0
    assert de.returncode == 0, de.stderr[-2000:]
    return json.loads(de.stdout), int(pack_rss.read_text()), int(verify_rss.read_text()), int(size.read_text())


def test_a_131072_token_lane_streams_exactly_in_bounded_memory(long_model, tmp_path):
    model = str(long_model.path)
    small, small_pack, small_verify, small_size = _lane(model, _doc(long_model, 16_384, tmp_path / "16k.txt"),
                                                        tmp_path)
    big, big_pack, big_verify, big_size = _lane(model, _doc(long_model, 131_072, tmp_path / "131k.txt"), tmp_path)
    assert big["prompt_tokens"] == 131_072 and big["source"] == "handoff"
    grew = big_size - small_size
    assert grew > 14 << 20
    for name, a, b in (("pack", small_pack, big_pack), ("verify", small_verify, big_verify)):
        assert (b - a) * 1024 < 0.75 * grew, f"{name} peak RSS grew {(b - a) / 1024:.1f} MiB for {grew >> 20} MiB more pack"
    local = subprocess.run([sys.executable, "-m", "muser_cli.commands", "decode", "-m", model, "--threads", "2",
                            "--dtype", "float32", "--chunk", CHUNK, "--prompt", str(tmp_path / "131k.txt"), "-n", "4",
                            "--json"], input=b"", capture_output=True, timeout=max(HANG_S, 3000))
    assert local.returncode == 0, local.stderr[-2000:]
    assert json.loads(local.stdout)["token_ids"] == big["token_ids"]
