"""Penalties, logit_bias, top-k, min-p and logprobs in the engines' pick (engines/base.py
``Sampling``), on the torch and the MLX engine, solo and batched (each sequence its own settings).

The reference is transformers itself on the same tiny model in float32, computed here: each
step's raw logits for the prompt and the tokens before it, shaped by OpenAI's definition
(``logit - frequency * count - presence * (count > 0) + bias``, counts over the generated tokens
only) after transformers' own ``RepetitionPenaltyLogitsProcessor`` (over the prompt and the
tokens generated), the greedy token the largest of them; logprobs the log-softmax of the raw
logits."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine_kit import run_queued_together
from muser_cli.consumer.turns import TurnEngine, Turns
from muser_cli.engines.base import Sampling
from muser_cli.engines.registry import get_engine
from muser_cli.model.tokens import encode_prompt

PROMPT = "The committee met on a grey Tuesday to decide where the new bridge would go, and"
NEW = 10
ENGINES = ["torch", pytest.param("mlx", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("mlx_lm"), reason="mlx-lm not installed"))]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama.path), dtype=torch.float32)
    model.eval()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].float()

    return logits


def _decode(info, eng, sampling: Sampling, prompt: str = PROMPT, n: int = NEW):
    ids = encode_prompt(info, prompt, chat=False)
    if sampling.repeats:  # the prompt's tokens count as seen (what the service gives)
        sampling = dataclasses.replace(sampling, seen=tuple(ids))
    layers = eng.prefill(ids[:-1])
    out = eng.decode(layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=n, sampling=sampling,
                     stop_on_eos=False)
    return ids, out.token_ids


def _reference_greedy(logits, ids: list[int], n: int, *, presence=0.0, frequency=0.0, bias=(),
                      repetition=1.0) -> list[int]:
    from transformers import RepetitionPenaltyLogitsProcessor

    tokens: list[int] = []
    counts: dict[int, int] = {}
    for _ in range(n):
        row = logits(ids + tokens).clone()
        if repetition != 1.0:
            row = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([ids + tokens]), row[None, :])[0]
        for t, c in counts.items():
            row[t] -= frequency * c + presence * (1 if c > 0 else 0)
        for t, b in bias:
            row[t] += b
        token = int(torch.argmax(row))
        tokens.append(token)
        counts[token] = counts.get(token, 0) + 1
    return tokens


@pytest.mark.parametrize("engine", ENGINES)
def test_logprobs_are_the_raw_log_softmax(engine, tiny_llama, reference):
    eng = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    record: list = []
    # a penalty and a temperature change the pick, not the logprobs: the model's own distribution
    ids, tokens = _decode(tiny_llama, eng, Sampling(temperature=0.9, seed=5, frequency_penalty=0.7, logprobs=5,
                                                    record=record))
    assert len(record) == len(tokens) == NEW
    for i, (token, (lp, top)) in enumerate(zip(tokens, record)):
        truth = torch.log_softmax(reference(ids + tokens[:i]), dim=-1)
        assert abs(lp - float(truth[token])) < 1e-4, (i, lp, float(truth[token]))
        assert len(top) == 5
        want = torch.topk(truth, 5)
        assert [t for t, _ in top] == [int(t) for t in want.indices], i
        assert all(abs(v - float(w)) < 1e-4 for (_, v), w in zip(top, want.values))


@pytest.mark.parametrize("engine", ENGINES)
def test_penalties_and_bias_follow_openais_definition(engine, tiny_llama, reference):
    eng = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    ids, plain = _decode(tiny_llama, eng, Sampling())
    assert plain == _reference_greedy(reference, ids, NEW)
    for kw in ({"frequency": 1.5}, {"presence": 1.5}, {"frequency": -0.5, "presence": 0.5},
               {"bias": ((plain[0], -100.0), (plain[1], 3.0))}):
        sampling = Sampling(frequency_penalty=kw.get("frequency", 0.0), presence_penalty=kw.get("presence", 0.0),
                            logit_bias=kw.get("bias", ()))
        _, got = _decode(tiny_llama, eng, sampling)
        assert got == _reference_greedy(reference, ids, NEW, **kw), kw
    # +100 makes a token the output; a strong frequency penalty keeps any token from repeating
    _, got = _decode(tiny_llama, eng, Sampling(logit_bias=((123, 100.0),)))
    assert got == [123] * NEW
    _, got = _decode(tiny_llama, eng, Sampling(frequency_penalty=2.0))
    assert got == _reference_greedy(reference, ids, NEW, frequency=2.0)


@pytest.mark.parametrize("engine", ENGINES)
def test_repetition_penalty_is_transformers(engine, tiny_llama, reference):
    """Greedy under a repetition penalty is transformers' RepetitionPenaltyLogitsProcessor (the
    prompt's tokens and the answer's so far seen: a positive logit divided by it, a negative one
    multiplied), before the frequency penalty; and it changes the answer."""
    eng = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    ids, plain = _decode(tiny_llama, eng, Sampling())
    for kw in ({"repetition": 1.5}, {"repetition": 0.7}, {"repetition": 1.3, "frequency": 0.5}):
        sampling = Sampling(repetition_penalty=kw["repetition"], frequency_penalty=kw.get("frequency", 0.0))
        _, got = _decode(tiny_llama, eng, sampling)
        want = _reference_greedy(reference, ids, NEW, **kw)
        assert got == want, kw
        if kw == {"repetition": 1.5}:
            assert got != plain


@pytest.mark.parametrize("engine", ENGINES)
def test_top_k_and_min_p_keep_only_the_likely(engine, tiny_llama, reference):
    """At temperature 2, every token picked under ``top_k`` k is among the k largest logits of its
    step; under ``min_p`` m its probability (after temperature) is at least m times the top one's;
    the same seeds without them pick tokens outside (the filter had an effect); ``top_k`` 1 is greedy."""
    eng = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    ids, greedy = _decode(tiny_llama, eng, Sampling())
    hot = 2.0
    assert _decode(tiny_llama, eng, Sampling(temperature=hot, seed=3, top_k=1))[1] == greedy
    outside = {"top_k": 0, "min_p": 0}
    for seed in range(3):
        for kw in ({"top_k": 3}, {"min_p": 0.3}, {}):
            _, got = _decode(tiny_llama, eng, Sampling(temperature=hot, seed=seed, **kw))
            for i, token in enumerate(got):
                row = reference(ids + got[:i]) / hot
                in_top_k = float(row[token]) >= float(torch.topk(row, 3).values[-1]) - 1e-5
                above_min_p = float(row[token] - row.max()) >= math.log(0.3) - 1e-5
                if kw:
                    assert in_top_k if "top_k" in kw else above_min_p, (kw, seed, i)
                else:
                    outside["top_k"] += not in_top_k
                    outside["min_p"] += not above_min_p
    assert all(outside.values()), outside


@pytest.mark.parametrize("engine", ENGINES)
def test_same_seed_same_tokens(engine, tiny_llama):
    eng = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    a = _decode(tiny_llama, eng, Sampling(temperature=1.0, seed=11))[1]
    b = _decode(tiny_llama, eng, Sampling(temperature=1.0, seed=11))[1]
    c = _decode(tiny_llama, eng, Sampling(temperature=1.0, seed=12))[1]
    assert a == b and a != c


@pytest.mark.parametrize("engine", ENGINES)
def test_batched_sequences_keep_their_own_settings(engine, tiny_llama):
    """Sequences stepped together, each with its own penalties, bias, seed and logprobs, give
    their solo tokens and logprobs."""
    solo = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    batched = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    turns, steps = Turns(), []
    batched.batch_decode(turns, on_step=steps.append)
    te = TurnEngine(batched, turns)
    settings = [{}, {"frequency_penalty": 1.5, "logprobs": 3}, {"presence_penalty": 1.0, "logprobs": 0},
                {"logit_bias": ((77, 4.0), (901, 2.5))},
                {"temperature": 0.8, "seed": 3, "frequency_penalty": 0.5, "logprobs": 2},
                {"repetition_penalty": 1.8}, {"repetition_penalty": 0.6, "logprobs": 1}, {"temperature": 1.5, "seed": 9, "top_k": 4, "min_p": 0.2, "top_p": 0.9}]
    prompts = [f"Sequence {i} asks about bridge {i * 11 + 2} over the grey river, and" for i in range(len(settings))]
    alone = []
    for p, kw in zip(prompts, settings):
        rec: list = []
        alone.append((_decode(tiny_llama, solo, Sampling(**kw, record=rec), p, n=12)[1], rec))
    out: list = [None] * len(settings)

    def one(i: int) -> None:
        turns.join()
        try:
            rec: list = []
            ids = encode_prompt(tiny_llama, prompts[i], chat=False)
            layers = te.prefill(ids[:-1])
            r = te.decode(layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=12,
                          sampling=Sampling(**settings[i], record=rec, seen=tuple(ids)), stop_on_eos=False)
            out[i] = (r.token_ids, rec, r.stats.get("batched"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[i] = exc
        finally:
            turns.leave()

    run_queued_together(turns, len(settings), one)
    batched.close()
    assert not any(isinstance(o, BaseException) for o in out), out
    assert max(steps) > 1
    for i, ((tokens, rec), (got, got_rec, was_batched)) in enumerate(zip(alone, out)):
        assert was_batched, i
        assert got == tokens, i
        assert len(got_rec) == len(rec), i
        for (lp, top), (glp, gtop) in zip(rec, got_rec):
            assert abs(lp - glp) < 1e-4 and [t for t, _ in top] == [t for t, _ in gtop], i


@pytest.mark.parametrize("engine", ENGINES)
def test_a_repetition_penalty_holds_in_the_batch(engine, tiny_llama):
    """mlx-lm's generation batch hands a sequence's picker log-probabilities, not logits: a
    repetition penalty (not shift-invariant) on them would pick other tokens than alone (it did,
    before the picker took the raw logits through a logits processor). Batched = solo, three
    sequences below 1 (repeats made more likely, where the two readings part soonest)."""
    solo = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    batched = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    turns = Turns()
    batched.batch_decode(turns)
    te = TurnEngine(batched, turns)
    prompts = [f"Sequence {i} asks about bridge {i * 11 + 2} over the grey river, and" for i in range(3)]
    out: list = [None] * len(prompts)

    def one(i: int) -> None:
        turns.join()
        try:
            ids = encode_prompt(tiny_llama, prompts[i], chat=False)
            r = te.decode(te.prefill(ids[:-1]), rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=12,
                          sampling=Sampling(repetition_penalty=0.6, seen=tuple(ids)), stop_on_eos=False)
            out[i] = (r.token_ids, r.stats.get("batched"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[i] = exc
        finally:
            turns.leave()

    run_queued_together(turns, len(prompts), one)
    batched.close()
    assert not any(isinstance(o, BaseException) for o in out), out
    for i, p in enumerate(prompts):
        assert out[i][1], i
        assert out[i][0] == _decode(tiny_llama, solo, Sampling(repetition_penalty=0.6), p, n=12)[1], i
