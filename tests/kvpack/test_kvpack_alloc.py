"""kvpack.alloc: a pack's destination arrays carved out of one allocation behave as arrays
of their own (independent, writable, aligned, each the base of its views), and the
readers hand out such arrays for layers they assemble."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest

from kvpack_factory import FP_A, FP_B, llama_layers, make_rows
from muser_cli.kvpack import PackHeader, read_buffer, read_pack, write_pack
from muser_cli.kvpack.alloc import ALIGN_BYTES, slab_arrays


@pytest.mark.parametrize("dtype", ["<u2", "<f2", "<f4"])
def test_carved_arrays_are_independent_aligned_and_writable(dtype):
    shapes = [(3, 5, 64), (3, 5, 64), (2, 0, 8), (1, 7, 3), (4, 1, 1)]
    arrays = slab_arrays(shapes, dtype)
    assert [a.shape for a in arrays] == shapes
    for i, a in enumerate(arrays):
        assert a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
        if a.size:
            assert a.ctypes.data % ALIGN_BYTES == 0
        a[...] = i + 1
    for i, a in enumerate(arrays):  # nothing written to one array reached another
        assert (a == i + 1).all()
    nonempty = [a for a in arrays if a.size]
    for a in nonempty:
        for b in nonempty:
            if a is not b:
                assert not np.shares_memory(a, b)


def test_a_view_of_leading_rows_has_the_whole_array_as_base():
    (k,) = slab_arrays([(2, 10, 4)], "<u2")
    lead = k[:, :6]
    assert lead.base is k and lead.base.shape == (2, 10, 4) and lead.strides == k.strides


def test_the_slab_outlives_the_call_as_long_as_an_array_does():
    a = slab_arrays([(1, 1024, 64), (1, 1024, 64)], "<f4")[1]
    a[...] = 7.0
    junk = [np.full(1 << 16, 1.0) for _ in range(8)]  # reuse of freed memory would show here
    del junk
    assert (a == 7.0).all()


def _pack(header: PackHeader, rows) -> bytes:
    buf = io.BytesIO()
    write_pack(buf, header, rows)
    return buf.getvalue()


def _header(layers, chunk: int) -> PackHeader:
    return replace(PackHeader(FP_A, FP_B, tuple(range(10, 51)), layers, "bfloat16", chunk, model_name="synthetic",
                              architecture="test"), minor=1, digest="blake3")


@pytest.mark.parametrize("use_mmap", [True, False])
def test_layers_assembled_from_several_frames_are_in_one_allocation(tmp_path, use_mmap):
    header = _header(llama_layers(4), chunk=8)  # 40 rows: five frames a layer
    rows = make_rows(header, 5)
    path = tmp_path / "p.kvpack"
    path.write_bytes(_pack(header, rows))
    with open(path, "rb") as f:
        pack = read_pack(f, use_mmap=use_mmap)
    for got, want in zip(pack.layers, rows):
        assert np.array_equal(got.keys, want.keys) and np.array_equal(got.values, want.values)
    arrays = [a for l in pack.layers for a in (l.keys, l.values) if a.size]
    lo = min(a.ctypes.data for a in arrays)
    hi = max(a.ctypes.data + a.nbytes for a in arrays)
    slack = ALIGN_BYTES * (len(arrays) + 1)
    assert hi - lo <= sum(a.nbytes for a in arrays) + slack  # back to back: one block
    assert all(a.flags.writeable for a in arrays)  # arrays of the reader's own, not the file


def test_a_roomy_read_still_leads_a_block_with_the_room(tmp_path):
    header = _header(llama_layers(3), chunk=8)
    pack = read_buffer(_pack(header, make_rows(header, 2)), spare_rows=9)
    for l in pack.layers:
        assert l.keys.base.shape[1] == l.keys.shape[1] + 9 and l.values.base.shape[1] == l.values.shape[1] + 9
