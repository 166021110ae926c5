"""The warm path's read (issue 14, part 4): a store entry is memory-mapped, verified at hash
speed, and -- with ``spare_rows`` -- each full layer is placed once into an array with room
for the tokens decode will add, which the torch engine adopts as its cache: that one
placement is the install, no intermediate copy follows. Nothing is handed out before the
root digest verified; the rows are the same bytes either way."""

from __future__ import annotations

import io
import mmap
from dataclasses import replace

import numpy as np
import pytest

from kvpack_factory import FP_A, FP_B, hybrid_layers, llama_layers, make_rows
from muser_cli.errors import KVPackError
from muser_cli.kvpack import PackHeader, read_buffer, read_pack, write_pack
from muser_cli.reuse import CorruptEntry, Store, find_resume

PROMPT = list(range(10, 51))  # rows [0, 40)


def _header(ids, layers, *, chunk=8, dtype="bfloat16", minor=1, digest="blake3") -> PackHeader:
    return replace(PackHeader(FP_A, FP_B, tuple(ids), layers, dtype, chunk, model_name="synthetic",
                              architecture="test"), minor=minor, digest=digest)


def _bytes(header, rows, codec="none") -> bytes:
    buf = io.BytesIO()
    write_pack(buf, header, rows, codec=codec)
    return buf.getvalue()


def _owner(a) -> object:
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


@pytest.mark.parametrize("codec", ["none", "zstd+bytegroup"])
@pytest.mark.parametrize("chunk", [8, 64])  # several frames per layer; one frame per layer
def test_spare_room_after_each_full_layer_same_rows(codec, chunk):
    header = _header(PROMPT, hybrid_layers(), chunk=chunk)
    rows = make_rows(header, 2)
    data = _bytes(header, rows, codec)
    plain = read_buffer(data)
    roomy = read_buffer(data, spare_rows=17)
    assert roomy.root_digest == plain.root_digest
    for spec, a, b, want in zip(header.layers, plain.layers, roomy.layers, rows):
        assert np.array_equal(b.keys, want.keys) and np.array_equal(b.values, want.values)
        assert b.first_row == a.first_row
        if spec.kind == "full":
            base = b.keys.base
            assert isinstance(base, np.ndarray) and base.shape[1] == b.keys.shape[1] + 17
            assert base.flags.writeable and base.flags.c_contiguous and b.keys.strides == base.strides
            assert b.values.base.shape[1] == b.values.shape[1] + 17
        else:  # a ring is read as without room
            assert b.keys.shape == a.keys.shape


def test_without_spare_rows_a_one_frame_layer_is_still_a_view_of_the_map(tmp_path):
    header = _header(PROMPT, llama_layers(2), chunk=64)
    path = tmp_path / "p.kvpack"
    path.write_bytes(_bytes(header, make_rows(header, 3)))
    with open(path, "rb") as f:
        pack = read_pack(f)
    assert all(isinstance(_owner(l.keys), mmap.mmap) for l in pack.layers)
    with open(path, "rb") as f:
        roomy = read_pack(f, spare_rows=5)
    assert not any(isinstance(_owner(l.keys), mmap.mmap) for l in roomy.layers)  # its own, writable arrays
    assert all(l.keys.base.flags.writeable for l in roomy.layers)


@pytest.mark.parametrize("minor,digest", [(0, "sha256"), (1, "blake3"), (1, "sha256")])
def test_a_flipped_bit_is_refused_before_anything_is_handed_out(minor, digest):
    header = _header(PROMPT, llama_layers(2), minor=minor, digest=digest)
    data = bytearray(_bytes(header, make_rows(header, 4)))
    data[len(data) // 2] ^= 0x04
    with pytest.raises(KVPackError):
        read_buffer(bytes(data), spare_rows=9)


def _put(store: Store, ids, layers, seed=0) -> str:
    header = _header(ids, layers)
    return store.put(io.BytesIO(_bytes(header, make_rows(header, seed)))).entry.id


def test_store_load_and_find_resume_with_room(tmp_path):
    store = Store(tmp_path / "store")
    entry = _put(store, PROMPT, hybrid_layers())
    pack = store.load(entry, spare_rows=11)
    ref = store.load(entry)
    for spec, a, b in zip(pack.header.layers, pack.layers, ref.layers):
        assert np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values)
        if spec.kind == "full":
            assert a.keys.base.shape[1] == a.keys.shape[1] + 11
    hit = find_resume(store, FP_A, FP_B, PROMPT, dtype="bfloat16", spare_rows=11)
    assert hit is not None and hit.held == len(PROMPT) - 1
    full = [l for s, l in zip(pack.header.layers, hit.layers) if s.kind == "full"]
    assert all(l.keys.base.shape[1] >= l.keys.shape[1] + 11 for l in full)
    # a stored prefix that is continued (not a full hit) is read as without room
    part = find_resume(store, FP_A, FP_B, PROMPT + list(range(300, 320)), dtype="bfloat16", spare_rows=11)
    assert part is not None and part.held < len(PROMPT) + 19


def test_a_corrupt_entry_is_removed_with_room_asked(tmp_path):
    store = Store(tmp_path / "store")
    entry = _put(store, PROMPT, llama_layers(2), seed=5)
    path = store.pack_path(entry)
    data = bytearray(path.read_bytes())
    data[-200] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptEntry):
        store.load(entry, spare_rows=3)
    assert not path.exists()


def test_the_torch_engine_adopts_a_stored_layer_and_decodes_the_same_tokens(tiny_llama, tmp_path):
    """The rows with room are what the engine's install takes without a copy (its own
    ``_adoptable`` check), and decoding from them gives the tokens of a copying install."""
    pytest.importorskip("torch")
    from muser_cli.engines.registry import get_engine
    from muser_cli.engines.torch.arrays import adoptable as _adoptable
    from muser_cli.schedule import build_header

    eng = get_engine("torch", tiny_llama, dtype="float32", threads=1)
    ids = list(range(5, 5 + 37))
    layers = eng.prefill(ids[:-1], chunk_tokens=8)
    header = build_header(tiny_llama, ids, dtype="float32", chunk_tokens=8, engine="torch", threads=1)
    store = Store(tmp_path / "store")
    buf = io.BytesIO()
    write_pack(buf, header, layers, codec="none")
    store.put(io.BytesIO(buf.getvalue()))
    n = 6
    hit = find_resume(store, tiny_llama.fingerprint, tiny_llama.tokenizer_fingerprint, ids, dtype="float32",
                      spare_rows=n + 1)
    assert hit is not None and hit.held == len(ids) - 1
    import torch

    rows = len(ids) - 1
    assert all(_adoptable(l.keys, rows + n + 1, torch.float32) is not None for l in hit.layers)
    adopted = eng.decode(hit.layers, rows=rows, next_tokens=[ids[-1]], max_new_tokens=n, adopt=True)
    copied = eng.decode(store.load(hit.entry).layers, rows=rows, next_tokens=[ids[-1]], max_new_tokens=n)
    assert adopted.token_ids == copied.token_ids and len(adopted.token_ids) == n
