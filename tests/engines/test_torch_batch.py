"""The torch engine's batched decode (engines/torch/batch.py): 8 sequences stepped together
through a Stepper holding a Turns give each one its solo tokens (greedy and seeded), on a plain,
a sliding, a latent and recurrent-state families; one leaving mid-way leaves the others'
tokens unchanged; a chunked family (Llama 4) decodes alone."""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest

from engine_kit import run_queued_together
from muser_cli.consumer.turns import TurnEngine, Turns
from muser_cli.engines.base import Sampling
from muser_cli.engines.torch.engine import TorchEngine

N = 8
NEW = 12
LENGTHS = [5, 9, 14, 21, 30, 38, 11, 26]  # different lengths: rows left-padded; several past the window (8)


class Cut(Exception):
    """A client gone mid-way (what a cancel or a stop string raises through ``on_token``)."""


def _prompts(engine: TorchEngine, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = engine._vocab_size()
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


def _solo(engine, packs, samplings, new=NEW):
    return [engine.decode(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=new,
                          sampling=s, stop_on_eos=False).token_ids for (ids, layers), s in zip(packs, samplings)]


def _together(engine, packs, samplings, new=NEW, cut: dict[int, int] | None = None):
    """All sequences decoded at once through the engine's turns: the first step of every one is
    queued before any batched step (the test holds the turn until all of them wait for it), so
    they join within the stepper's first steps. ``cut``: sequence -> tokens after which it leaves."""
    turns = Turns()
    steps: list[int] = []
    engine.batch_decode(turns, on_step=steps.append)
    te = TurnEngine(engine, turns)
    out: list = [None] * len(packs)

    def one(i: int) -> None:
        ids, layers = packs[i]
        got: list[int] = []

        def on_token(t: int) -> None:
            got.append(t)
            if cut and i in cut and len(got) >= cut[i]:
                raise Cut()

        try:
            r = te.decode(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=new, sampling=samplings[i],
                          stop_on_eos=False, on_token=on_token)
            out[i] = (r.token_ids, r.stats.get("batched"))
        except Cut:
            out[i] = (got, "cut")
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            out[i] = exc

    run_queued_together(turns, len(packs), one)
    engine.close()
    assert not any(isinstance(o, BaseException) for o in out), out
    return out, steps


def _packs(engine, seed=0):
    return [(ids, engine.prefill(ids[:-1], chunk_tokens=16)) for ids in _prompts(engine, seed)]


@pytest.mark.parametrize("family", ["llama", "cohere2", "gemma3_text", "deepseek_v3", "qwen3_next", "granitemoehybrid"])
def test_batched_greedy_equals_solo(family, tiny_family, tiny_llama, tiny_hybrid):
    info = tiny_llama if family == "llama" else tiny_hybrid if family == "cohere2" else tiny_family(family)
    engine = TorchEngine(info, dtype="float32", threads=1)
    packs = _packs(engine)
    greedy = [Sampling()] * N
    solo = _solo(engine, packs, greedy)
    together, steps = _together(engine, packs, greedy)
    assert [b for _, b in together] == [True] * N  # every one joined the batch
    assert max(steps) == N  # ... and they stepped together
    assert [t for t, _ in together] == solo


def test_seeded_sampling_equals_solo(tiny_hybrid):
    engine = TorchEngine(tiny_hybrid, dtype="float32", threads=1)
    packs = _packs(engine, seed=1)
    sampled = [Sampling(temperature=0.9, top_p=0.95 if i % 2 else 1.0, seed=100 + i) for i in range(N - 2)]
    samplings = sampled + [Sampling(), Sampling()]  # greedy ones beside them
    solo = _solo(engine, packs, samplings)
    together, steps = _together(engine, packs, samplings)
    assert max(steps) == N
    assert [t for t, _ in together] == solo
    assert len({tuple(t) for t in solo}) == N  # the seeds did give different tokens


def test_leaving_midway_leaves_the_others_unchanged(tiny_llama):
    engine = TorchEngine(tiny_llama, dtype="float32", threads=1)
    packs = _packs(engine, seed=2)
    greedy = [Sampling()] * N
    solo = _solo(engine, packs, greedy, new=20)
    cut = {1: 3, 4: 7, 6: 1}  # 6 leaves on its first token (before its first batched step)
    together, steps = _together(engine, packs, greedy, new=20, cut=cut)
    for i, (tokens, how) in enumerate(together):
        if i in cut:
            assert how == "cut" and tokens == solo[i][:cut[i]]
        else:
            assert how is True and tokens == solo[i]
    assert max(steps) >= N - len(cut)


def test_eos_and_lengths(tiny_llama):
    """Sequences of different token counts, one stopping at an end token: each its solo tokens."""
    engine = TorchEngine(tiny_llama, dtype="float32", threads=1)
    packs = _packs(engine, seed=3)
    greedy = [Sampling()] * N
    solo = [engine.decode(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=4 + i,
                          stop_on_eos=False).token_ids for i, (ids, layers) in enumerate(packs)]
    stop = solo[5][3]  # sequence 5's fourth token, made an end token for this run
    saved = engine.info
    engine.info = dataclasses.replace(saved, eos_token_ids=(stop,))
    try:
        want = [engine.decode(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=4 + i).token_ids
                for i, (ids, layers) in enumerate(packs)]
        turns = Turns()
        engine.batch_decode(turns)
        te = TurnEngine(engine, turns)
        out: list = [None] * N

        def one(i: int) -> None:
            ids, layers = packs[i]
            out[i] = te.decode(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=4 + i)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        engine.close()
    finally:
        engine.info = saved
    assert [r.token_ids for r in out] == want
    assert want[5][-1] == stop and out[5].stats["stop_reason"] == "eos"
    assert all(len(w) == 4 + i for i, w in enumerate(want) if stop not in w)


def test_chunked_family_decodes_alone(tiny_family):
    engine = TorchEngine(tiny_family("llama4_text"), dtype="float32", threads=1)
    packs = _packs(engine)[:3]
    greedy = [Sampling()] * 3
    solo = _solo(engine, packs, greedy)
    together, steps = _together(engine, packs, greedy)
    assert steps == [] and [b for _, b in together] == [None] * 3
    assert [t for t, _ in together] == solo
