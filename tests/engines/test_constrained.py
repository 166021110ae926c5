"""Constrained decoding (engines/constraint.py, ``Sampling.constraint``): on the torch and the MLX
engine, solo and batched (each sequence its own matcher and schema), a tiny random model's
answer under a JSON schema parses and validates (``jsonschema``), and it ends on the model's end
token once the grammar accepts, never before."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine_kit import run_queued_together
from muser_cli.consumer.turns import TurnEngine, Turns
from muser_cli.engines.base import Sampling
from muser_cli.engines.constraint import (
    json_constraint,
    schema_problem,
    tool_constraint,
)
from muser_cli.engines.registry import get_engine
from muser_cli.model.tokens import decode_text, encode_prompt

ENGINES = ["torch", pytest.param("mlx", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("mlx_lm"), reason="mlx-lm not installed"))]
NEW = 200

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", "bird"]}},
     "required": ["name", "count", "ok", "kind"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"when": {"enum": ["now", "later"]},
                                      "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
     "required": ["when", "tags"], "additionalProperties": False},
    {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": 100, "maximum": 200}]},
]
PROMPTS = [f"Record {i}: the committee met on a grey Tuesday about bridge {i * 7 + 3}, and" for i in range(len(SCHEMAS))]


def _decode(info, eng, sampling: Sampling, prompt: str):
    ids = encode_prompt(info, prompt, chat=False)
    layers = eng.prefill(ids[:-1])
    return eng.decode(layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=NEW, sampling=sampling)


def _valid(info, tokens: list[int], schema: dict) -> object:
    assert tokens[-1] in info.eos_token_ids, "the answer did not end on the end token"
    assert not any(t in info.eos_token_ids for t in tokens[:-1])
    value = json.loads(decode_text(info, tokens))
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_answer_validates(engine, tiny_llama):
    eng = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    for schema, prompt in zip(SCHEMAS, PROMPTS):
        out = _decode(tiny_llama, eng, Sampling(constraint=json_constraint(tiny_llama, schema)), prompt)
        assert out.stats["stop_reason"] == "eos"
        _valid(tiny_llama, out.token_ids, schema)
    # unconstrained, the same model writes no JSON at all
    free = _decode(tiny_llama, eng, Sampling(), PROMPTS[0])
    with pytest.raises(ValueError):
        json.loads(decode_text(tiny_llama, free.token_ids))


@pytest.mark.parametrize("engine", ENGINES)
def test_sampled_answer_validates_with_penalties_and_bias(engine, tiny_llama):
    """Temperature, top-p, penalties and a bias on the token of ``{``: the mask still decides."""
    eng = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    brace = encode_prompt(tiny_llama, "{", chat=False)[-1]
    for seed in range(3):
        sampling = Sampling(temperature=1.2, top_p=0.95, seed=seed, frequency_penalty=1.0, presence_penalty=0.5,
                            logit_bias=((brace, -100.0),), constraint=json_constraint(tiny_llama, SCHEMAS[0]))
        out = _decode(tiny_llama, eng, sampling, PROMPTS[0])
        _valid(tiny_llama, out.token_ids, SCHEMAS[0])


@pytest.mark.parametrize("engine", ENGINES)
def test_max_tokens_cuts_the_json(engine, tiny_llama):
    """Cut by max_tokens, the answer is a prefix of a valid one and ends on no end token."""
    eng = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    ids = encode_prompt(tiny_llama, PROMPTS[0], chat=False)
    out = eng.decode(eng.prefill(ids[:-1]), rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=4,
                     sampling=Sampling(constraint=json_constraint(tiny_llama, SCHEMAS[0])))
    assert out.stats["stop_reason"] == "length" and len(out.token_ids) == 4
    assert '{"name": "'.startswith(decode_text(tiny_llama, out.token_ids)) or \
        decode_text(tiny_llama, out.token_ids).startswith('{"name": "')


@pytest.mark.parametrize("engine", ENGINES)
def test_tool_arguments_after_a_forced_opening(engine, tiny_llama):
    """A tool call's rest after the forced ``{"name": "`` (tool_choice required): one offered name,
    its arguments by that function's schema (free whitespace), the call's closing brace."""
    eng = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    calls = [("get_weather\", \"arguments\": ", SCHEMAS[2]), ("count\", \"arguments\": ", SCHEMAS[0])]
    out = _decode(tiny_llama, eng, Sampling(constraint=tool_constraint(tiny_llama, calls, "}")),
                  'Call a tool. {"name": "')
    text = decode_text(tiny_llama, out.token_ids)
    call, _ = json.JSONDecoder().raw_decode('{"name": "' + text)  # one call: free text may follow it
    schema = dict(calls)[f'{call["name"]}", "arguments": ']
    jsonschema.validate(call["arguments"], schema)


def test_schema_problems_are_named():
    assert schema_problem(SCHEMAS[0]) is None
    assert "not" in schema_problem({"type": "object", "not": {"required": ["a"]}})


@pytest.mark.parametrize("engine", ENGINES)
def test_batched_sequences_each_keep_their_own_schema(engine, tiny_llama):
    """Sequences stepped together, each under its own schema (and one unconstrained), give their
    solo tokens, and each constrained one validates."""
    solo = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    batched = get_engine(engine, tiny_llama, dtype="float32", threads=1)
    turns, steps = Turns(), []
    batched.batch_decode(turns, on_step=steps.append)
    te = TurnEngine(batched, turns)
    schemas = SCHEMAS + [None]
    prompts = PROMPTS + ["An unconstrained sequence about the grey river, and"]

    def sampling(i: int) -> Sampling:
        return Sampling(constraint=json_constraint(tiny_llama, schemas[i])) if schemas[i] is not None else Sampling()

    alone = [_decode(tiny_llama, solo, sampling(i), p).token_ids for i, p in enumerate(prompts)]
    out: list = [None] * len(prompts)

    def one(i: int) -> None:
        turns.join()
        try:
            ids = encode_prompt(tiny_llama, prompts[i], chat=False)
            layers = te.prefill(ids[:-1])
            r = te.decode(layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=NEW, sampling=sampling(i))
            out[i] = (r.token_ids, r.stats.get("batched"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[i] = exc
        finally:
            turns.leave()

    run_queued_together(turns, len(prompts), one)
    batched.close()
    assert not any(isinstance(o, BaseException) for o in out), out
    assert max(steps) > 1
    for i, (tokens, (got, was_batched)) in enumerate(zip(alone, out)):
        assert was_batched, i
        assert got == tokens, i
        if schemas[i] is not None:
            _valid(tiny_llama, got, schemas[i])
