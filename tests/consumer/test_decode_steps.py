"""decode as steps (issue #37 item 1): a request is tokenized once — a service or a batch hands
decode the ids and the loaded model's facts — and decode and the lane read as short steps."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from muser_cli.consumer import decode as dec
from muser_cli.model.tokens import encode_prompt

ROOT = Path(__file__).resolve().parents[2]


def test_given_ids_the_prompt_is_not_tokenized_again(tiny_llama, monkeypatch):
    ids = encode_prompt(tiny_llama, "The committee met on a grey Tuesday to decide where the bridge would go.")
    alone = dec.decode(None, model=str(tiny_llama.path), prompt_ids=ids, max_new_tokens=4, dtype="float32",
                       reuse=False)

    def tokenized(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(dec, "encode_prompt", tokenized)
    again = dec.decode(None, prompt="ignored: the ids are given", prompt_ids=ids, info=tiny_llama, max_new_tokens=4,
                       dtype="float32", reuse=False)
    assert again.token_ids == alone.token_ids and again.prompt_tokens == len(ids)


@pytest.mark.parametrize("path", ["muser_cli/consumer/decode.py", "muser_cli/consumer/lane.py"])
def test_decode_and_the_lane_are_short_steps(path):
    """Every function of the consumer's decode and lane under 80 lines of code (docstring apart)."""
    tree = ast.parse((ROOT / path).read_text())
    long = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[1] if ast.get_docstring(node) and len(node.body) > 1 else node.body[0]
            if node.end_lineno - first.lineno + 1 > 80:
                long.append(f"{node.name}: {node.end_lineno - first.lineno + 1} lines")
    assert long == []
