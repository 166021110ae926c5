"""``decode --json``'s fields are each documented once (issue #49, item 4): docs/cli-contract.md,
"decode --json: the fields", names every key the command prints, from a pack (with its
timings: ``first_byte_s``, ``last_frame_s``, ``tail_s``, ``pack_read_s``, ``first_token_s``)
and from a local prefill; ``fallback_reason`` is the documented alias of ``reason``. Real
processes, a tiny model."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from handoff_kit import HANG_S, env_for, muser_cmd

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli-contract.md"
PROMPT = "The committee met on a grey Tuesday to decide where the new bridge would go."


def documented() -> set[str]:
    text = DOC.read_text()
    section = text.split("## `decode --json`: the fields", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for row in section.splitlines():
        if row.startswith("| `"):
            names.update(re.findall(r"`([a-z_]+)`", row.split("|")[1]))
    return names


def test_every_decode_json_field_is_documented_and_fallback_reason_is_reasons_alias(tmp_path, tiny_llama):
    env = env_for(tmp_path / "home")
    flags = ["-m", str(tiny_llama.path), "--threads", "1", "--dtype", "float32"]
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    pack = tmp_path / "p.kvpack"
    made = subprocess.run(muser_cmd("prefill", *flags, str(prompt), "-o", str(pack)), env=env,
                          capture_output=True, timeout=HANG_S)
    assert made.returncode == 0, made.stderr
    runs = {}
    for name, args in {"pack": [str(pack), "--prompt", str(prompt)],
                       "local": ["--prompt", str(prompt), "--no-reuse"]}.items():
        r = subprocess.run(muser_cmd("decode", *flags, *args, "-n", "3", "--json"), env=env, capture_output=True,
                           timeout=HANG_S, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stderr
        runs[name] = json.loads(r.stdout)
    names = documented()
    for name, out in runs.items():
        missing = set(out) - names
        assert not missing, f"decode --json ({name}) prints fields docs/cli-contract.md does not name: {missing}"
    from_pack, local = runs["pack"], runs["local"]
    assert from_pack["source"] == "handoff" and not from_pack["fallback"]
    assert from_pack["reason"] == "" and from_pack["fallback_reason"] is None
    for key in ("first_byte_s", "last_frame_s", "tail_s", "first_token_s"):
        assert isinstance(from_pack[key], float), (key, from_pack)
    assert from_pack["first_byte_s"] <= from_pack["last_frame_s"] <= from_pack["first_token_s"]
    assert from_pack["pack_read_s"] > 0
    assert local["fallback"] and local["reason"] and local["fallback_reason"] == local["reason"], local
    assert local["first_byte_s"] is None and local["last_frame_s"] is None and local["tail_s"] is None
