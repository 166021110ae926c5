"""The paged-cache -> logical-rows conversion (muser_cli.engines.vllm.gather), on CPU.

Round trips: logical rows -> scattered into a paged cache the way vLLM lays it out
(written here position by position, independently of the code under test) with a random
block table -> gather_paged_kv recovers them bit for bit.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from muser_cli.engines.vllm import fp8 as F
from muser_cli.engines.vllm import gather as L
from muser_cli.engines.vllm import layouts as LY
from muser_cli.errors import ConfigError, DataError

# vLLM 0.30-0.33 KVCacheLayout members: stride order over the logical [L, B, H, N, C].
VLLM_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
# Older layouts: name -> logical shape builder (blocks, heads, tokens, dim).
LEGACY = {
    "KBNHD": lambda B, H, N, D: (2, B, N, H, D),
    "KBHND": lambda B, H, N, D: (2, B, H, N, D),
    "BKNHD": lambda B, H, N, D: (B, 2, N, H, D),
    "BKHND": lambda B, H, N, D: (B, 2, H, N, D),
}


def rows(rng, heads, n, dim, dtype):
    if dtype == np.uint16:  # bfloat16 bits
        return rng.integers(0, 1 << 16, (heads, n, dim), dtype=np.uint16)
    if dtype == np.uint8:  # fp8 bits, avoiding NaN codes of every format
        r = rng.integers(0, 0x78, (heads, n, dim), dtype=np.uint8)
        return r | (rng.integers(0, 2, r.shape, dtype=np.uint8) << 7)
    return rng.standard_normal((heads, n, dim)).astype(dtype)


def table_for(rng, n_tokens, block_size, num_blocks):
    need = -(-n_tokens // block_size)
    return [int(b) for b in rng.permutation(np.arange(1, num_blocks))[:need]]  # block 0 = null


def vllm_cache(order, num_layers, layer, B, H, N, C, dtype):
    """A per-layer BHNC view of a vLLM-style 5D allocation in physical ``order``."""
    logical = (num_layers, B, H, N, C)
    phys = np.zeros(tuple(logical[i] for i in order), dtype=dtype)
    view5 = phys.transpose(np.argsort(order))
    assert view5.shape == logical and np.shares_memory(view5, phys)
    return view5[layer]


def put_bhnc(cache, table, keys, values, *, start=0, block_size=None, ks=None, vs=None):
    """vLLM's reshape_and_cache, one position at a time (kernel-block aware)."""
    N = cache.shape[2]
    bs = block_size or N
    hd = keys.shape[2]
    for i in range(keys.shape[1]):
        p = start + i
        kb = table[p // bs] * (bs // N) + (p % bs) // N
        off = p % N
        if ks is None:
            cache[kb, :, off, :hd] = keys[:, i]
            cache[kb, :, off, hd:] = values[:, i]
        else:  # fp8_per_token_head cell: K | k_scale f32 | V | v_scale f32
            cell = np.concatenate(
                [keys[:, i], ks[:, i : i + 1].astype("<f4").view(np.uint8),
                 values[:, i], vs[:, i : i + 1].astype("<f4").view(np.uint8)], axis=1)
            cache[kb, :, off, :] = cell


def filled(rng, layout, num_layers, layer, B, H, T, N, D, dtype, *, Dv=None, table_blocks=None, bs=None):
    """``T`` random rows (K of ``D``, V of ``Dv`` dims) written as vLLM writes them into one
    layer's view of a ``layout`` allocation, under a random table of ``bs``-token blocks
    (default ``N``) over ``table_blocks`` (default ``B``): (cache, table, keys, values)."""
    Dv = D if Dv is None else Dv
    k, v = rows(rng, H, T, D, dtype), rows(rng, H, T, Dv, dtype)
    cache = vllm_cache(VLLM_LAYOUTS[layout], num_layers, layer, B, H, N, D + Dv, dtype)
    table = table_for(rng, T, bs or N, table_blocks or B)
    put_bhnc(cache, table, k, v, block_size=bs)
    return cache, table, k, v


def put_legacy(cache, name, table, keys, values):
    N = cache.shape[{"KBNHD": 2, "KBHND": 3, "BKNHD": 2, "BKHND": 3}[name]]
    for i in range(keys.shape[1]):
        b, off = table[i // N], i % N
        for side, src in ((0, keys), (1, values)):
            for h in range(keys.shape[0]):
                if name == "KBNHD":
                    cache[side, b, off, h] = src[h, i]
                elif name == "KBHND":
                    cache[side, b, h, off] = src[h, i]
                elif name == "BKNHD":
                    cache[b, side, off, h] = src[h, i]
                else:
                    cache[b, side, h, off] = src[h, i]


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout", sorted(VLLM_LAYOUTS))
@pytest.mark.parametrize("block_size", [16, 32])
def test_vllm_layouts_round_trip(layout, block_size):
    rng = np.random.default_rng(hash((layout, block_size)) % 2**32)
    H, D, T, num_blocks = 2, 8, 3 * block_size + 5, 9  # partial last block
    cache, table, k, v = filled(rng, layout, 3, 1, num_blocks, H, T, block_size, D, np.uint16)
    got = L.gather_paged_kv(cache, table, start=0, stop=T)
    assert got.dtype == "bfloat16" and got.first_row == 0 and got.rows == T
    assert got.keys.shape == (H, T, D) and got.keys.flags.c_contiguous
    np.testing.assert_array_equal(got.keys, k)
    np.testing.assert_array_equal(got.values, v)
    # A sub-range that starts and ends mid-block.
    got = L.gather_paged_kv(cache, table, start=block_size - 3, stop=T - 2)
    np.testing.assert_array_equal(got.keys, k[:, block_size - 3 : T - 2])
    np.testing.assert_array_equal(got.values, v[:, block_size - 3 : T - 2])


@pytest.mark.parametrize("dtype,name", [(np.float16, "float16"), (np.float32, "float32"), (np.uint16, "bfloat16")])
def test_storage_dtypes_and_unequal_v_head_dim(dtype, name):
    rng = np.random.default_rng(1)
    H, D, Dv, T, bs = 3, 16, 8, 40, 16
    cache, table, k, v = filled(rng, "LBNHC", 1, 0, 6, H, T, bs, D, dtype, Dv=Dv)
    got = L.gather_paged_kv(cache, table, start=0, stop=T, head_dim=D, v_head_dim=Dv)
    assert got.dtype == name and got.keys.dtype == dtype
    np.testing.assert_array_equal(got.keys, k)
    np.testing.assert_array_equal(got.values, v)


@pytest.mark.parametrize("name", sorted(LEGACY))
@pytest.mark.parametrize("block_size", [16, 32])
def test_legacy_layouts_round_trip(name, block_size):
    rng = np.random.default_rng(7)
    H, D, T, B = 2, 4, 2 * block_size + 1, 5
    k, v = rows(rng, H, T, D, np.float16), rows(rng, H, T, D, np.float16)
    cache = np.zeros(LEGACY[name](B, H, block_size, D), dtype=np.float16)
    table = table_for(rng, T, block_size, B)
    put_legacy(cache, name, table, k, v)
    got = L.gather_paged_kv(cache, table, start=0, stop=T, layout=name)
    np.testing.assert_array_equal(got.keys, k)
    np.testing.assert_array_equal(got.values, v)
    # scatter_rows is the inverse too (tests and simulations use it).
    again = np.zeros_like(cache)
    L.scatter_rows(again, table, k, v, layout=name)
    np.testing.assert_array_equal(again, cache)


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_kernel_blocks_inside_manager_blocks(layout):
    """vLLM may split a 32-token manager block into two 16-token kernel blocks."""
    rng = np.random.default_rng(3)
    H, D, T, manager_bs, kernel_bs, num_blocks = 2, 8, 75, 32, 16, 5
    cache, table, k, v = filled(rng, layout, 2, 0, num_blocks * 2, H, T, kernel_bs, D, np.uint16,
                                table_blocks=num_blocks, bs=manager_bs)
    got = L.gather_paged_kv(cache, table, start=0, stop=T, block_size=manager_bs)
    np.testing.assert_array_equal(got.keys, k)
    np.testing.assert_array_equal(got.values, v)
    with pytest.raises(DataError, match="not a multiple"):
        L.gather_paged_kv(cache, table, start=0, stop=T, block_size=24)


@pytest.mark.parametrize("block_size", [16, 32])
def test_sliding_window_with_null_blocks(block_size):
    """Blocks wholly before the window are the null block (id 0); the window is exact."""
    rng = np.random.default_rng(block_size)
    H, D, T, window, num_blocks = 2, 8, 5 * block_size + 3, block_size + 4, 12
    cache, table, k, v = filled(rng, "LBHNC", 1, 0, num_blocks, H, T, block_size, D, np.uint16)
    first, stop = L.layer_rows_for("sliding", window, T)
    assert (first, stop) == (T - window + 1, T)
    nulled = [0 if (j + 1) * block_size <= first else b for j, b in enumerate(table)]
    assert nulled.count(0) >= 3
    got = L.gather_paged_kv(cache, nulled, start=first, stop=stop)
    assert got.first_row == first and got.rows == window - 1
    np.testing.assert_array_equal(got.keys, k[:, first:])
    np.testing.assert_array_equal(got.values, v[:, first:])
    with pytest.raises(DataError, match="null block"):
        L.gather_paged_kv(cache, nulled, start=first - block_size, stop=stop)
    # Null blocks may repeat in a table; used blocks may not.
    assert L.layer_rows_for("sliding", window, 5) == (0, 5)
    assert L.layer_rows_for("full", None, 9) == (0, 9)


# ---------------------------------------------------------------------------- fp8


def test_fp8_tables_match_torch():
    torch = pytest.importorskip("torch")
    codes = torch.arange(256, dtype=torch.uint8)
    for fmt, tdt in (("e4m3fn", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2), ("e4m3fnuz", torch.float8_e4m3fnuz)):
        want = codes.view(tdt).float().numpy()
        got = F.fp8_table(fmt)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=fmt)
        ok = ~np.isnan(want)
        np.testing.assert_array_equal(got[ok], want[ok], err_msg=fmt)


@pytest.mark.parametrize("scale_kind", ["per_tensor", "per_head"])
def test_fp8_with_scales(scale_kind):
    rng = np.random.default_rng(5)
    H, D, T, bs = 4, 16, 50, 16
    cache, table, k, v = filled(rng, "LBNHC", 1, 0, 8, H, T, bs, D, np.uint8)
    ks = np.float32(0.37) if scale_kind == "per_tensor" else rng.uniform(0.1, 2, H).astype(np.float32)
    vs = np.array([0.5], np.float32) if scale_kind == "per_tensor" else rng.uniform(0.1, 2, H).astype(np.float32)
    got = L.gather_paged_kv(cache, table, start=0, stop=T, quant="fp8", k_scale=ks, v_scale=vs)
    assert got.dtype == "fp8" and got.fp8_format == "e4m3fn" and got.keys.dtype == np.uint8
    np.testing.assert_array_equal(got.keys, k)
    np.testing.assert_array_equal(got.values, v)
    lut = F.fp8_table("e4m3fn")
    sk = np.asarray(ks).reshape(-1, 1, 1) if scale_kind == "per_head" else np.float32(ks)
    np.testing.assert_array_equal(F.dequantize_fp8(got.keys, got.k_scale), (lut[k] * sk).astype(np.float32))
    assert got.v_scale.shape == (() if scale_kind == "per_tensor" else (H,))
    with pytest.raises(DataError, match="k_scale"):
        L.gather_paged_kv(cache, table, start=0, stop=T, quant="fp8", k_scale=np.ones(H + 1), v_scale=vs)
    with pytest.raises(DataError, match="k_scale"):
        L.gather_paged_kv(cache, table, start=0, stop=T, quant="fp8", k_scale=None, v_scale=vs)
    with pytest.raises(DataError, match="positive"):
        L.gather_paged_kv(cache, table, start=0, stop=T, quant="fp8", k_scale=np.float32(0), v_scale=vs)
    with pytest.raises(DataError, match="does not fit quant"):
        L.gather_paged_kv(cache, table, start=0, stop=T)


def test_fp8_per_token_head_inline_scales():
    rng = np.random.default_rng(6)
    H, D, T, bs = 2, 8, 37, 16
    k, v = rows(rng, H, T, D, np.uint8), rows(rng, H, T, D, np.uint8)
    ks, vs = rng.uniform(0.01, 3, (H, T)).astype(np.float32), rng.uniform(0.01, 3, (H, T)).astype(np.float32)
    cache = vllm_cache(VLLM_LAYOUTS["LBHNC"], 1, 0, 5, H, bs, 2 * (D + 4), np.uint8)
    table = table_for(rng, T, bs, 5)
    put_bhnc(cache, table, k, v, ks=ks, vs=vs)
    got = L.gather_paged_kv(cache, table, start=0, stop=T, quant="fp8_per_token_head")
    np.testing.assert_array_equal(got.keys, k)
    np.testing.assert_array_equal(got.values, v)
    np.testing.assert_array_equal(got.k_scale, ks)
    np.testing.assert_array_equal(got.v_scale, vs)
    deq = F.dequantize_fp8(got.values, got.v_scale, "e4m3fn")
    np.testing.assert_array_equal(deq, (F.fp8_table("e4m3fn")[v] * vs[:, :, None]).astype(np.float32))
    with pytest.raises(DataError, match="only in the 'BHNC'"):
        L.gather_paged_kv(np.zeros((2, 5, 16, H, D), np.uint8), table, start=0, stop=T, layout="KBNHD",
                          quant="fp8_per_token_head")


def test_dequantize_rejects_nan_and_bad_scale():
    nan_code = np.full((1, 1, 1), 0x7F, np.uint8)  # e4m3fn NaN
    with pytest.raises(DataError, match="NaN"):
        F.dequantize_fp8(nan_code, 1.0)
    with pytest.raises(DataError, match="scale shape"):
        F.dequantize_fp8(np.zeros((2, 3, 4), np.uint8), np.ones(3))


# ---------------------------------------------------------------------------- torch, slots


def test_torch_tensors_by_duck_typing():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    H, D, T, bs = 2, 8, 33, 16
    cache, table, k, v = filled(rng, "LBNHC", 1, 0, 6, H, T, bs, D, np.uint16)
    # A strided torch view of an LBNHC allocation, as vLLM hands it over.
    phys = torch.from_numpy(np.ascontiguousarray(cache.transpose(0, 2, 1, 3)).view(np.int16))  # (B, N, H, C)
    tcache = phys.view(torch.bfloat16).permute(0, 2, 1, 3)
    assert not tcache.is_contiguous()
    ttable = torch.tensor(table, dtype=torch.int32)
    got = L.gather_paged_kv(tcache, ttable, start=0, stop=T)
    assert got.dtype == "bfloat16" and got.keys.dtype == np.uint16
    np.testing.assert_array_equal(got.keys, k)
    np.testing.assert_array_equal(got.values, v)
    f8 = torch.from_numpy(rows(rng, 6, 2 * bs, 2 * D, np.uint8).reshape(6, 2, bs, 2 * D)).view(torch.float8_e4m3fn)
    got = L.gather_paged_kv(f8, table, start=0, stop=T, quant="fp8", k_scale=torch.tensor(1.0), v_scale=torch.ones(2))
    np.testing.assert_array_equal(got.keys[:, 0], f8.view(torch.uint8)[table[0], :, 0, :D].numpy())
    assert got.keys.dtype == np.uint8


def test_gather_by_slot_mapping():
    rng = np.random.default_rng(9)
    H, D, T, bs = 2, 4, 45, 16
    cache, table, k, v = filled(rng, "BHLNC", 2, 1, 7, H, T, bs, D, np.float32)
    slots = [table[p // bs] * bs + p % bs for p in range(T)]
    got = L.gather_slots(cache, slots[20:])
    np.testing.assert_array_equal(got.keys, k[:, 20:])
    np.testing.assert_array_equal(got.values, v[:, 20:])
    with pytest.raises(DataError, match="negative"):
        L.gather_slots(cache, [-1] + slots[1:])  # vLLM's PAD_SLOT_ID
    with pytest.raises(DataError, match="consecutive"):
        L.gather_slots(cache, slots[:3] + [slots[5]])


# ---------------------------------------------------------------------------- validation


def _bad(match, cache, table, **kw):
    kw.setdefault("start", 0)
    kw.setdefault("stop", 20)
    with pytest.raises(DataError, match=match) as info:
        L.gather_paged_kv(cache, table, **kw)
    assert "\n" not in str(info.value) and info.value.exit_status == 65


def test_strict_validation():
    cache = np.zeros((6, 2, 16, 16), np.uint16)
    _bad("holds 1 blocks", cache, [3])  # block table too short
    _bad(r"block id 6, outside \[0, 6\)", cache, [1, 6])
    _bad("block id -1", cache, [1, -1])
    _bad("more than once", cache, [2, 2])
    _bad("must hold integers", cache, [1.0, 2.0])
    _bad("one-dimensional", cache, [[1, 2]])
    _bad("not a valid range", cache, [1, 2], start=5, stop=3)
    _bad("needs a 4-d cache", np.zeros((6, 2, 16)), [1, 2])
    _bad("needs a 5-d cache", cache, [1, 2], layout="KBNHD")
    _bad("size 2 on axis 0", np.zeros((3, 6, 16, 2, 8), np.uint16), [1, 2], layout="KBNHD")
    _bad("content axis 16", cache, [1, 2], head_dim=10, v_head_dim=10)
    _bad("unknown layout", cache, [1, 2], layout="NHD")
    _bad("unknown quant", cache, [1, 2], quant="int4")
    _bad("not a KV storage dtype", np.zeros((6, 2, 16, 16), np.int64), [1, 2])
    _bad("numpy array or a torch tensor", [[0]], [1, 2])
    _bad("takes no external", cache, [1, 2], k_scale=1.0)
    _bad("holds head_dim 8", np.zeros((2, 6, 16, 2, 8), np.uint16), [1, 2], layout="KBNHD", head_dim=4)
    _bad("do not group", np.zeros((5, 2, 16, 16), np.uint16), [1, 2], block_size=32)
    _bad("empty axis", np.zeros((6, 0, 16, 16), np.uint16), [1, 2])
    # The null block check can be switched off (caches without a reserved null block).
    got = L.gather_paged_kv(cache, [0, 1], start=0, stop=20, null_block=None)
    assert got.rows == 20
    # Empty range: fine, zero rows.
    assert L.gather_paged_kv(cache, [], start=0, stop=0).rows == 0


def test_module_imports_nothing_heavy():
    code = (
        "import sys; import muser_cli.engines.vllm.gather, muser_cli.engines.vllm_connector, "
        "muser_cli.engines.vllm.engine, muser_cli.engines.vllm.connector, muser_cli.engines.vllm.engine, "
        "muser_cli.engines.vllm.layouts, muser_cli.engines.vllm.options; "
        "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- CPU_ATTN (vec)


def put_cpu_vec(cache, table, keys, values, *, block_size=None):
    """What vLLM's CPU ``vec`` kernel stores, one element at a time, from its description:
    per (block, head) ``block_size * D`` elements of K as ``[d][slot]``, then V as ``[slot][d]``."""
    for flat, kb, h, i, slot, d, N, D in cpu_elements(cache, table, keys.shape[1], block_size):
        flat[kb, h, d * N + slot] = keys[h, i, d]
        flat[kb, h, N * D + slot * D + d] = values[h, i, d]


def cpu_elements(cache, table, T, block_size=None):
    """Each element of ``T`` rows in a CPU_ATTN cache: (its block-and-head interior as one flat
    axis, kernel block, head, row, slot in the block, dim, block size N, head_dim D)."""
    B, H, N, C = cache.shape
    D = C // 2
    flat = cache.reshape(B, H, N * C)  # the dense (block, head) interior
    bs = block_size or N
    for i in range(T):
        kb = table[i // bs] * (bs // N) + (i % bs) // N
        for h in range(H):
            for d in range(D):
                yield flat, kb, h, i, i % N, d, N, D


@pytest.mark.parametrize("dtype", [np.uint16, np.float16, np.float32])
@pytest.mark.parametrize("block_size,kernel_split", [(32, 1), (128, 1), (64, 2)])
def test_cpu_vec_layout_round_trip(dtype, block_size, kernel_split):
    rng = np.random.default_rng(block_size + kernel_split)
    H, D, T = 3, 16, 2 * block_size + 7
    N = block_size // kernel_split
    num_blocks = 6
    cache = np.zeros((num_blocks * kernel_split, H, N, 2 * D), dtype=dtype)
    table = table_for(rng, T, block_size, num_blocks)
    k, v = rows(rng, H, T, D, dtype), rows(rng, H, T, D, dtype)
    cpu_round_trip("CPU_KT_V", put_cpu_vec, cache, table, k, v, block_size, part_side="keys")
    # The GPU view of the same bytes is wrong (what the connector read before it checked the backend).
    gpu = L.gather_paged_kv(cache, table, start=0, stop=T, layout="BHNC", block_size=block_size)
    assert not np.array_equal(gpu.keys, k)


def cpu_round_trip(layout, put, cache, table, k, v, block_size, *, part_side):
    """Rows written by the independent writer ``put`` read back whole and in part (``part_side``
    compared), and scatter_rows writing the same bytes as ``put``."""
    put(cache, table, k, v, block_size=block_size)
    got = L.gather_paged_kv(cache, table, start=0, stop=k.shape[1], layout=layout, block_size=block_size)
    np.testing.assert_array_equal(got.keys, k)
    np.testing.assert_array_equal(got.values, v)
    part = L.gather_paged_kv(cache, table, start=5, stop=block_size + 3, layout=layout, block_size=block_size)
    np.testing.assert_array_equal(getattr(part, part_side), {"keys": k, "values": v}[part_side][:, 5 : block_size + 3])
    again = np.zeros_like(cache)
    L.scatter_rows(again, table, k, v, layout=layout, block_size=block_size)
    np.testing.assert_array_equal(again, cache)


def test_cpu_vec_layout_refuses_what_it_cannot_read():
    cache = np.zeros((4, 2, 32, 16), np.uint16)
    with pytest.raises(DataError, match="head_dim == v_head_dim"):
        L.gather_paged_kv(cache, [1], start=0, stop=4, layout="CPU_KT_V", head_dim=6, v_head_dim=10)
    with pytest.raises(DataError, match="unquantized"):
        L.gather_paged_kv(np.zeros((4, 2, 32, 16), np.uint8), [1], start=0, stop=4, layout="CPU_KT_V",
                          quant="fp8", k_scale=1.0, v_scale=1.0)
    strided = np.zeros((4, 32, 2, 16), np.uint16).transpose(0, 2, 1, 3)  # LBNHC: interior not dense
    with pytest.raises(DataError, match="dense"):
        L.gather_paged_kv(strided, [1], start=0, stop=4, layout="CPU_KT_V")


def put_cpu_amx(cache, table, keys, values, *, block_size=None):
    """An independent writer of vLLM's AMX interior, element by element from the kernel's
    address arithmetic (cpu_attn_amx.hpp reshape_and_cache, bfloat16: 2 elements a 4-byte word):
    K at word ``(slot // 16) * 16 * (D / 2) + (d // 2) * 16 + slot % 16``, element ``d % 2``;
    V at ``(d // 16) * N * 16 + (slot // 2) * 32 + (d % 16) * 2 + slot % 2``."""
    for flat, kb, h, i, slot, d, N, D in cpu_elements(cache, table, keys.shape[1], block_size):
        word = (slot // 16) * 16 * (D // 2) + (d // 2) * 16 + slot % 16
        flat[kb, h, 2 * word + d % 2] = keys[h, i, d]
        flat[kb, h, N * D + (d // 16) * N * 16 + (slot // 2) * 32 + (d % 16) * 2 + slot % 2] = values[h, i, d]


@pytest.mark.parametrize("block_size,kernel_split,D", [(32, 1, 32), (128, 1, 16), (64, 2, 48)])
def test_cpu_amx_layout_round_trip(block_size, kernel_split, D):
    rng = np.random.default_rng(block_size + D)
    H, T = 2, 2 * block_size + 7
    N = block_size // kernel_split
    cache = np.zeros((6 * kernel_split, H, N, 2 * D), dtype=np.uint16)  # bfloat16 bits
    table = table_for(rng, T, block_size, 6)
    k, v = rows(rng, H, T, D, np.uint16), rows(rng, H, T, D, np.uint16)
    cpu_round_trip("CPU_AMX", put_cpu_amx, cache, table, k, v, block_size, part_side="values")
    # The vec reader on the same bytes is wrong (what a connector accepting 'amx' unchecked would read).
    vec = L.gather_paged_kv(cache, table, start=0, stop=T, layout="CPU_KT_V", block_size=block_size)
    assert not np.array_equal(vec.keys, k) and not np.array_equal(vec.values, v)


def test_cpu_amx_layout_refuses_what_it_cannot_read():
    with pytest.raises(DataError, match="bfloat16 only"):
        L.gather_paged_kv(np.zeros((4, 2, 32, 64), np.float32), [1], start=0, stop=4, layout="CPU_AMX")
    with pytest.raises(DataError, match="multiples of 16"):
        L.gather_paged_kv(np.zeros((4, 2, 32, 40), np.uint16), [1], start=0, stop=4, layout="CPU_AMX")
    with pytest.raises(DataError, match="unquantized"):
        L.gather_paged_kv(np.zeros((4, 2, 32, 64), np.uint8), [1], start=0, stop=4, layout="CPU_AMX",
                          quant="fp8", k_scale=1.0, v_scale=1.0)


def test_backends_are_resolved_or_refused():
    cpu = LY.resolve_layout("CPU_ATTN", cache_dtype="auto", block_size=128, kernel_block_size=128,
                            kv_cache_layout="LBHNC", isa="vec")
    assert cpu.layout == "CPU_KT_V" and cpu.verified == "kernel"
    assert cpu.record() == {"attention_backend": "CPU_ATTN", "layout": "CPU_KT_V", "block_size": 128,
                            "kernel_block_size": 128, "kv_cache_dtype": "auto", "kv_cache_layout": "LBHNC",
                            "isa": "vec"}
    assert LY.resolve_layout("CPU_ATTN", cache_dtype="auto", block_size=64, kernel_block_size=64,
                             isa="vec16").layout == "CPU_KT_V"
    for name in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"):
        got = LY.resolve_layout(name, cache_dtype="fp8", block_size=32, kernel_block_size=16, kv_cache_layout="LBNHC")
        assert got.layout == "BHNC" and got.verified == "source" and got.isa is None
    with pytest.raises(ConfigError, match="FLEX_ATTENTION .*not checked"):
        LY.resolve_layout("FLEX_ATTENTION", cache_dtype="auto", block_size=16, kernel_block_size=16)
    amx = LY.resolve_layout("CPU_ATTN", cache_dtype="auto", block_size=128, kernel_block_size=128,
                            kv_cache_layout="LBHNC", isa="amx")  # checked since session 7: its own reader
    assert amx.layout == "CPU_AMX" and amx.verified == "kernel" and amx.record()["isa"] == "amx"
    with pytest.raises(ConfigError, match="ISA 'neon'.*not checked"):
        LY.resolve_layout("CPU_ATTN", cache_dtype="auto", block_size=128, kernel_block_size=128, isa="neon")
    with pytest.raises(ConfigError, match="no kernel ISA"):
        LY.resolve_layout("CPU_ATTN", cache_dtype="auto", block_size=128, kernel_block_size=128)
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8' on backend CPU_ATTN"):
        LY.resolve_layout("CPU_ATTN", cache_dtype="fp8", block_size=128, kernel_block_size=128, isa="vec")
    with pytest.raises(ConfigError, match="layout LBNHC on backend CPU_ATTN"):
        LY.resolve_layout("CPU_ATTN", cache_dtype="auto", block_size=128, kernel_block_size=128,
                          kv_cache_layout="LBNHC", isa="vec")
    with pytest.raises(ConfigError, match="does not tell its attention backend"):
        LY.resolve_layout(None, cache_dtype="auto", block_size=16, kernel_block_size=16)
    rec = LY.producer_record({0: cpu, 1: cpu})
    assert rec == {"kv_layout": cpu.record()}
    other = LY.resolve_layout("CPU_ATTN", cache_dtype="auto", block_size=64, kernel_block_size=64, isa="vec")
    assert LY.producer_record({0: cpu, 1: other, 2: cpu})["kv_layouts"] == [
        {**cpu.record(), "layers": [0, 2]}, {**other.record(), "layers": [1]}]
