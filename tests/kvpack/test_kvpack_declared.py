"""A length a kvpack merely declares allocates nothing large (#30 item 9).

A 1.4 KiB input whose frame header declares 1 GiB: every stream reader (``read_pack`` on a
pipe, ``pack`` from a pipe, ``decode``'s reader thread) allocates with the bytes that
arrive, and refuses the input with one line -- no thread prints a traceback.
"""

from __future__ import annotations

import io
import os
import threading
import tracemalloc

import pytest

from handoff_kit import HANG_S, env_for, muser_cmd
from kvpack_factory import forged_big_frame, llama_layers, make_pack
from muser_cli.errors import KVPackError

LIMIT = 16 << 20  # what any reader may allocate for the forged input (the old readers took 1 GiB)


def _pipe_of(data: bytes) -> io.BufferedReader:
    """A real pipe carrying ``data`` (written by a thread; the reader sees EOF after it)."""
    r, w = os.pipe()

    def feed() -> None:
        with open(w, "wb") as f:
            f.write(data)

    threading.Thread(target=feed, daemon=True).start()
    return open(r, "rb")


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def test_read_pack_from_a_pipe_allocates_what_arrived_not_what_was_declared():
    from muser_cli.kvpack import read_pack

    data, declared = forged_big_frame()

    def run() -> None:
        with _pipe_of(data) as src, pytest.raises(KVPackError, match="truncated"):
            read_pack(src)

    assert _peak(run) < LIMIT, f"declared {declared}"


def test_pack_from_a_pipe_allocates_what_arrived_not_what_was_declared():
    from muser_cli.produce.pack import pack

    data, _ = forged_big_frame()

    def run() -> None:
        with _pipe_of(data) as src, pytest.raises(KVPackError, match="truncated"):
            pack(src, io.BytesIO(), codec="none")

    assert _peak(run) < LIMIT


def test_a_large_frame_read_in_growing_pieces_is_byte_exact():
    """A frame larger than the first read (1 MiB) that arrives through a pipe: the growing
    buffer gives the same rows as the in-memory reader."""
    import numpy as np

    from muser_cli.kvpack import read_pack, read_pack_bytes
    from muser_cli.kvpack.layers import LayerSpec, RopeSpec

    layers = tuple(LayerSpec("full", 8, 128, 128, rope=RopeSpec(10000.0, 128)) for _ in range(2))
    data, _, _ = make_pack(300, layers=layers, dtype="float32", chunk=512)  # one 2.3 MiB frame per layer
    with _pipe_of(data) as src:
        got = read_pack(src)
    want = read_pack_bytes(data)
    assert got.root_digest == want.root_digest
    for a, b in zip(got.layers, want.layers):
        assert np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values)


def test_streamed_pack_reader_thread_never_prints(monkeypatch):
    """Whatever fails on decode's reader thread (here: the allocation of the declared rows)
    reaches the caller as one KVPackError; the thread itself prints nothing."""
    from muser_cli.kvpack import stream as stream_mod

    printed: list[object] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_value))

    def no_memory(*_a, **_k):
        raise MemoryError

    monkeypatch.setattr(stream_mod, "slab_arrays", no_memory)
    data, _, _ = make_pack(41, layers=llama_layers(2))
    sp = stream_mod.StreamedPack(io.BytesIO(data))
    with pytest.raises(KVPackError, match="not enough memory to read this kvpack"):
        sp.header()
    with pytest.raises(KVPackError):
        sp.result()
    assert printed == []


def test_decode_from_a_pipe_refuses_a_forged_frame_in_one_line_under_a_memory_limit(tiny_llama, tmp_path):
    """The issue's reproduction: ``decode`` reading the forged input from a pipe under
    ``ulimit -v 3000000``. Before: the reader thread's 1 GiB allocation failed and printed
    a traceback before the refusal. Now: exit 65 and one line on stderr."""
    import shlex
    import subprocess

    data, _ = forged_big_frame()
    forged = tmp_path / "forged.kvpack"
    forged.write_bytes(data)
    cmd = shlex.join(muser_cmd("decode", "-m", str(tiny_llama.path), "-n", "4"))
    r = subprocess.run(["bash", "-c", f"ulimit -v 3000000; cat {shlex.quote(str(forged))} | {cmd}"], env=env_for(tmp_path / "home"),
                       capture_output=True, timeout=HANG_S)
    err = r.stderr.decode()
    assert r.returncode == 65, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert r.stdout == b""
