"""What a newcomer meets at the command line (issue #29, items 6-11): a clean stderr, a first
run that says what it does, help that reads as paragraphs with examples, one throughput unit,
and charts that show what they name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from handoff_kit import HANG_S


def muser(*args, input: bytes | None = None, env=None):
    cmd = [sys.executable, "-m", "muser_cli.commands", *map(str, args)]
    return subprocess.run(cmd, input=input, capture_output=True, env={**os.environ, **(env or {})}, timeout=HANG_S)


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    p = tmp_path / "prompt.txt"
    p.write_text("The river rose in the spring and the town")
    return p


# ----------------------------------------------------------------------------- item 6: clean stderr
def test_decode_quiet_after_the_subcommand_leaves_stderr_empty(tiny_llama, prompt_file):
    r = muser("decode", "-q", "-m", tiny_llama.path, "--prompt", prompt_file, "-n", "4", input=b"",
              env={"PYTHONWARNINGS": "default"})
    assert r.returncode == 0, r.stderr
    assert r.stdout and r.stderr == b""
    r = muser("decode", "--quiet", "-m", tiny_llama.path, "--prompt", prompt_file, "-n", "4", input=b"")
    assert r.returncode == 0 and r.stderr == b""


def test_plain_decode_prints_no_future_warning(tiny_llama, prompt_file):
    r = muser("decode", "-m", tiny_llama.path, "--prompt", prompt_file, "-n", "4", input=b"",
              env={"PYTHONWARNINGS": "default"})
    assert r.returncode == 0, r.stderr
    assert b"Warning" not in r.stderr, r.stderr.decode()
    assert b"decode: 4 tokens" in r.stderr  # the notes themselves are still there


# ----------------------------------------------------------------------------- item 11: help text
HELP_COMMANDS = ["prefill", "pack", "send", "receive", "verify", "decode", "reuse", "batch"]


def _help(*path: str, columns: int = 200) -> str:
    from typer.testing import CliRunner

    from muser_cli.commands import app

    r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(columns)}, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_help_ends_with_examples(command):
    from muser_cli.commands._examples import EXAMPLES

    out = _help(command)
    assert "Examples" in out
    tail = out[out.rindex("Examples"):]
    assert "╭" not in tail  # the examples come last, after the options
    examples = EXAMPLES[command]
    assert 2 <= len(examples) <= 3
    for what, line in examples:
        assert what in tail and f"$ {line}" in tail


def test_help_paragraphs_are_not_broken_mid_sentence():
    out = _help("receive")
    # one logical line in a wide terminal: the docstring's hard breaks are gone
    assert ("each frame is forwarded once it verified against the digest chain, the end frame only "
            "after the trailer verified and the handoff id was recorded durably") in out
    out = _help("send")
    assert "Connects as soon as the kvpack header is in (a pipe from `muser prefill` streams frames as" in out


def test_examples_use_only_real_options_and_fit_80_columns():
    import shlex

    import typer.main

    from muser_cli.commands import app
    from muser_cli.commands._examples import EXAMPLES

    cli = typer.main.get_command(app)
    for path, items in EXAMPLES.items():
        for what, line in items:
            assert len(line) + 4 <= 78, line  # "  $ " + line inside Rich's padding
            for part in line.replace("&&", "|").replace("||", "|").split("|"):
                words = shlex.split(part.split("<")[0].split(">")[0])
                assert words[0] == "muser", line
                cmd, rest = cli, words[1:]
                while rest and rest[0] in getattr(cmd, "commands", {}):
                    cmd, rest = cmd.commands[rest[0]], rest[1:]
                opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
                unknown = [w for w in rest if w.startswith("-") and w != "-" and w not in opts]
                assert not unknown, f"{line}: {unknown}"


# ----------------------------------------------------------------------------- item 7: the first run
def _fake_conversion(monkeypatch, tiny_llama, tmp_path) -> Path:
    """A .gguf whose 'conversion' copies the tiny model (the real one takes 20-45 s)."""
    import shutil

    from muser_cli.model import resolve as models

    def convert_into(file, out):
        for item in Path(tiny_llama.path).iterdir():
            if item.is_file() and not item.name.startswith("."):
                shutil.copy(item, out / item.name)

    monkeypatch.setattr(models, "_convert_into", convert_into)
    monkeypatch.setenv("MUSER_MODELS", str(tmp_path / "models"))
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF fake")
    return gguf


def test_first_run_says_it_converts_once_and_later_runs_say_nothing(monkeypatch, tiny_llama, tmp_path, prompt_file):
    from typer.testing import CliRunner

    from muser_cli.commands import app

    gguf = _fake_conversion(monkeypatch, tiny_llama, tmp_path)
    args = ["decode", "-m", str(gguf), "--prompt", str(prompt_file), "-n", "2"]
    first = CliRunner().invoke(app, args, input=b"", catch_exceptions=False)
    assert first.exit_code == 0, first.output
    lines = [line for line in first.stderr.splitlines() if "convert" in line]
    assert len(lines) == 1 and lines[0].startswith("muser: converting fake.gguf once")
    assert "later runs skip this" in lines[0] and " done in " in lines[0]
    again = CliRunner().invoke(app, args, input=b"", catch_exceptions=False)
    assert again.exit_code == 0 and "convert" not in again.stderr


def test_first_run_conversion_note_respects_quiet(monkeypatch, tiny_llama, tmp_path, prompt_file):
    from typer.testing import CliRunner

    from muser_cli.commands import app

    gguf = _fake_conversion(monkeypatch, tiny_llama, tmp_path)
    r = CliRunner().invoke(app, ["decode", "-q", "-m", str(gguf), "--prompt", str(prompt_file), "-n", "2"],
                           input=b"", catch_exceptions=False)
    assert r.exit_code == 0 and r.stderr == ""
    assert any((tmp_path / "models").glob("fake-*/config.json"))  # it did convert


def test_conversion_events_reach_a_listener_and_a_failure_is_told(monkeypatch, tmp_path):
    from muser_cli.model import resolve as models

    monkeypatch.setenv("MUSER_MODELS", str(tmp_path / "models"))
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf")
    heard = []
    stop = models.on_convert(lambda event, fields: heard.append((event, Path(fields["source"]).name)))

    def convert_into(file, out):
        raise models.DataError("cannot convert: not a GGUF")

    monkeypatch.setattr(models, "_convert_into", convert_into)
    try:
        with pytest.raises(models.DataError):
            models.convert_gguf(gguf)
    finally:
        stop()
    assert heard == [("start", "broken.gguf"), ("failed", "broken.gguf")]


# ----------------------------------------------------------------------------- item 9: words and units
def test_counts_sizes_and_rates_read_as_words():
    from muser_cli.units import plural, rate_text, size_text

    assert plural(1, "entry", "entries") == "1 entry" and plural(2, "entry", "entries") == "2 entries"
    assert plural(1, "frame") == "1 frame" and plural(0, "frame") == "0 frames"
    assert size_text(1) == "1 byte" and size_text(4032) == "4.03 kB" and size_text(47_160_000) == "47.2 MB"
    assert rate_text(205e6) == "205 MB/s" and rate_text(5e5) == "0.5 MB/s" and rate_text(2.6e9) == "2,600 MB/s"


def test_one_throughput_unit_in_commands_and_bench_lines():
    """MB/s everywhere a person reads a rate: no Mbit/s, GB/s or MiB/s in what the commands print."""
    import re

    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "commands").glob("*.py")) + sorted((root / "muser_cli" / "bench").glob("*.py"))
    for f in files:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            assert not re.search(r"Mbit/s|GB/s|MiB/s|kB/s", line), f"{f.name}:{n}: {line.strip()}"


def test_reuse_and_pack_lines_use_the_right_number_and_say_what_a_ratio_is(tiny_llama, tmp_path, prompt_file):
    from typer.testing import CliRunner

    from muser_cli.commands import app

    raw, packed = tmp_path / "raw.kvpack", tmp_path / "z.kvpack"
    r = CliRunner().invoke(app, ["prefill", "-m", str(tiny_llama.path), "--chunk", "8", str(prompt_file),
                                 "-o", str(raw)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["pack", str(raw), "-o", str(packed)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    line = r.stderr.strip()
    assert "x of raw KV" not in line and "% of the raw KV's" in line and "codec zstd" in line, line
    assert CliRunner().invoke(app, ["reuse", "put", "-m", str(tiny_llama.path), str(packed)]).exit_code == 0
    r = CliRunner().invoke(app, ["reuse", "have", "-m", str(tiny_llama.path), str(prompt_file)], catch_exceptions=False)
    assert r.exit_code == 0 and "rows this prompt needs (all: no producer needed)" in r.stderr, r.stderr
    r = CliRunner().invoke(app, ["reuse", "ls"], catch_exceptions=False)
    assert r.exit_code == 0 and "reuse: 1 entry," in r.stderr, r.stderr
    assert "entries" not in r.stderr


def test_wire_table_explains_a_send_rate_over_the_link():
    from muser_cli.bench.wire import wire_table

    def st(x):
        return {"median": x, "cv": 0.0, "min": x, "max": x}

    row = {"bytes": 1e6, "payload_rate_Bps": st(600e6), "probe_up_Bps": st(250e6), "ratio": st(2.4),
           "end_to_end_Bps": st(30e6), "end_to_end_ratio": st(0.12)}
    lines = wire_table([row])
    assert "240%" in lines[1] and lines[-1].startswith("note: a send rate over 100 % of raw TLS")
    assert not wire_table([{**row, "payload_rate_Bps": st(200e6), "ratio": st(0.8)}])[-1].startswith("note")


# ----------------------------------------------------------------------------- item 10: charts
def _stats(x):
    return {"median": x, "min": x * 0.9, "max": x * 1.1, "cv": 0.05, "n": 2}


def _drawn(monkeypatch, name, payload):
    """The figure a bench chart draws (captured instead of written)."""
    from muser_cli.bench import plot

    got = {}
    monkeypatch.setattr(plot, "_write", lambda fig, path: got.setdefault("fig", fig))
    plot.PLOTTERS[name](payload, Path("unused.png"))
    return got["fig"]


def _pack_payload(with_mlx: bool):
    cases = ["memcpy", "pack none", "save kvpack none", "load kvpack none"]
    if with_mlx:
        cases += ["save mlx-lm prompt cache", "load mlx-lm prompt cache"]
    sizes = {"raw KV": 4032, "pack none": 5312, "file kvpack none": 5312}
    if with_mlx:
        sizes["file mlx-lm prompt cache"] = 16660
    row = {"depth": 64, "raw_kv_bytes": 4032, "cases": cases, "seconds": {c: _stats(1e-3) for c in cases},
           "bytes": sizes}
    return {"model": "tiny", "mlx_lm": with_mlx, "reps": 2, "kv": "real", "rows": [row], "machine": {}}


def test_pack_chart_names_only_the_systems_it_shows_and_sizes_in_readable_units(monkeypatch):
    fig = _drawn(monkeypatch, "pack", _pack_payload(with_mlx=False))
    ax = fig.axes[0]
    title = ax.get_title()
    assert title.startswith("kvpack vs memcpy") and "mlx-lm not measured" in title
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["64 tokens (4.03 kB of KV)"]  # not "0.0 MB KV"
    assert "ms" in ax.get_xlabel() and "kB" in fig.axes[1].get_xlabel()
    fig = _drawn(monkeypatch, "pack", _pack_payload(with_mlx=True))
    assert fig.axes[0].get_title().startswith("kvpack vs mlx-lm and memcpy")


def test_wire_chart_notes_a_send_rate_above_raw_tls(monkeypatch):
    row = {"megabytes": 1, "bytes": 988_000, "probe_up_Bps": _stats(250e6), "payload_rate_Bps": _stats(600e6),
           "end_to_end_Bps": _stats(30e6)}
    fig = _drawn(monkeypatch, "wire", {"rows": [row], "reps": 2, "machine": {}})
    ax = fig.axes[0]
    assert "MB/s" in ax.get_ylabel() and "MB" in ax.get_xlabel()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1"]  # the size asked for, not 0.988
    assert "Note: a send rate over 100 % of raw TLS" in fig._supxlabel.get_text()
    legend = " ".join(t.get_text() for t in ax.get_legend().get_texts())
    assert "raw TLS" in legend and "end to end" in legend
    fig = _drawn(monkeypatch, "wire", {"rows": [{**row, "payload_rate_Bps": _stats(200e6)}], "reps": 2,
                                       "machine": {}})
    assert "Note:" not in fig._supxlabel.get_text()


# ----------------------------------------------------------------------------- item 8: make demo
def test_demo_checks_the_short_case_and_measures_the_payoff_on_a_long_prompt(tmp_path):
    """docs/demo.sh end to end on a tiny model (DEMO_MODEL): the short prompt is a correctness check
    with no speed claim; the headline is a long prompt from a ready pack against a local prefill."""
    import re

    from muser_cli.model.tiny import make_tiny_long_llama

    root = Path(__file__).resolve().parents[2]
    model = make_tiny_long_llama(tmp_path / "tiny-long")
    env = {**os.environ, "DEMO_MODEL": str(model), "MUSER_MODELS": str(tmp_path / "models"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run(["bash", str(root / "docs" / "demo.sh")], cwd=root, env=env, capture_output=True,
                       text=True, timeout=HANG_S)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "TTFT handoff" not in out  # no speed figure on the short prompt
    assert "a correctness check, not a speed figure" in out
    m = re.search(r"(\d+)-token prompt: TTFT from the ready pack (\d+) ms .*\| local prefill (\d+) ms: "
                  r"([\d.]+)x sooner", out)
    assert m, out
    tokens, ready, local, ratio = int(m[1]), int(m[2]), int(m[3]), float(m[4])
    assert tokens >= 500 and ratio > 1
    # the ratio is of the two figures shown, each printed rounded to a whole ms (a 2 ms figure is 1.5-2.5 ms)
    low, high = (local - 0.5) / (ready + 0.5), (local + 0.5) / max(ready - 0.5, 0.05)
    assert low - 0.05 <= ratio <= high + 0.05, (ratio, local, ready)
    assert out.count("tokens identical: True") == 2 and "follow-up tokens identical (delta vs fallback): True" in out
