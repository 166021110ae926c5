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
