"""kvpack <-> transformers DynamicCache (``muser_cli.to_transformers`` / ``from_transformers``).

* ``model.generate`` continuing from ``to_transformers(pack, model)`` gives the tokens of
  ``muser decode`` (torch engine), on the all-full and the hybrid (sliding) tiny model;
* kvpack -> DynamicCache -> kvpack keeps the KV bytes; a cache transformers filled itself
  becomes a pack that muser verifies and decodes to transformers' own continuation;
* a pack for another model, a batch, or a cache that lacks a sliding layer's rows is refused.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import muser_cli
from muser_cli.consumer.decode import decode
from muser_cli.errors import DataError, GateIncomplete, IdentityMismatch, UsageError
from muser_cli.kvpack import read_pack_bytes
from muser_cli.produce.prefill import prefill
from muser_cli.model.tokens import encode_prompt
from muser_cli.gate.verify import verify

PROMPT = ("The producer computes the prompt once and ships its keys and values to the consumer. "
          "A sliding window layer keeps only the last few rows.")
CHUNK = 8
NEW = 16
_MODELS: dict = {}


def hf_model(info):
    if str(info.path) not in _MODELS:
        _MODELS[str(info.path)] = AutoModelForCausalLM.from_pretrained(str(info.path), dtype=torch.float32).eval()
    return _MODELS[str(info.path)]


def pack_bytes(info) -> bytes:
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), engine="torch", dtype="float32", chunk_tokens=CHUNK)
    return out.getvalue()


def generate(model, ids, cache, n=NEW) -> list[int]:
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore", FutureWarning)  # 5.24 renames past_key_values to cache; 5.19 has only the old name
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             past_key_values=cache, max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_hybrid"])
def test_generate_from_to_transformers_equals_muser_decode(name, request):
    info = request.getfixturevalue(name)
    data = pack_bytes(info)
    pack = read_pack_bytes(data)
    ids = list(pack.header.token_ids)
    model = hf_model(info)
    cache = muser_cli.to_transformers(data, model)
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == len(ids) - 1
    if any(s.kind == "sliding" for s in info.layers):
        window = next(s.window for s in info.layers if s.kind == "sliding")
        assert cache.layers[0].keys.shape[2] == window - 1  # only what the window can see
    theirs = generate(model, ids, cache)
    ours = decode(io.BytesIO(data), model=str(info.path), engine="torch", max_new_tokens=NEW)
    assert ours.token_ids and theirs[: len(ours.token_ids)] == ours.token_ids
    assert len(set(theirs)) > 3


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_hybrid"])
def test_kvpack_to_dynamic_cache_to_kvpack_keeps_the_bytes(name, request):
    info = request.getfixturevalue(name)
    data = pack_bytes(info)
    a = read_pack_bytes(data)
    model = hf_model(info)
    b = read_pack_bytes(muser_cli.from_transformers(muser_cli.to_transformers(data, model), a.header.token_ids, model,
                                                    chunk_tokens=CHUNK))
    assert b.header.token_ids == a.header.token_ids and b.header.layers == a.header.layers
    assert b.header.model_fingerprint == a.header.model_fingerprint and b.header.dtype == a.header.dtype
    # A sliding layer's history (ring_extra = rows) does not survive transformers' window - 1 rows.
    assert b.header.ring_extra == 0
    for x, y, spec in zip(a.layers, b.layers, info.layers):
        cut = y.first_row - x.first_row
        assert cut == (a.header.rows_end - (spec.window - 1) if spec.kind == "sliding" else 0)
        assert x.keys[:, cut:].tobytes() == y.keys.tobytes() and x.values[:, cut:].tobytes() == y.values.tobytes()


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_hybrid"])
def test_a_cache_transformers_filled_becomes_a_verified_pack(name, request):
    info = request.getfixturevalue(name)
    model = hf_model(info)
    ids = encode_prompt(info, PROMPT)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:-1]]), past_key_values=cache, use_cache=True)
    data = muser_cli.from_transformers(cache, torch.tensor([ids]), model)
    report = verify(io.BytesIO(data), model=str(info.path), prompt=PROMPT, audit=2)
    assert report.ok, [c.to_json() for c in report.checks]
    fresh = DynamicCache(config=model.config)
    theirs = generate(model, ids, fresh)  # transformers on its own, from scratch
    hybrid = any(s.kind == "sliding" for s in info.layers)
    if hybrid:  # transformers' sliding layers hold the window only: not all checkable, never decoded unchecked
        with pytest.raises(GateIncomplete):
            decode(io.BytesIO(data), model=str(info.path), engine="torch", max_new_tokens=NEW)
    ours = decode(io.BytesIO(data), model=str(info.path), engine="torch", max_new_tokens=NEW,
                  prompt=PROMPT if hybrid else None)
    assert ours.source == ("local" if hybrid else "handoff")
    assert ours.token_ids and theirs[: len(ours.token_ids)] == ours.token_ids


def test_refusals(tiny_llama, tiny_hybrid):
    llama, hybrid = hf_model(tiny_llama), hf_model(tiny_hybrid)
    data = pack_bytes(tiny_llama)
    with pytest.raises(IdentityMismatch, match="model mismatch"):
        muser_cli.to_transformers(data, hybrid)
    ids = encode_prompt(tiny_hybrid, PROMPT)
    cache = DynamicCache(config=hybrid.config)
    with torch.inference_mode():
        hybrid(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)  # the whole prompt
    with pytest.raises(DataError, match="layer 0 \\(sliding\\) holds positions"):
        muser_cli.from_transformers(cache, ids, hybrid)
    with pytest.raises(DataError, match="holds .* positions, the prompt is"):
        muser_cli.from_transformers(cache, ids + [5, 6, 7], hybrid)
    with pytest.raises(UsageError, match="batch"):
        muser_cli.from_transformers(cache, [ids, ids], hybrid)
    # the whole prompt on an all-full model: the last row is left to the consumer
    ids = encode_prompt(tiny_llama, PROMPT)
    cache = DynamicCache(config=llama.config)
    with torch.inference_mode():
        llama(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    pack = read_pack_bytes(muser_cli.from_transformers(cache, ids, llama))
    assert pack.header.rows_end == len(ids) - 1 and pack.layers[0].keys.shape[1] == len(ids) - 1
    assert np.array_equal(pack.layers[0].keys, cache.layers[0].keys[0, :, :-1].numpy())
