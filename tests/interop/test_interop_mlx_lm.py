"""mlx-lm prompt caches in and out of kvpacks (docs/interop.md).

* an exported file loads with mlx-lm's own ``load_prompt_cache`` and continues with the
  tokens (and first-step logits, bit for bit) of ``muser decode --engine mlx``; mlx-lm's
  own CLI (``python -m mlx_lm generate --prompt-cache-file``) prints the same text;
* a file mlx-lm wrote itself (``save_prompt_cache`` after its own prefill) imports as a
  kvpack that ``verify --audit`` passes and that decodes to mlx-lm's own continuation;
* round trips mlx-lm -> kvpack -> mlx-lm and kvpack -> mlx-lm -> kvpack keep the KV bytes;
* tampered files (wrong shapes, an unknown class name, offsets past the rows) are refused
  with one line and exit 65, and nothing is written.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_lm_kit import PROMPT, mlx_blas, mx  # first: MLX's BLAS, or the module skipped

from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache  # noqa: E402

from muser_cli.consumer.decode import decode  # noqa: E402
from muser_cli.engines.registry import get_engine  # noqa: E402
from muser_cli.errors import DataError, MissingInput  # noqa: E402
from muser_cli.interop import mlx_lm as interop  # noqa: E402
from muser_cli.interop import safetensors_io as st  # noqa: E402
from muser_cli.kvpack import read_pack, read_pack_bytes  # noqa: E402
from muser_cli.produce.prefill import prefill  # noqa: E402
from muser_cli.model.tokens import decode_text, encode_prompt, tokenizer_for  # noqa: E402
from handoff_kit import HANG_S  # noqa: E402

pytestmark = pytest.mark.mlx

CHUNK = 8  # the tiny hybrid's window is 8: rings wrap
NEW = 16
_ENGINES: dict = {}


def mlx_engine(info):
    key = (str(info.path), info.fingerprint)
    if key not in _ENGINES:
        _ENGINES[key] = get_engine("mlx", info, dtype="float32", threads=1)
    return _ENGINES[key]


def make_pack(info, tmp_path: Path, *, engine: str = "torch") -> Path:
    path = tmp_path / "doc.kvpack"
    with open(path, "wb") as out:
        prefill(PROMPT, out, model=str(info.path), engine=engine, dtype="float32", chunk_tokens=CHUNK)
    return path


def export(pack_path: Path, out_path: Path, model) -> interop.ExportResult:
    with open(pack_path, "rb") as src, open(out_path, "wb") as out:
        return interop.export_mlx_lm(src, out, model=str(model.path))


def muser(*args, input: bytes | None = None, timeout: float = HANG_S):
    cmd = [sys.executable, "-m", "muser_cli.commands", *args]
    return subprocess.run(cmd, input=input, capture_output=True, env=dict(os.environ), timeout=timeout)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_hybrid"])
def test_export_continues_in_mlx_lm_like_muser_decode(name, request, tmp_path):
    info = request.getfixturevalue(name)
    pack_path = make_pack(info, tmp_path)
    res = export(pack_path, tmp_path / "doc.safetensors", info)
    pack = read_pack(open(pack_path, "rb"))
    ids = list(pack.header.token_ids)
    assert res.rows == len(ids) - 1 and res.next_token_ids == [ids[-1]] and res.model_ref == str(info.path)

    cache, meta = load_prompt_cache(str(tmp_path / "doc.safetensors"), return_metadata=True)
    kinds = ["RotatingKVCache" if s.kind == "sliding" else "KVCache" for s in info.layers]
    assert [type(c).__name__ for c in cache] == kinds
    assert all(c.offset == len(ids) - 1 for c in cache)
    assert json.loads(meta[interop.METADATA_KEY])["next_token_ids"] == [ids[-1]]
    assert meta["model"] == str(info.path)

    eng = mlx_engine(info)
    # first-step logits: mlx-lm's loaded cache vs muser's installed rows, bit for bit
    theirs = np.array(eng.model(mx.array([[ids[-1]]]), cache=cache)[0].astype(mx.float32))
    ours = eng.step_logits(pack.layers, rows=len(ids) - 1, next_tokens=[ids[-1]], chunk_tokens=CHUNK)
    assert np.array_equal(theirs, ours)

    cache = load_prompt_cache(str(tmp_path / "doc.safetensors"))
    mlx_tokens = [t for t, _ in generate_step(mx.array([ids[-1]]), eng.model, max_tokens=NEW, prompt_cache=cache)]
    with open(pack_path, "rb") as src:
        out = decode(src, model=str(info.path), engine="mlx", max_new_tokens=NEW)
    assert out.token_ids == mlx_tokens[: len(out.token_ids)]
    assert len(out.token_ids) == NEW or out.token_ids[-1] in info.eos_token_ids
    assert len(set(mlx_tokens)) > 3  # a real continuation, not one token repeated


def test_mlx_lm_cli_continues_an_exported_file_like_muser_decode_cli(tiny_llama, tmp_path):
    """mlx-lm's own command line, offline on the local folder, given the last prompt token."""
    info = tiny_llama
    pack_path = make_pack(info, tmp_path)
    out_path = tmp_path / "doc.safetensors"
    r = muser("pack", "--export", "mlx-lm", "-m", str(info.path), str(pack_path), "-o", str(out_path))
    assert r.returncode == 0, r.stderr.decode()
    assert b"continue with the last prompt token" in r.stderr
    last = read_pack(open(pack_path, "rb")).header.token_ids[-1]
    text = tokenizer_for(info).decode([last])
    assert tokenizer_for(info)(text)["input_ids"] == [last]  # the CLI's --prompt is text: it must be this token
    n = 12
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **mlx_blas.preload_env()}
    mlx = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--prompt-cache-file", str(out_path),
                          "--prompt", text, "--ignore-chat-template", "--max-tokens", str(n), "--verbose", "False"],
                         capture_output=True, env=env, timeout=HANG_S)
    assert mlx.returncode == 0, mlx.stderr.decode()[-2000:]
    d = muser("decode", "-m", str(info.path), "--engine", "mlx", "-n", str(n), "--json", str(pack_path))
    assert d.returncode == 0, d.stderr.decode()
    ours = json.loads(d.stdout)
    assert len(ours["token_ids"]) == n
    assert mlx.stdout.decode().rstrip("\n") == ours["text"]


def mlx_lm_file(info, ids, path: Path, *, whole: bool) -> list:
    """What mlx-lm writes itself: its own prefill (generate_step, as mlx_lm.cache_prompt runs
    it) over the whole prompt (``whole``) or prompt[:-1], then save_prompt_cache."""
    eng = mlx_engine(info)
    cache = make_prompt_cache(eng.model)
    feed = ids if whole else ids[:-1]
    for _ in generate_step(mx.array(feed), eng.model, max_tokens=0, prompt_cache=cache, prefill_step_size=CHUNK):
        pass
    save_prompt_cache(str(path), cache, {"model": str(info.path), "tokenizer_config": "{}"})
    return cache


def temporal_rows(path: Path) -> list[tuple[np.ndarray, np.ndarray, int, int]]:
    c, _, mapping = interop.read_prompt_cache_file(str(path))
    return [(np.array(k), np.array(v), first, layer.offset) for layer in c.layers for k, v, first in [layer.temporal()]]


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_hybrid"])
@pytest.mark.parametrize("whole", [True, False], ids=["cache_prompt", "prompt[:-1]"])
def test_mlx_lm_file_imports_verifies_and_round_trips(name, whole, request, tmp_path):
    info = request.getfixturevalue(name)
    ids = encode_prompt(info, PROMPT)
    src = tmp_path / "c.safetensors"
    mlx_lm_file(info, ids, src, whole=whole)
    pack_path = tmp_path / "doc.kvpack"
    with open(pack_path, "wb") as out:
        res = interop.import_mlx_lm(str(src), out, model=str(info.path), prompt=PROMPT, chunk_tokens=CHUNK)
    assert res.dropped_last_row is whole and res.tokens == len(ids)
    pack = read_pack(open(pack_path, "rb"))
    assert list(pack.header.token_ids) == ids and pack.header.producer["engine"] == "mlx-lm"

    # the KV is mlx-lm's own, byte for byte, on every position the pack carries
    original = temporal_rows(src)
    for (k, v, first, _), spec, kv in zip(original, info.layers, pack.layers):
        a = kv.first_row - first
        assert np.array_equal(k[:, a : a + kv.keys.shape[1]], kv.keys)
        assert np.array_equal(v[:, a : a + kv.values.shape[1]], kv.values)

    # muser decodes it to mlx-lm's own continuation of the whole prompt
    eng = mlx_engine(info)
    theirs = [t for t, _ in generate_step(mx.array(ids), eng.model, max_tokens=NEW, prefill_step_size=CHUNK)]
    hybrid = any(s.kind == "sliding" and s.window - 1 < len(ids) - 1 for s in info.layers)
    if hybrid:  # mlx-lm's ring holds the window only: its rows cannot all be checked, never decoded unchecked
        from muser_cli.errors import GateIncomplete

        with open(pack_path, "rb") as f, pytest.raises(GateIncomplete):
            decode(f, model=str(info.path), engine="mlx", max_new_tokens=NEW)
    with open(pack_path, "rb") as f:
        out = decode(f, model=str(info.path), engine="mlx", max_new_tokens=NEW, prompt=PROMPT if hybrid else None)
    assert out.token_ids == theirs[: len(out.token_ids)] and out.token_ids
    assert out.source == ("local" if hybrid else "handoff")

    # kvpack -> mlx-lm again: the same rows (the whole file when it held prompt[:-1])
    back = tmp_path / "back.safetensors"
    with open(pack_path, "rb") as f, open(back, "wb") as o:
        interop.export_mlx_lm(f, o, model=str(info.path))
    for (k0, v0, f0, n0), (k1, v1, f1, n1), spec in zip(original, temporal_rows(back), info.layers):
        assert n1 == len(ids) - 1 and n0 == len(ids) - (0 if whole else 1)
        rows = k1.shape[1] if spec.kind == "full" else spec.carried_rows(n1)
        k1, v1 = k1[:, k1.shape[1] - rows :], v1[:, v1.shape[1] - rows :]
        a = (n1 - rows) - f0
        assert np.array_equal(k0[:, a : a + rows], k1) and np.array_equal(v0[:, a : a + rows], v1)
        if not whole and spec.kind == "full":
            assert np.array_equal(k0, k1) and np.array_equal(v0, v1)


def test_kvpack_to_mlx_lm_to_kvpack_keeps_the_bytes(tiny_hybrid, tmp_path):
    info = tiny_hybrid
    pack_path = make_pack(info, tmp_path)
    export(pack_path, tmp_path / "doc.safetensors", info)
    out = io.BytesIO()
    interop.import_mlx_lm(str(tmp_path / "doc.safetensors"), out, model=str(info.path), prompt=PROMPT,
                          chunk_tokens=CHUNK)
    a, b = read_pack(open(pack_path, "rb")), read_pack_bytes(out.getvalue())
    assert a.header.token_ids == b.header.token_ids and a.header.layers == b.header.layers
    # The pack's sliding history (ring_extra = rows) does not survive mlx-lm's ring of window - 1 rows.
    assert a.header.ring_extra == a.header.rows_end and b.header.ring_extra == 0
    for x, y, spec in zip(a.layers, b.layers, info.layers):
        cut = y.first_row - x.first_row
        assert cut == (a.header.rows_end - (spec.window - 1) if spec.kind == "sliding" else 0)
        assert x.keys[:, cut:].tobytes() == y.keys.tobytes() and x.values[:, cut:].tobytes() == y.values.tobytes()


def test_mlx_lm_cache_prompt_cli_file_imports_and_passes_verify_audit(tiny_llama, tmp_path):
    """A file from mlx-lm's own ``cache_prompt`` command (chat template, as it renders it)."""
    info = tiny_llama
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **mlx_blas.preload_env()}
    src = tmp_path / "c.safetensors"
    r = subprocess.run([sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(info.path), "--prompt", PROMPT,
                        "--prompt-cache-file", str(src)], capture_output=True, env=env, timeout=HANG_S)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    rendered = tokenizer_for(info).apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                       add_generation_prompt=False, continue_final_message=True)
    (tmp_path / "doc.txt").write_text(rendered)
    r = muser("pack", "--import", "mlx-lm", str(src), "--prompt", str(tmp_path / "doc.txt"),
              "-m", str(info.path), "-o", str(tmp_path / "doc.kvpack"))
    assert r.returncode == 0, r.stderr.decode()
    assert b"its last row is left to the consumer" in r.stderr
    v = muser("verify", "-m", str(info.path), "--audit", "4", "--json", str(tmp_path / "doc.kvpack"))
    assert v.returncode == 0, v.stdout.decode() + v.stderr.decode()
    report = json.loads(v.stdout)
    assert any(c["name"] == "audit" and c["ok"] for c in report["checks"]), report


# ---------------------------------------------------------------------------- refusals


def _rewrite(src: Path, dst: Path, *, tensors=None, meta=None) -> None:
    f = st.parse(src.read_bytes())
    ts = {k: (t.dtype, t.array) for k, t in f.tensors.items()}
    md = dict(f.metadata)
    if tensors:
        ts.update(tensors)
    if meta:
        md.update(meta)
    with open(dst, "wb") as out:
        st.write(out, ts, md)


def test_tampered_files_get_one_line_and_exit_65(tiny_hybrid, tmp_path):
    info = tiny_hybrid
    ids = encode_prompt(info, PROMPT)
    good = tmp_path / "good.safetensors"
    mlx_lm_file(info, ids, good, whole=True)
    f = st.parse(good.read_bytes())
    k0 = f.tensors["3.0"].array  # the full (KVCache) layer
    cases = {
        "shape": ({"3.0": ("F32", np.ascontiguousarray(k0[:, :1])),
                   "3.1": ("F32", np.ascontiguousarray(f.tensors["3.1"].array[:, :1]))}, None, "KV heads"),
        "class": (None, {"1.3": "QuantizedKVCache"}, "'QuantizedKVCache'"),
        "unknown": (None, {"1.0": "os.system"}, "'os.system'"),
        "offset": ({"3.2": ("I32", np.array(k0.shape[2] + 5, dtype="<i4"))}, None, "past the"),
        "ring": ({"0.5": ("I32", np.array(99, dtype="<i4"))}, None, "past its"),
    }
    (tmp_path / "doc.txt").write_text(PROMPT)
    for label, (tensors, meta, needle) in cases.items():
        bad = tmp_path / f"{label}.safetensors"
        _rewrite(good, bad, tensors=tensors, meta=meta)
        with pytest.raises(DataError, match=needle.replace("(", r"\(")):
            interop.import_mlx_lm(str(bad), io.BytesIO(), model=str(info.path), token_ids=ids)
    # the command line: one line, exit 65, no output file
    for label in ("class", "offset"):
        out = tmp_path / f"{label}.kvpack"
        r = muser("pack", "--import", "mlx-lm", str(tmp_path / f"{label}.safetensors"), "--prompt",
                  str(tmp_path / "doc.txt"), "-m", str(info.path), "-o", str(out))
        assert r.returncode == 65, r.stderr.decode()
        assert len(r.stderr.decode().strip().splitlines()) == 1, r.stderr.decode()
        assert not out.exists()


def test_import_refuses_another_prompt_length_and_layout(tiny_llama, tiny_hybrid, tmp_path):
    ids = encode_prompt(tiny_llama, PROMPT)
    src = tmp_path / "c.safetensors"
    mlx_lm_file(tiny_llama, ids, src, whole=True)
    with pytest.raises(DataError, match="holds .* positions, the prompt is"):
        interop.import_mlx_lm(str(src), io.BytesIO(), model=str(tiny_llama.path), token_ids=ids + [5, 6])
    with pytest.raises(DataError, match="sliding|KVCache"):
        interop.import_mlx_lm(str(src), io.BytesIO(), model=str(tiny_hybrid.path),
                              token_ids=encode_prompt(tiny_hybrid, PROMPT)[: len(ids)])


def test_safetensors_reader_refuses_broken_headers():
    good = io.BytesIO()
    st.write(good, {"0.0": ("F32", np.zeros((1, 2, 3, 4), "<f4"))}, {"1.0": "KVCache"})
    data = good.getvalue()
    with pytest.raises(DataError, match="too short"):
        st.parse(data[:4])
    with pytest.raises(DataError, match="header length"):
        st.parse((10 ** 9).to_bytes(8, "little") + data[8:])
    with pytest.raises(DataError, match="do not fit"):
        st.parse(data[:-8])
    header = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    with pytest.raises(DataError, match="duplicate"):
        st.parse(len(header).to_bytes(8, "little") + header + b"\0" * 4)


def test_export_refuses_a_delta_pack_naming_it(tiny_llama):
    from dataclasses import replace

    from muser_cli.kvpack import LayerKV

    h = replace(read_pack_bytes(_pack_bytes(tiny_llama)).header, rows_start=8, base={"root": "x"})
    with pytest.raises(DataError, match="delta pack"):
        interop.prompt_cache_tensors(h, [LayerKV(np.zeros((1, 1, 1)), np.zeros((1, 1, 1)))], model_ref="m")


def _pack_bytes(info) -> bytes:
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), engine="torch", dtype="float32", chunk_tokens=CHUNK)
    return out.getvalue()


@pytest.mark.slow
def test_real_model_export_continues_in_mlx_lm(real_model, tmp_path):
    info = real_model
    pack_path = make_pack(info, tmp_path)
    export(pack_path, tmp_path / "doc.safetensors", info)
    ids = list(read_pack(open(pack_path, "rb")).header.token_ids)
    eng = mlx_engine(info)
    cache = load_prompt_cache(str(tmp_path / "doc.safetensors"))
    theirs = [t for t, _ in generate_step(mx.array([ids[-1]]), eng.model, max_tokens=NEW, prompt_cache=cache)]
    with open(pack_path, "rb") as src:
        out = decode(src, model=str(info.path), engine="mlx", max_new_tokens=NEW)
    assert out.token_ids and out.token_ids == theirs[: len(out.token_ids)]
    assert decode_text(info, out.token_ids).strip()


def test_cli_usage_errors_exit_2(tiny_llama, tmp_path):
    f = tmp_path / "c.safetensors"
    f.write_bytes(b"\0" * 16)
    for args, needle in (
        (["--import", "mlx-lm", str(f), "-m", str(tiny_llama.path)], b"--prompt"),
        (["--export", "gguf", str(f)], b"unknown cache format 'gguf'"),
        (["--export", "mlx-lm", "--import", "mlx-lm", str(f)], b"exclude each other"),
    ):
        r = muser("pack", *args, "-o", str(tmp_path / "out"))
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)
        assert not (tmp_path / "out").exists()


def test_bfloat16_rows_export_as_bf16_bits_and_come_back(tiny_hybrid, tmp_path):
    info = tiny_hybrid
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), engine="torch", dtype="bfloat16", chunk_tokens=CHUNK)
    pack = read_pack_bytes(out.getvalue())
    f = tmp_path / "bf16.safetensors"
    with open(f, "wb") as o:
        interop.export_mlx_lm(pack, o, model=str(info.path))
    cache = load_prompt_cache(str(f))
    assert all(c.keys.dtype == mx.bfloat16 for c in cache)
    full = info.layers.index(next(s for s in info.layers if s.kind == "full"))
    assert np.array_equal(np.array(cache[full].keys[0].view(mx.uint16)), pack.layers[full].keys)
    back = io.BytesIO()
    interop.import_mlx_lm(str(f), back, model=str(info.path), token_ids=list(pack.header.token_ids), chunk_tokens=CHUNK)
    again = read_pack_bytes(back.getvalue())
    assert again.header.dtype == "bfloat16"
    cuts = [y.first_row - x.first_row for x, y in zip(pack.layers, again.layers)]  # the sliding history is dropped
    assert cuts == [pack.header.rows_end - (s.window - 1) if s.kind == "sliding" else 0 for s in info.layers]
    assert all(x.keys[:, c:].tobytes() == y.keys.tobytes() and x.values[:, c:].tobytes() == y.values.tobytes()
               for x, y, c in zip(pack.layers, again.layers, cuts))


def test_a_file_muser_exported_is_bound_to_its_prompt(tiny_llama, tmp_path):
    info = tiny_llama
    pack_path = make_pack(info, tmp_path)
    export(pack_path, tmp_path / "doc.safetensors", info)
    ids = list(read_pack(open(pack_path, "rb")).header.token_ids)
    other = ids[:-1] + [(ids[-1] + 1) % 500 + 3]  # same length, another last token
    from muser_cli.errors import IdentityMismatch

    with pytest.raises(IdentityMismatch, match="another prompt"):
        interop.import_mlx_lm(str(tmp_path / "doc.safetensors"), io.BytesIO(), model=str(info.path), token_ids=other)


def test_any_corruption_of_a_file_is_a_data_error(tiny_hybrid, tmp_path):
    """Flipped bytes anywhere in the header or data, and cuts: parsing either succeeds or
    raises DataError (one line), never anything else."""
    info = tiny_hybrid
    good = tmp_path / "good.safetensors"
    mlx_lm_file(info, encode_prompt(info, PROMPT), good, whole=True)
    data = good.read_bytes()
    hlen = int.from_bytes(data[:8], "little")
    rng = np.random.default_rng(16)
    outcomes = {"ok": 0, "refused": 0}
    for trial in range(400):
        b = bytearray(data)
        if trial % 4 == 3:
            b = b[: int(rng.integers(0, len(b)))]
        else:
            for _ in range(int(rng.integers(1, 4))):
                at = int(rng.integers(0, 8 + hlen)) if trial % 2 else int(rng.integers(0, len(b)))
                b[at] = int(rng.integers(0, 256))
        try:
            cache = interop.parse_prompt_cache(bytes(b))
            interop.cache_to_layers(cache, info, encode_prompt(info, PROMPT))
            outcomes["ok"] += 1
        except DataError as exc:
            assert 0 < len(exc.message) < 400 and "\n" not in exc.message
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100


def test_import_of_a_fifo_or_a_device_is_refused_at_once_not_waited_on(tiny_llama, tmp_path):
    """Issue 30 item 5: ``pack --import mlx-lm FIFO`` (no one writing) hung; it is refused (66)
    after an fstat of a non-blocking open, in one line, with nothing written."""
    fifo = tmp_path / "cache.safetensors"
    os.mkfifo(fifo)
    (tmp_path / "doc.txt").write_text(PROMPT)
    for src, kind in ((fifo, b"named pipe (FIFO)"), (Path("/dev/zero"), b"character device")):
        out = tmp_path / "out.kvpack"
        r = muser("pack", "--import", "mlx-lm", str(src), "--prompt", str(tmp_path / "doc.txt"),
                  "-m", str(tiny_llama.path), "-o", str(out), timeout=HANG_S)
        assert r.returncode == 66 and kind in r.stderr and b"not a regular file" in r.stderr, r.stderr
        assert len(r.stderr.decode().strip().splitlines()) == 1 and not out.exists()
    with pytest.raises(MissingInput, match="named pipe"):
        interop.read_prompt_cache_file(str(fifo))


def test_an_mlx_lm_cache_of_another_prompt_that_ends_alike_is_never_decoded(tiny_llama, tmp_path):
    """Issue 30: mlx-lm's cache of *another* prompt of the same length, imported for this one,
    passed the check of the last position when the prompts ended alike, and decoded wrong
    text. The gate samples positions across the prompt: refused without a prompt (65), set
    aside for a local prefill with one."""
    from muser_cli.errors import SpotCheckFailed

    info = tiny_llama
    ids = encode_prompt(info, PROMPT)
    other = encode_prompt(info, "Rivers carry silt to the sea, and the delta grows a little every spring flood.")
    other = (other * (len(ids) // len(other) + 1))[: len(ids) - 4] + ids[-4:]
    src = tmp_path / "other.safetensors"
    mlx_lm_file(info, other, src, whole=False)
    pack_path = tmp_path / "imported.kvpack"
    with open(pack_path, "wb") as out:
        interop.import_mlx_lm(str(src), out, model=str(info.path), prompt=PROMPT, chunk_tokens=CHUNK)
    with open(pack_path, "rb") as f, pytest.raises(SpotCheckFailed, match="sampled across the prompt"):
        decode(f, model=str(info.path), dtype="float32", max_new_tokens=4)
    local = decode(None, model=str(info.path), prompt=PROMPT, dtype="float32", max_new_tokens=4)
    with open(pack_path, "rb") as f:
        out = decode(f, model=str(info.path), prompt=PROMPT, dtype="float32", max_new_tokens=4)
    assert out.source == "local" and out.token_ids == local.token_ids and "set aside" in out.set_aside
