"""The numeric gate before the first token (docs/reliability.md H49): a pack from another
engine, dtype or codec is spot-checked by decode by default; a self-consistent pack of wrong
rows is refused before any token with the cause named; an honest one decodes."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from muser_cli.consumer.decode import decode
from muser_cli.errors import SpotCheckFailed
from muser_cli.kvpack import LayerKV, read_pack, write_pack
from muser_cli.produce.prefill import prefill

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
    # Asked for on a pack this consumer would have made: a step of its own, the decode bit-exact.
    assert forced.spot_check["fused"] is False and forced.token_ids == same.token_ids


def test_foreign_pack_of_swapped_layers_is_refused_before_any_token(tiny_llama):
    data = _pack(tiny_llama, engine_name="vllm", swap=True)
    tokens: list[int] = []
    with pytest.raises(SpotCheckFailed, match="before the first token.*swapped"):
        _decode(tiny_llama, data, on_token=tokens.append)
    assert tokens == []
    # --no-audit skips it, and says so.
    out = _decode(tiny_llama, data, audit=0)
    assert out.spot_check == {"ran": False, "skipped": True, "reason": "made by vllm, decoded on torch"}


# ------------------------------------------------------------------ fused into the first step
def test_the_check_rides_in_the_first_decode_step(tiny_llama):
    """No step of its own: the first forward recomputes the checked positions and gives the
    first token; what it compares is what the separate check compares."""
    from muser_cli.gate.audit import spot_check
    from muser_cli.engines.registry import get_engine

    data = _pack(tiny_llama, engine_name="vllm")
    out = _decode(tiny_llama, data)
    spot = out.spot_check
    assert spot["fused"] is True and spot["ok"] and spot["layers_checked"] == len(tiny_llama.layers)
    rows = read_pack(io.BytesIO(data)).header.rows_end
    assert spot["positions"] == [rows - 1, rows] and spot["layers_unchecked"] == []
    alone = spot_check(read_pack(io.BytesIO(data)), get_engine("torch", tiny_llama, dtype="float32", threads=1))
    assert alone.fused is False and alone.positions == tuple(spot["positions"])
    assert spot["worst_rel"] == pytest.approx(alone.worst["rel_max"], rel=0.5, abs=1e-6)
    assert out.token_ids == _decode(tiny_llama, data, audit=0).token_ids
    wide = _decode(tiny_llama, data, audit=4)
    assert wide.spot_check["fused"] and wide.spot_check["positions"] == [rows - 4, rows]
    assert wide.token_ids == out.token_ids


def _rewrite(data: bytes, *, engine_name: str | None = None, ring_extra: int | None = None, corrupt=None) -> bytes:
    """``data`` written again, every digest right: relabelled, with its ring rows cut to
    ``ring_extra``, or with ``corrupt(layer_index, layers)`` applied to copies of its rows."""
    p = read_pack(io.BytesIO(data))
    header = p.header
    if engine_name is not None:
        header = replace(header, producer={**header.producer, "engine": engine_name})
    if ring_extra is not None:
        header = replace(header, ring_extra=ring_extra, minor=2 if ring_extra else 1)
    layers = [LayerKV(l.keys.copy(), l.values.copy(), l.first_row) for l in p.layers]
    if corrupt is not None:
        corrupt(layers)
    again = io.BytesIO()
    write_pack(again, header, layers)  # rows before a layer's first carried one are skipped
    return again.getvalue()


def test_a_hybrid_pack_past_its_window_is_checked_in_every_layer(tiny_hybrid):
    """A v1.2 pack carries one ring row more than window - 1 in each sliding layer: the fused
    check recomputes the last position of every layer, sliding ones included."""
    data = _pack(tiny_hybrid, engine_name="vllm")
    h = read_pack(io.BytesIO(data)).header
    assert h.rows_end > 8 and h.ring_extra == h.rows_end and h.minor == 2  # past the window of 8, with its history
    assert [h.layer_rows(i) for i in range(4)] == [h.rows_end] * 4
    out = _decode(tiny_hybrid, data)
    spot = out.spot_check
    assert spot["ran"] and spot["ok"] and spot["fused"] is True
    assert spot["layers_checked"] == 4 and spot["layers_unchecked"] == []
    assert spot["positions"] == [h.rows_end - 1, h.rows_end]
    own = _decode(tiny_hybrid, _pack(tiny_hybrid, engine_name="torch"))  # no check: the pack's rows as they are
    assert own.spot_check["ran"] is False and out.token_ids == own.token_ids
    asked = _decode(tiny_hybrid, _pack(tiny_hybrid, engine_name="torch"), audit=1).spot_check  # a step of its own
    assert asked["fused"] is False and asked["ok"] and asked["layers_unchecked"] == []


def test_without_the_sliding_history_a_foreign_hybrid_pack_is_refused_not_half_checked(tiny_hybrid):
    """A pack whose sliding layers carry their window only (v1.1 without the ring row, v1.2 with
    one): the layers above the first sliding one cannot be recomputed before the window, so the
    gate refuses it (65) rather than name them unchecked and decode (issue 30); with its history
    a check as wide as asked is fused and covers every layer."""
    from muser_cli.errors import GateIncomplete

    data = _pack(tiny_hybrid, engine_name="vllm")
    for ring in (0, 1):
        old = _rewrite(data, ring_extra=ring)
        assert read_pack(io.BytesIO(old)).header.minor == (1 if ring == 0 else 2)
        with pytest.raises(GateIncomplete, match="cannot be checked in full"):
            _decode(tiny_hybrid, old)
    wide = _decode(tiny_hybrid, data, audit=3).spot_check
    assert wide["ok"] and wide["fused"] is True and wide["layers_unchecked"] == []
    assert wide["positions"][1] - wide["positions"][0] == 3


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_a_sliding_layer_with_a_wrong_last_row_is_refused_naming_it(tiny_hybrid, layer):
    data = _pack(tiny_hybrid, engine_name="vllm")

    def corrupt(layers):
        layers[layer].keys[:, -1] *= 1.5  # the last row of one sliding layer, re-signed
    bad = _rewrite(data, corrupt=corrupt)
    tokens: list[int] = []
    with pytest.raises(SpotCheckFailed, match=rf"before the first token: 1 of 4 layers differ.*worst layer {layer} "
                                              r"\(sliding"):
        _decode(tiny_hybrid, bad, on_token=tokens.append)
    assert tokens == []


def test_a_wrong_extra_ring_row_is_caught_through_the_layers_after_it(tiny_hybrid):
    """The row just before the window (the last-position check's prefix, never compared by
    that check itself): a wrong one makes the later layers' recomputed rows disagree -- or the
    sampled gate lands on it -- and the pack is refused before any token."""
    data = _pack(tiny_hybrid, engine_name="vllm")
    h = read_pack(io.BytesIO(data)).header
    before = h.rows_end - tiny_hybrid.layers[1].window  # with the history: position == row index

    def corrupt(layers):
        layers[1].keys[:, before] *= -4.0
        layers[1].values[:, before] *= -4.0
    tokens: list[int] = []
    for seed in (1, 2, 3):
        with pytest.raises(SpotCheckFailed, match=r"before the first token: [23] of 4 layers differ"):
            _decode(tiny_hybrid, _rewrite(data, corrupt=corrupt), on_token=tokens.append, audit_seed=seed)
    assert tokens == []


@pytest.mark.parametrize("producer, consumer", [("torch", "mlx"), ("mlx", "torch")])
def test_honest_cross_engine_hybrid_packs_pass_in_every_layer(tiny_hybrid, producer, consumer):
    pytest.importorskip("mlx.core", reason="mlx not installed")
    pytest.importorskip("mlx_lm", reason="mlx-lm not installed")
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(tiny_hybrid.path), engine=producer, chunk_tokens=8, dtype="float32")
    h = read_pack(io.BytesIO(out.getvalue())).header
    assert h.ring_extra == h.rows_end and h.producer["engine"] == producer  # with the sliding history
    res = _decode(tiny_hybrid, out.getvalue(), engine=consumer)
    spot = res.spot_check
    assert spot["ran"] and spot["ok"] and spot["fused"] and spot["layers_unchecked"] == []
    assert f"made by {producer}, decoded on {consumer}" in spot["reason"]


def test_a_short_hybrid_prompt_is_fused(tiny_hybrid):
    """Within the window a sliding layer still holds every row: the fused check covers all layers."""
    out = io.BytesIO()
    prefill("The bridge", out, model=str(tiny_hybrid.path), chunk_tokens=8, dtype="float32")
    p = read_pack(io.BytesIO(out.getvalue()))
    assert 2 <= p.header.rows_end <= 7
    again = io.BytesIO()
    write_pack(again, replace(p.header, producer={**p.header.producer, "engine": "mlx"}), p.layers)
    res = _decode(tiny_hybrid, again.getvalue())
    assert res.spot_check["fused"] and res.spot_check["ok"]
    assert res.spot_check["layers_checked"] == len(tiny_hybrid.layers)


def test_a_refused_fused_check_emits_nothing_and_leaves_the_engine_usable(tiny_llama):
    from muser_cli.engines.registry import get_engine

    eng = get_engine("torch", tiny_llama, dtype="float32", threads=1)
    tokens: list[int] = []
    with pytest.raises(SpotCheckFailed, match="swapped"):
        _decode(tiny_llama, _pack(tiny_llama, engine_name="vllm", swap=True), on_token=tokens.append, resident=eng,
                dtype="float32")
    assert tokens == []
    good = _decode(tiny_llama, _pack(tiny_llama, engine_name="vllm"), resident=eng, dtype="float32")
    assert good.spot_check["fused"] and good.spot_check["ok"]


@pytest.mark.parametrize("swap", [False, True])
def test_fused_check_on_mlx(tiny_llama, swap):
    pytest.importorskip("mlx.core", reason="mlx not installed")
    pytest.importorskip("mlx_lm", reason="mlx-lm not installed")
    data = _pack(tiny_llama, engine_name="torch", swap=swap)  # made by torch, decoded on MLX
    if swap:
        tokens: list[int] = []
        with pytest.raises(SpotCheckFailed, match="before the first token"):
            _decode(tiny_llama, data, engine="mlx", on_token=tokens.append)
        assert tokens == []
        return
    out = _decode(tiny_llama, data, engine="mlx")
    assert out.spot_check["fused"] and out.spot_check["ok"] and "decoded on mlx" in out.spot_check["reason"]
    assert out.token_ids == _decode(tiny_llama, data, engine="mlx", audit=0).token_ids


def test_decode_store_keeps_the_packs_own_rows_after_a_fused_check(tiny_llama):
    """An adopting engine writes its recomputation of the checked rows into the pack's
    arrays; what decode --store keeps is still the pack, bit for bit."""
    import numpy as np

    from muser_cli.reuse.store import Store

    data = _pack(tiny_llama, engine_name="vllm")
    out = _decode(tiny_llama, data, store=True, audit=3)
    assert out.spot_check["fused"] and out.stored
    kept = Store().load(out.stored)
    sent = read_pack(io.BytesIO(data))
    for a, b in zip(kept.layers, sent.layers):
        assert np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values)


@pytest.mark.parametrize("rows_wanted, audit", [(7, 6), (7, 7), (7, 100), (None, 100), (None, 9)])
def test_hybrid_checks_of_every_width_pass_an_honest_pack(tiny_hybrid, rows_wanted, audit):
    """A ring exactly as long as the prompt and checks wider than the window: fused where the
    rows allow it, else a step of its own, never an honest pack refused."""
    prompt = PROMPT
    if rows_wanted is not None:  # a prompt whose pack holds exactly window - 1 rows
        from muser_cli.model.resolve import resolve_model
        from muser_cli.model.tokens import decode_text, encode_prompt

        info = resolve_model(str(tiny_hybrid.path))
        prompt = decode_text(info, encode_prompt(info, PROMPT)[: rows_wanted + 1])
    out = io.BytesIO()
    prefill(prompt, out, model=str(tiny_hybrid.path), chunk_tokens=8, dtype="float32")
    p = read_pack(io.BytesIO(out.getvalue()))
    if rows_wanted is not None and p.header.rows_end != rows_wanted:
        pytest.skip(f"the text round trip gave {p.header.rows_end} rows")
    again = io.BytesIO()
    write_pack(again, replace(p.header, producer={**p.header.producer, "engine": "mlx"}), p.layers)
    res = _decode(tiny_hybrid, again.getvalue(), audit=audit)
    assert res.spot_check["ran"] and res.spot_check["ok"], res.spot_check


def test_a_producer_asked_for_kvpack_1_1_leaves_the_ring_row_out(tiny_hybrid, monkeypatch):
    """MUSER_KVPACK_MINOR=1: a hybrid pack past its window is written as 1.1 (window - 1 rows),
    for receivers that read 1.1 only; its rows are the same as the 1.2 pack's, less the
    extra one. Any other value is a configuration error (78), before anything is written."""
    import numpy as np

    from muser_cli.errors import ConfigError

    new = read_pack(io.BytesIO(_pack(tiny_hybrid, engine_name="torch")))
    monkeypatch.setenv("MUSER_KVPACK_MINOR", "1")
    old = read_pack(io.BytesIO(_pack(tiny_hybrid, engine_name="torch")))
    assert new.header.minor == 2 and old.header.minor == 1 and old.header.ring_extra == 0
    for i, spec in enumerate(old.header.layers):
        drop = new.header.rows_end - (spec.window - 1) if spec.kind == "sliding" else 0  # the history's older rows
        assert np.array_equal(old.layers[i].keys, new.layers[i].keys[:, drop:])
    monkeypatch.setenv("MUSER_KVPACK_MINOR", "3")
    with pytest.raises(ConfigError, match="MUSER_KVPACK_MINOR"):
        _pack(tiny_hybrid, engine_name="torch")
