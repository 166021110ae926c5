"""kvpack 1.3's layer kinds (docs/kvpack.md 1.4, 2.6): ``latent`` (MLA rows of latent + rope
key) and ``state`` (a recurrent layer's snapshot per chunk, the newest superseding the rest).
Every reader gives the same layers, the same verdict on corrupt input, and a cut stream
resumes from the last chunk that arrived whole, state snapshot included."""

from __future__ import annotations

import io
import json
import struct
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpack_factory import corrupted, fed_root, frame_offsets, kinds_layers, make_pack, make_rows, plain_header, verdict
from muser_cli.errors import KVPackError
from muser_cli.kvpack import EndEvent, FrameEvent, PackReader, buffer_events, read_pack, read_pack_bytes, write_pack
from muser_cli.kvpack.format import canonical_json
from muser_cli.kvpack.validate import parse_header
from muser_cli.kvpack.layers import StateKV, latent_spec, state_spec
from muser_cli.kvpack.stream import Cut, StreamedPack
from muser_cli.kvpack.summary import summarize


def _kinds_pack(n: int = 21, codec: str = "none", chunk: int = 4, digest: str = "blake3"):
    header = replace(plain_header(n, layers=kinds_layers(), chunk=chunk), digest=digest)
    rows = make_rows(header, seed=5)
    buf = io.BytesIO()
    write_pack(buf, header, rows, codec=codec)
    return buf.getvalue(), header, rows


def _same_layers(got, want) -> None:
    for g, w in zip(got, want):
        if isinstance(w, StateKV):
            assert isinstance(g, StateKV) and g.position == w.position and g.first_row == w.first_row
            assert set(g.tensors) == set(w.tensors)
            for name, arr in w.tensors.items():
                assert g.tensors[name].dtype == arr.dtype and np.array_equal(g.tensors[name], arr)
        else:
            assert g.first_row == w.first_row
            assert np.array_equal(g.keys, w.keys) and np.array_equal(g.values, w.values)


@pytest.mark.parametrize("codec", ["none", "zstd", "zstd+bytegroup"])
def test_every_reader_gives_the_latent_rows_and_the_newest_state_snapshot(codec, tmp_path):
    data, header, rows = _kinds_pack(codec=codec)
    assert header.minor == 3 and json.loads(data[16:16 + struct.unpack_from("<I", data, 12)[0]])["layers"][0] == {
        "kind": "latent", "kv_lora_rank": 24, "rope_dim": 8,
        "rope": {"theta": 10000.0, "dims": 8, "style": "interleaved", "scaling": None}}
    path = tmp_path / "p.kvpack"
    path.write_bytes(data)
    with open(path, "rb") as fh:
        mapped = read_pack(fh)
    streamed = StreamedPack(io.BytesIO(data)).result()
    for pack in (read_pack_bytes(data), read_pack(io.BytesIO(data), use_mmap=False), mapped, streamed):
        _same_layers(pack.layers, rows)
        assert pack.layers[1].position == 20  # the state after positions [0, 20): the snapshot of the last chunk


def test_state_frames_are_whole_snapshots_one_per_chunk_in_the_chunk_major_plan():
    data, header, rows = _kinds_pack()
    reader = PackReader()
    frames = [ev for ev in reader.feed(data) if isinstance(ev, FrameEvent)]
    reader.finish()
    state = [ev for ev in frames if ev.layer == 1]
    assert [(ev.start, ev.count) for ev in state] == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4)]
    snap = header.layers[1].state_bytes
    assert snap == 3 * 20 * 2 + 2 * 4 * 6 * 4 and all(len(ev.keys) == snap for ev in state)
    assert [ev.layer for ev in frames[:3]] == [0, 1, 2]  # chunk-major: every layer's frame of a chunk, in order
    # the end frame's raw length counts every snapshot; what a consumer holds counts one
    assert header.total_raw_bytes() == 5 * snap + 20 * (24 + 8) * 2 + 20 * 2 * 32 * 2
    assert summarize(read_pack_bytes(data))["kv_bytes_by_kind"] == {"latent": 20 * 64, "state": snap, "full": 20 * 128}


def test_int8_quantizes_latent_rows_and_leaves_state_snapshots_exact():
    from muser_cli.kvpack.quant import to_float32
    from muser_cli.produce.pack import pack

    layers = (latent_spec(24, 8, None), kinds_layers()[1])
    header = plain_header(21, layers=layers, chunk=4, dtype="float32")
    rows = make_rows(header, seed=2)
    src = io.BytesIO()
    write_pack(src, header, rows)
    out = io.BytesIO()
    pack(io.BytesIO(src.getvalue()), out, quant="int8")
    q = read_pack_bytes(out.getvalue())
    assert q.header.quant["scheme"] == "int8"
    err = np.abs(to_float32(q.layers[0].keys, "float32") - rows[0].keys).max()
    assert 0 < err <= q.header.quant["error"]["k_max_abs"] + 1e-6
    _same_layers(q.layers[1:], rows[1:])  # the snapshot: bit for bit
    again = io.BytesIO()  # and re-encoding the plain pack passes snapshots on as they are
    pack(io.BytesIO(src.getvalue()), again, codec="zstd+bytegroup")
    _same_layers(read_pack_bytes(again.getvalue()).layers, rows)


@pytest.mark.parametrize("cut_frames", range(0, 15))
def test_a_cut_stream_resumes_from_the_last_whole_chunk_with_that_chunks_snapshot(cut_frames):
    """Cut after any number of frames: prefix() is the deepest chunk end where every layer
    verified, and the state layer's snapshot there -- also when the cut falls inside a chunk
    after that chunk's own (newer) snapshot arrived: the previous one is still kept."""
    data, header, rows = _kinds_pack()
    offsets = frame_offsets(data)
    sp = StreamedPack(io.BytesIO(data[: offsets[cut_frames]]))
    assert isinstance(sp.result(), Cut)
    best, layers = sp.prefix(header.chunk_tokens)
    whole_chunks = cut_frames // 3  # three layers, one frame each per chunk of 4
    assert best == 4 * whole_chunks
    assert sp.boundary(header.chunk_tokens) == best  # the race's check: the boundary alone, no views built
    if best:
        state = layers[1]
        assert isinstance(state, StateKV) and state.position == best
        for name, arr in rows[1].at(best).items():
            assert np.array_equal(state.tensors[name], arr)
        assert np.array_equal(layers[0].keys, rows[0].keys[:, :best])
    else:
        assert layers == []


@pytest.mark.parametrize("mutate,needle", [
    (lambda l: l.update(kv_heads=1), r"must have exactly the keys"),
    (lambda l: l["rope"].update(dims=16), r"layers\[0\]\.rope\.dims=16 outside \[2, 8\]"),
    (lambda l: l.update(kv_lora_rank=0), r"kv_lora_rank=0 outside"),
])
def test_latent_layer_descriptions_are_checked(mutate, needle):
    _refused_with_layer_changed(0, mutate, needle)


def _refused_with_layer_changed(index, mutate, needle):
    """The kinds pack's header with layer ``index`` changed by ``mutate`` is refused, saying ``needle``."""
    data, _, _ = _kinds_pack()
    obj = json.loads(data[16:16 + struct.unpack_from("<I", data, 12)[0]])
    mutate(obj["layers"][index])
    with pytest.raises(KVPackError, match=needle):
        parse_header(canonical_json(obj), 1, 3)


@pytest.mark.parametrize("mutate,needle", [
    (lambda l: l["tensors"][1].update(name="conv"), r"'conv' is a duplicate"),
    (lambda l: l["tensors"][0].update(dtype="float8"), r"dtype 'float8' is unknown"),
    (lambda l: l["tensors"][0].update(shape=[3, 0]), r"shape must be 1-6 dimensions"),
    (lambda l: l["tensors"][0].update(shape=[1 << 14, 1 << 14, 4]), r"snapshot of .* bytes exceeds"),
    (lambda l: l.update(tensors=[]), r"0 tensors outside \[1, 16\]"),
    (lambda l: l.update(mixer="Mamba-2"), r"mixer must be 1-64 of"),
    (lambda l: l.update(window=None), r"must have exactly the keys"),
    (lambda l: l["tensors"][0].update(order="C"), r"must have exactly the keys"),
])
def test_state_layer_descriptions_are_checked(mutate, needle):
    _refused_with_layer_changed(1, mutate, needle)


def test_the_writer_refuses_a_missing_or_misshapen_snapshot():
    header = plain_header(21, layers=kinds_layers(), chunk=4)
    rows = make_rows(header)
    missing = list(rows)
    missing[1] = replace(rows[1], earlier={k: v for k, v in rows[1].earlier.items() if k != 8})
    with pytest.raises(KVPackError, match="layer 1 has no state snapshot at position 8"):
        write_pack(io.BytesIO(), header, missing)
    bad = list(rows)
    snap = dict(rows[1].tensors, recurrent=np.zeros((2, 4, 6), np.float16))
    bad[1] = StateKV(tensors=snap, position=20, earlier={**rows[1].earlier, 20: snap})
    with pytest.raises(KVPackError, match=r"state 'recurrent' is float16\(2, 4, 6\), the header says float32"):
        write_pack(io.BytesIO(), header, bad)
    with pytest.raises(KVPackError, match=r"need kvpack 1\.3 \(this header is 1\.0\)"):
        replace(header, minor=0)


def test_a_state_pack_round_trips_through_every_digest_and_the_spec_verifier_sees_its_frames():
    for digest in ("blake3", "sha256"):
        data, header, rows = _kinds_pack(digest=digest)
        _same_layers(read_pack_bytes(data).layers, rows)
        ends = [ev for ev in buffer_events(data) if isinstance(ev, EndEvent)]
        assert ends[0].raw_bytes == header.total_raw_bytes()


def test_every_bit_flip_in_a_kinds_pack_is_refused():
    data, _, _ = _kinds_pack(n=9, chunk=4)
    for pos in range(0, len(data), 7):
        b = bytearray(data)
        b[pos] ^= 0x10
        with pytest.raises(KVPackError):
            read_pack_bytes(bytes(b))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_readers_agree_on_corrupted_kinds_packs(data):
    """The whole-buffer reader, buffer_events, PackReader in pieces (decoding and verify-only)
    and the stream reader give one verdict -- the same root, or the same message."""
    codec = data.draw(st.sampled_from(["none", "zstd", "zstd+bytegroup"]))
    raw = corrupted(data, _kinds_pack(n=13, codec=codec)[0])

    def pieces(decode: bool):
        return fed_root(raw, data.draw(st.integers(1, 300)), decode=decode)

    whole = verdict(lambda: read_pack_bytes(raw).root_digest)
    assert whole == verdict(lambda: pieces(True)) == verdict(lambda: pieces(False))
    assert whole == verdict(lambda: [e for e in buffer_events(raw) if isinstance(e, EndEvent)][0].root_digest)
    assert whole == verdict(lambda: read_pack(io.BytesIO(raw)).root_digest)


def test_state_spec_and_latent_spec_are_what_the_header_says():
    spec = state_spec("short_conv", [("conv", (4, 8), "bfloat16")])
    assert spec.to_json() == {"kind": "state", "mixer": "short_conv",
                              "tensors": [{"name": "conv", "shape": [4, 8], "dtype": "bfloat16"}]}
    assert spec.state_bytes == 64 and spec.state_elem == 2
    _, header, _ = make_pack(9, layers=(latent_spec(16, 8, None), spec), chunk=4)
    assert header.minor == 3 and header.layer_frames(1) == 2 and header.frame_raw_len(1, 4) == 64


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 80), grid=st.integers(1, 9), every=st.integers(1, 5), start=st.integers(0, 60))
def test_property_layer_frames_counts_the_plan_and_snapshots_fall_where_due(n, grid, every, start):
    start = min(start, n - 2)
    header = replace(plain_header(n, layers=kinds_layers(), chunk=grid), state_every=every, rows_start=start,
                     base={"root": "x"} if start else None)
    plan = list(header.frame_plan())
    for i in range(3):
        assert header.layer_frames(i) == sum(1 for f in plan if f[0] == i)
    state = [(s, c) for layer, s, c in plan if layer == 1]
    assert state and state[0][0] == start and state[-1][0] + state[-1][1] == header.rows_end
    for (s0, c0), (s1, _) in zip(state, state[1:]):
        assert s0 + c0 == s1 and (s1 % (grid * every) == 0)  # contiguous, each at a due chunk end


def test_state_every_thins_snapshots_and_a_cut_resumes_at_the_last_due_one():
    """state_every 2 on grid 4 (21 tokens): snapshots at 8, 16 and 20; a cut after chunk 3's
    frames (rows to 12) resumes at 8, the last snapshot, never at 12."""
    header = replace(plain_header(21, layers=kinds_layers(), chunk=4), state_every=2)
    assert [(s, c) for layer, s, c in header.frame_plan() if layer == 1] == [(0, 8), (8, 8), (16, 4)]
    rows = make_rows(header, seed=9)
    buf = io.BytesIO()
    write_pack(buf, header, rows)
    data = buf.getvalue()
    pack = read_pack_bytes(data)
    assert pack.header.state_every == 2 and pack.header.raw["state_every"] == 2
    _same_layers(pack.layers, rows)
    offsets = frame_offsets(data)
    # frames: c0: L0 F2 | c1: L0 S F2 | c2: L0 F2 | c3: L0 S F2 | c4: L0 S F2
    sp = StreamedPack(io.BytesIO(data[: offsets[8]]))  # c0..c2 whole and c3's L0: rows to 12, snapshot at 8
    assert isinstance(sp.result(), Cut)
    best, layers = sp.prefix(4)
    assert best == 8 and layers[1].position == 8 and sp.boundary(4) == 8
    with pytest.raises(KVPackError, match="state_every needs a state layer"):
        replace(header, layers=(header.layers[0],))
    obj = json.loads(data[16:16 + struct.unpack_from("<I", data, 12)[0]])
    with pytest.raises(KVPackError, match=r"unknown key\(s\) \['state_every'\] for version 1\.2"):
        parse_header(canonical_json({**obj, "version": [1, 2], "layers": [{"kind": "full", "kv_heads": 2, "head_dim": 16,
                     "v_head_dim": 16, "window": None, "rope": None}]}), 1, 2)


def test_pack_have_cuts_state_layers_at_the_consumers_snapshot():
    """A delta of a pack with state layers (issue 27): the consumer's store holds the snapshot
    at its held position (a chunk end), so a state layer ships only the snapshots after it,
    each whole; a whole pack's reader keeps every superseded snapshot (``earlier``)."""
    from muser_cli.kvpack import token_digest
    from muser_cli.produce.pack import pack
    from muser_cli.reuse.chain import Scope
    from muser_cli.reuse.manifest import HaveManifest

    from muser_cli.reuse.chain import chain_at

    data, header, rows = _kinds_pack()
    scope = Scope(header.model_fingerprint, header.tokenizer_fingerprint, "bfloat16", 4)
    have = HaveManifest(model=header.model_fingerprint, model_name="synthetic", tokenizer=header.tokenizer_fingerprint,
                        prompt_tokens=len(header.token_ids), prompt_digest=token_digest(header.token_ids),
                        held_tokens=8, entry_id="e", chain=chain_at(scope, header.token_ids, 8), scope=scope)
    out = io.BytesIO()
    pack(io.BytesIO(data), out, have=have, codec="none")
    delta = read_pack(io.BytesIO(out.getvalue()))
    assert delta.header.rows_start == 8
    states = [i for i, spec in enumerate(header.layers) if spec.kind == "state"]
    whole = read_pack(io.BytesIO(data))
    for i in states:
        plan = [f for f in delta.header.frame_plan() if f[0] == i]
        assert plan[0][1] == 8 and [f[1] + f[2] for f in plan] == list(range(12, 20, 4)) + [20]
        got, want = delta.layers[i], rows[i]
        assert sorted(got.earlier) == [12, 16] and got.position == 20
        for p in (12, 16, 20):
            for name, arr in want.at(p).items():
                assert np.array_equal(got.at(p)[name], arr)
        assert sorted(whole.layers[i].earlier) == [4, 8, 12, 16]
