"""The chat template a GGUF carries (issue #49, item 2): read from the file's header
(``tokenizer.chat_template``, :mod:`muser_cli.model.ggufmeta`), kept in the converted folder, put
into a folder an older muser converted without it (once, in place, the weights untouched), and a
model without one marked by ``muser model ls`` and ``muser model check``.

GGUF files are written here with the ``gguf`` package (llama.cpp's own writer); the named models'
facts are read from the installed packages' files."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from muser_cli.commands import app
from muser_cli.errors import DataError
from muser_cli.model.ggufmeta import gguf_chat_template, gguf_string, has_chat_template
from muser_cli.model.resolve import (CONVERSION_FILE, CONVERSION_VERSION, NAMED_MODELS, convert_gguf, default_gguf,
                                     gguf_sha256, resolve_model)
from muser_cli.model.tokens import render_chat
from muser_cli.paths import models_dir

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} says\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant says\n{% endif %}")


def write_gguf(path: Path, *, template: str | None) -> Path:
    """A small GGUF: metadata of every kind a real one has (arrays of strings, numbers), then a tensor."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "a", "bb", "ccc"])
    writer.add_array("tokenizer.ggml.scores", [0.0, 0.0, -1.0, -2.0, -3.0])
    if template is not None:
        writer.add_chat_template(template)
    writer.add_string("general.name", "tiny")
    writer.add_tensor("token_embd.weight", np.zeros((5, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_gives_the_chat_template_and_refuses_what_is_no_gguf(tmp_path):
    with_template = write_gguf(tmp_path / "a.gguf", template=TEMPLATE)
    assert gguf_chat_template(with_template) == TEMPLATE
    assert gguf_string(with_template, "general.name") == "tiny"  # a key after the template: the walk goes on
    assert gguf_chat_template(write_gguf(tmp_path / "b.gguf", template=None)) is None
    assert gguf_chat_template(write_gguf(tmp_path / "c.gguf", template="")) is None  # empty: none
    with pytest.raises(DataError, match="not a string"):
        gguf_string(with_template, "llama.block_count")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(with_template.read_bytes()[:60])
    with pytest.raises(DataError, match="past the file's end"):
        gguf_chat_template(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(DataError, match="no GGUF magic"):
        gguf_chat_template(other)


def test_the_embedded_gguf_carries_the_template_its_folder_keeps(real_model):
    """SmolLM2's GGUF carries its template; its converted folder (new, or brought up to date) keeps
    exactly that text, and records the conversion's version."""
    template = gguf_chat_template(default_gguf())
    assert template and "<|im_start|>" in template
    from muser_cli.model.tokens import chat_template_text

    assert chat_template_text(real_model) == template
    assert json.loads((real_model.path / CONVERSION_FILE).read_text()) == {"version": CONVERSION_VERSION,
                                                                          "chat_template": True}


def _older_conversion(tmp_path, monkeypatch, tiny_llama, template: str | None) -> tuple[Path, Path]:
    """A GGUF, and the folder an older muser converted it to: the tiny model without any chat template
    and without the conversion's record (models_dir() is this test's own)."""
    monkeypatch.setenv("MUSER_MODELS", str(tmp_path / "models"))
    gguf = write_gguf(tmp_path / "m.gguf", template=template)
    target = models_dir() / f"m-{gguf_sha256(gguf)[:12]}"
    shutil.copytree(tiny_llama.path, target)
    (target / "chat_template.jinja").unlink()
    assert not has_chat_template(target) and not (target / CONVERSION_FILE).exists()
    return gguf, target


def test_a_folder_converted_before_gets_the_ggufs_template_once(tmp_path, monkeypatch, tiny_llama):
    gguf, target = _older_conversion(tmp_path, monkeypatch, tiny_llama, TEMPLATE)
    weights = {p.name: p.stat().st_mtime_ns for p in target.glob("*.safetensors")}
    assert convert_gguf(gguf) == target  # used, not converted again
    assert (target / "chat_template.jinja").read_text() == TEMPLATE
    assert json.loads((target / CONVERSION_FILE).read_text()) == {"version": CONVERSION_VERSION, "chat_template": True}
    assert {p.name: p.stat().st_mtime_ns for p in target.glob("*.safetensors")} == weights
    info = resolve_model(gguf)
    assert info.path == target
    assert render_chat(info, [{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user says\nhi<|im_end|>\n<|im_start|>assistant says\n"
    stamp = (target / "chat_template.jinja").stat().st_mtime_ns
    assert convert_gguf(gguf) == target and (target / "chat_template.jinja").stat().st_mtime_ns == stamp  # once


def test_a_folder_whose_gguf_has_no_template_is_recorded_and_marked(tmp_path, monkeypatch, tiny_llama):
    gguf, target = _older_conversion(tmp_path, monkeypatch, tiny_llama, None)
    assert convert_gguf(gguf) == target
    assert not has_chat_template(target)
    assert json.loads((target / CONVERSION_FILE).read_text()) == {"version": CONVERSION_VERSION,
                                                                  "chat_template": False}
    runner = CliRunner()
    report = json.loads(runner.invoke(app, ["model", "check", str(target), "--json"], catch_exceptions=False).stdout)
    assert report["chat_template"] is False
    human = runner.invoke(app, ["model", "check", str(target)], catch_exceptions=False).stdout
    assert "chat template: none, so chat requests are refused" in human and "/v1/completions" in human
    human = runner.invoke(app, ["model", "check", str(tiny_llama.path)], catch_exceptions=False).stdout
    assert "chat template: yes" in human


def test_model_ls_marks_the_names_without_a_chat_template():
    out = CliRunner().invoke(app, ["model", "ls", "--json"], catch_exceptions=False).stdout
    names = {n["name"]: n for n in json.loads(out)["names"]}
    assert names["default"]["chat_template"] is True and names["gemma3-270m"]["chat_template"] is False
    human = CliRunner().invoke(app, ["model", "ls"], catch_exceptions=False).stdout
    line = next(x for x in human.splitlines() if x.strip().startswith("gemma3-270m"))
    assert "no chat template" in line
    assert "no chat template" not in next(x for x in human.splitlines() if x.strip().startswith("default"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(NAMED_MODELS))
def test_each_named_models_chat_fact_is_its_files(name, shared_models_dir):
    """``NAMED_MODELS`` says whether each named model has a chat template: its GGUF's header says so
    too, and so does its converted folder (the Gemma 3 270M GGUF carries none)."""
    package = NAMED_MODELS[name][1]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    from muser_cli.model.resolve import named_gguf

    gguf = default_gguf() if package == NAMED_MODELS["default"][1] else named_gguf(name)
    assert (gguf_chat_template(gguf) is not None) == NAMED_MODELS[name][3]
    assert has_chat_template(resolve_model(name).path) == NAMED_MODELS[name][3]
