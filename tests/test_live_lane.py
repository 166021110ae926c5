"""The live lane, producer and consumer side: frames leave prefill as each chunk finishes,
decode reads and verifies them as they arrive, and a cut stream costs only what is missing.

Exactness: the streamed bytes equal the bytes of the finished pack (same frame order), and
tokens decoded from a streamed or cut stream equal the local fallback's on the same engine,
dtype and threads.
"""

from __future__ import annotations

import io

import pytest

from muser_cli.engines.torch_engine import TorchEngine
from muser_cli.prefill import prefill

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
    from muser_cli.engines.mlx_engine import MLXEngine

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
