"""``prefill --serve --store`` (issue 12): the resident producer continues a request from its
own reuse store as well as from its last request's rows, and keeps every result there.

The library half runs the producer in process on tiny models (real engine, real store on
disk under this test's MUSER_HOME); the rows it answers with are compared, layer by layer
and byte for byte, with a full prefill of the same prompt on the same schedule. The
command half is in ``tests/pulllane/test_pull_lane.py`` (a restarted producer answers from its store).
"""

from __future__ import annotations

import io
import time

import numpy as np
import pytest

from muser_cli.handoff.wire.pull_protocol import PullRequest, new_request_id

CHUNK = 8
DOC = tuple(range(5, 46))  # 41 tokens: 40 rows, a whole number of chunks (a sliding ring resumes there)
FOLLOW = DOC + tuple(range(50, 63))


def request(info, ids, **over) -> PullRequest:
    fields = dict(key_id="k1", request_id=new_request_id(), issued_at_ms=int(time.time() * 1000),
                  consumer="consumer", token_ids=tuple(ids), tokenizer_fingerprint=info.tokenizer_fingerprint,
                  model_fingerprint=info.fingerprint, chunk_tokens=CHUNK, dtype="float32")
    fields.update(over)
    return PullRequest(**fields)


def serve_one(prod, req: PullRequest):
    """What the server does with one admitted request: run it into a pipe-like buffer, then
    the after-stream work; the stats and the pack as the consumer reads it."""
    from muser_cli.kvpack import read_pack

    buf = io.BytesIO()
    prod.check(req)
    stats = prod.run(req, buf)
    prod.after_stream(stats)
    return stats, read_pack(io.BytesIO(buf.getvalue()))


def same_rows(got, want) -> None:
    """Two whole packs carry the same rows, byte for byte."""
    assert len(got.layers) == len(want.layers)
    for i, (a, b) in enumerate(zip(got.layers, want.layers)):
        assert a.first_row == b.first_row, (i, a.first_row, b.first_row)
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            x, y = np.asarray(x), np.asarray(y)
            assert x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes(), f"layer {i} differs"


@pytest.fixture(params=["tiny_llama", "tiny_hybrid"])
def info(request):
    return request.getfixturevalue(request.param)


def reference(info, ids, history: bool = False):
    """A full prefill of ``ids`` on the schedule, no store, no memory (``history``: with the
    sliding history, docs/kvpack.md 1.3; the store tests below serve packs without it)."""
    from muser_cli.pulllane.producer import ResidentProducer

    prod = ResidentProducer(str(info.path), dtype="float32", history=history)
    prod.keep_last = False
    return serve_one(prod, request(info, ids))


def test_a_restarted_producer_continues_from_its_store_and_keeps_every_result(info):
    from muser_cli.reuse import Store
    from muser_cli.pulllane.producer import ResidentProducer

    first = ResidentProducer(str(info.path), dtype="float32", store=True, history=False)
    stats, _ = serve_one(first, request(info, DOC))
    assert stats["reused_rows"] == 0 and stats["reused_from"] is None
    assert stats["stored"] and "store_error" not in stats, stats
    assert [e.id for e in Store().entries()] == [stats["stored"]]

    again = ResidentProducer(str(info.path), dtype="float32", store=True, history=False)  # its memory is empty: a restart
    stats, pack = serve_one(again, request(info, FOLLOW))
    assert stats["reused_from"] == "store" and stats["reused_rows"] >= CHUNK, stats
    assert stats["reused_rows"] % CHUNK == 0 and stats["stored"], stats
    same_rows(pack, reference(info, FOLLOW)[1])

    # the document again, on a third start: the store holds all of its rows (a full hit,
    # nothing computed or stored again)
    third = ResidentProducer(str(info.path), dtype="float32", store=True, history=False)
    stats, pack = serve_one(third, request(info, DOC))
    assert stats["reused_from"] == "store" and stats["reused_rows"] == len(DOC) - 1, stats
    assert "stored" not in stats
    same_rows(pack, reference(info, DOC)[1])


def test_a_delta_request_is_answered_from_the_store_with_the_same_rows(info):
    from muser_cli.reuse.chain import Scope, chain_at
    from muser_cli.pulllane.producer import ResidentProducer

    serve_one(ResidentProducer(str(info.path), dtype="float32", store=True, history=False), request(info, DOC))
    prod = ResidentProducer(str(info.path), dtype="float32", store=True, history=False)
    scope = Scope(info.fingerprint, info.tokenizer_fingerprint, "float32", CHUNK)
    req = request(info, FOLLOW, have_tokens=16, have_chain=chain_at(scope, list(FOLLOW), 16))
    stats, pack = serve_one(prod, req)
    assert pack.header.rows_start == 16 and stats["held_rows"] == 16, stats
    assert stats["reused_from"] == "store" and stats["shipped_rows"] == len(FOLLOW) - 1 - 16
    full = reference(info, FOLLOW)[1]
    for a, b in zip(pack.layers, full.layers):  # the delta carries the full pack's rows from its start
        off = a.first_row - b.first_row
        n = np.asarray(a.keys).shape[1]
        assert a.first_row + n == b.first_row + np.asarray(b.keys).shape[1]
        assert np.asarray(a.keys).tobytes() == np.asarray(b.keys)[:, off:off + n].tobytes()
        assert np.asarray(a.values).tobytes() == np.asarray(b.values)[:, off:off + n].tobytes()


def test_with_the_sliding_history_a_producer_computes_what_no_store_entry_holds(tiny_hybrid):
    """A pack with the sliding history (the default) carries every sliding row; a store entry
    or a remembered prompt holds the window only past the consumer's own prefix, so the
    producer computes those rows itself rather than ship a pack its header would misdescribe."""
    from muser_cli.pulllane.producer import ResidentProducer

    serve_one(ResidentProducer(str(tiny_hybrid.path), dtype="float32", store=True), request(tiny_hybrid, DOC))
    again = ResidentProducer(str(tiny_hybrid.path), dtype="float32", store=True)
    stats, pack = serve_one(again, request(tiny_hybrid, FOLLOW))
    assert stats["reused_rows"] == 0, stats
    assert pack.header.ring_extra == pack.header.rows_end and all(l.first_row == 0 for l in pack.layers)
    same_rows(pack, reference(tiny_hybrid, FOLLOW, history=True)[1])


def test_without_store_the_producer_neither_reads_nor_writes_it(tiny_llama):
    from muser_cli.reuse import Store
    from muser_cli.pulllane.producer import ResidentProducer

    serve_one(ResidentProducer(str(tiny_llama.path), dtype="float32", store=True), request(tiny_llama, DOC))
    before = Store().points(tiny_llama.fingerprint, tiny_llama.tokenizer_fingerprint, list(FOLLOW), len(FOLLOW) - 1)
    prod = ResidentProducer(str(tiny_llama.path), dtype="float32")
    stats, _ = serve_one(prod, request(tiny_llama, FOLLOW))
    assert stats["reused_rows"] == 0 and "stored" not in stats, stats
    after = Store().points(tiny_llama.fingerprint, tiny_llama.tokenizer_fingerprint, list(FOLLOW), len(FOLLOW) - 1)
    assert before and sorted(p.entry for p in after) == sorted(p.entry for p in before)


def test_the_last_request_wins_when_it_holds_the_deeper_prefix(tiny_llama):
    """Memory and store both hold a prefix: the deeper one is used (here the memory's)."""
    from muser_cli.pulllane.producer import ResidentProducer

    serve_one(ResidentProducer(str(tiny_llama.path), dtype="float32", store=True), request(tiny_llama, DOC[:20]))
    prod = ResidentProducer(str(tiny_llama.path), dtype="float32")
    serve_one(prod, request(tiny_llama, DOC))  # not stored: only in memory (it continues 32 of them)
    prod.store = True  # the store holds 16 rows of FOLLOW, the memory 32
    stats, pack = serve_one(prod, request(tiny_llama, FOLLOW))
    assert stats["reused_from"] == "memory" and stats["reused_rows"] == 32, stats
    same_rows(pack, reference(tiny_llama, FOLLOW)[1])
    # a prompt the last request holds whole (its rows a prefix of FOLLOW's on whole chunks): nothing computed
    stats, pack = serve_one(prod, request(tiny_llama, DOC))
    assert stats["reused_from"] == "memory" and stats["reused_rows"] == len(DOC) - 1, stats
    same_rows(pack, reference(tiny_llama, DOC)[1])
