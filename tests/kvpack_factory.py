"""Synthetic packs for format tests (no model needed): random rows, real writer."""

from __future__ import annotations

import io
import os
import threading
from contextlib import contextmanager
from typing import BinaryIO, Iterator

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


def kinds_layers() -> tuple[LayerSpec, ...]:
    """kvpack 1.3's kinds beside a row layer: an MLA latent layer, a recurrent state layer, a full one."""
    from muser_cli.kvpack.layers import latent_spec, state_spec

    return (
        latent_spec(24, 8, RopeSpec(10000.0, 8, "interleaved")),
        state_spec("mamba2", [("conv", (3, 20), "bfloat16"), ("recurrent", (2, 4, 6), "float32")]),
        LayerSpec("full", 2, 16, 16, rope=RopeSpec(10000.0, 16)),
    )


def chunked_layers() -> tuple[LayerSpec, ...]:
    """kvpack 1.4's chunked kind as Llama 4 lays it out: chunked-local layers with RoPE, a full NoPE one."""
    from muser_cli.kvpack.layers import chunked_spec

    return (
        chunked_spec(2, 16, 16, 4, RopeSpec(500000.0, 16)),
        chunked_spec(2, 16, 16, 4, RopeSpec(500000.0, 16)),
        LayerSpec("full", 2, 16, 16, rope=None),
    )


def make_state(header: PackHeader, i: int, rng: np.random.Generator):
    """Random snapshots of state layer ``i`` at every chunk end its frames need."""
    from muser_cli.kvpack.layers import DTYPES, StateKV

    spec, snaps = header.layers[i], {}
    for layer, start, count in header.frame_plan():
        if layer == i:
            snaps[start + count] = {t.name: (rng.standard_normal(t.shape).astype("<f4") if t.dtype == "float32"
                                             else rng.integers(0, 1 << 16, t.shape, dtype=np.uint16)).view(DTYPES[t.dtype][1])
                                    for t in spec.tensors}
    end = header.rows_end
    return StateKV(tensors=snaps.get(end, {}), position=end, first_row=header.layer_first_row(i), earlier=snaps)


def make_rows(header: PackHeader, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out: list = []
    for i, spec in enumerate(header.layers):
        if spec.kind == "state":
            out.append(make_state(header, i, rng))
            continue
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


plain_header = make_header  # not replaced by test_kvpack's per-version fixture (the fuzz seeds set their own)


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


def corrupted(data, blob: bytes) -> bytes:
    """``blob`` with up to three flips, cuts or insertions drawn from hypothesis ``data``."""
    from hypothesis import strategies as st

    b = bytearray(blob)
    for _ in range(data.draw(st.integers(0, 3))):
        if not b:
            break
        pos = data.draw(st.integers(0, len(b) - 1))
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if kind == "flip":
            b[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "cut":
            del b[pos:]
        else:
            b[pos:pos] = data.draw(st.binary(min_size=1, max_size=70))
    return bytes(b)


def verdict(fn) -> tuple[str, object]:
    """``("ok", fn())``, or ``("refused", the message)`` where ``fn`` raised KVPackError."""
    from muser_cli.errors import KVPackError

    try:
        return "ok", fn()
    except KVPackError as exc:
        return "refused", str(exc)


def fed_root(blob: bytes, step: int, *, decode: bool = True) -> bytes | None:
    """The root digest of ``blob`` fed to a PackReader ``step`` bytes at a time."""
    from muser_cli.kvpack import PackReader

    reader = PackReader(decode=decode)
    for i in range(0, len(blob), step):
        reader.feed(blob[i:i + step])
    reader.finish()
    return reader.root_digest


@contextmanager
def pipe_in_pieces(data: bytes, step: int) -> Iterator[BinaryIO]:
    """The read end of a pipe that a thread fills with ``data``, ``step`` bytes a write."""
    r, w = os.pipe()

    def feed() -> None:
        with os.fdopen(w, "wb") as out:
            for i in range(0, len(data), step):
                out.write(data[i:i + step])
                out.flush()

    t = threading.Thread(target=feed)
    t.start()
    try:
        with os.fdopen(r, "rb") as src:
            yield src
    finally:
        t.join()
