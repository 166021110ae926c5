"""The reuse store, chain hashes, the have manifest and delta packs, on synthetic packs
(no model): exact points, to-the-byte delta sizes, corruption, LRU, concurrent writers."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvpack_factory import FP_A, FP_B, hybrid_layers, llama_layers, make_rows
from muser_cli.commands import app
from muser_cli.errors import DataError, IdentityMismatch
from muser_cli.kvpack import LayerKV, PackHeader, read_pack_bytes, token_digest, write_pack
from muser_cli.kvpack.format import FRAME_HEADER, PREAMBLE, pad_len
from muser_cli.produce.pack import pack
from muser_cli.reuse import (
    BaseNotHeld, CorruptEntry, HaveManifest, Scope, Store, chain_at, chain_points, find_resume, parse_size,
    resolve_delta,
)
from muser_cli.reuse.chain import resumable
from muser_cli.reuse.manifest import check_base
from handoff_kit import HANG_S

CHUNK = 8


def header_for(ids, *, layers=None, chunk=CHUNK, dtype="float32") -> PackHeader:
    return PackHeader(FP_A, FP_B, tuple(ids), layers or hybrid_layers(), dtype, chunk, model_name="synthetic",
                      architecture="test")


def pack_bytes(ids, *, seed=0, codec="none", **kw) -> bytes:
    h = header_for(ids, **kw)
    buf = io.BytesIO()
    write_pack(buf, h, make_rows(h, seed), codec=codec)
    return buf.getvalue()


def manifest_for(store: Store, ids, **kw) -> HaveManifest:
    """What `muser reuse have` computes, from token ids (no tokenizer needed)."""
    base = HaveManifest(FP_A, "synthetic", FP_B, len(ids), token_digest(list(ids)))
    pts = store.points(FP_A, FP_B, ids, len(ids) - 1, **kw)
    if not pts:
        return base
    p = pts[0]
    return replace(base, held_tokens=p.held, entry_id=p.entry, chain=p.chain, scope=p.scope,
                   complete=p.held == len(ids) - 1 and p.resumable)


PROMPT = list(range(10, 51))  # 41 tokens: rows [0, 40)
LONGER = PROMPT + list(range(300, 340))  # 81 tokens, shares the first 41


# ------------------------------------------------------------------ chain hashes
def test_chain_points_are_chunk_boundaries_and_the_exact_end():
    scope = Scope(FP_A, FP_B, "float32", CHUNK)
    pts = chain_points(scope, PROMPT, 40)
    assert [n for n, _ in pts] == [8, 16, 24, 32, 40]
    assert [n for n, _ in chain_points(scope, PROMPT, 37)] == [8, 16, 24, 32, 37]
    # a prefix's chain does not depend on what follows; the exact end differs from a boundary
    assert chain_at(scope, LONGER, 32) == chain_at(scope, PROMPT, 32)
    assert chain_at(scope, PROMPT, 37) == chain_at(scope, LONGER, 37)  # same 37 tokens
    assert chain_at(scope, PROMPT, 37) != chain_at(scope, PROMPT, 32)
    # the scope is part of the chain: another chunk size, dtype or model never matches
    for other in (Scope(FP_A, FP_B, "float32", 16), Scope(FP_A, FP_B, "bfloat16", CHUNK),
                  Scope(FP_B, FP_B, "float32", CHUNK)):
        assert chain_at(other, PROMPT, 16) != chain_at(scope, PROMPT, 16)


def test_resumable_needs_the_sliding_ring_at_that_point():
    hybrid, full = hybrid_layers(), llama_layers()
    assert resumable(full, 40, 16) and resumable(full, 40, 40)
    assert resumable(hybrid, 40, 40) and not resumable(hybrid, 40, 32)  # ring [33,40) is not [25,32)
    assert resumable(hybrid, 6, 4)  # a short entry (rows <= window-1) holds every sliding row


# ------------------------------------------------------------------ store basics
def test_put_lookup_get_ls_rm(tmp_path):
    store = Store()
    data = pack_bytes(PROMPT)
    res = store.put(io.BytesIO(data))
    assert res.new and res.points == 5 and res.entry.id == read_pack_bytes(data).root_digest.hex()
    assert res.entry.bytes == len(data) and res.entry.tokens == 41 and res.entry.rows == 40
    assert not store.put(io.BytesIO(data)).new  # content-addressed: the same pack is held once
    pts = store.points(FP_A, FP_B, LONGER, 80)
    assert [(p.held, p.resumable) for p in pts] == [(40, True), (32, False), (24, False), (16, False), (8, False)]
    pts = store.points(FP_A, FP_B, PROMPT, 40)
    assert (pts[0].held, pts[0].resumable) == (40, True)  # the exact prompt: a full hit
    assert store.points(FP_A, FP_B, LONGER, 80, chunk_tokens=16) == []
    r = CliRunner().invoke(app, ["reuse", "ls", "--json"])
    listed = json.loads(r.stdout)["entries"]
    assert r.exit_code == 0 and [e["id"] for e in listed] == [res.entry.id] and listed[0]["tokens"] == 41
    out = tmp_path / "got.kvpack"
    r = CliRunner().invoke(app, ["reuse", "get", res.entry.id[:10], "-o", str(out)])
    assert r.exit_code == 0 and out.read_bytes() == data
    r = CliRunner().invoke(app, ["reuse", "rm", res.entry.id[:8]])
    assert r.exit_code == 0 and store.entries() == [] and not store.pack_path(res.entry.id).exists()
    assert CliRunner().invoke(app, ["reuse", "rm", "abcd1234"]).exit_code == 66


def test_store_refuses_quantized_and_unheld_deltas():
    store = Store()
    full = pack_bytes(PROMPT)
    q = io.BytesIO()
    pack(io.BytesIO(full), q, codec="none", quant="int8")
    with pytest.raises(DataError, match="quantized"):
        store.put(io.BytesIO(q.getvalue()))
    other = Store(store.root.parent / "elsewhere")
    other.put(io.BytesIO(full))
    d = io.BytesIO()
    pack(io.BytesIO(pack_bytes(LONGER)), d, codec="none", have=manifest_for(other, LONGER))
    with pytest.raises(BaseNotHeld):
        store.put(io.BytesIO(d.getvalue()))
    tmp = store.root / "tmp"  # issue #29.2: a refused first put removes the folders it made, tmp included
    assert store.entries() == [] and (not tmp.exists() or not list(tmp.iterdir()))


# ------------------------------------------------------------------ delta packs
def expected_delta_bytes(header: PackHeader) -> tuple[int, int]:
    """(whole file, payload) from the rule alone: new full-attention rows + whole sliding rings,
    plus the preamble and header, 128 bytes per frame (+ payload padding) and the end frame."""
    end, held = header.rows_end, header.rows_start
    payload = 0
    for i, spec in enumerate(header.layers):
        rows = min(end, spec.window - 1) if spec.kind == "sliding" else end - held
        payload += rows * spec.kv_heads * (spec.head_dim + spec.v_head_dim) * 4
    head = PREAMBLE.size + len(header.encode())
    total = head + pad_len(head)
    for layer, start, count in header.frame_plan():
        raw = count * header.row_bytes(layer)
        total += FRAME_HEADER.size + raw + pad_len(raw) + 64
    return total + FRAME_HEADER.size + 64, payload


@pytest.mark.parametrize("layers", [hybrid_layers(), llama_layers()], ids=["hybrid", "full"])
def test_delta_is_the_formula_to_the_byte_and_merges_exactly(layers):
    store = Store()
    ids = list(range(10, 91))  # 81 tokens: rows [0, 80)
    h_full = header_for(ids, layers=layers)
    rows = make_rows(h_full, 0)
    buf = io.BytesIO()
    write_pack(buf, h_full, rows)
    full = buf.getvalue()
    # The consumer holds ids[:41] (rows [0, 40): half the prompt), whose full-attention rows are
    # the full pack's own; its sliding rings belong to position 40 and are never used by a merge.
    h_pre = header_for(ids[:41], layers=layers)
    pre = [LayerKV(r.keys[:, :40], r.values[:, :40], 0) if s.kind == "full" else
           LayerKV(np.zeros((s.kv_heads, 7, s.head_dim), "<f4"), np.zeros((s.kv_heads, 7, s.v_head_dim), "<f4"), 33)
           for r, s in zip(rows, layers)]
    buf = io.BytesIO()
    write_pack(buf, h_pre, pre)
    store.put(io.BytesIO(buf.getvalue()))

    have = manifest_for(store, ids)
    assert have.held_tokens == 40 and not have.complete
    out = io.BytesIO()
    res = pack(io.BytesIO(full), out, codec="none", have=have)
    delta = out.getvalue()
    d = read_pack_bytes(delta)
    assert res.held_tokens == 40 and d.header.rows_start == 40 and d.header.base["tokens"] == 40
    total, payload = expected_delta_bytes(d.header)
    assert len(delta) == total and res.raw_bytes == payload
    assert payload == d.header.total_raw_bytes()
    # merge: the stored prefix + the delta is every byte of the full pack's KV
    merged, entry = resolve_delta(d, store)
    assert entry == have.entry_id
    for got, want in zip(merged, read_pack_bytes(full).layers):
        assert got.first_row == want.first_row
        assert np.array_equal(got.keys, want.keys) and np.array_equal(got.values, want.values)
    # a delta re-packed with the same manifest is the same delta; with nothing held, refused
    again = io.BytesIO()
    pack(io.BytesIO(delta), again, codec="none", have=have)
    assert again.getvalue() == delta
    with pytest.raises(DataError, match="holds only 0"):
        pack(io.BytesIO(delta), io.BytesIO(), have=replace(have, held_tokens=0, entry_id=None, chain=None, scope=None))


def test_a_held_point_off_the_chunk_grid_gives_a_delta_from_the_boundary_below():
    """#30 item 3, the manifest path: a consumer holds a 38-token prompt (rows end at 37, off
    the chunk-8 grid) and says so (a hand-written manifest: ``reuse have`` names 32). The
    delta ``pack --have`` makes starts at 32, the boundary below: its base verifies and it
    merges with the stored entry to every byte of the full pack (before: a delta from 37,
    written with no error, that every reader refused)."""
    layers = llama_layers(2)
    full = pack_bytes(LONGER, layers=layers)
    rows = read_pack_bytes(full).layers
    buf = io.BytesIO()
    write_pack(buf, header_for(LONGER[:38], layers=layers), [LayerKV(r.keys[:, :37], r.values[:, :37], 0) for r in rows])
    store = Store()
    store.put(io.BytesIO(buf.getvalue()))
    scope = Scope(FP_A, FP_B, "float32", CHUNK)
    have = replace(manifest_for(store, LONGER), held_tokens=37, chain=chain_at(scope, LONGER, 37), scope=scope,
                   complete=False)
    have.check_prompt(LONGER)
    out = io.BytesIO()
    res = pack(io.BytesIO(full), out, codec="none", have=have)
    d = read_pack_bytes(out.getvalue())
    assert res.held_tokens == 32 and d.header.rows_start == 32 and d.header.base["tokens"] == 32
    check_base(d.header)
    merged, _ = resolve_delta(d, store)
    for got, want in zip(merged, read_pack_bytes(full).layers):
        assert np.array_equal(got.keys, want.keys) and np.array_equal(got.values, want.values)


def test_forged_or_unheld_base_is_refused():
    store = Store()
    store.put(io.BytesIO(pack_bytes(PROMPT)))
    out = io.BytesIO()
    pack(io.BytesIO(pack_bytes(LONGER)), out, codec="none", have=manifest_for(store, LONGER))
    d = read_pack_bytes(out.getvalue())
    check_base(d.header)
    forged = replace(d.header, base=dict(d.header.base, chain="sha256:" + "0" * 64))
    with pytest.raises(DataError, match="chain"):
        check_base(forged)
    with pytest.raises(DataError, match="not a multiple"):
        check_base(replace(d.header, rows_start=30, base=dict(d.header.base, tokens=30)))
    store.remove([e.id for e in store.entries()])
    with pytest.raises(BaseNotHeld) as exc:
        resolve_delta(d, store)
    assert exc.value.exit_status == 65 and exc.value.hint


# ------------------------------------------------------------------ manifest
def test_manifest_round_trip_and_strictness():
    store = Store()
    store.put(io.BytesIO(pack_bytes(PROMPT)))
    m = manifest_for(store, LONGER)
    back = HaveManifest.loads(m.dumps())
    assert back == m and back.to_json()["entry"]["held_tokens"] == 40 and back.prompt_tokens == 81
    obj = json.loads(m.dumps())
    bad = [b"", b"[]", b"{", json.dumps(dict(obj, format="x")), json.dumps(dict(obj, version=[2, 0])),
           json.dumps(dict(obj, held_tokens=81)), json.dumps(dict(obj, held_tokens="32")),
           json.dumps(dict(obj, entry=None)), json.dumps(dict(obj, entry=dict(obj["entry"], held_tokens=32))),
           json.dumps(dict(obj, entry=dict(obj["entry"], chain="sha256:xyz"))), b"{" * 5000]
    for blob in bad:
        with pytest.raises(DataError):
            HaveManifest.loads(blob)
    with pytest.raises(IdentityMismatch, match="model"):
        m.check_model(FP_B, FP_B)
    with pytest.raises(IdentityMismatch, match="prompt"):
        m.check_prompt(LONGER[:-1] + [1])
    m.check_prompt(LONGER)
    with pytest.raises(IdentityMismatch, match="chain"):
        replace(m, chain="sha256:" + "1" * 64).check_prompt(LONGER)


# ------------------------------------------------------------------ corruption, LRU, rebuild
def test_corrupt_entry_is_detected_removed_and_never_used():
    store = Store()
    res = store.put(io.BytesIO(pack_bytes(PROMPT, layers=llama_layers())))
    path = store.pack_path(res.entry.id)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    assert find_resume(store, FP_A, FP_B, PROMPT, dtype="float32") is None
    assert store.entries() == [] and not path.exists()
    assert len(store.problems) == 1 and "digest mismatch" in store.problems[0]
    res = store.put(io.BytesIO(pack_bytes(PROMPT, layers=llama_layers())))
    store.pack_path(res.entry.id).unlink()
    with pytest.raises(CorruptEntry, match="vanished"):
        store.load(res.entry.id)
    assert store.entries() == []


def test_lru_cap_and_gc():
    packs = [pack_bytes([i] + PROMPT, seed=i) for i in range(4)]
    size = len(packs[0])
    store = Store(max_bytes=3 * size)
    ids = [store.put(io.BytesIO(p)).entry.id for p in packs[:3]]
    store.touch(ids[0])  # entry 1 is now the least recently used
    res = store.put(io.BytesIO(packs[3]))
    assert res.evicted == [ids[1]] and {e.id for e in store.entries()} == {ids[0], ids[2], res.entry.id}
    r = CliRunner().invoke(app, ["reuse", "gc", "--max-size", str(2 * size), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["evicted"] == [ids[2]] and out["entries"] == 2 and out["bytes"] <= 2 * size
    assert parse_size("20G") == 20 << 30 and parse_size("1.5MiB") == 3 << 19 and parse_size("512") == 512


def test_rebuild_the_index_from_the_packs():
    store = Store()
    ids = {store.put(io.BytesIO(pack_bytes([i] + PROMPT, seed=i))).entry.id for i in range(3)}
    store.close()
    store.index_path.write_bytes(b"this is not a database" * 100)
    for suffix in ("-wal", "-shm"):
        Path(str(store.index_path) + suffix).unlink(missing_ok=True)
    # A broken index repairs itself from the verified packs on first use (the store is a
    # cache: it never refuses a caller), saying so; the old index is kept aside.
    r = CliRunner().invoke(app, ["reuse", "ls", "--json"])
    assert r.exit_code == 0, r.output
    assert "rebuilt from 3 verified packs" in r.stderr
    assert {e["id"] for e in json.loads(r.stdout)["entries"]} == ids
    assert any(p.name.startswith("index.sqlite3.broken-") for p in store.root.iterdir())
    r = CliRunner().invoke(app, ["reuse", "gc", "--rebuild", "--json"])
    assert r.exit_code == 0, r.output
    assert {e.id for e in Store().entries()} == ids


# ------------------------------------------------------------------ two writers at once
WRITER = textwrap.dedent("""
    import io, sys
    sys.path[:0] = {tests!r}
    from test_reuse_store import pack_bytes, PROMPT
    from muser_cli.reuse import Store
    who = int(sys.argv[1])
    store = Store()
    for i in range(6):
        seed = i if i % 2 else 100 * who + i  # even: every process its own pack; odd: all the same pack
        store.put(io.BytesIO(pack_bytes([seed] + PROMPT, seed=seed)))
        store.points(*{fps!r}, [seed] + PROMPT, 41)
""")


def test_concurrent_writers(tmp_path):
    script = WRITER.format(tests=[str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])], fps=(FP_A, FP_B))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(w)], stderr=subprocess.PIPE) for w in range(4)]
    errs = [p.communicate(timeout=HANG_S)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errs
    store = Store()
    entries = store.entries()
    assert len(entries) == 4 * 3 + 3  # 3 own packs per process + 3 shared ones, each held once
    res = store.gc(verify=True)
    assert res.removed == [] and res.entries == len(entries) and store.problems == []
    assert not list((store.root / "tmp").iterdir())


# ------------------------------------------------------------------ v1.2 ring rows (ring_extra)
def test_a_full_hit_keeps_the_ring_rows_a_producer_promises():
    """An entry stored with ring_extra 1 serves a producer that writes it (window rows in each
    sliding layer); one stored without serves only the consumer's cache (window - 1)."""
    store = Store()
    h = replace(header_for(PROMPT), ring_extra=1)
    assert h.minor == 2 and [h.layer_rows(i) for i in range(3)] == [8, 8, 40]
    rows = make_rows(h, 1)
    buf = io.BytesIO()
    write_pack(buf, h, rows)
    store.put(io.BytesIO(buf.getvalue()))
    got = find_resume(store, FP_A, FP_B, PROMPT, dtype="float32", ring_extra=1)
    assert got is not None and got.held == 40
    assert [(l.first_row, l.keys.shape[1]) for l in got.layers] == [(32, 8), (32, 8), (0, 40)]
    assert np.array_equal(got.layers[0].keys, rows[0].keys)
    plain = find_resume(store, FP_A, FP_B, PROMPT, dtype="float32")  # a consumer: what its cache holds
    assert [(l.first_row, l.keys.shape[1]) for l in plain.layers] == [(33, 7), (33, 7), (0, 40)]
    assert np.array_equal(plain.layers[0].keys, rows[0].keys[:, 1:])

    old = Store(store.root.parent / "old")
    old.put(io.BytesIO(pack_bytes(PROMPT)))  # v1.1: window - 1 rows
    entry = old.points(FP_A, FP_B, PROMPT, 40, dtype="float32")[0].entry
    assert old.ring_extra_of(entry) == 0 and store.ring_extra_of(got.entry) == 1  # from the header alone
    used = old.entry(entry).last_used
    time.sleep(0.01)
    assert find_resume(old, FP_A, FP_B, PROMPT, dtype="float32", ring_extra=1) is None  # no full hit for it
    assert old.entry(entry).last_used == used  # not loaded, not marked used: eviction still sees it old
    assert find_resume(old, FP_A, FP_B, PROMPT, dtype="float32").held == 40


def test_a_delta_of_a_v1_2_pack_carries_the_same_ring_and_merges_back():
    store = Store()
    full = replace(header_for(LONGER), ring_extra=1)
    rows = make_rows(full, 2)
    prefix = replace(header_for(PROMPT), ring_extra=1)
    pbuf = io.BytesIO()
    write_pack(pbuf, prefix, [LayerKV(l.keys[:, :40], l.values[:, :40], 0) if s.kind == "full"
                              else LayerKV(*(make_rows(prefix, 3)[i].keys,) * 2, prefix.layer_first_row(i))
                              for i, (s, l) in enumerate(zip(full.layers, rows))])
    store.put(io.BytesIO(pbuf.getvalue()))
    fbuf = io.BytesIO()
    write_pack(fbuf, full, rows)
    d = io.BytesIO()
    pack(io.BytesIO(fbuf.getvalue()), d, codec="none", have=manifest_for(store, LONGER))
    delta = read_pack_bytes(d.getvalue())
    assert delta.header.rows_start == 40 and delta.header.ring_extra == 1 and delta.header.minor == 2
    assert [delta.header.layer_rows(i) for i in range(3)] == [8, 8, 40]
    merged, _ = resolve_delta(delta, store)
    for m, r in zip(merged, rows):
        assert m.first_row == r.first_row and np.array_equal(m.keys, r.keys) and np.array_equal(m.values, r.values)
