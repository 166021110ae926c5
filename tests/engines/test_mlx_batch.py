"""The MLX engine's batched decode (engines/stepper.py, engines/mlx/batch.py): sequences on
threads of their own, their decode steps computed together by the stepper's thread.

* a sequence that stops mid-way (its token callback raises: a client gone, a stop string)
  leaves the others' tokens as they were;
* seeded sampling at temperature > 0 gives each sequence its solo tokens;
* a step that fails reaches every sequence in it, and the next sequences decode as before;
* a thread waiting for its tokens does not hold the engine's turn.
Tiny random model, float32, one thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("mlx_lm")

from muser_cli.consumer.turns import TurnEngine, Turns  # noqa: E402
from muser_cli.engines.base import Sampling  # noqa: E402
from muser_cli.engines.registry import get_engine  # noqa: E402
from muser_cli.model.tokens import encode_prompt  # noqa: E402

PROMPTS = [f"Sequence {i} asks about bridge {i * 11 + 2} over the grey river, and {i} answers." for i in range(6)]


class Gone(Exception):
    pass


@pytest.fixture(scope="module")
def engines(tiny_llama):
    solo = get_engine("mlx", tiny_llama, dtype="float32", threads=1)
    batched = get_engine("mlx", tiny_llama, dtype="float32", threads=1)
    turns = Turns()
    steps: list[int] = []
    batched.batch_decode(turns, on_step=steps.append)
    yield tiny_llama, solo, TurnEngine(batched, turns), turns, steps
    batched.close()


def _decode(info, eng, prompt: str, *, n: int = 16, sampling: Sampling = Sampling(), on_token=None):
    ids = encode_prompt(info, prompt, chat=False)
    layers = eng.prefill(ids[:-1])
    return eng.decode(layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=n, sampling=sampling,
                      on_token=on_token)


def _together(turns, fn, items):
    def run(item):
        turns.join()
        try:
            return fn(item)
        finally:
            turns.leave()

    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(run, items))


def test_a_sequence_that_stops_midway_leaves_the_others_unchanged(engines):
    info, solo, eng, turns, steps = engines
    alone = [_decode(info, solo, p).token_ids for p in PROMPTS]
    seen: dict[int, list[int]] = {}

    def one(i):
        def on_token(token):
            seen.setdefault(i, []).append(token)
            if i == 2 and len(seen[i]) == 4:
                raise Gone()
        try:
            return _decode(info, eng, PROMPTS[i], on_token=on_token)
        except Gone:
            return None

    before = len(steps)
    got = _together(turns, one, list(range(len(PROMPTS))))
    assert got[2] is None and seen[2] == alone[2][:4]
    for i, result in enumerate(got):
        if i != 2:
            assert result.stats["batched"] and result.token_ids == alone[i], i
    assert max(steps[before:]) > 1  # they did share steps


def test_seeded_sampling_gives_each_sequence_its_solo_tokens(engines):
    info, solo, eng, turns, _ = engines
    samplings = [Sampling(temperature=0.8, top_p=0.9 if i % 2 else 1.0, seed=100 + i) for i in range(len(PROMPTS))]
    alone = [_decode(info, solo, p, sampling=s).token_ids for p, s in zip(PROMPTS, samplings)]
    got = _together(turns, lambda i: _decode(info, eng, PROMPTS[i], sampling=samplings[i]).token_ids,
                    list(range(len(PROMPTS))))
    assert got == alone
    assert len({tuple(t) for t in got}) > 1


def test_a_failed_step_reaches_its_sequences_and_the_next_ones_decode(engines, monkeypatch):
    info, solo, eng, turns, _ = engines
    stepper = eng.inner._stepper
    batch = stepper._batch
    real_step = batch.step
    failed = threading.Event()

    def failing_step():  # the first step two or more share fails
        if len(batch) >= 2 and not failed.is_set():
            failed.set()
            raise RuntimeError("a step that failed")
        return real_step()

    monkeypatch.setattr(batch, "step", failing_step)
    outcomes = _together(turns, lambda p: _catch(lambda: _decode(info, eng, p, n=32)), PROMPTS[:3])
    hit = [o for o in outcomes if isinstance(o, Exception)]
    assert len(hit) >= 2 and all(isinstance(o, RuntimeError) and "a step that failed" in str(o) for o in hit), outcomes
    for prompt, o in zip(PROMPTS, outcomes):  # one that joined after the failure decoded as alone
        if not isinstance(o, Exception):
            assert o.token_ids == _decode(info, solo, prompt, n=32).token_ids
    monkeypatch.setattr(batch, "step", real_step)
    alone = _decode(info, solo, PROMPTS[0]).token_ids
    assert _together(turns, lambda p: _decode(info, eng, p).token_ids, [PROMPTS[0]]) == [alone]


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
        return exc


def test_waiting_for_tokens_does_not_hold_the_turn(engines):
    info, _, eng, turns, _ = engines
    holding: list[bool] = []
    released = threading.Event()

    def on_token(token):
        holding.append(turns.holds())
        if len(holding) == 3:  # another thread can take the turn while this one waits for tokens
            t = threading.Thread(target=lambda: (turns.acquire(), turns.release(), released.set()))
            t.start()
            t.join(60)

    turns.join()
    try:
        _decode(info, eng, PROMPTS[0], on_token=on_token)
    finally:
        turns.leave()
    assert released.is_set() and holding and not any(holding)
