"""Synthetic packs for format tests (no model needed): random rows, real writer."""

from __future__ import annotations

import io

import numpy as np

from muser_cli.kvpack import LayerKV, LayerSpec, PackHeader, RopeSpec, write_pack

FP_A = "sha256:" + "a" * 64
FP_B = "sha256:" + "b" * 64


def hybrid_layers() -> tuple[LayerSpec, ...]:
    return (
        LayerSpec("sliding", 2, 16, 16, window=8, rope=RopeSpec(10000.0, 16)),
        LayerSpec("sliding", 2, 16, 16, window=8, rope=RopeSpec(10000.0, 16)),
        LayerSpec("full", 2, 16, 16, rope=None),
    )


def llama_layers(n: int = 3) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec("full", 2, 16, 16, rope=RopeSpec(100000.0, 16)) for _ in range(n))


def make_rows(header: PackHeader, seed: int = 0) -> list[LayerKV]:
    rng = np.random.default_rng(seed)
    out = []
    for i, spec in enumerate(header.layers):
        rows = header.layer_rows(i)
        if header.dtype == "float32":
            k = rng.standard_normal((spec.kv_heads, rows, spec.head_dim)).astype("<f4")
            v = rng.standard_normal((spec.kv_heads, rows, spec.v_head_dim)).astype("<f4")
        else:
            k = rng.integers(0, 1 << 16, (spec.kv_heads, rows, spec.head_dim), dtype=np.uint16)
            v = rng.integers(0, 1 << 16, (spec.kv_heads, rows, spec.v_head_dim), dtype=np.uint16)
        out.append(LayerKV(k, v, header.layer_first_row(i)))
    return out


def make_header(n_tokens: int = 41, *, layers=None, dtype: str = "bfloat16", chunk: int = 16) -> PackHeader:
    return PackHeader(FP_A, FP_B, tuple(range(1, n_tokens + 1)), layers or hybrid_layers(), dtype, chunk,
                      model_name="synthetic", architecture="test")


def make_pack(n_tokens: int = 41, *, codec: str = "none", seed: int = 0, **kw) -> tuple[bytes, PackHeader, list[LayerKV]]:
    header = make_header(n_tokens, **kw)
    rows = make_rows(header, seed)
    buf = io.BytesIO()
    write_pack(buf, header, rows, codec=codec)
    return buf.getvalue(), header, rows


def frame_offsets(data: bytes) -> list[int]:
    """Offset of every data frame's header in a well-formed pack (walked by the frame lengths)."""
    from muser_cli.kvpack.format import FRAME_HEADER, PREAMBLE, TAG_DATA, pad_len

    hlen = PREAMBLE.unpack_from(data)[3]
    pos = PREAMBLE.size + hlen + pad_len(PREAMBLE.size + hlen)
    out = []
    while True:
        tag, *_rest, stored = FRAME_HEADER.unpack_from(data, pos)
        if tag != TAG_DATA:
            return out
        out.append(pos)
        pos += FRAME_HEADER.size + stored + pad_len(stored) + 64


def forged_big_frame(*, pad: int = 512) -> tuple[bytes, int]:
    """A ~1.4 KiB input whose header plans one 1 GiB frame (1 layer of 1024 x 4096 float32
    heads, 32 rows), then that frame's header declaring its 1 GiB and ``pad`` zero bytes.
    Returns (bytes, the declared frame length)."""
    from muser_cli.kvpack import PackWriter
    from muser_cli.kvpack.format import FRAME_HEADER, TAG_DATA

    layers = (LayerSpec("full", 1024, 4096, 4096, rope=None),)
    header = PackHeader(FP_A, FP_B, tuple(range(1, 34)), layers, "float32", 32, model_name="forged",
                        architecture="test")
    buf = io.BytesIO()
    PackWriter(buf, header)
    declared = header.row_bytes(0) * 32
    return buf.getvalue() + FRAME_HEADER.pack(TAG_DATA, 0, 0, 0, 32, 0, 0, 0, declared, declared) + bytes(pad), declared
