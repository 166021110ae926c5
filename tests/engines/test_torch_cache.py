"""The sized cache (muser_cli/engines/torch/cache.py) computes what transformers' own
growing DynamicCache computes, bit for bit, and adopts a streamed pack's arrays without a copy."""

from __future__ import annotations

import io

import numpy as np
import pytest

from muser_cli.engines.torch.engine import TorchEngine
from muser_cli.kvpack import write_pack
from muser_cli.kvpack.layers import LayerKV
from muser_cli.kvpack.stream import StreamedPack
from muser_cli.schedule import build_header
from muser_cli.model.tokens import encode_prompt

PROMPT = ("A sized cache writes each new row in place; transformers' own cache concatenates. "
          "Both must hand attention the same numbers, so the tokens agree bit for bit. ") * 2
CHUNK = 16
NEW = 12


def _pair(info, dtype):
    sized = TorchEngine(info, dtype=dtype, threads=1)
    grown = TorchEngine(info, dtype=dtype, threads=1)
    grown.sized_cache = False
    grown.model = sized.model  # the same weights: only the cache differs
    return sized, grown


def _same_layers(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.first_row == y.first_row
        assert np.array_equal(x.keys, y.keys) and np.array_equal(x.values, y.values)


@pytest.mark.parametrize("model,dtype", [("tiny_llama", "float32"), ("tiny_llama", "bfloat16"),
                                         ("tiny_hybrid", "float32")])
def test_sized_equals_growing_bit_for_bit(request, model, dtype):
    info = request.getfixturevalue(model)
    sized, grown = _pair(info, dtype)
    ids = encode_prompt(info, PROMPT)
    rows = len(ids) - 1
    layers_s = sized.prefill(ids[:-1], chunk_tokens=CHUNK)
    layers_g = grown.prefill(ids[:-1], chunk_tokens=CHUNK)
    _same_layers(layers_s, layers_g)  # the producer's bytes do not change

    out_s = sized.decode(layers_s, rows=rows, next_tokens=ids[-1:], max_new_tokens=NEW, stop_on_eos=False)
    out_g = grown.decode(layers_g, rows=rows, next_tokens=ids[-1:], max_new_tokens=NEW, stop_on_eos=False)
    assert out_s.token_ids == out_g.token_ids
    ref = grown.generate_reference(ids[:-1], ids[-1:], NEW, chunk_tokens=CHUNK, stop_on_eos=False)
    assert out_s.token_ids == ref.token_ids

    feed = ids[-1:] + out_s.token_ids[:4]
    assert np.array_equal(sized.step_logits(layers_s, rows=rows, next_tokens=feed),
                          grown.step_logits(layers_g, rows=rows, next_tokens=feed))
    _same_layers(sized.recompute(layers_s[:], rows=rows, token_ids=feed),
                 grown.recompute(layers_g, rows=rows, token_ids=feed))
    half = (rows // 2 // CHUNK) * CHUNK
    head = grown.prefill(ids[:half], chunk_tokens=CHUNK)
    _same_layers(sized.prefill_from(head, rows=half, token_ids=ids[half:-1], chunk_tokens=CHUNK), layers_g)


def test_sized_layer_grows_past_its_capacity(tiny_llama):
    """A caller that writes past the room it asked for gets a larger buffer, same numbers."""
    from muser_cli.engines.torch.cache import sized_cache

    sized, grown = _pair(tiny_llama, "float32")
    ids = encode_prompt(tiny_llama, PROMPT)
    small = sized_cache(sized.model.config, 3)
    with sized._session():
        for begin in range(0, len(ids), 7):
            sized._forward(ids[begin : begin + 7], begin, small, keep=1)
        got = sized._extract(small, len(ids))
    assert small.layers[0].capacity >= len(ids)
    _same_layers(got, grown.prefill(ids, chunk_tokens=7))


def _streamed(info, dtype, layers, ids, spare):
    header = build_header(info, ids, dtype=dtype, chunk_tokens=CHUNK, engine="torch", threads=1)
    buf = io.BytesIO()
    write_pack(buf, header, layers)
    stream = StreamedPack(io.BytesIO(buf.getvalue()), spare_rows=spare)
    return stream.result()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_rows_are_adopted_without_a_copy(tiny_llama, dtype):
    sized, grown = _pair(tiny_llama, dtype)
    ids = encode_prompt(tiny_llama, PROMPT)
    rows = len(ids) - 1
    layers = sized.prefill(ids[:-1], chunk_tokens=CHUNK)
    pack = _streamed(tiny_llama, dtype, layers, ids, NEW + 1)
    before = [(kv.keys.copy(), kv.values.copy()) for kv in pack.layers]
    with sized._session():
        cache = sized._install(pack.layers, rows, extra=1 + NEW, adopt=True)
    for kv, layer in zip(pack.layers, cache.layers):
        assert layer.keys.data_ptr() == kv.keys.__array_interface__["data"][0]  # the same memory
        assert layer.capacity >= rows + 1 + NEW
    out = sized.decode(pack.layers, rows=rows, next_tokens=ids[-1:], max_new_tokens=NEW, stop_on_eos=False,
                       adopt=True)
    ref = grown.generate_reference(ids[:-1], ids[-1:], NEW, chunk_tokens=CHUNK, stop_on_eos=False)
    assert out.token_ids == ref.token_ids
    for kv, (k, v) in zip(pack.layers, before):  # the verified rows are never written
        assert np.array_equal(kv.keys, k) and np.array_equal(kv.values, v)


def test_no_adoption_without_room_or_in_another_dtype(tiny_llama):
    sized, _ = _pair(tiny_llama, "float32")
    ids = encode_prompt(tiny_llama, PROMPT)
    rows = len(ids) - 1
    layers = sized.prefill(ids[:-1], chunk_tokens=CHUNK)
    tight = _streamed(tiny_llama, "float32", layers, ids, 0)  # no spare room: copied
    with sized._session():
        cache = sized._install(tight.layers, rows, extra=4, adopt=True)
    assert cache.layers[0].keys.data_ptr() != tight.layers[0].keys.__array_interface__["data"][0]
    roomy = _streamed(tiny_llama, "float32", layers, ids, 8)
    with sized._session():
        cache = sized._install(roomy.layers, rows, extra=4, adopt=False)  # not given up: copied
    assert cache.layers[0].keys.data_ptr() != roomy.layers[0].keys.__array_interface__["data"][0]
    other = [LayerKV(keys=np.ascontiguousarray(kv.keys), values=kv.values, first_row=kv.first_row)
             for kv in roomy.layers]
    with sized._session():
        cache = sized._install(other, rows, extra=4, adopt=True)  # keys not a view: copied
    assert cache.layers[0].keys.data_ptr() != other[0].keys.__array_interface__["data"][0]


def test_rows_of_another_dtype_and_readonly_views_install_alike(tiny_llama):
    """float32 rows into a bfloat16 engine (cast on the one copy), read-only strided views
    (a memory-mapped pack cut to a prefix): the same numbers as transformers' own path."""
    sized, grown = _pair(tiny_llama, "bfloat16")
    f32 = TorchEngine(tiny_llama, dtype="float32", threads=1)
    ids = encode_prompt(tiny_llama, PROMPT)
    rows = len(ids) - 1
    layers = f32.prefill(ids[:-1], chunk_tokens=CHUNK)
    feed = ids[-1:]
    assert np.array_equal(sized.step_logits(layers, rows=rows, next_tokens=feed),
                          grown.step_logits(layers, rows=rows, next_tokens=feed))
    cut = rows - 5
    views = []
    for kv in layers:
        k, v = kv.keys.copy(), kv.values.copy()
        k.flags.writeable = v.flags.writeable = False
        views.append(LayerKV(keys=k[:, :cut], values=v[:, :cut], first_row=0))
    assert not views[0].keys.flags.c_contiguous
    _same_layers(sized.recompute(views, rows=cut, token_ids=ids[cut:rows]),
                 grown.recompute(views, rows=cut, token_ids=ids[cut:rows]))
