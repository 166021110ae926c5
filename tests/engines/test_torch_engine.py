"""The torch engine: canonical chunked prefill, extraction, rebuild, exact decode."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from muser_cli.engines.base import Sampling
from muser_cli.engines.registry import get_engine
from muser_cli.engines.torch.engine import TorchEngine
from muser_cli.errors import PromptTooLong, UsageError
from muser_cli.kvpack.layers import DTYPES, LayerKV
from muser_cli.model.tokens import decode_text, encode_prompt
from engine_kit import PROMPT, refuses_bad_rows, through_bytes

THREADS = 1  # the test machine is small and shared; one thread avoids spin-wait stalls
CHUNK = 16
NEW = 16

_ENGINES: dict = {}


def engine_for(info, dtype: str) -> TorchEngine:
    key = (str(info.path), info.fingerprint, dtype)
    if key not in _ENGINES:
        _ENGINES[key] = TorchEngine(info, dtype=dtype, threads=THREADS)
    return _ENGINES[key]


def check_exact(info, dtype: str, ids: list[int], new: int = NEW, chunk: int = CHUNK, thorough: bool = True):
    """prefill -> extract -> bytes -> rebuild in a fresh engine -> decode == live-cache decode."""
    producer = engine_for(info, dtype)
    rows = len(ids) - 1
    seen: list = []
    layers = producer.prefill(ids[:-1], chunk_tokens=chunk, progress=lambda *a: seen.append(a))
    assert seen[-1] == ("prefill", rows, rows) and len(seen) == 1 + -(-rows // chunk)
    for spec, kv in zip(info.layers, layers):
        carried = spec.carried_rows(rows, producer.ring_extra)  # a sliding layer: one ring row more
        assert kv.keys.shape == (spec.kv_heads, carried, spec.head_dim)
        assert kv.values.shape == (spec.kv_heads, carried, spec.v_head_dim)
        assert kv.first_row == rows - carried

    reference = producer.generate_reference(ids[:-1], ids[-1:], new, chunk_tokens=chunk, stop_on_eos=False)
    fresh = TorchEngine(info, dtype=dtype, threads=THREADS)  # a new model instance: the consumer's
    streamed: list[int] = []
    rebuilt = fresh.decode(
        through_bytes(layers, dtype), rows=rows, next_tokens=ids[-1:], max_new_tokens=new,
        stop_on_eos=False, on_token=streamed.append,
    )
    assert len(reference.token_ids) == new
    assert rebuilt.token_ids == reference.token_ids
    assert streamed == rebuilt.token_ids
    assert rebuilt.ttft_s > 0 and rebuilt.decode_s > 0 and rebuilt.stats["stop_reason"] == "length"
    if not thorough:
        return layers, reference
    same_engine = producer.decode(layers, rows=rows, next_tokens=ids[-1:], max_new_tokens=new, stop_on_eos=False)
    assert same_engine.token_ids == reference.token_ids
    # The KV bytes themselves are reproducible: a second prefill gives the same bytes.
    again = producer.prefill(ids[:-1], chunk_tokens=chunk)
    assert all(a.keys.tobytes() == b.keys.tobytes() and a.values.tobytes() == b.values.tobytes() for a, b in zip(layers, again))
    return layers, reference


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["tiny_llama", "tiny_hybrid"])
def test_tiny_exact_resume(which, dtype, request):
    info = request.getfixturevalue(which)
    ids = encode_prompt(info, PROMPT)
    assert len(ids) > 3 * CHUNK // 2  # several chunks, and longer than the window
    layers, _ = check_exact(info, dtype, ids)
    storage = np.dtype(DTYPES[dtype][1])
    assert {kv.keys.dtype for kv in layers} == {storage}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_model_exact_resume(real_model, dtype):
    ids = encode_prompt(real_model, "What is the capital of France?", chat=True)
    assert len(ids) > 2 * CHUNK
    _, reference = check_exact(real_model, dtype, ids, new=8, thorough=False)
    assert "Paris" in decode_text(real_model, reference.token_ids)


def test_get_engine_builds_torch(tiny_llama):
    engine = get_engine("torch", tiny_llama, dtype="float32", threads=1)
    assert isinstance(engine, TorchEngine) and engine.name == "torch"
    with pytest.raises(UsageError, match="no dtype 'float16'"):
        TorchEngine(tiny_llama, dtype="float16", threads=1)


def test_sliding_layers_carry_a_window_of_rows(tiny_hybrid):
    """window - 1 rows a decoding cache needs, and one more ring row (ring_extra 1) so that a
    consumer can recompute the last position of every sliding layer."""
    engine = engine_for(tiny_hybrid, "float32")
    assert engine.ring_extra == 1
    ids = encode_prompt(tiny_hybrid, PROMPT)[:40]
    layers = engine.prefill(ids, chunk_tokens=CHUNK)
    assert [kv.keys.shape[1] for kv in layers] == [8, 8, 8, 40]
    assert [kv.first_row for kv in layers] == [32, 32, 32, 0]
    short = engine.prefill(ids[:5], chunk_tokens=CHUNK)  # shorter than the window: every row
    assert [(kv.keys.shape[1], kv.first_row) for kv in short] == [(5, 0)] * 4
    # One more token: the window moves by one; rows of whole chunks are unchanged.
    longer = engine.prefill(encode_prompt(tiny_hybrid, PROMPT)[:41], chunk_tokens=CHUNK)
    assert [kv.first_row for kv in longer] == [33, 33, 33, 0]
    assert np.array_equal(longer[3].keys[:, :32], layers[3].keys[:, :32])


@pytest.mark.parametrize("rows", [0, 5])
def test_short_prompts_resume_exactly(tiny_hybrid, rows):
    ids = encode_prompt(tiny_hybrid, PROMPT)[: rows + 1]
    engine = engine_for(tiny_hybrid, "float32")
    layers = engine.prefill(ids[:-1], chunk_tokens=CHUNK)
    assert all(kv.keys.shape[1] == rows for kv in layers)
    reference = engine.generate_reference(ids[:-1], ids[-1:], 8, chunk_tokens=CHUNK, stop_on_eos=False)
    result = engine.decode(layers, rows=rows, next_tokens=ids[-1:], max_new_tokens=8, stop_on_eos=False)
    assert result.token_ids == reference.token_ids


def test_wrong_sliding_row_order_is_caught(tiny_hybrid):
    """Rows installed newest-first must change the model's output (and in-order must not).

    A single query sees every cached row of the window, so it cannot tell the order;
    three queries can: the window mask hides the oldest *stored* row from the last one.
    """
    engine = engine_for(tiny_hybrid, "float32")
    ids = encode_prompt(tiny_hybrid, PROMPT)
    rows = 40
    prefix, nxt = ids[:rows], ids[rows : rows + 3]
    layers = engine.prefill(prefix, chunk_tokens=CHUNK)
    live = engine.live_logits(prefix, nxt, chunk_tokens=CHUNK)
    installed = engine.step_logits(layers, rows=rows, next_tokens=nxt)
    assert np.array_equal(installed, live), f"max_diff={np.abs(installed - live).max()}"

    reversed_rows = [
        LayerKV(keys=kv.keys[:, ::-1], values=kv.values[:, ::-1], first_row=kv.first_row) if spec.kind == "sliding" else kv
        for spec, kv in zip(tiny_hybrid.layers, layers)
    ]
    wrong = engine.step_logits(reversed_rows, rows=rows, next_tokens=nxt)
    assert np.abs(wrong[-1] - live[-1]).max() > 1e-3
    good = engine.decode(layers, rows=rows, next_tokens=nxt[:1], max_new_tokens=8, stop_on_eos=False)
    bad = engine.decode(reversed_rows, rows=rows, next_tokens=nxt[:1], max_new_tokens=8, stop_on_eos=False)
    assert good.token_ids != bad.token_ids


def test_install_checks_shapes_and_positions(tiny_hybrid):
    refuses_bad_rows(engine_for(tiny_hybrid, "float32"), encode_prompt(tiny_hybrid, PROMPT)[:21], CHUNK)


def test_context_limit_is_refused_before_computing(tiny_llama):
    engine = engine_for(tiny_llama, "float32")
    assert tiny_llama.max_positions == 256
    # One error class per fact: a prompt past the context is bad data (exit 65) wherever it is found.
    with pytest.raises(PromptTooLong, match="longer than the model's context of 256"):
        engine.prefill([5] * 256, chunk_tokens=CHUNK)
    layers = engine.prefill([5] * 10, chunk_tokens=CHUNK)
    with pytest.raises(PromptTooLong, match="11 tokens plus 250 new tokens"):
        engine.decode(layers, rows=10, next_tokens=[5], max_new_tokens=250)
    with pytest.raises(UsageError):
        engine.decode(layers, rows=10, next_tokens=[], max_new_tokens=1)
    with pytest.raises(UsageError, match="chunk_tokens"):
        engine.prefill([5] * 10, chunk_tokens=0)


def test_sampling_is_seeded_and_matches_reference(tiny_llama):
    engine = engine_for(tiny_llama, "float32")
    ids = encode_prompt(tiny_llama, PROMPT)
    layers = engine.prefill(ids[:-1], chunk_tokens=CHUNK)
    sampling = Sampling(temperature=1.0, top_p=0.9, seed=7)
    args = dict(rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=12, stop_on_eos=False)
    first = engine.decode(layers, sampling=sampling, **args)
    second = engine.decode(layers, sampling=sampling, **args)
    reference = engine.generate_reference(ids[:-1], ids[-1:], 12, chunk_tokens=CHUNK, sampling=sampling, stop_on_eos=False)
    assert first.token_ids == second.token_ids == reference.token_ids
    greedy = engine.decode(layers, **args)
    assert first.token_ids != greedy.token_ids
    narrow = engine.decode(layers, sampling=Sampling(temperature=1.0, top_p=1e-6, seed=1), **args)
    assert narrow.token_ids == greedy.token_ids  # top-p that keeps one token is greedy


def test_stops_on_eos(tiny_llama):
    ids = encode_prompt(tiny_llama, PROMPT)
    plain = engine_for(tiny_llama, "float32")
    layers = plain.prefill(ids[:-1], chunk_tokens=CHUNK)
    args = dict(rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=10)
    free = plain.decode(layers, stop_on_eos=False, **args)
    stop_at = free.token_ids[3]
    engine = TorchEngine(dataclasses.replace(tiny_llama, eos_token_ids=(stop_at,)), dtype="float32", threads=THREADS)
    result = engine.decode(layers, **args)
    first = free.token_ids.index(stop_at)
    assert result.token_ids == free.token_ids[: first + 1]
    assert result.stats["stop_reason"] == "eos"
    assert engine.decode(layers, stop_on_eos=False, **args).token_ids == free.token_ids


def test_cross_dtype_install(tiny_llama):
    """float32 rows install into a bfloat16 engine (converted; not an exactness claim)."""
    ids = encode_prompt(tiny_llama, PROMPT)
    layers = engine_for(tiny_llama, "float32").prefill(ids[:-1], chunk_tokens=CHUNK)
    result = engine_for(tiny_llama, "bfloat16").decode(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=4)
    assert len(result.token_ids) >= 1


@pytest.mark.parametrize("chunk", [CHUNK, 7, 1])
def test_the_extra_ring_row_changes_no_number(tiny_hybrid, chunk):
    """A prefill whose sliding layers keep one row more (RingLayer) gives the rows a plain
    transformers cache gives, plus one older row, bit for bit; decoding from them (the extra
    row dropped on install) gives the live cache's logits exactly, in float32."""
    engine = engine_for(tiny_hybrid, "float32")
    ids = encode_prompt(tiny_hybrid, PROMPT)[:41]
    rows = 37
    layers = engine.prefill(ids[:rows], chunk_tokens=chunk)
    with engine._session():
        plain = engine._extract(engine._prefill_cache(ids[:rows], chunk, None), rows)  # window - 1, no ring
    for spec, a, b in zip(tiny_hybrid.layers, layers, plain):
        cut = 1 if spec.kind == "sliding" else 0
        assert a.first_row == b.first_row - cut and a.keys.shape[1] == b.keys.shape[1] + cut
        assert a.keys[:, cut:].tobytes() == b.keys.tobytes() and a.values[:, cut:].tobytes() == b.values.tobytes()
    nxt = ids[rows : rows + 3]
    live = engine.live_logits(ids[:rows], nxt, chunk_tokens=chunk)
    assert np.array_equal(engine.step_logits(layers, rows=rows, next_tokens=nxt), live)
    assert np.array_equal(engine.step_logits(plain, rows=rows, next_tokens=nxt), live)
    # Continuing a prefill from the ring rows gives the same bytes as prefilling it all at once.
    if chunk == CHUNK:
        at = 32
        head = engine.prefill(ids[:at], chunk_tokens=chunk)
        assert [kv.keys.tobytes() for kv in engine.prefill_from(head, rows=at, token_ids=ids[at:rows],
                                                                 chunk_tokens=chunk)] == [kv.keys.tobytes() for kv in layers]
