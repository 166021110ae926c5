"""Deterministic rows for the golden kvpack files (no RNG library dependence: integer hash)."""

from __future__ import annotations

import numpy as np

from muser_cli.kvpack import LayerKV, LayerSpec, PackHeader, RopeSpec

CASES = ("full-rope", "sliding-rope", "full-nope")
FP_MODEL = "sha256:" + "6d" * 32
FP_TOK = "sha256:" + "74" * 32


def golden_header(layer_class: str) -> PackHeader:
    if layer_class == "full-rope":
        layers = (LayerSpec("full", 2, 8, 8, rope=RopeSpec(100000.0, 8)),) * 2
    elif layer_class == "sliding-rope":
        layers = (LayerSpec("sliding", 2, 8, 8, window=6, rope=RopeSpec(10000.0, 8)),) * 2
    else:
        layers = (LayerSpec("full", 1, 8, 8, rope=None),) * 2
    return PackHeader(FP_MODEL, FP_TOK, tuple(range(100, 121)), layers, "bfloat16", 8,
                      model_name="golden", architecture=layer_class,
                      producer={"engine": "golden", "threads": 1, "muser": "0.1.0"})


def golden_rows(header: PackHeader) -> list[LayerKV]:
    out = []
    for i, spec in enumerate(header.layers):
        first = header.layer_first_row(i)
        rows = header.layer_rows(i)

        def block(salt: int, dim: int) -> np.ndarray:
            h, t, d = np.meshgrid(np.arange(spec.kv_heads), np.arange(first, first + rows), np.arange(dim), indexing="ij")
            x = ((h * 7919 + t * 104729 + d * 1299709 + i * 15485863 + salt) % 2001 - 1000) / 250.0
            f = x.astype(np.float32)
            return (f.view(np.uint32) >> 16).astype(np.uint16)  # exact bf16 (values chosen representable)

        out.append(LayerKV(block(1, spec.head_dim), block(2, spec.v_head_dim), first))
    return out
