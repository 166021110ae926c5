"""Model resolution, layer specs, fingerprints, tokenizer, tiny models."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from muser_cli.model import resolve as models
from muser_cli.errors import ConfigError, DataError, MissingInput
from muser_cli.kvpack.layers import RopeSpec
from muser_cli.model.resolve import describe_folder, layer_specs, resolve_model
from muser_cli.model.tiny import make_tiny_hybrid, make_tiny_llama
from muser_cli.model.tokens import decode_text, encode_prompt, tokenizer_for


def _copy_model(info, dest: Path) -> Path:
    shutil.copytree(info.path, dest)
    return dest


def _edit_config(folder: Path, **changes) -> None:
    file = folder / "config.json"
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


# ----------------------------------------------------------------- layer specs


def test_tiny_llama_layer_specs(tiny_llama):
    assert tiny_llama.architecture == "llama"
    assert len(tiny_llama.layers) == 4
    for spec in tiny_llama.layers:
        assert (spec.kind, spec.kv_heads, spec.head_dim, spec.v_head_dim, spec.window) == ("full", 2, 16, 16, None)
        assert spec.rope == RopeSpec(theta=10000.0, dims=16, style="rotate_half", scaling=None)
    assert tiny_llama.max_positions == 256
    assert tiny_llama.eos_token_ids == (2,)


def test_tiny_hybrid_layer_specs(tiny_hybrid):
    assert tiny_hybrid.architecture == "cohere2"
    kinds = [(s.kind, s.window) for s in tiny_hybrid.layers]
    assert kinds == [("sliding", 8)] * 3 + [("full", None)]
    for spec in tiny_hybrid.layers[:3]:
        assert spec.rope == RopeSpec(theta=10000.0, dims=16, style="interleaved", scaling=None)
        assert spec.carried_rows(40) == 7
    assert tiny_hybrid.layers[3].rope is None  # Cohere2 full attention is NoPE
    assert {(s.kv_heads, s.head_dim, s.v_head_dim) for s in tiny_hybrid.layers} == {(2, 16, 16)}


@pytest.mark.slow
def test_real_model_description(real_model):
    assert real_model.architecture == "llama"
    assert real_model.name == "SmolLM2-135M-Instruct.Q4_1"
    assert len(real_model.layers) == 30
    assert {s.kind for s in real_model.layers} == {"full"}
    assert {(s.kv_heads, s.head_dim, s.v_head_dim) for s in real_model.layers} == {(3, 64, 64)}
    assert {s.rope for s in real_model.layers} == {RopeSpec(theta=100000.0, dims=64, style="rotate_half")}
    assert real_model.max_positions == 8192
    assert real_model.eos_token_ids == (2,)
    config = json.loads((real_model.path / "config.json").read_text())
    assert config["rope_theta"] == 100000.0  # mlx-lm reads only the top-level key
    assert "quantization_config" not in config
    assert real_model.path.parent == Path(os.environ["MUSER_MODELS"])
    assert resolve_model(None) == real_model  # a later use only reads the folder
    ids = encode_prompt(real_model, "What is the capital of France?", chat=True)
    assert decode_text(real_model, ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


_CASES = {
    "llama": {"model_type": "llama"},
    "mistral-default-window": {"model_type": "mistral"},
    "mistral-no-window": {"model_type": "mistral", "sliding_window": None},
    "mistral-window": {"model_type": "mistral", "sliding_window": 16},
    "qwen2-plain": {"model_type": "qwen2", "sliding_window": 32},
    "qwen2-sliding": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2},
    "cohere2-pattern": {"model_type": "cohere2", "sliding_window": 8},
    "cohere2-types": {
        "model_type": "cohere2",
        "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    },
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_layer_specs_match_what_transformers_builds(case):
    """The torch-free reading of config.json agrees with transformers' own cache layout."""
    from transformers import AutoConfig
    from transformers.cache_utils import get_layer_types_and_kwargs

    raw = dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
        vocab_size=100, max_position_embeddings=64, **_CASES[case],
    )
    config = AutoConfig.for_model(**raw)
    types, kwargs = get_layer_types_and_kwargs(config)
    expected = [("sliding", kw["sliding_window"]) if t == "sliding_attention" else ("full", None) for t, kw in zip(types, kwargs)]
    specs = layer_specs(raw)
    assert [(s.kind, s.window) for s in specs] == expected
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert {(s.kv_heads, s.head_dim) for s in specs} == {(config.num_key_value_heads, head_dim)}


def test_rope_scaling_and_partial_rotary_are_carried():
    raw = dict(
        model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        partial_rotary_factor=0.5,
    )
    rope = layer_specs(raw)[0].rope
    assert rope.theta == 500000.0 and rope.dims == 8
    assert rope.scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}
    json.dumps(rope.to_json())  # plain JSON
    legacy = dict(raw, rope_parameters=None, rope_theta=1234.0, partial_rotary_factor=None)
    assert layer_specs(legacy)[0].rope == RopeSpec(theta=1234.0, dims=16, style="rotate_half", scaling=None)


def test_unsupported_architecture_is_named(tmp_path, tiny_llama):
    folder = _copy_model(tiny_llama, tmp_path / "m")
    _edit_config(folder, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="unsupported architecture 'gpt2'.*GPT2LMHeadModel"):
        resolve_model(folder)


def test_unsupported_layer_type(tmp_path, tiny_hybrid):
    folder = _copy_model(tiny_hybrid, tmp_path / "m")
    _edit_config(folder, layer_types=["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"])
    with pytest.raises(ConfigError, match="chunked_attention"):
        resolve_model(folder)


# ----------------------------------------------------------------- resolution errors


def test_missing_model_has_a_hint(tmp_path):
    with pytest.raises(MissingInput) as exc:
        resolve_model(tmp_path / "nope")
    assert "model not found" in str(exc.value) and exc.value.hint


def test_folder_without_config(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(DataError) as exc:
        resolve_model(tmp_path)
    assert "has no config.json" in str(exc.value) and "\n" not in str(exc.value)
    assert "x.gguf" in exc.value.hint


def test_file_that_is_not_a_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(DataError, match="neither a folder nor a .gguf"):
        resolve_model(tmp_path / "weights.bin")


def test_folder_without_safetensors(tmp_path, tiny_llama):
    folder = _copy_model(tiny_llama, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(DataError, match="no \\*.safetensors"):
        resolve_model(folder)


# ----------------------------------------------------------------- fingerprints


def test_fingerprints_stable_deterministic_and_distinct(tmp_path, tiny_llama, tiny_hybrid):
    assert tiny_llama.fingerprint.startswith("sha256:") and len(tiny_llama.fingerprint) == 71
    assert resolve_model(tiny_llama.path).fingerprint == tiny_llama.fingerprint
    assert tiny_llama.fingerprint != tiny_hybrid.fingerprint
    # Same tokenizer files in both tiny models -> same tokenizer fingerprint.
    assert tiny_llama.tokenizer_fingerprint == tiny_hybrid.tokenizer_fingerprint
    again = resolve_model(make_tiny_llama(tmp_path / "again", seed=0))  # other path, same bytes
    assert again.fingerprint == tiny_llama.fingerprint
    other = resolve_model(make_tiny_llama(tmp_path / "other", seed=1))
    assert other.fingerprint != tiny_llama.fingerprint
    assert other.tokenizer_fingerprint == tiny_llama.tokenizer_fingerprint


def test_fingerprint_is_cached_and_follows_changes(tmp_path, tiny_llama, monkeypatch):
    folder = _copy_model(tiny_llama, tmp_path / "m")
    first = resolve_model(folder)

    def boom(*args, **kwargs):
        raise AssertionError("rehashed although nothing changed")

    with monkeypatch.context() as mp:
        mp.setattr(models, "model_fingerprint", boom)
        assert resolve_model(folder).fingerprint == first.fingerprint

    _edit_config(folder, transformers_version="9.9.9")  # who wrote it: not identity
    assert resolve_model(folder).fingerprint == first.fingerprint
    _edit_config(folder, rms_norm_eps=1e-3)
    changed = resolve_model(folder)
    assert changed.fingerprint != first.fingerprint
    assert changed.tokenizer_fingerprint == first.tokenizer_fingerprint

    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert resolve_model(folder).fingerprint not in (first.fingerprint, changed.fingerprint)

    tok = folder / "tokenizer_config.json"
    tok.write_text(tok.read_text().replace("}", ', "x": 1}', 1))
    assert resolve_model(folder).tokenizer_fingerprint != first.tokenizer_fingerprint


def test_describe_does_not_import_torch(tiny_hybrid):
    code = (
        "import sys\n"
        "from muser_cli.model.resolve import resolve_model\n"
        f"info = resolve_model({str(tiny_hybrid.path)!r})\n"
        "assert len(info.layers) == 4\n"
        "bad = [m for m in ('torch', 'transformers', 'mlx') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())


# ----------------------------------------------------------------- GGUF conversion (faked)


def _fake_convert(calls):
    def convert(file, out):
        calls.append(file)
        (out / "config.json").write_text("{}")
        (out / "weights.safetensors").write_bytes(b"w" * 1000)

    return convert


def test_gguf_conversion_is_once_and_atomic(tmp_path, monkeypatch):
    gguf = tmp_path / "Thing-1B.Q4.gguf"
    gguf.write_bytes(b"GGUF fake")
    calls: list = []
    monkeypatch.setattr(models, "_convert_into", _fake_convert(calls))
    target = models.convert_gguf(gguf)
    assert target.parent == Path(os.environ["MUSER_MODELS"]) and target.name.startswith("Thing-1B.Q4-")
    assert models.convert_gguf(gguf) == target and len(calls) == 1
    assert not [p for p in target.parent.iterdir() if p.name.endswith(".part")]
    shutil.rmtree(target)


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _until(predicate, ceiling_s=60.0):
    """Wait for a state, not a budget: the ceiling only catches a hang."""
    import time

    deadline = time.monotonic() + ceiling_s
    while not predicate():
        assert time.monotonic() < deadline, "hung"
        time.sleep(0.01)


@contextlib.contextmanager
def _second_waits(gguf: Path, started: threading.Event, release: threading.Event):
    """Two threads convert ``gguf`` at once: the block runs once the first has started (its
    conversion holds until ``release``) and the second waits on the lock; then the first is
    released and both are joined. Yields (the events heard, the first's answer, the second's)."""
    heard: list = []
    stop = models.on_convert(lambda event, fields: heard.append(event))
    try:
        first, got1 = _in_thread(lambda: models.convert_gguf(gguf))
        assert started.wait(60)
        second, got2 = _in_thread(lambda: models.convert_gguf(gguf))
        _until(lambda: "wait" in heard)
        yield heard, got1, got2
        release.set()
        first.join(60)
        second.join(60)
    finally:
        stop()


def test_gguf_conversion_race_converts_once_and_the_other_waits(tmp_path, monkeypatch):
    gguf = tmp_path / "Race.gguf"
    gguf.write_bytes(b"GGUF race")
    calls: list = []
    inner = _fake_convert(calls)
    started, release = threading.Event(), threading.Event()

    def slow_convert(file, out):
        started.set()
        assert release.wait(60)
        inner(file, out)

    monkeypatch.setattr(models, "_convert_into", slow_convert)
    with _second_waits(gguf, started, release) as (heard, got1, got2):
        assert len(calls) == 0  # the second one blocks on the lock, converting nothing
    assert "error" not in got1 and "error" not in got2
    assert got1["value"] == got2["value"] and len(calls) == 1
    assert sorted(heard) == sorted(["start", "wait", "done", "waited"])
    assert (got1["value"] / "config.json").read_text() == "{}"
    assert not [p for p in got1["value"].parent.iterdir() if p.name.endswith(".part")]
    shutil.rmtree(got1["value"])


def test_a_waiter_converts_itself_when_the_first_conversion_failed(tmp_path, monkeypatch):
    gguf = tmp_path / "Again.gguf"
    gguf.write_bytes(b"GGUF again")
    calls: list = []
    started, release = threading.Event(), threading.Event()

    def first_fails(file, out):
        calls.append(file)
        if len(calls) == 1:
            started.set()
            assert release.wait(60)
            (out / "config.json").write_text("{}")  # half-written: never renamed into place
            raise DataError("cannot convert: disk trouble")
        (out / "config.json").write_text('{"ok": 1}')

    monkeypatch.setattr(models, "_convert_into", first_fails)
    with _second_waits(gguf, started, release) as (heard, got1, got2):
        pass  # the first fails once released; the second converts itself
    assert isinstance(got1.get("error"), DataError)
    assert json.loads((got2["value"] / "config.json").read_text()) == {"ok": 1} and len(calls) == 2
    assert heard.count("start") == 2 and "failed" in heard and "waited" in heard and "done" in heard
    shutil.rmtree(got2["value"])


@pytest.mark.slow
def test_two_processes_converting_the_default_model_convert_once(tmp_path, real_model):
    """The demo's first pipeline: producer and consumer both need the default model, and a
    fresh models folder has none. One converts; the other says it waits, then uses it."""
    env = {**os.environ, "MUSER_MODELS": str(tmp_path / "models"), "MUSER_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "muser_cli.commands", "model", "check", "default"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]  # a ceiling for a hang, not a budget
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    errs = "".join(err for _, err in outs)
    assert errs.count("muser: converting SmolLM2") == 1, errs
    assert errs.count("another process is converting") <= 1, errs
    folders = [p for p in (tmp_path / "models").iterdir() if not p.name.startswith(".")]
    assert len(folders) == 1 and (folders[0] / "config.json").is_file()


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    gguf = tmp_path / "Broken.gguf"
    gguf.write_bytes(b"GGUF broken")

    def fail(file, out):
        (out / "config.json").write_text("{}")
        raise DataError("cannot convert: bad tensor")

    monkeypatch.setattr(models, "_convert_into", fail)
    with pytest.raises(DataError):
        models.convert_gguf(gguf)
    assert not [p for p in Path(os.environ["MUSER_MODELS"]).iterdir() if p.name.startswith(("Broken", ".Broken"))]


# ----------------------------------------------------------------- tokenizer


def test_encode_decode_round_trip(tiny_llama):
    text = "The consumer checks every frame, then decodes."
    ids = encode_prompt(tiny_llama, text)
    assert ids and all(0 <= i < 512 for i in ids)
    assert decode_text(tiny_llama, ids) == text
    assert tokenizer_for(tiny_llama) is tokenizer_for(tiny_llama)


def test_chat_prompt_uses_template(tiny_llama):
    ids = encode_prompt(tiny_llama, "hi", chat=True)
    assert ids[0] == 1 and ids.count(2) == 1  # <|im_start|> ... <|im_end|> once
    assert decode_text(tiny_llama, ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert decode_text(tiny_llama, ids) == "user\nhi\nassistant\n"


def test_chat_without_template(tmp_path, tiny_llama):
    folder = _copy_model(tiny_llama, tmp_path / "m")
    (folder / "chat_template.jinja").unlink()
    info = resolve_model(folder)
    with pytest.raises(ConfigError, match="no chat template"):
        encode_prompt(info, "hi", chat=True)


# ----------------------------------------------------------------- tiny models in mlx-lm


@pytest.mark.mlx
def test_tiny_models_load_in_mlx(tiny_llama, tiny_hybrid):
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_llama.path)
    assert [type(c).__name__ for c in make_prompt_cache(model)] == ["KVCache"] * 4
    assert model.args.rope_theta == 10000.0
    model, _ = load_model(tiny_hybrid.path)
    assert [type(c).__name__ for c in make_prompt_cache(model)] == ["RotatingKVCache"] * 3 + ["KVCache"]
    assert model.args.rope_theta == 10000.0 and model.args.sliding_window == 8


def test_tiny_model_is_quick_and_describes_itself(tmp_path):
    info = describe_folder(make_tiny_hybrid(tmp_path / "h", seed=3))
    assert info.name == "h" and info.architecture == "cohere2"
