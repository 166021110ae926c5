"""``decode --serve`` answers many requests at once (issue #37): each running request takes
the engine's turns one decode step or prefill chunk at a time, so

* concurrent requests each get their solo text (each is computed exactly as alone), through
  the real ``openai`` client, on torch and on MLX;
* a request whose producer holds its bytes costs the others nothing (it does not hold the engine
  while it waits);
* a long local prefill does not freeze a request that is already streaming: that request's
  tokens keep arriving between the prefill's chunks (shown by the order of events).

Real processes on 127.0.0.1, tiny random models, the real model in one case.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
from handoff_kit import HANG_S, make_nodes  # noqa: E402
from serve_kit import DecodeServer  # noqa: E402

PROMPTS = [f"Request {i}: the committee met on a grey Tuesday to decide where bridge number {i * 7 + 3} would go, "
           f"and {['Ada', 'Bo', 'Cy', 'Di', 'Ed', 'Flo', 'Gus', 'Hal'][i]} spoke first." for i in range(8)]


Server = DecodeServer


def _texts(server: Server, prompts: list[str], *, concurrent: bool, n: int = 12, batched: list | None = None) -> list[str]:
    def one(prompt: str) -> str:
        out = server.client().completions.create(model="default", prompt=prompt, max_tokens=n, temperature=0)
        if batched is not None:
            batched.append(out.model_extra["muser"]["batched"])
        return out.choices[0].text

    if not concurrent:
        return [one(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _concurrent_equals_solo(home: Path, model: str, *flags: str, n: int = 12, batched: bool = False) -> None:
    """Eight prompts alone, then at once: the same greedy texts. ``batched``: the engine steps
    them together in batched calls (answers' ``muser.batched``: it shared a step with another),
    else each alone (--exact, a family that decodes alone)."""
    server = Server(home, "-m", model, "--threads", "1", "--no-reuse", "--max-batch", "8", *flags)
    try:
        solo = _texts(server, PROMPTS, concurrent=False, n=n)
        steps_alone = server.metric("muser_batch_size_count")
        seen: list[bool] = []
        together = _texts(server, PROMPTS, concurrent=True, n=n, batched=seen)
        assert any(seen) if batched else not any(seen), seen  # some shared steps (the first may end alone)
        assert together == solo
        assert len(set(solo)) > 1  # distinct prompts, distinct answers: a mix-up would show
        # the eight ran together: some steps had more than one sequence taking turns
        steps = server.metric("muser_batch_size_count") - steps_alone
        ones = server.metric('muser_batch_size_bucket{le="1.0"}')
        assert steps > 0 and ones < server.metric("muser_batch_size_count")
    finally:
        rc = server.stop()
    assert rc == 0, "".join(server.lines[-10:])  # MLX too: its teardown at exit is skipped (commands/__init__.py)


def test_eight_concurrent_requests_each_get_their_solo_text_on_torch(tmp_path, tiny_llama):
    _concurrent_equals_solo(tmp_path / "home", str(tiny_llama.path), "--dtype", "float32", batched=True)


def test_exact_mode_decodes_each_request_alone_on_torch(tmp_path, tiny_llama):
    _concurrent_equals_solo(tmp_path / "home", str(tiny_llama.path), "--dtype", "float32", "--exact")


def test_eight_concurrent_requests_each_get_their_solo_text_on_mlx(tmp_path, tiny_llama):
    """MLX steps the eight together (one batched forward a step): on this model the greedy
    texts are the solo ones all the same (docs/serve.md gives the agreement measured)."""
    pytest.importorskip("mlx_lm")
    _concurrent_equals_solo(tmp_path / "home", str(tiny_llama.path), "--dtype", "float32", "--engine", "mlx",
                            batched=True)


def test_exact_mode_decodes_each_request_alone_on_mlx(tmp_path, tiny_llama):
    pytest.importorskip("mlx_lm")
    _concurrent_equals_solo(tmp_path / "home", str(tiny_llama.path), "--dtype", "float32", "--engine", "mlx",
                            "--exact")


@pytest.mark.parametrize("family", ["gemma3_text", "deepseek_v3", "qwen3_next"])
def test_sliding_latent_and_state_families_answer_concurrently_as_alone(tmp_path, tiny_family, family):
    _concurrent_equals_solo(tmp_path / "home", str(tiny_family(family).path), "--dtype", "float32", n=8,
                            batched=True)


@pytest.mark.parametrize("family", ["gemma3_text", "deepseek_v3", "qwen3_next", "gemma2"])
def test_sliding_latent_and_state_families_batch_on_mlx(tmp_path, tiny_family, family):
    """Sliding rings, latent rows and recurrent state merge into mlx-lm's batch caches;
    gemma2 decodes each request alone, by name (engines/mlx/config.py MLX_DECODES_ALONE)."""
    pytest.importorskip("mlx_lm")
    _concurrent_equals_solo(tmp_path / "home", str(tiny_family(family).path), "--dtype", "float32", "--engine",
                            "mlx", n=8, batched=family != "gemma2")


@pytest.mark.slow
def test_the_real_model_answers_concurrent_requests_as_alone(tmp_path, real_model):
    _concurrent_equals_solo(tmp_path / "home", str(real_model.path), n=8, batched=True)


@pytest.mark.slow
def test_the_real_model_batched_on_mlx_answers_as_alone(tmp_path, real_model):
    pytest.importorskip("mlx_lm")
    _concurrent_equals_solo(tmp_path / "home", str(real_model.path), "--engine", "mlx", n=8, batched=True)


class Stall:
    """A "producer" on 127.0.0.1 that accepts connections and never sends a byte until
    :meth:`release` (then it closes them): a producer whose bytes are held."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.accepted = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted.set()

    def release(self) -> None:
        for conn in self.conns:
            conn.close()
        self.sock.close()


def test_a_request_whose_producer_holds_its_bytes_does_not_stop_another(tmp_path, tiny_llama):
    stall = Stall()
    nodes = make_nodes(tmp_path)  # an enrolled consumer: its pull goes as far as the producer's socket
    server = Server(nodes.consumer_home, "-m", str(tiny_llama.path), "--threads", "1", "--dtype", "float32",
                    "--no-reuse", "--max-batch", "4", "--producer", stall.address)
    done: list[str] = []
    try:
        def held() -> None:  # waits on its producer for as long as the stall lasts
            server.client().completions.create(model="default", prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                               extra_body={"muser_prefill_deadline": HANG_S})
            done.append("held")

        waiting = threading.Thread(target=held)
        waiting.start()
        assert stall.accepted.wait(HANG_S)  # the held request is at its producer now
        out = server.client().completions.create(model="default", prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                                 extra_body={"muser_prefill_deadline": 0.5})
        done.append("other")
        assert out.choices[0].text
        assert done == ["other"]  # answered while the first still waits on its producer
        stall.release()
        waiting.join(HANG_S)
        assert done == ["other", "held"]
    finally:
        stall.release()
        server.stop()


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory) -> Path:
    from muser_cli.model.tiny import make_tiny_long_llama

    return make_tiny_long_llama(tmp_path_factory.mktemp("concurrent-models") / "tiny-long")


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_a_long_local_prefill_does_not_freeze_a_streaming_request(tmp_path, tiny_long, engine):
    """Request A streams (up to 3000 tokens: still going when B comes); request B brings a 2k-token
    prompt prefilled here in chunks of 128. Between B's arrival and B's first token, A's tokens
    keep coming (one between two of B's chunks), and A is still streaming after B's first token.
    On MLX, A's steps are the batched decode's (the stepper's thread)."""
    if engine == "mlx":
        pytest.importorskip("mlx_lm")
    server = Server(tmp_path / "home", "-m", str(tiny_long), "--threads", "1", "--dtype", "float32",
                    "--no-reuse", "--max-batch", "4", "--chunk", "128", "--engine", engine)
    events: list[str] = []
    lock = threading.Lock()
    started = threading.Event()

    def note(what: str) -> None:
        with lock:
            events.append(what)

    def stream_a() -> None:
        stream = server.client().completions.create(model="default", prompt=PROMPTS[2], max_tokens=3000,
                                                    temperature=0, stream=True)
        for i, chunk in enumerate(stream):
            if chunk.choices and chunk.choices[0].text:
                note("A")
                if i == 4:
                    started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                note(f"A-done:{chunk.choices[0].finish_reason}")
        started.set()

    long_prompt = " ".join(f"w{i % 97}" for i in range(2100))
    try:
        a = threading.Thread(target=stream_a)
        a.start()
        assert started.wait(HANG_S)
        note("B-sent")
        stream = server.client().completions.create(model="default", prompt=long_prompt, max_tokens=2, temperature=0,
                                                    stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                note("B-first")
                break
        for _ in stream:
            pass
        a.join(HANG_S)
    finally:
        server.stop()
    assert "A-done:stop" not in events[:events.index("B-first")], events  # A met its EOS early: no stream to watch
    sent, first = events.index("B-sent"), events.index("B-first")
    between = events[sent:first].count("A")
    assert between >= 4, events  # B's ~17 chunks: A took steps between them
    assert "A" in events[first:], events  # and A was still streaming when B's first token came
