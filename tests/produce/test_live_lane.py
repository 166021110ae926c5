"""The live lane, producer and consumer side: frames leave prefill as each chunk finishes,
decode reads and verifies them as they arrive, and a cut stream costs only what is missing.

Exactness: the streamed bytes equal the bytes of the finished pack (same frame order), and
tokens decoded from a streamed or cut stream equal the local fallback's on the same engine,
dtype and threads.
"""

from __future__ import annotations

import io

import pytest

from muser_cli.engines.torch.engine import TorchEngine
from muser_cli.kvpack.parser import frame_ends
from muser_cli.produce.prefill import prefill
from handoff_kit import HANG_S

PROMPT = ("The committee met on a grey Tuesday to decide where the new bridge would go. "
          "After a long debate about costs, traffic and the river's spring floods, they chose "
          "the northern site, close to the old mill and the school.")


class _Recorder(io.BytesIO):
    """An output that notes how many bytes had arrived at each progress report."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []  # (rows done, bytes written by then)

    def progress(self, stage: str, done: int, total: int) -> None:
        self.seen.append((done, len(self.getbuffer())))


def _finished_bytes(monkeypatch, **kw) -> bytes:
    """The same prefill written the old way: the finished pack after the last chunk."""
    with monkeypatch.context() as m:
        m.setattr(TorchEngine, "streams_prefill", False)
        out = io.BytesIO()
        prefill(PROMPT, out, **kw)
        return out.getvalue()


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_hybrid"])
@pytest.mark.parametrize("codec", ["none", "zstd+bytegroup"])
def test_streamed_prefill_bytes_equal_the_finished_pack(request, monkeypatch, which, codec):
    model = request.getfixturevalue(which)
    kw = dict(model=str(model.path), chunk_tokens=8, codec=codec, dtype="float32")
    out = _Recorder()
    prefill(PROMPT, out, progress=out.progress, **kw)
    assert out.getvalue() == _finished_bytes(monkeypatch, **kw)
    # Frames left while prefill still ran: bytes grew between chunk reports, long before the end.
    chunks = [(d, n) for d, n in out.seen if d > 0]
    assert len(chunks) >= 4
    total = len(out.getvalue())
    assert chunks[0][1] > 0 and chunks[1][1] > chunks[0][1], chunks[:3]
    assert chunks[-2][1] < total


def test_streamed_prefill_from_the_store_and_as_a_delta(tiny_llama, monkeypatch):
    """Resuming from a stored prefix and writing a delta stream the same bytes too."""
    from muser_cli.reuse import Store
    from muser_cli.reuse.api import have as have_manifest

    kw = dict(model=str(tiny_llama.path), chunk_tokens=8, dtype="float32")
    short = PROMPT[: len(PROMPT) // 2]
    prefill(short, io.BytesIO(), store=True, **kw)
    assert Store().entries()
    resumed = _Recorder()
    r = prefill(PROMPT, resumed, reuse=True, progress=resumed.progress, **kw)
    assert r.reused_tokens > 0
    assert resumed.getvalue() == _finished_bytes(monkeypatch, reuse=True, **kw)
    have = have_manifest(PROMPT, model=str(tiny_llama.path), dtype="float32", chunk_tokens=8)
    assert have.held_tokens > 0
    delta = io.BytesIO()
    d = prefill(PROMPT, delta, have=have, **kw)
    assert d.held_tokens == have.held_tokens
    assert delta.getvalue() == _finished_bytes(monkeypatch, have=have, **kw)


def test_streamed_prefill_on_mlx_equals_the_finished_pack(tiny_hybrid, monkeypatch):
    pytest.importorskip("mlx_lm")
    from muser_cli.engines.mlx.engine import MLXEngine

    kw = dict(model=str(tiny_hybrid.path), chunk_tokens=8, dtype="float32", engine="mlx")
    out = _Recorder()
    prefill(PROMPT, out, progress=out.progress, **kw)
    with monkeypatch.context() as m:
        m.setattr(MLXEngine, "streams_prefill", False)
        whole = io.BytesIO()
        prefill(PROMPT, whole, **kw)
    assert out.getvalue() == whole.getvalue()
    chunks = [(d, n) for d, n in out.seen if d > 0]
    assert chunks[1][1] > chunks[0][1] > 0


# ---------------------------------------------------------------------- consumer side

_frame_ends = frame_ends  # (bytes of preamble + header, the byte offset just after each data frame)


def _decode(model, data: bytes | None, prompt: str | None, **kw):
    from muser_cli.consumer.decode import decode

    src = io.BytesIO(data) if data is not None else None
    return decode(src, model=str(model.path), prompt=prompt, max_new_tokens=10, dtype="float32", **kw)


@pytest.fixture(scope="module")
def streamed(tiny_llama):
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(tiny_llama.path), chunk_tokens=8, dtype="float32")
    return out.getvalue()


def test_streamed_decode_equals_fallback_and_reports_its_timings(tiny_llama, streamed):
    full = _decode(tiny_llama, streamed, None)
    local = _decode(tiny_llama, b"", PROMPT, chunk_tokens=8)
    assert full.source == "handoff" and local.fallback
    assert full.token_ids == local.token_ids
    j = full.to_json()
    assert j["first_byte_s"] is not None and j["last_frame_s"] >= j["first_byte_s"]
    assert j["tail_s"] is not None and j["tail_s"] >= 0
    assert local.to_json()["tail_s"] is None


def test_cut_stream_keeps_the_verified_chunks_and_prefills_the_rest(tiny_llama, streamed):
    head, ends = _frame_ends(streamed)
    layers = len(tiny_llama.layers)
    chunks = len(ends) // layers
    local = _decode(tiny_llama, b"", PROMPT, chunk_tokens=8)
    rows = local.prompt_tokens - 1
    for k in (0, 1, chunks // 2, chunks - 1):
        cut = streamed[: head if k == 0 else ends[k * layers - 1]]
        got = _decode(tiny_llama, cut, PROMPT)
        assert got.token_ids == local.token_ids, k
        assert got.fallback and got.handoff_rows == 8 * k and got.local_rows == rows - 8 * k
        assert got.source == ("partial+local" if k else "local")
        assert "cut stream" in got.reason and "truncated" in got.reason
    # A chunk cut in the middle of its frames keeps only the whole chunks before it.
    got = _decode(tiny_llama, streamed[: ends[2 * layers + 1]], PROMPT)
    assert got.handoff_rows == 16 and got.token_ids == local.token_ids


def test_cut_stream_without_a_prompt_is_refused(tiny_llama, streamed):
    from muser_cli.errors import KVPackError

    _, ends = _frame_ends(streamed)
    with pytest.raises(KVPackError, match="truncated"):
        _decode(tiny_llama, streamed[: ends[3]], None)


def test_corrupt_frame_is_refused_even_with_a_prompt(tiny_llama, streamed):
    """Data that failed a check is never decoded from, and is no cut to recover from: with
    a prompt it is set aside whole (issue 29 item 3: the tokens are a local prefill's, none
    of its verified chunks kept); with --strict, or without a prompt, it is refused."""
    from muser_cli.errors import KVPackError

    head, ends = _frame_ends(streamed)
    bad = bytearray(streamed)
    bad[ends[5] - 80] ^= 0x10  # inside frame 6's payload
    with pytest.raises(KVPackError):
        _decode(tiny_llama, bytes(bad), PROMPT, strict=True)
    out = _decode(tiny_llama, bytes(bad), PROMPT)
    assert out.source == "local" and out.handoff_rows is None and "set aside" in out.set_aside
    assert out.token_ids == _decode(tiny_llama, b"", PROMPT).token_ids


def test_cut_stream_on_a_sliding_window_model(tiny_hybrid):
    """With the sliding history (the default) a sliding layer ships every row chunk by chunk,
    so a cut keeps its whole chunks; without it (--no-history) the sliding layers ship only
    their last window-1 rows, at the end, so a cut before them keeps nothing. The tokens are
    the full fallback's either way."""
    local = _decode(tiny_hybrid, b"", PROMPT, chunk_tokens=8)
    for history in (True, False):
        out = io.BytesIO()
        prefill(PROMPT, out, model=str(tiny_hybrid.path), chunk_tokens=8, dtype="float32", history=history)
        data = out.getvalue()
        _, ends = _frame_ends(data)
        got = _decode(tiny_hybrid, data[: ends[len(ends) // 2]], PROMPT)
        assert got.token_ids == local.token_ids and got.fallback
        if history:
            assert got.handoff_rows > 0 and got.source == "partial+local"
        else:
            assert got.handoff_rows == 0 and got.source == "local"


# ---------------------------------------------------------------------- verify in a pipe

def test_streaming_verify_passes_on_exactly_the_verified_bytes(tiny_llama, streamed):
    from muser_cli.gate.verify import verify_stream

    out = io.BytesIO()
    rep = verify_stream(io.BytesIO(streamed), out, model=str(tiny_llama.path), prompt=PROMPT)
    assert rep.ok and out.getvalue() == streamed
    head, ends = _frame_ends(streamed)
    # A bad frame: everything before it passes, nothing from it on; no end frame.
    bad = bytearray(streamed)
    bad[ends[4] - 80] ^= 0x01
    out = io.BytesIO()
    rep = verify_stream(io.BytesIO(bytes(bad)), out, model=str(tiny_llama.path))
    assert not rep.ok and rep.first_failure().name == "integrity"
    assert out.getvalue() == streamed[: ends[3]]
    # Bytes after a good end frame: the end frame itself is held back.
    out = io.BytesIO()
    rep = verify_stream(io.BytesIO(streamed + b"\0"), out, model=str(tiny_llama.path))
    assert not rep.ok and out.getvalue() == streamed[: ends[-1]]
    # Another prompt: refused at the header, nothing passed on.
    out = io.BytesIO()
    rep = verify_stream(io.BytesIO(streamed), out, model=str(tiny_llama.path), prompt=PROMPT + " Later")
    assert not rep.ok and rep.first_failure().name == "prompt" and out.getvalue() == b""


def test_pack_in_a_pipe_passes_each_frame_on_as_it_arrives(tiny_llama, streamed):
    """pack reads a pipe with read1 and flushes after each frame: what it has written at
    any moment is a prefix of its output, and a cut input leaves no end frame."""
    from muser_cli.errors import KVPackError
    from muser_cli.produce.pack import pack

    whole = io.BytesIO()
    pack(io.BytesIO(streamed), whole, codec="zstd+bytegroup")
    _, ends = _frame_ends(streamed)
    cut = io.BytesIO()
    with pytest.raises(KVPackError, match="truncated"):
        pack(io.BufferedReader(io.BytesIO(streamed[: ends[6]])), cut, codec="zstd+bytegroup")
    got = cut.getvalue()
    assert got and whole.getvalue().startswith(got)
    _, out_ends = _frame_ends(whole.getvalue())
    assert len(got) == out_ends[6]  # the 7 frames that arrived, all passed on


def test_decode_starts_at_the_end_frame_but_refuses_bytes_after_it(tiny_llama, streamed):
    """decode does not wait for the producer to close its output before the first step, yet
    a pack followed by anything is still refused before anything is returned."""
    import os
    import threading

    from muser_cli.errors import KVPackError

    r, w = os.pipe()
    first_token, closing = threading.Event(), threading.Event()
    open_at_first_token: list[bool] = []

    def producer() -> None:  # the whole pack, then the writer stays open until the first token
        with os.fdopen(w, "wb") as f:
            f.write(streamed)
            f.flush()
            first_token.wait(HANG_S)
            closing.set()  # before the close: decode cannot see the end of its input earlier

    def on_token(_tid: int) -> None:
        if not first_token.is_set():
            open_at_first_token.append(not closing.is_set())
            first_token.set()

    threading.Thread(target=producer, daemon=True).start()
    with os.fdopen(r, "rb") as src:
        from muser_cli.consumer.decode import decode

        out = decode(src, model=str(tiny_llama.path), max_new_tokens=4, dtype="float32", on_token=on_token)
    assert out.source == "handoff" and out.first_token_s is not None and out.tail_s is not None
    # States, not stopwatches: its first token came while the writer was still open, and it
    # returned only once the input was seen to end (after the writer closed).
    assert open_at_first_token == [True]
    assert closing.is_set()
    with pytest.raises(KVPackError, match="after the end frame"):
        _decode(tiny_llama, streamed + b"\0", None)
