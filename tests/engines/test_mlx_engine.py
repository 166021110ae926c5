"""The heterogeneous lane: MLX (mlx-lm on ``mlx[cpu]``) as consumer and producer.

* torch -> MLX and MLX -> torch handoffs give the same greedy tokens (float32; tiny
  models and the real one, short prompts);
* MLX -> MLX through kvpack bytes is bit-identical to MLX's own live cache, to
  ``mlx_lm.generate_step`` on the same schedule, and to the local fallback path;
* sliding-window rows land in mlx-lm's rotating cache in temporal order (the oldest row
  is evicted first), exactly where mlx-lm itself would have put them;
* a RoPE the loaded MLX model would not honour (theta, style, NoPE) is refused before decode;
* which BLAS MLX uses is chosen before MLX loads and reported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from muser_cli.engines.mlx import blas as mlx_blas

mlx_blas.ensure_fast_blas()  # before the first import of mlx.core in this process
mx = pytest.importorskip("mlx.core", reason="mlx not installed")
pytest.importorskip("mlx_lm", reason="mlx-lm not installed")

from muser_cli.engines.mlx import engine as mlx_engine  # noqa: E402
from muser_cli.engines.base import Sampling
from muser_cli.engines.registry import get_engine  # noqa: E402
from muser_cli.engines.mlx.engine import MLXEngine  # noqa: E402
from muser_cli.errors import DataError, IdentityMismatch, PromptTooLong, UsageError  # noqa: E402
from muser_cli.kvpack.layers import LayerKV  # noqa: E402
from muser_cli.model.tokens import decode_text, encode_prompt  # noqa: E402
from engine_kit import PROMPT, refuses_bad_rows, through_bytes  # noqa: E402

pytestmark = pytest.mark.mlx

THREADS = 1  # small shared machine: one BLAS thread avoids spin-wait stalls
CHUNK = 16
NEW = 16  # > the tiny hybrid's window (8): decoding evicts ring rows

_ENGINES: dict = {}


def engine(kind: str, info, dtype: str = "float32"):
    key = (kind, str(info.path), info.fingerprint, dtype)
    if key not in _ENGINES:
        _ENGINES[key] = get_engine(kind, info, dtype=dtype, threads=THREADS)
    return _ENGINES[key]


def greedy(eng, layers, ids, new=NEW, **kw):
    return eng.decode(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=new, stop_on_eos=False, **kw)


def live_logits(eng: MLXEngine, prefix: list[int], nxt: list[int], chunk: int) -> np.ndarray:
    caches = eng._prefill_caches(prefix, chunk, None)
    return np.array(eng.model(mx.array([nxt]), cache=caches)[0])


# --------------------------------------------------------------------------- cross-engine


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_hybrid"])
def test_torch_to_mlx_and_back_tiny(which, request):
    info = request.getfixturevalue(which)
    ids = encode_prompt(info, PROMPT)
    assert len(ids) > 2 * CHUNK
    torch_eng, mlx_eng = engine("torch", info), engine("mlx", info)
    from_torch = torch_eng.prefill(ids[:-1], chunk_tokens=CHUNK)
    reference = greedy(torch_eng, from_torch, ids)
    streamed: list[int] = []
    consumed = greedy(mlx_eng, through_bytes(from_torch, "float32"), ids, on_token=streamed.append)
    assert consumed.token_ids == reference.token_ids and streamed == consumed.token_ids
    assert consumed.stats["blas"] == mlx_blas.active_blas().name and consumed.stats["stop_reason"] == "length"
    assert consumed.ttft_s > 0 and consumed.decode_s > 0

    seen: list = []
    from_mlx = mlx_eng.prefill(ids[:-1], chunk_tokens=CHUNK, progress=lambda *a: seen.append(a))
    rows = len(ids) - 1
    assert seen[0] == ("prefill", 0, rows) and seen[-1] == ("prefill", rows, rows)
    for spec, a, b in zip(info.layers, from_mlx, from_torch):
        assert a.keys.dtype == np.float32 and a.keys.shape == b.keys.shape and a.first_row == b.first_row
        assert np.abs(a.keys - b.keys).max() < 1e-4 and np.abs(a.values - b.values).max() < 1e-4
    assert greedy(torch_eng, through_bytes(from_mlx, "float32"), ids).token_ids == reference.token_ids
    logits_t = torch_eng.step_logits(from_torch, rows=rows, next_tokens=ids[-1:])
    logits_m = mlx_eng.step_logits(from_torch, rows=rows, next_tokens=ids[-1:])
    print(f"{which}: torch KV -> mlx logits max_diff={np.abs(logits_t - logits_m).max():.2e}")
    assert np.abs(logits_t - logits_m).max() < 1e-3


@pytest.mark.slow
def test_real_model_torch_to_mlx_and_back(real_model):
    torch_eng, mlx_eng = engine("torch", real_model), engine("mlx", real_model)
    for prompt in ("What is the capital of France?", "Write one sentence about rivers."):
        ids = encode_prompt(real_model, prompt, chat=True)
        rows = len(ids) - 1
        from_torch = torch_eng.prefill(ids[:-1], chunk_tokens=CHUNK)
        reference = greedy(torch_eng, from_torch, ids, new=12)
        assert greedy(mlx_eng, through_bytes(from_torch, "float32"), ids, new=12).token_ids == reference.token_ids
        from_mlx = mlx_eng.prefill(ids[:-1], chunk_tokens=CHUNK)
        assert greedy(torch_eng, through_bytes(from_mlx, "float32"), ids, new=12).token_ids == reference.token_ids
        diff = max(float(np.abs(a.keys - b.keys).max()) for a, b in zip(from_mlx, from_torch))
        print(f"real model, {rows} rows: max |K_mlx - K_torch| = {diff:.2e}")
        assert diff < 1e-3


@pytest.mark.slow
def test_real_model_answers_on_mlx(real_model):
    ids = encode_prompt(real_model, "What is the capital of France?", chat=True)
    layers = engine("torch", real_model).prefill(ids[:-1], chunk_tokens=CHUNK)
    text = decode_text(real_model, greedy(engine("mlx", real_model), layers, ids, new=8).token_ids)
    assert "Paris" in text


# --------------------------------------------------------------------------- MLX -> MLX exactness


@pytest.mark.parametrize("chunk", [1, 7, 16])
@pytest.mark.parametrize("which", ["tiny_llama", "tiny_hybrid"])
def test_mlx_handoff_bit_identical_to_live_cache(which, chunk, request):
    from mlx_lm.generate import generate_step

    info = request.getfixturevalue(which)
    ids = encode_prompt(info, PROMPT)[:41]
    producer = engine("mlx", info)
    consumer = MLXEngine(info, dtype="float32", threads=THREADS)  # a fresh model instance
    for rows in (40, 2 * chunk + 1 if 2 * chunk + 1 < 40 else 33, 17):  # also a one-token last chunk
        n = rows + 1
        sub = ids[:n]
        layers = producer.prefill(sub[:-1], chunk_tokens=chunk)
        reference = producer.generate_reference(sub[:-1], sub[-1:], NEW, chunk_tokens=chunk, stop_on_eos=False)
        handed = greedy(consumer, through_bytes(layers, "float32"), sub, chunk_tokens=chunk)
        assert handed.token_ids == reference.token_ids
        steps = [tok for tok, _ in generate_step(mx.array(sub), producer.model, max_tokens=NEW, prefill_step_size=chunk)]
        assert steps == reference.token_ids
        live = live_logits(producer, sub[:-1], sub[-1:], chunk)
        installed = consumer.step_logits(through_bytes(layers, "float32"), rows=n - 1, next_tokens=sub[-1:],
                                         chunk_tokens=chunk)
        assert np.array_equal(live, installed), f"max_diff={np.abs(live - installed).max()}"
        again = producer.prefill(sub[:-1], chunk_tokens=chunk)
        assert all(a.keys.tobytes() == b.keys.tobytes() and a.values.tobytes() == b.values.tobytes()
                   for a, b in zip(layers, again))


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_hybrid"])
def test_mlx_bfloat16_rows_are_raw_bits_and_exact(which, request):
    info = request.getfixturevalue(which)
    ids = encode_prompt(info, PROMPT)
    eng = engine("mlx", info, "bfloat16")
    layers = eng.prefill(ids[:-1], chunk_tokens=CHUNK)
    assert {kv.keys.dtype for kv in layers} == {np.dtype("<u2")}
    reference = eng.generate_reference(ids[:-1], ids[-1:], NEW, chunk_tokens=CHUNK, stop_on_eos=False)
    fresh = MLXEngine(info, dtype="bfloat16", threads=THREADS)
    assert greedy(fresh, through_bytes(layers, "bfloat16"), ids, chunk_tokens=CHUNK).token_ids == reference.token_ids


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_hybrid"])
def test_mlx_handoff_equals_mlx_fallback_through_the_library(which, request, tmp_path):
    """prefill --engine mlx -> kvpack bytes -> decode --engine mlx == decode --engine mlx --prompt (fallback)."""
    import io

    from muser_cli.consumer.decode import decode
    from muser_cli.produce.prefill import prefill

    info = request.getfixturevalue(which)
    out = io.BytesIO()
    res = prefill(PROMPT, out, model=str(info.path), engine="mlx", threads=THREADS)
    assert res.header.dtype == "float32" and res.header.producer["engine"] == "mlx"
    assert res.header.producer["blas"] == mlx_blas.active_blas().name
    handed = decode(io.BytesIO(out.getvalue()), model=str(info.path), engine="mlx", max_new_tokens=NEW, threads=THREADS)
    local = decode(io.BytesIO(b""), model=str(info.path), prompt=PROMPT, engine="mlx", max_new_tokens=NEW,
                   threads=THREADS)
    assert handed.fallback is False and local.fallback is True
    assert handed.token_ids == local.token_ids and len(handed.token_ids) > 0
    # The torch consumer reads the MLX producer's pack too.
    crossed = decode(io.BytesIO(out.getvalue()), model=str(info.path), engine="torch", max_new_tokens=NEW,
                     threads=THREADS)
    assert crossed.token_ids == handed.token_ids


@pytest.mark.parametrize("chunk", [1, 8])
@pytest.mark.parametrize("which", ["tiny_llama", "tiny_hybrid"])
def test_prefill_from_a_chunk_boundary_is_byte_identical(which, chunk, request):
    """Store + suffix (reuse): installed rows continued on the schedule == one full prefill."""
    info = request.getfixturevalue(which)
    eng = engine("mlx", info)
    ids = encode_prompt(info, PROMPT)[:45]
    full = eng.prefill(ids, chunk_tokens=chunk)
    held = 24  # a chunk boundary for both sizes
    head = eng.prefill(ids[:held], chunk_tokens=chunk)
    seen: list = []
    resumed = eng.prefill_from(through_bytes(head, "float32"), rows=held, token_ids=ids[held:], chunk_tokens=chunk,
                               progress=lambda *a: seen.append(a))
    assert seen[0] == ("prefill", held, len(ids)) and seen[-1] == ("prefill", len(ids), len(ids))
    for a, b in zip(full, resumed):
        assert a.first_row == b.first_row
        assert a.keys.tobytes() == b.keys.tobytes() and a.values.tobytes() == b.values.tobytes()
    with pytest.raises(UsageError, match="chunk boundary"):
        eng.prefill_from(head, rows=held, token_ids=ids[held:], chunk_tokens=7)


# --------------------------------------------------------------------------- sliding-window rings


@pytest.mark.parametrize("rows, chunk", [(40, 16), (40, 7), (41, 8), (33, 1), (20, 1), (8, 7), (9, 8), (5, 16), (7, 3)])
def test_ring_install_matches_mlx_lm_own_layout(rows, chunk):
    """Rows installed from a pack sit in the very slots mlx-lm's own prefill would use, and the
    next writes evict the oldest row first. Model-free: row p holds the number p."""
    from mlx_lm.models.cache import RotatingKVCache

    from muser_cli.engines.mlx.cache import install_rotating, temporal

    window = 8

    def rows_of(a, b):  # (1, 1, b - a, 2): position p -> [p, -p]
        pos = np.arange(a, b, dtype=np.float32)
        return mx.array(np.stack([pos, -pos], axis=-1)[None, None])

    live = RotatingKVCache(max_size=window)
    for begin in range(0, rows, chunk):
        live.update_and_fetch(rows_of(begin, min(rows, begin + chunk)), rows_of(begin, min(rows, begin + chunk)))
    carried = min(rows, window - 1)
    installed = RotatingKVCache(max_size=window)
    pack = rows_of(rows - carried, rows)
    install_rotating(mx, installed, pack, pack, rows, chunk)
    keys, _ = temporal(installed)
    assert np.array(keys)[0, 0, -carried:, 0].tolist() == list(range(rows - carried, rows))
    for step in range(2 * window + 1):  # decode: one token at a time, past a full turn of the ring
        new = rows_of(rows + step, rows + step + 1)
        got_k, _ = installed.update_and_fetch(new, new)
        want_k, _ = live.update_and_fetch(new, new)
        # Same physical layout as mlx-lm's own cache (so the same arithmetic order) ...
        assert np.array_equal(np.array(got_k), np.array(want_k)), (step, np.array(got_k)[0, 0, :, 0], np.array(want_k)[0, 0, :, 0])
        # ... holding exactly the window, oldest first once un-rotated.
        now = rows + step + 1
        held, _ = temporal(installed)
        assert np.array(held)[0, 0, :, 0].tolist()[-min(now, window):] == list(range(max(0, now - window), now))


def test_ring_order_matters_and_is_temporal(tiny_hybrid):
    """Torch's rows (temporal order) decode in MLX exactly as in torch; the same rows in the
    physical order of a rotated ring, or reversed, do not."""
    info = tiny_hybrid
    ids = encode_prompt(info, PROMPT)
    rows = 40
    prefix, nxt = ids[:rows], ids[rows : rows + 3]
    torch_eng, mlx_eng = engine("torch", info), engine("mlx", info)
    layers = torch_eng.prefill(prefix, chunk_tokens=CHUNK)
    assert [kv.keys.shape[1] for kv in layers] == [8, 8, 8, 40]  # window - 1 and one ring row (ring_extra)
    reference = torch_eng.decode(layers, rows=rows, next_tokens=nxt[:1], max_new_tokens=NEW, stop_on_eos=False)
    assert mlx_eng.decode(layers, rows=rows, next_tokens=nxt[:1], max_new_tokens=NEW,
                          stop_on_eos=False).token_ids == reference.token_ids

    def reorder(fn):
        return [LayerKV(keys=fn(kv.keys), values=fn(kv.values), first_row=kv.first_row) if spec.kind == "sliding" else kv
                for spec, kv in zip(info.layers, layers)]

    physical = reorder(lambda a: np.roll(a, 3, axis=1))  # a ring dumped in slot order, not un-rotated
    wrong = mlx_eng.decode(physical, rows=rows, next_tokens=nxt[:1], max_new_tokens=NEW, stop_on_eos=False)
    assert wrong.token_ids != reference.token_ids
    # Three queries at once: the window mask hides the oldest *stored* row from the last one.
    own = mlx_eng.prefill(prefix, chunk_tokens=CHUNK)
    live = live_logits(mlx_eng, prefix, nxt, CHUNK)
    assert np.array_equal(mlx_eng.step_logits(own, rows=rows, next_tokens=nxt, chunk_tokens=CHUNK), live)
    backwards = mlx_eng.step_logits(reorder(lambda a: a[:, ::-1]), rows=rows, next_tokens=nxt)
    assert np.abs(backwards[-1] - live[-1]).max() > 1e-3


# --------------------------------------------------------------------------- RoPE refusals


def _with_rope(info, **changes):
    layers = tuple(dataclasses.replace(s, rope=dataclasses.replace(s.rope, **changes)) if s.rope else s for s in info.layers)
    return dataclasses.replace(info, layers=layers)


def test_planted_rope_theta_mismatch_is_refused(tiny_llama):
    planted = _with_rope(tiny_llama, theta=100000.0)
    with pytest.raises(IdentityMismatch, match=r"layer 0 rope\.theta: the model uses 100000, mlx-lm would use 10000"):
        MLXEngine(planted, dtype="float32", threads=THREADS)
    with pytest.raises(IdentityMismatch, match=r"rope\.style"):
        MLXEngine(_with_rope(tiny_llama, style="interleaved"), dtype="float32", threads=THREADS)
    with pytest.raises(IdentityMismatch, match=r"rope\.dims"):
        MLXEngine(_with_rope(tiny_llama, dims=8), dtype="float32", threads=THREADS)
    with pytest.raises(DataError, match=r"rope\.scaling: type 'longrope'"):  # yarn is checked since #26
        MLXEngine(_with_rope(tiny_llama, scaling={"rope_type": "longrope", "factor": 4.0}), dtype="float32",
                  threads=THREADS)
    with pytest.raises(DataError, match=r"rope\.scaling: yarn needs factor and original_max_position_embeddings"):
        MLXEngine(_with_rope(tiny_llama, scaling={"rope_type": "yarn", "factor": 4.0}), dtype="float32", threads=THREADS)


def test_nope_and_layout_mismatches_are_refused(tiny_hybrid):
    specs = list(tiny_hybrid.layers)
    specs[3] = dataclasses.replace(specs[3], rope=specs[0].rope)  # claims RoPE on Cohere2's NoPE layer
    with pytest.raises(IdentityMismatch, match=r"layer 3 rope: the model applies RoPE .* mlx-lm applies none"):
        MLXEngine(dataclasses.replace(tiny_hybrid, layers=tuple(specs)), dtype="float32", threads=THREADS)
    specs = list(tiny_hybrid.layers)
    specs[0] = dataclasses.replace(specs[0], window=16)
    with pytest.raises(IdentityMismatch, match=r"layer 0 kind: the model describes sliding \(window 16\), mlx-lm builds sliding \(window 8\)"):
        MLXEngine(dataclasses.replace(tiny_hybrid, layers=tuple(specs)), dtype="float32", threads=THREADS)


@pytest.fixture
def llama_theta_only_in_rope_parameters(tiny_llama, tmp_path) -> Path:
    """The transformers 5.x layout: rope_theta under rope_parameters only (and not the default)."""
    folder = tmp_path / "llama-rope-params"
    shutil.copytree(tiny_llama.path, folder, ignore=shutil.ignore_patterns(".muser-*"))
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_theta", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_rope_theta_translated_from_rope_parameters(llama_theta_only_in_rope_parameters, monkeypatch):
    from mlx_lm.utils import load_model

    from muser_cli.model.resolve import resolve_model

    folder = llama_theta_only_in_rope_parameters
    info = resolve_model(folder)
    assert {s.rope.theta for s in info.layers} == {500.0}
    plain, _ = load_model(folder)  # the pitfall: mlx-lm alone falls back to its default theta
    assert plain.layers[0].self_attn.rope.base == 10000
    eng = MLXEngine(info, dtype="float32", threads=THREADS)  # translated: loads and passes the check
    assert eng.overrides["rope_theta"] == 500.0 and eng.model.layers[0].self_attn.rope.base == 500.0
    ids = encode_prompt(info, PROMPT)
    torch_eng = get_engine("torch", info, dtype="float32", threads=THREADS)
    layers = torch_eng.prefill(ids[:-1], chunk_tokens=CHUNK)
    assert greedy(eng, layers, ids).token_ids == greedy(torch_eng, layers, ids).token_ids
    # Without the translation the loaded model would rotate with 10000: refused, not decoded.
    monkeypatch.setattr(mlx_engine, "mlx_config_overrides", lambda config: {})
    with pytest.raises(IdentityMismatch, match=r"rope\.theta: the model uses 500, mlx-lm would use 10000"):
        MLXEngine(info, dtype="float32", threads=THREADS)


def test_rope_probe_catches_what_attributes_do_not_name():
    """A RoPE module that hides its parameters is still checked by rotating a probe vector."""
    from muser_cli.kvpack.layers import LayerSpec, RopeSpec

    class Opaque:
        def __init__(self, base):
            self._rope = mx.fast.rope
            self._base = base

        def __call__(self, x, offset=0):
            return mx.fast.rope(x, 16, traditional=False, base=self._base, scale=1.0, offset=offset)

    spec = LayerSpec(kind="full", kv_heads=2, head_dim=16, v_head_dim=16, rope=RopeSpec(theta=10000.0, dims=16))
    mlx_engine.check_rope(0, spec, Opaque(10000.0), 256)
    with pytest.raises(IdentityMismatch, match=r"layer 0 rope: mlx-lm's rotation differs"):
        mlx_engine.check_rope(0, spec, Opaque(100000.0), 256)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    from mlx_lm.models.rope_utils import initialize_rope

    module = initialize_rope(16, 10000.0, False, llama3, 4096)
    scaled = LayerSpec(kind="full", kv_heads=2, head_dim=16, v_head_dim=16,
                       rope=RopeSpec(theta=10000.0, dims=16, scaling=llama3))
    mlx_engine.check_rope(0, scaled, module, 4096)
    with pytest.raises(IdentityMismatch):
        mlx_engine.check_rope(0, spec, module, 4096)  # the model says unscaled, mlx-lm scales


# --------------------------------------------------------------------------- recompute (verify --audit)


def test_recompute_suffix_matches_prefill(tiny_llama):
    eng = engine("mlx", tiny_llama)
    ids = encode_prompt(tiny_llama, PROMPT)[:41]
    rows = 40
    layers = eng.prefill(ids[:rows], chunk_tokens=CHUNK)
    start = 32  # a chunk boundary: with the same grid the suffix is recomputed bit for bit
    prefix = [LayerKV(kv.keys[:, :start], kv.values[:, :start], 0) for kv in layers]
    fresh = eng.recompute(prefix, rows=start, token_ids=ids[start:rows], chunk_tokens=CHUNK)
    for kv, new in zip(layers, fresh):
        assert new.first_row == start and new.keys.shape == (2, rows - start, 16)
        assert np.array_equal(new.keys, kv.keys[:, start:]) and np.array_equal(new.values, kv.values[:, start:])
    loose = eng.recompute(layers, 40, ids[start:rows], start)  # [0, start) cut from 40 rows; one pass
    assert max(float(np.abs(a.keys - kv.keys[:, start:]).max()) for a, kv in zip(loose, layers)) < 1e-5


def test_recompute_needs_the_window_before_start(tiny_hybrid):
    eng = engine("mlx", tiny_hybrid)
    ids = encode_prompt(tiny_hybrid, PROMPT)
    layers = eng.prefill(ids[:40], chunk_tokens=CHUNK)
    with pytest.raises(DataError, match=r"layer 0 \(sliding\): recomputing from position 32 needs rows \[25, 32\)"):
        eng.recompute(layers, 40, ids[32:40], 32)
    fresh = eng.recompute(layers, rows=40, token_ids=ids[40:44])  # from the end: the window is there
    longer = eng.prefill(ids[:44], chunk_tokens=CHUNK)
    for spec, new, kv in zip(tiny_hybrid.layers, fresh, longer):
        assert new.first_row == 40 and new.keys.shape[1] == 4
        assert np.abs(new.keys - kv.keys[:, -4:]).max() < 1e-5


def test_verify_audit_on_mlx(tiny_llama, tiny_hybrid):
    import io

    from muser_cli.produce.prefill import prefill
    from muser_cli.gate.verify import verify

    for info in (tiny_llama, tiny_hybrid):
        out = io.BytesIO()
        prefill(PROMPT, out, model=str(info.path), engine="torch", dtype="float32", chunk_tokens=CHUNK, threads=THREADS)
        report = verify(io.BytesIO(out.getvalue()), model=str(info.path), audit=8, engine="mlx", threads=THREADS)
        assert report.ok, report.to_json()
        audit = report.summary["audit"]
        assert len(audit["layers"]) == 4 and all(l["rel_max"] < 1e-3 for l in audit["layers"])


# --------------------------------------------------------------------------- sampling, errors


def test_sampling_is_seeded(tiny_llama):
    eng = engine("mlx", tiny_llama)
    ids = encode_prompt(tiny_llama, PROMPT)
    layers = eng.prefill(ids[:-1], chunk_tokens=CHUNK)
    sampling = Sampling(temperature=1.0, top_p=0.9, seed=7)
    first = greedy(eng, layers, ids, sampling=sampling)
    assert greedy(eng, layers, ids, sampling=sampling).token_ids == first.token_ids
    reference = eng.generate_reference(ids[:-1], ids[-1:], NEW, chunk_tokens=CHUNK, sampling=sampling, stop_on_eos=False)
    assert reference.token_ids == first.token_ids
    plain = greedy(eng, layers, ids)
    assert greedy(eng, layers, ids, sampling=Sampling(temperature=1.0, top_p=1e-9, seed=3)).token_ids == plain.token_ids
    others = {tuple(greedy(eng, layers, ids, sampling=Sampling(temperature=2.0, seed=s)).token_ids) for s in range(4)}
    assert len(others) > 1


def test_stop_on_eos(tiny_llama):
    eng = engine("mlx", tiny_llama)
    ids = encode_prompt(tiny_llama, PROMPT)
    layers = eng.prefill(ids[:-1], chunk_tokens=CHUNK)
    first = greedy(eng, layers, ids).token_ids
    eos_info = dataclasses.replace(tiny_llama, eos_token_ids=(first[2],))
    stopper = MLXEngine(eos_info, dtype="float32", threads=THREADS)
    result = stopper.decode(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=NEW)
    assert result.token_ids == first[: first.index(first[2]) + 1] and result.stats["stop_reason"] == "eos"


def test_bad_input_is_refused(tiny_hybrid):
    eng = engine("mlx", tiny_hybrid)
    ids = encode_prompt(tiny_hybrid, PROMPT)[:21]
    layers = refuses_bad_rows(eng, ids, CHUNK)
    with pytest.raises(PromptTooLong, match="longer than the model's context of 256"):
        eng.decode(layers, rows=20, next_tokens=ids[-1:], max_new_tokens=250)
    with pytest.raises(UsageError, match="no dtype 'float16'"):
        MLXEngine(tiny_hybrid, dtype="float16", threads=THREADS)
    empty = eng.prefill([], chunk_tokens=CHUNK)
    assert all(kv.keys.shape[1] == 0 for kv in empty)


# --------------------------------------------------------------------------- BLAS


def test_blas_choice_and_report(tiny_llama, tmp_path):
    info = mlx_blas.active_blas()
    assert info.name in ("mkl", "openblas", "reference", "accelerate", "other")
    if sys.platform != "linux":
        return
    env = {**os.environ, mlx_blas.ENV_VAR: "reference"}
    env.pop("LD_PRELOAD", None)
    probe = ("from muser_cli.engines.mlx import blas as mlx_blas; import json; print(json.dumps(mlx_blas.ensure_fast_blas().to_json()))")
    ref = json.loads(subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout)
    assert ref["name"] == "reference" and "reference" in ref["how"]
    mkl = mlx_blas.find_library("mkl")
    if mkl is None:
        pytest.skip("no MKL in this environment (pip install mkl)")
    env[mlx_blas.ENV_VAR] = "auto"
    auto = json.loads(subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout)
    assert auto["name"] == "mkl" and auto["how"].startswith("loaded before mlx")
    preloaded = mlx_blas.preload_env(env)
    assert preloaded["LD_PRELOAD"].split()[0] == str(mkl)
    pre = json.loads(subprocess.run([sys.executable, "-c", probe], env=preloaded, capture_output=True, text=True, check=True).stdout)
    assert pre["name"] == "mkl" and pre["how"] == "LD_PRELOAD"
    # Too late once mlx is imported: said, not hidden.
    late = "import mlx.core; " + probe
    after = json.loads(subprocess.run([sys.executable, "-c", late], env=env, capture_output=True, text=True, check=True).stdout)
    assert after["name"] == "reference" and "imported before" in after["how"]
    env[mlx_blas.ENV_VAR] = "nonsense"
    bad = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "not a BLAS choice" in bad.stderr
