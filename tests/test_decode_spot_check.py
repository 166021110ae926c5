"""The numeric gate before the first token (docs/reliability.md H49): a pack from another
engine, dtype or codec is spot-checked by decode by default; a self-consistent pack of wrong
rows is refused before any token with the cause named; an honest one decodes."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from muser_cli.decode import decode
from muser_cli.errors import SpotCheckFailed
from muser_cli.kvpack import LayerKV, read_pack, write_pack
from muser_cli.prefill import prefill

PROMPT = ("The committee met on a grey Tuesday to decide where the new bridge would go. "
          "After a long debate about costs, traffic and the river's spring floods, they chose")


def _pack(model, *, engine_name: str, swap: bool = False) -> bytes:
    """A torch-made pack re-labelled as made by ``engine_name`` (and optionally with layers
    0 and 1 swapped): every digest and fingerprint right, exactly what a misread layout gives."""
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(model.path), chunk_tokens=8, dtype="float32")
    p = read_pack(io.BytesIO(out.getvalue()))
    layers = list(p.layers)
    if swap:
        layers[0], layers[1] = (LayerKV(layers[1].keys, layers[1].values, layers[0].first_row),
                                LayerKV(layers[0].keys, layers[0].values, layers[1].first_row))
    header = replace(p.header, producer={**p.header.producer, "engine": engine_name})
    again = io.BytesIO()
    write_pack(again, header, layers)
    return again.getvalue()


def _decode(model, data: bytes, **kw):
    return decode(io.BytesIO(data), model=str(model.path), max_new_tokens=6, **kw)


def test_own_pack_needs_no_spot_check(tiny_llama):
    out = _decode(tiny_llama, _pack(tiny_llama, engine_name="torch"))
    assert out.spot_check == {"ran": False, "reason": "made by this engine, in this dtype, lossless"}


def test_foreign_honest_pack_passes_the_spot_check(tiny_llama):
    data = _pack(tiny_llama, engine_name="vllm")
    out = _decode(tiny_llama, data)
    assert out.spot_check["ran"] and out.spot_check["ok"] and "made by vllm" in out.spot_check["reason"]
    same = _decode(tiny_llama, _pack(tiny_llama, engine_name="torch"))
    assert out.token_ids == same.token_ids
    forced = _decode(tiny_llama, _pack(tiny_llama, engine_name="torch"), audit=3)
    assert forced.spot_check["ran"] and forced.spot_check["positions"][1] - forced.spot_check["positions"][0] == 3


def test_foreign_pack_of_swapped_layers_is_refused_before_any_token(tiny_llama):
    data = _pack(tiny_llama, engine_name="vllm", swap=True)
    tokens: list[int] = []
    with pytest.raises(SpotCheckFailed, match="before the first token.*swapped"):
        _decode(tiny_llama, data, on_token=tokens.append)
    assert tokens == []
    # --no-audit skips it, and says so.
    out = _decode(tiny_llama, data, audit=0)
    assert out.spot_check == {"ran": False, "skipped": True, "reason": "made by vllm, decoded on torch"}
