"""The MUSER_* environment variables as docs/cli.md documents them: bad values are one
line and a documented exit status, never an internal error."""

from __future__ import annotations

import os
import shutil

import pytest
from typer.testing import CliRunner

from muser_cli.commands import app
from muser_cli.commands._common import default_threads


def test_muser_threads_is_read_and_clamped(monkeypatch):
    monkeypatch.setenv("MUSER_THREADS", "3")
    assert default_threads() == 3
    monkeypatch.setenv("MUSER_THREADS", "0")
    assert default_threads() == 1
    monkeypatch.delenv("MUSER_THREADS")
    assert 1 <= default_threads() <= 8


@pytest.mark.parametrize("value", ["abc", "2.5", "two"])
def test_a_non_integer_muser_threads_is_a_configuration_error(tiny_llama, tmp_path, value):
    prompt = tmp_path / "p.txt"
    prompt.write_text("The bridge was built in the spring.")
    r = CliRunner().invoke(app, ["decode", "-m", str(tiny_llama.path), "--prompt", str(prompt), "-n", "1"],
                           env={"MUSER_THREADS": value}, input=b"")
    assert r.exit_code == 78, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("muser: error: MUSER_THREADS=") and "internal error" not in r.stderr
    assert r.stdout == ""


def test_a_pinned_process_uses_only_its_cores():
    """taskset (how one host stands in for two machines) narrows the default threads and
    the kvpack pool to the cores the process may run on."""
    import subprocess
    import sys

    if not hasattr(os, "sched_getaffinity") or shutil.which("taskset") is None:
        pytest.skip("no CPU affinity on this platform")
    code = ("from muser_cli.threads import default_threads; from muser_cli.kvpack.digest import workers; "
            "print(default_threads(), workers())")
    env = {k: v for k, v in os.environ.items() if k not in ("MUSER_THREADS", "MUSER_KVPACK_THREADS")}
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True)
    assert out.stdout.split() == ["1", "1"]


def test_the_default_leaves_out_a_core_another_process_keeps_busy():
    """--threads 0 on two cores, one of them held by a busy process: one thread, not two (a
    thread on the held core would stall the other at every operation). Both processes pinned, so
    what the machine runs besides does not decide it."""
    import subprocess
    import sys

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None:
        pytest.skip("needs two cores and CPU affinity")
    a, b = sorted(os.sched_getaffinity(0))[:2]
    env = {k: v for k, v in os.environ.items() if k != "MUSER_THREADS"}
    busy = subprocess.Popen(["taskset", "-c", str(a), sys.executable, "-c", "while True: pass"])
    try:
        code = "from muser_cli.threads import default_threads; print(default_threads())"
        out = subprocess.run(["taskset", "-c", f"{a},{b}", sys.executable, "-c", code], capture_output=True,
                             text=True, env=env, check=True, timeout=60)
        assert out.stdout.split() == ["1"], out
    finally:
        busy.kill()
        busy.wait()
