"""What a newcomer meets at the command line (issue #29, items 6-11): a clean stderr, a first
run that says what it does, help that reads as paragraphs with examples, one throughput unit,
and charts that show what they name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def muser(*args, input: bytes | None = None, env=None):
    cmd = [sys.executable, "-m", "muser_cli.commands", *map(str, args)]
    return subprocess.run(cmd, input=input, capture_output=True, env={**os.environ, **(env or {})}, timeout=300)


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

    from muser_cli import models

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
    from muser_cli import models

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
