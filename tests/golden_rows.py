"""Deterministic rows for the golden kvpack files (no RNG library dependence: integer hash)."""

from __future__ import annotations

import numpy as np

from muser_cli.kvpack import LayerKV, LayerSpec, PackHeader, RopeSpec
from muser_cli.kvpack.layers import StateKV, chunked_spec, latent_spec, state_spec

CASES = ("full-rope", "sliding-rope", "full-nope")
CASES_V1_3 = ("latent-rope", "hybrid-state")  # kvpack 1.3's layer kinds
CASES_V1_4 = ("chunked-rope",)  # kvpack 1.4's chunked kind
FP_MODEL = "sha256:" + "6d" * 32
FP_TOK = "sha256:" + "74" * 32


def golden_header(layer_class: str) -> PackHeader:
    if layer_class == "full-rope":
        layers = (LayerSpec("full", 2, 8, 8, rope=RopeSpec(100000.0, 8)),) * 2
    elif layer_class == "sliding-rope":
        layers = (LayerSpec("sliding", 2, 8, 8, window=6, rope=RopeSpec(10000.0, 8)),) * 2
    elif layer_class == "latent-rope":  # MLA: latent rank 16 + a shared rope key of 8, RoPE interleaved
        layers = (latent_spec(16, 8, RopeSpec(10000.0, 8, "interleaved")),) * 2
    elif layer_class == "hybrid-state":  # a recurrent layer (bf16 conv window, f32 state) then a full one
        layers = (state_spec("gated_delta_net", [("conv", (12, 4), "bfloat16"), ("recurrent", (2, 4, 4), "float32")]),
                  LayerSpec("full", 1, 8, 8, rope=RopeSpec(10000.0, 8)))
    elif layer_class == "chunked-rope":  # Llama 4's pattern: chunked-local attention with RoPE, then a full NoPE layer
        layers = (chunked_spec(2, 8, 8, 5, RopeSpec(500000.0, 8)), LayerSpec("full", 1, 8, 8, rope=None))
    else:
        layers = (LayerSpec("full", 1, 8, 8, rope=None),) * 2
    return PackHeader(FP_MODEL, FP_TOK, tuple(range(100, 121)), layers, "bfloat16", 8,
                      model_name="golden", architecture=layer_class,
                      producer={"engine": "golden", "threads": 1, "muser": "0.1.0"})


def _values(shape: tuple[int, ...], salt: int) -> np.ndarray:
    """Deterministic float32 values, each exactly representable in bf16."""
    n = np.arange(int(np.prod(shape)), dtype=np.int64)
    x = ((n * 1299709 + salt * 15485863) % 2001 - 1000) / 250.0
    return x.astype(np.float32).reshape(shape)


def golden_state(header: PackHeader, i: int) -> StateKV:
    """A state layer's snapshots at every chunk end its frames need (position-dependent)."""
    spec = header.layers[i]
    snaps = {}
    for layer, start, count in header.frame_plan():
        if layer != i:
            continue
        pos = start + count
        snap = {}
        for j, t in enumerate(spec.tensors):
            f = _values(t.shape, pos * 31 + j * 7 + i)
            snap[t.name] = f if t.dtype == "float32" else (f.view(np.uint32) >> 16).astype(np.uint16)
        snaps[pos] = snap
    end = header.rows_end
    return StateKV(tensors=snaps.get(end, {}), position=end, first_row=header.layer_first_row(i), earlier=snaps)


def golden_rows(header: PackHeader) -> list:
    out: list = []
    for i, spec in enumerate(header.layers):
        if spec.kind == "state":
            out.append(golden_state(header, i))
            continue
        first = header.layer_first_row(i)
        rows = header.layer_rows(i)

        def block(salt: int, dim: int) -> np.ndarray:
            h, t, d = np.meshgrid(np.arange(spec.kv_heads), np.arange(first, first + rows), np.arange(dim), indexing="ij")
            x = ((h * 7919 + t * 104729 + d * 1299709 + i * 15485863 + salt) % 2001 - 1000) / 250.0
            f = x.astype(np.float32)
            return (f.view(np.uint32) >> 16).astype(np.uint16)  # exact bf16 (values chosen representable)

        out.append(LayerKV(block(1, spec.head_dim), block(2, spec.v_head_dim), first))
    return out
