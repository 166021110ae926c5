"""Shell completion of ``-m`` (issue #49, item 4): the names ``-m`` knows (``muser model ls``:
default, smollm2-135m, gemma3-270m), then the folders and ``.gguf`` files of the path typed,
on every command that takes ``-m`` and on ``model check``. Real processes, asked as the
completion scripts in ``completions/`` ask (``_MUSER_COMPLETE``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from handoff_kit import HANG_S, env_for

MUSER = Path(sys.executable).parent / "muser"  # the console script the completion scripts call


def complete(tmp_path, words: str) -> list[str]:
    """What bash's completion gets for the last of ``words`` (``COMP_WORDS``, ``COMP_CWORD``)."""
    env = {**env_for(tmp_path / "home"), "_MUSER_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split(" ")) - 1)}
    if not MUSER.exists():
        pytest.skip("the muser console script is not installed beside this Python")
    r = subprocess.run([str(MUSER)], env=env, capture_output=True, timeout=HANG_S, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return r.stdout.decode().split()


@pytest.fixture
def folders(tmp_path):
    (tmp_path / "models" / "my-model").mkdir(parents=True)
    (tmp_path / "models" / "other").mkdir()
    (tmp_path / "models" / ".hidden").mkdir()
    (tmp_path / "models" / "tiny.gguf").write_bytes(b"")
    (tmp_path / "models" / "notes.txt").write_text("not a model")
    return tmp_path


@pytest.mark.parametrize("command", ["decode", "prefill", "verify", "batch jobs.jsonl", "reuse ls", "model check"])
def test_m_completes_model_names_then_folders(folders, command):
    flag = "" if command == "model check" else " -m"
    assert complete(folders, f"muser {command}{flag} ") == ["default", "smollm2-135m", "gemma3-270m", "models/"]
    assert complete(folders, f"muser {command}{flag} g") == ["gemma3-270m"]
    assert complete(folders, f"muser {command}{flag} models/") == ["models/my-model/", "models/other/",
                                                                   "models/tiny.gguf"]
    assert complete(folders, f"muser {command}{flag} models/m") == ["models/my-model/"]
    assert complete(folders, f"muser {command}{flag} nowhere/x") == []
