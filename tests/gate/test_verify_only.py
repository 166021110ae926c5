"""``muser verify FILE`` with no --audit and nowhere to pass the pack on reads it frame by frame
(:func:`muser_cli.gate.verify.verify_only`): the same verdict and summary as reading it whole,
a refusal that still says whose pack it is, a delta read whole again from where it began (a file)
or spooled once (a pipe), and a peak memory that does not follow the pack's size."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from handoff_kit import HANG_S
from muser_cli.commands import app

DOC = ("The producer computes the prompt once and ships its keys and values to the consumer. "
       "The consumer checks every frame, installs the rows and decodes the next token itself.")
MORE = " When the network fails, the consumer falls back to a local prefill and still answers."
SAME = ("pack_bytes", "kv_bytes", "rows", "tokens", "model", "model_fingerprint", "root_digest", "codec", "dtype",
        "ratio", "layers")


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("MUSER_THREADS", "1")


def ok(*args, input: bytes | None = None):
    r = CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r


@pytest.fixture
def packs(tiny_llama, tmp_path: Path) -> dict[str, Path]:
    m = tiny_llama.path
    doc, doc2 = tmp_path / "doc.txt", tmp_path / "doc2.txt"
    doc.write_text(DOC)
    doc2.write_text(DOC + MORE)
    out = {"full": tmp_path / "doc.kvpack", "delta": tmp_path / "delta.kvpack", "have": tmp_path / "have.json"}
    ok("prefill", "-m", m, "--chunk", "8", "--store", doc, "-o", out["full"])
    ok("reuse", "have", "-m", m, doc2, "-o", out["have"])
    ok("prefill", "-m", m, "--chunk", "8", doc2, "--have", out["have"], "-o", out["delta"])
    return out


def test_a_verdict_frame_by_frame_says_what_the_whole_read_says(tiny_llama, packs):
    from muser_cli.gate.verify import verify, verify_only

    m = str(tiny_llama.path)
    with open(packs["full"], "rb") as f:
        whole = verify(f, model=m)
    with open(packs["full"], "rb") as f:
        streamed = verify_only(f, model=m)
    assert whole.ok and streamed.ok
    assert [c.name for c in streamed.checks] == [c.name for c in whole.checks]
    assert "streamed" in streamed.checks[0].detail
    assert {k: streamed.summary[k] for k in SAME} == {k: whole.summary[k] for k in SAME}


def test_a_pack_for_another_model_is_refused_with_its_summary(tiny_llama, tiny_family, packs):
    from muser_cli.gate.verify import verify_only

    with open(packs["full"], "rb") as f:
        report = verify_only(f, model=str(tiny_family("qwen3").path))
    assert not report.ok and report.first_failure().name == "model"
    assert report.checks[0].name == "integrity" and report.checks[0].ok  # read to its end: the bytes are sound
    assert report.summary["model"] == tiny_llama.path.name  # whose pack it is, said


def test_a_damaged_pack_fails_integrity_first(tiny_llama, tiny_family, packs, tmp_path):
    from muser_cli.gate.verify import verify_only

    blob = bytearray(packs["full"].read_bytes())
    blob[-200] ^= 0x40
    bad = tmp_path / "bad.kvpack"
    bad.write_bytes(bytes(blob))
    for model in (tiny_llama.path, tiny_family("qwen3").path):  # another model's too: the damage is said first
        with open(bad, "rb") as f:
            report = verify_only(f, model=str(model))
        assert not report.ok and report.first_failure().name == "integrity", report.checks


def test_a_delta_is_checked_against_its_base_from_a_file_and_from_a_pipe(tiny_llama, packs):
    from muser_cli.gate.verify import verify_only

    m = str(tiny_llama.path)
    with open(packs["delta"], "rb") as f:
        f.read(0)
        from_file = verify_only(f, model=m)
    pipe = io.BufferedReader(io.BytesIO(packs["delta"].read_bytes()))
    pipe.seekable = lambda: False  # as stdin from a pipe: it cannot rewind
    from_pipe = verify_only(pipe, model=m)
    for report in (from_file, from_pipe):
        assert report.ok, report.checks
        assert {c.name: c.ok for c in report.checks}["base"] is True
    # a delta that does not start at the file's first byte: read again from where it began
    both = packs["delta"].parent / "two.bin"
    both.write_bytes(b"x" * 100 + packs["delta"].read_bytes())
    with open(both, "rb") as f:
        f.seek(100)
        assert verify_only(f, model=m).ok


def test_the_command_and_its_json(tiny_llama, tiny_family, packs):
    m = tiny_llama.path
    r = ok("verify", "-m", m, packs["full"], "--json")
    report = json.loads(r.stdout)
    assert report["ok"] and report["summary"]["rows"] == [0, report["summary"]["tokens"] - 1]
    refused = CliRunner().invoke(app, ["verify", "-m", str(tiny_family("qwen3").path), str(packs["full"]), "--json"])
    assert refused.exit_code == 65
    assert json.loads(refused.stdout)["summary"]["model"] == m.name


def test_peak_memory_of_a_verdict_on_a_file_does_not_follow_the_packs_size(tmp_path):
    """A synthetic pack of 4 MB and one of 100 MB (4 MiB frames): ``muser verify FILE`` peaks
    within a few frames of each other (reading the big one whole would add 96 MB or more)."""
    import stream_producer

    here = Path(__file__).resolve().parents[1]
    sizes = {}
    for name, layers in (("small", 1), ("big", 24)):
        pack = tmp_path / f"{name}.kvpack"
        with open(pack, "wb") as f:
            stream_producer.write(f, stream_producer.make_header(1025, layers, 8, 128, 1024))
        rss = tmp_path / f"{name}.rss"
        p = subprocess.run([sys.executable, str(here / "peak_rss.py"), str(rss), "--", sys.executable, "-m",
                            "muser_cli.commands", "verify", str(pack), "--json"], capture_output=True,
                           timeout=HANG_S)
        assert p.returncode in (0, 65), p.stderr  # integrity verified; the synthetic model is not here
        assert json.loads(p.stdout)["checks"][0]["ok"] is True
        sizes[name] = (pack.stat().st_size, int(rss.read_text()) * 1024)
    grew = sizes["big"][0] - sizes["small"][0]
    assert grew > 90e6
    assert sizes["big"][1] - sizes["small"][1] < 24 << 20, sizes
