"""Recurrent state layers (kvpack 1.3 ``state``, issue 27) through the torch engine.

qwen3_next (gated DeltaNet) and granitemoehybrid (Mamba-2), each a tiny random model from
transformers' config classes: 2 state layers beside 2 full-attention ones.

* the snapshot muser extracts equals the conv window / recurrent matrix in transformers' OWN
  ``LinearAttentionLayer`` after the model's own forward (conv: less its oldest column);
* torch -> torch through kvpack bytes decodes the tokens of the local fallback;
* a prefill resumed from a snapshot at a chunk boundary gives the same pack layers.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from muser_cli.consumer.decode import decode
from muser_cli.engines.registry import get_engine
from muser_cli.kvpack import read_pack
from muser_cli.kvpack.layers import StateKV
from muser_cli.produce.prefill import prefill
from muser_cli.model.tokens import encode_prompt

HYBRIDS = ["qwen3_next", "granitemoehybrid"]
PROMPT = (
    "The producer computes the prompt once and ships its keys and values to the consumer in Paris. "
    "Seven quick wizards juggle 42 lazy dogs; the window slides, the rows stay exact, zebras hum."
)
NEW = 10
_ENGINES: dict = {}


def engine(info):
    if str(info.path) not in _ENGINES:
        _ENGINES[str(info.path)] = get_engine("torch", info, dtype="float32", threads=1)
    return _ENGINES[str(info.path)]


def _own_cache(eng, ids: list[int], chunk: int):
    """transformers' own DynamicCache after the model's own forwards over ``ids`` in chunks
    of ``chunk`` (nothing of muser's: no position ids, no muser cache class)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=eng.model.config)
    with torch.inference_mode():
        for begin in range(0, len(ids), chunk):
            eng.model(input_ids=torch.tensor([ids[begin:begin + chunk]]), cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("family", HYBRIDS)
def test_snapshots_are_transformers_own_state(family, tiny_family):
    info = tiny_family(family)
    ids = encode_prompt(info, PROMPT)[:-1]
    eng = engine(info)
    states = [i for i, s in enumerate(info.layers) if s.kind == "state"]
    assert states and len(states) < len(info.layers)
    for chunk in (len(ids), 16):  # one forward; the chunked schedule (each forward continues the held state)
        layers = eng.prefill(ids, chunk_tokens=chunk)
        own = _own_cache(eng, ids, chunk)
        for i in states:
            snap, layer = layers[i], own.layers[i]
            assert isinstance(snap, StateKV) and snap.position == len(ids)
            assert type(layer).__name__ == "LinearAttentionLayer"
            kernel = layer.conv_states[0].shape[-1]
            own_conv = layer.conv_states[0][0].numpy()
            own_rec = layer.recurrent_states[0][0].numpy()
            assert snap.tensors["conv"].shape == (own_conv.shape[0], kernel - 1)
            np.testing.assert_array_equal(snap.tensors["conv"], own_conv[:, 1:])
            np.testing.assert_array_equal(snap.tensors["recurrent"], own_rec)
            ends = sorted(snap.earlier) + [snap.position]  # one snapshot per chunk end
            assert ends == list(range(chunk, len(ids), chunk)) + [len(ids)]
        for i in (i for i, s in enumerate(info.layers) if s.kind == "full"):
            np.testing.assert_array_equal(layers[i].keys, own.layers[i].keys[0].numpy())


@pytest.mark.parametrize("family", HYBRIDS)
def test_torch_to_torch_through_a_pack_equals_the_local_fallback(family, tiny_family):
    info = tiny_family(family)
    ids = encode_prompt(info, PROMPT)
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), chunk_tokens=16, threads=1)
    pack = read_pack(io.BytesIO(out.getvalue()))
    assert pack.header.minor >= 3
    n_chunks = -(-(len(ids) - 1) // 16)
    state_frames = [f for f in pack.header.frame_plan() if info.layers[f[0]].kind == "state"]
    assert len(state_frames) == 2 * n_chunks  # a snapshot per chunk per state layer
    handed = decode(io.BytesIO(out.getvalue()), model=str(info.path), max_new_tokens=NEW, threads=1)
    local = decode(io.BytesIO(b""), model=str(info.path), prompt=PROMPT, max_new_tokens=NEW, threads=1)
    reference = engine(info).generate_reference(ids[:-1], ids[-1:], NEW, chunk_tokens=16)
    assert handed.fallback is False and local.fallback is True
    assert handed.token_ids == local.token_ids == reference.token_ids
    assert len(set(handed.token_ids)) > 1


@pytest.mark.parametrize("family", HYBRIDS)
def test_prefill_resumes_from_a_snapshot_at_a_chunk_boundary(family, tiny_family):
    info = tiny_family(family)
    ids = encode_prompt(info, PROMPT)[:-1]
    eng = engine(info)
    whole = eng.prefill(ids, chunk_tokens=16)
    head = eng.prefill(ids[:32], chunk_tokens=16)
    resumed = eng.prefill_from(head, rows=32, token_ids=ids[32:], chunk_tokens=16)
    for a, b in zip(resumed, whole):
        if isinstance(b, StateKV):
            assert a.position == b.position
            for name in b.tensors:
                np.testing.assert_array_equal(a.tensors[name], b.tensors[name])
            for p in range(48, len(ids), 16):  # the snapshots recorded after the resume point
                np.testing.assert_array_equal(a.earlier[p]["recurrent"], b.earlier[p]["recurrent"])
        else:
            np.testing.assert_array_equal(a.keys, b.keys)


@pytest.mark.parametrize("family", HYBRIDS)
def test_cut_stream_resumes_from_the_last_verified_snapshot(family, tiny_family):
    """A V3 stream cut after k whole chunks: the consumer keeps the rows and the newest
    snapshot of those chunks, prefills only the rest, and decodes the local fallback's tokens."""
    from stream_producer import frame_ends

    info = tiny_family(family)
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), chunk_tokens=16, threads=1)
    data = out.getvalue()
    ends = frame_ends(data)[1:]  # after each data frame
    per_chunk = len(info.layers)  # every layer has a frame in every chunk (state: its snapshot)
    local = decode(io.BytesIO(b""), model=str(info.path), prompt=PROMPT, max_new_tokens=NEW, threads=1,
                   chunk_tokens=16)
    chunks = (len(ends) - 1) // per_chunk
    for k in (1, chunks - 1):
        got = decode(io.BytesIO(data[: ends[k * per_chunk - 1]]), model=str(info.path), prompt=PROMPT,
                     max_new_tokens=NEW, threads=1)
        assert got.source == "partial+local" and got.handoff_rows == 16 * k, k
        assert got.token_ids == local.token_ids, k
    # cut in the middle of a chunk's frames (its snapshot may have arrived): only whole chunks count
    got = decode(io.BytesIO(data[: ends[per_chunk + 1]]), model=str(info.path), prompt=PROMPT,
                 max_new_tokens=NEW, threads=1)
    assert got.handoff_rows == 16 and got.token_ids == local.token_ids


def _cli(*args, input: bytes | None = None):
    from typer.testing import CliRunner

    from muser_cli.commands import app

    r = CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r


def _decode_json(*args, **kw) -> dict:
    import json

    return json.loads(_cli("decode", *args, "--json", **kw).stdout)


@pytest.mark.parametrize("family", HYBRIDS)
def test_store_and_delta_resume_from_a_stored_snapshot(family, tiny_family, tmp_path, monkeypatch):
    """A stored document's pack keeps a snapshot per chunk: a follow-up prompt resumes from the
    one at the deepest shared chunk boundary (store+local), a producer ships only the suffix as
    a delta (its rows and one snapshot per chunk), and both decode the cold prefill's tokens.
    The store's size counts the snapshots (an entry is its pack's bytes)."""
    import json

    from muser_cli.kvpack import read_pack_bytes
    from muser_cli.reuse import Store, resolve_delta

    monkeypatch.setenv("MUSER_THREADS", "1")
    info = tiny_family(family)
    m = info.path
    doc, doc2 = tmp_path / "doc.txt", tmp_path / "doc2.txt"
    doc.write_text(PROMPT)
    doc2.write_text(PROMPT + " A follow-up question about the stored document, and one more clause.")
    pre = tmp_path / "doc.kvpack"
    _cli("prefill", "-m", m, "--chunk", "16", doc, "-o", pre)
    assert "stored" in _cli("reuse", "put", pre).stderr
    assert Store().total_bytes() == pre.stat().st_size  # every superseded snapshot counted

    warm = _decode_json("-m", m, "--prompt", doc2, "-n", NEW, input=b"")
    cold = _decode_json("-m", m, "--chunk", "16", "--no-reuse", "--prompt", doc2, "-n", NEW, input=b"")
    assert warm["source"] == "store+local" and warm["reuse"]["held_tokens"] % 16 == 0
    assert 0 < warm["reuse"]["held_tokens"] < warm["prompt_tokens"] - 1
    assert warm["token_ids"] == cold["token_ids"]

    have, delta, full = tmp_path / "have.json", tmp_path / "delta.kvpack", tmp_path / "full.kvpack"
    _cli("reuse", "have", "-m", m, doc2, "-o", have)
    held = json.loads(have.read_text())["held_tokens"]
    _cli("prefill", "-m", m, doc2, "--have", have, "-o", delta)
    _cli("prefill", "-m", m, "--chunk", "16", doc2, "-o", full)
    cut = tmp_path / "cut.kvpack"
    _cli("pack", "--no-zstd", "--have", have, full, "-o", cut)
    assert cut.read_bytes() == delta.read_bytes()  # the delta is the full pack cut at held
    d = read_pack_bytes(delta.read_bytes())
    assert d.header.rows_start == held
    merged, _ = resolve_delta(d, Store())
    want = read_pack_bytes(full.read_bytes()).layers
    for spec, a, b in zip(info.layers, merged, want):
        if spec.kind == "state":
            assert a.position == b.position and sorted(a.earlier) == sorted(b.earlier)
            for name in b.tensors:
                np.testing.assert_array_equal(a.tensors[name], b.tensors[name])
        else:
            np.testing.assert_array_equal(a.keys, b.keys)
    via_delta = _decode_json("-m", m, delta, "-n", NEW)
    assert via_delta["source"] == "delta" and via_delta["token_ids"] == cold["token_ids"]
    # the producer starts from its own store (a partial hit, then a full one): the same bytes
    for prompt, plain in ((doc2, full), (doc, pre)):
        resumed = tmp_path / "resumed.kvpack"
        r = _cli("prefill", "-m", m, "--chunk", "16", "--reuse", "--json", prompt, "-o", resumed)
        assert json.loads(r.stdout)["reused_tokens"] > 0
        assert resumed.read_bytes() == plain.read_bytes()


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("fault", ["clean", "recurrent_scaled", "conv_shifted", "full_row_scaled", "old_state"])
def test_gate_recomputes_state_from_a_checkpoint_and_refuses_a_planted_fault(family, fault, tiny_family):
    """A pack "from another engine" (every digest right): the default gate recomputes the last
    chunk from the pack's own snapshot before it and its full-attention rows, and compares the
    snapshot at the end and the chunk's rows. Clean, it passes and decodes the local fallback's
    tokens; with the final recurrent state scaled, its conv window shifted, one full-attention
    row of the last chunk scaled, or the checkpoint snapshot before the last chunk scaled, it is
    refused (65) before any token, naming a layer."""
    from dataclasses import replace

    from muser_cli.errors import SpotCheckFailed
    from muser_cli.kvpack import LayerKV, write_pack

    info = tiny_family(family)
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), chunk_tokens=16, threads=1)
    pack = read_pack(io.BytesIO(out.getvalue()))
    layers = list(pack.layers)
    state = next(i for i, s in enumerate(info.layers) if s.kind == "state")
    full = next(i for i, s in enumerate(info.layers) if s.kind == "full")
    snap = layers[state]
    end = snap.position
    last = max(snap.earlier)
    if fault in ("recurrent_scaled", "conv_shifted"):
        tensors = dict(snap.tensors)
        if fault == "recurrent_scaled":
            tensors["recurrent"] = tensors["recurrent"] * np.float32(1.5)
        else:
            tensors["conv"] = np.roll(tensors["conv"], 1, axis=1)
        layers[state] = StateKV(tensors=tensors, position=end, earlier=snap.earlier)
    elif fault == "old_state":
        earlier = dict(snap.earlier)
        earlier[last] = {**earlier[last], "recurrent": earlier[last]["recurrent"] * np.float32(1.5)}
        layers[state] = StateKV(tensors=snap.tensors, position=end, earlier=earlier)
    elif fault == "full_row_scaled":
        keys = np.array(layers[full].keys)
        keys[:, end - 2] *= 1.5
        layers[full] = LayerKV(keys=keys, values=layers[full].values, first_row=0)
    planted = io.BytesIO()
    write_pack(planted, replace(pack.header, producer={**pack.header.producer, "engine": "vllm"}), layers)
    tokens: list[int] = []
    kw = dict(model=str(info.path), max_new_tokens=NEW, threads=1)
    if fault == "clean":
        got = decode(io.BytesIO(planted.getvalue()), **kw)
        local = decode(io.BytesIO(b""), prompt=PROMPT, **kw)
        assert got.spot_check["ran"] and got.spot_check["ok"] and got.spot_check["method"] == "state-checkpoint"
        assert got.spot_check["layers_checked"] == len(info.layers)
        assert got.token_ids == local.token_ids
        return
    with pytest.raises(SpotCheckFailed, match="before the first token.*layer") as exc:
        decode(io.BytesIO(planted.getvalue()), on_token=tokens.append, **kw)
    assert tokens == [] and int(exc.value.exit_status) == 65


def test_verify_audit_recomputes_state_spans(tiny_family, tmp_path):
    """``verify --audit N`` on a hybrid's pack: N chunk spans recomputed from its checkpoints."""
    import json

    info = tiny_family("qwen3_next")
    doc, pack = tmp_path / "doc.txt", tmp_path / "doc.kvpack"
    doc.write_text(PROMPT)
    _cli("prefill", "-m", info.path, "--chunk", "16", doc, "-o", pack)
    report = json.loads(_cli("verify", "-m", info.path, pack, "--audit", "3", "--json").stdout)
    audit = report["summary"]["audit"] if "summary" in report else report["audit"]
    assert audit["ok"] and audit["mode"] == "state-checkpoint" and len(audit["span_ends"]) == 3
    assert all(l["rel_max"] == 0.0 for l in audit["layers"])  # its own engine: bit-exact


@pytest.mark.mlx
@pytest.mark.parametrize("family", HYBRIDS)
def test_mlx_snapshots_are_mlx_lms_own_and_torch_packs_pass_the_gate_both_ways(family, tiny_family):
    """MLX's extracted snapshot equals mlx-lm's own ArraysCache after mlx-lm's own forward
    (conv transposed; gated DeltaNet's recurrent matrix transposed); a torch pack decodes on MLX
    through the default gate (the state-checkpoint recompute ran and passed) with MLX's own
    local decode's tokens, and an MLX pack on torch with torch's."""
    from muser_cli.engines.mlx import blas as mlx_blas

    mlx_blas.ensure_fast_blas()
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache

    info = tiny_family(family)
    ids = encode_prompt(info, PROMPT)[:-1]
    eng = get_engine("mlx", info, dtype="float32", threads=1)
    layers = eng.prefill(ids, chunk_tokens=len(ids))
    caches = make_prompt_cache(eng.model)
    eng.model(mx.array([ids]), cache=caches)  # mlx-lm's own forward, its own caches
    for i, spec in enumerate(info.layers):
        if spec.kind != "state":
            continue
        own_conv, own_rec = np.array(caches[i][0][0]), np.array(caches[i][1][0])
        np.testing.assert_array_equal(layers[i].tensors["conv"], own_conv.T)
        want = own_rec.swapaxes(-1, -2) if spec.mixer == "gated_delta_net" else own_rec
        np.testing.assert_array_equal(layers[i].tensors["recurrent"], want)

    kw = dict(model=str(info.path), max_new_tokens=NEW, threads=1)
    made_by_torch = io.BytesIO()
    prefill(PROMPT, made_by_torch, chunk_tokens=16, **{k: v for k, v in kw.items() if k != "max_new_tokens"})
    crossed = decode(io.BytesIO(made_by_torch.getvalue()), engine="mlx", **kw)
    mlx_local = decode(io.BytesIO(b""), prompt=PROMPT, engine="mlx", **kw)
    spot = crossed.spot_check
    assert spot["ran"] and spot["ok"] and spot["method"] == "state-checkpoint" and not spot["layers_unchecked"]
    assert crossed.token_ids[:4] == mlx_local.token_ids[:4]
    made_by_mlx = io.BytesIO()
    prefill(PROMPT, made_by_mlx, engine="mlx", chunk_tokens=16, model=str(info.path), threads=1)
    back = decode(io.BytesIO(made_by_mlx.getvalue()), **kw)
    torch_local = decode(io.BytesIO(b""), prompt=PROMPT, **kw)
    assert back.spot_check["ran"] and back.spot_check["ok"] and back.token_ids[:4] == torch_local.token_ids[:4]
    print(f"{family}: torch pack -> mlx worst rel {spot['worst_rel']:.2e}; mlx pack -> torch "
          f"{back.spot_check['worst_rel']:.2e}; tokens mlx {crossed.token_ids} torch {torch_local.token_ids}")


def test_vllm_refuses_state_layers_by_name(tiny_family):
    from muser_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot move qwen3_next's state layers"):
        get_engine("vllm", tiny_family("qwen3_next"), dtype="float32", threads=1)


@pytest.mark.parametrize("family", HYBRIDS)
def test_bfloat16_pack_decodes_the_local_fallbacks_tokens(family, tiny_family):
    """In bfloat16 the conv window is the model's bfloat16 widened exactly to the pack's
    float32, the recurrent matrix float32 as transformers keeps it: still bit-exact."""
    info = tiny_family(family)
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), chunk_tokens=16, threads=1, dtype="bfloat16")
    pack = read_pack(io.BytesIO(out.getvalue()))
    assert pack.header.dtype == "bfloat16"
    assert {t.dtype for s in pack.header.layers if s.kind == "state" for t in s.tensors} == {"float32"}
    handed = decode(io.BytesIO(out.getvalue()), model=str(info.path), max_new_tokens=NEW, threads=1)
    local = decode(io.BytesIO(b""), model=str(info.path), prompt=PROMPT, max_new_tokens=NEW, threads=1,
                   dtype="bfloat16", chunk_tokens=16)
    assert handed.spot_check["ran"] is False and handed.token_ids == local.token_ids


def test_decode_store_of_a_streamed_pack_keeps_its_newest_snapshot(tiny_family, tmp_path, monkeypatch):
    """``decode --store`` of a streamed hybrid pack (which holds its newest snapshots only) stores
    it with ``state_every`` past its end: an entry that serves its end (a full hit: no prefill)
    and no chunk boundary it holds no snapshot for (``reuse have`` says 0 for a longer prompt)."""
    import json

    from muser_cli.kvpack import read_pack
    from muser_cli.reuse import Store

    monkeypatch.setenv("MUSER_THREADS", "1")
    info = tiny_family("qwen3_next")
    m = info.path
    doc, doc2, pack = tmp_path / "doc.txt", tmp_path / "doc2.txt", tmp_path / "doc.kvpack"
    doc.write_text(PROMPT)
    doc2.write_text(PROMPT + " And a follow-up question about it.")
    _cli("prefill", "-m", m, "--chunk", "16", doc, "-o", pack)
    stored = _decode_json("-m", m, "-n", NEW, "--store", input=pack.read_bytes())
    assert stored["stored"] and not stored.get("store_problems")
    with open(Store().pack_path(stored["stored"]), "rb") as f:
        entry = read_pack(f)
    assert entry.header.state_every > 1 and all(not l.earlier for l in entry.layers if isinstance(l, StateKV))
    warm = _decode_json("-m", m, "--prompt", doc, "-n", NEW, input=b"")
    assert warm["source"] == "store" and warm["token_ids"] == stored["token_ids"]
    assert json.loads(_cli("reuse", "have", "-m", m, doc2).stdout)["held_tokens"] == 0


def test_reuse_put_of_a_delta_on_an_end_only_entry_merges_and_stores(tiny_family, tmp_path, monkeypatch):
    """A delta whose base entry holds only its end snapshot (stored from a stream) merges and is
    stored too (``state_every`` past its end), and decodes the cold prefill's tokens."""
    import json

    monkeypatch.setenv("MUSER_THREADS", "1")
    info = tiny_family("granitemoehybrid")
    m = info.path
    doc, doc2 = tmp_path / "doc.txt", tmp_path / "doc2.txt"
    short = PROMPT[:98]  # 33 tokens: its rows end at 32, a chunk point of the long prompt's chain
    doc.write_text(short)
    doc2.write_text(PROMPT)
    pack = tmp_path / "doc.kvpack"
    _cli("prefill", "-m", m, "--chunk", "16", doc, "-o", pack)
    assert _decode_json("-m", m, "-n", 2, "--store", input=pack.read_bytes())["stored"]
    have = tmp_path / "have.json"
    _cli("reuse", "have", "-m", m, doc2, "-o", have)
    held = json.loads(have.read_text())["held_tokens"]
    delta = tmp_path / "delta.kvpack"
    _cli("prefill", "-m", m, doc2, "--have", have, "-o", delta)
    cold = _decode_json("-m", m, "--chunk", "16", "--no-reuse", "--prompt", doc2, "-n", NEW, input=b"")
    assert held == 32
    via = _decode_json("-m", m, delta, "-n", NEW)
    assert via["source"] == "delta" and via["token_ids"] == cold["token_ids"]
    assert "stored" in _cli("reuse", "put", delta).stderr
    warm = _decode_json("-m", m, "--prompt", doc2, "-n", NEW, input=b"")
    assert warm["token_ids"] == cold["token_ids"]


@pytest.mark.mlx
@pytest.mark.parametrize("family", HYBRIDS)
def test_mlx_resumes_a_prefill_and_a_cut_stream_from_a_snapshot(family, tiny_family):
    """On MLX: a prefill resumed at a chunk boundary gives the same layers and snapshots as one
    from 0; an MLX pack decodes MLX's local tokens (no gate), whole or cut after 2 chunks."""
    from muser_cli.engines.mlx import blas as mlx_blas
    from stream_producer import frame_ends

    mlx_blas.ensure_fast_blas()
    pytest.importorskip("mlx_lm")
    info = tiny_family(family)
    ids = encode_prompt(info, PROMPT)[:-1]
    eng = get_engine("mlx", info, dtype="float32", threads=1)
    whole = eng.prefill(ids, chunk_tokens=16)
    resumed = eng.prefill_from(eng.prefill(ids[:32], chunk_tokens=16), rows=32, token_ids=ids[32:], chunk_tokens=16)
    for a, b in zip(resumed, whole):
        if isinstance(b, StateKV):
            assert sorted(a.earlier) == sorted(b.earlier)
            for name in b.tensors:
                np.testing.assert_array_equal(a.tensors[name], b.tensors[name])
        else:
            np.testing.assert_array_equal(a.keys, b.keys)
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), engine="mlx", chunk_tokens=16, threads=1)
    data = out.getvalue()
    ends = frame_ends(data)[1:]
    kw = dict(model=str(info.path), engine="mlx", max_new_tokens=NEW, threads=1)
    local = decode(io.BytesIO(b""), prompt=PROMPT, chunk_tokens=16, **kw)
    full = decode(io.BytesIO(data), **kw)
    assert full.spot_check["ran"] is False and full.token_ids == local.token_ids
    cut = decode(io.BytesIO(data[: ends[2 * len(info.layers) - 1]]), prompt=PROMPT, **kw)
    assert cut.source == "partial+local" and cut.handoff_rows == 32 and cut.token_ids == local.token_ids


@pytest.mark.parametrize("family", HYBRIDS)
def test_prefill_state_every_ships_fewer_snapshots_and_the_same_tokens(family, tiny_family, tmp_path):
    """``prefill --state-every 3``: the state layers' snapshots only at every third chunk end
    and at the end, rows still every chunk. The pack is smaller, verifies, decodes the local
    fallback's tokens; cut after five whole chunks it resumes at the snapshot of chunk three
    (24 rows on chunk 8), with the same tokens; as "another engine's" pack the gate
    recomputes the span since the snapshot before the end. A model without state layers, or
    a count below 1, is a usage error (2), with --serve too (before it starts)."""
    from dataclasses import replace

    from muser_cli.errors import UsageError
    from muser_cli.kvpack import write_pack
    from stream_producer import frame_ends
    from typer.testing import CliRunner

    from muser_cli.commands import app

    info = tiny_family(family)
    rows = len(encode_prompt(info, PROMPT)) - 1
    kw = dict(model=str(info.path), chunk_tokens=8, threads=1)
    plain, spaced = io.BytesIO(), io.BytesIO()
    prefill(PROMPT, plain, **kw)
    prefill(PROMPT, spaced, state_every=3, **kw)
    data = spaced.getvalue()
    pack = read_pack(io.BytesIO(data))
    h = pack.header
    assert h.state_every == 3 and rows > 5 * 8
    states = [i for i, s in enumerate(info.layers) if s.kind == "state"]
    plan = list(h.frame_plan())
    due = [c for c in range(24, rows, 24)] + [rows]
    for i in states:
        assert [s + c for j, s, c in plan if j == i] == due
    for i in (i for i, s in enumerate(info.layers) if s.kind != "state"):  # rows: every chunk, as before
        assert len([1 for j, _, _ in plan if j == i]) == -(-rows // 8)
    assert len(data) < len(plain.getvalue())
    doc, path = tmp_path / "doc.txt", tmp_path / "spaced.kvpack"
    doc.write_text(PROMPT)
    path.write_bytes(data)
    _cli("verify", "-m", info.path, path)
    dkw = dict(model=str(info.path), max_new_tokens=NEW, threads=1)
    local = decode(io.BytesIO(b""), prompt=PROMPT, chunk_tokens=8, **dkw)
    handed = decode(io.BytesIO(data), **dkw)
    assert not handed.fallback and handed.token_ids == local.token_ids
    ends = frame_ends(data)[1:]
    last = max(j for j, (_, s, c) in enumerate(plan) if s + c <= 40)  # every frame of the first five chunks
    cut = decode(io.BytesIO(data[: ends[last]]), prompt=PROMPT, **dkw)
    assert cut.source == "partial+local" and cut.handoff_rows == 24 and cut.token_ids == local.token_ids
    foreign = io.BytesIO()
    write_pack(foreign, replace(h, producer={**h.producer, "engine": "vllm"}), list(pack.layers))
    gated = decode(io.BytesIO(foreign.getvalue()), **dkw)
    assert gated.spot_check["ran"] and gated.spot_check["ok"] and gated.spot_check["method"] == "state-checkpoint"
    assert gated.token_ids == local.token_ids
    with pytest.raises(UsageError, match="no recurrent state layers"):
        prefill(PROMPT, io.BytesIO(), model=str(tiny_family("qwen3").path), state_every=2, chunk_tokens=8)
    with pytest.raises(UsageError, match="--state-every"):
        prefill(PROMPT, io.BytesIO(), state_every=0, **kw)
    for model, count in ((tiny_family("qwen3").path, "2"), (info.path, "0")):  # --serve checks it before it starts
        r = CliRunner().invoke(app, ["prefill", "--serve", "127.0.0.1:0", "-m", str(model), "--state-every", count])
        assert r.exit_code == 2 and "--state-every" in r.output, r.output


@pytest.mark.mlx
@pytest.mark.parametrize("family", HYBRIDS)
def test_state_every_packs_cross_between_torch_and_mlx_through_the_gate(family, tiny_family):
    """A pack with a snapshot every third chunk, made on one engine, decodes on the other:
    the gate recomputes from the pack's own spaced checkpoint and passes; the first tokens
    equal the consumer's own local decode."""
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    info = tiny_family(family)
    for made_by, on in (("torch", "mlx"), ("mlx", "torch")):
        out = io.BytesIO()
        prefill(PROMPT, out, model=str(info.path), engine=made_by, chunk_tokens=8, threads=1, state_every=3)
        assert read_pack(io.BytesIO(out.getvalue())).header.state_every == 3
        kw = dict(model=str(info.path), engine=on, max_new_tokens=NEW, threads=1)
        got = decode(io.BytesIO(out.getvalue()), **kw)
        local = decode(io.BytesIO(b""), prompt=PROMPT, chunk_tokens=8, **kw)
        assert not got.fallback and got.spot_check["ran"] and got.spot_check["ok"], got.spot_check
        assert got.spot_check["method"] == "state-checkpoint"
        assert got.token_ids[:4] == local.token_ids[:4], (made_by, on)
