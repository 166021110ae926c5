"""torch <-> MLX greedy agreement per family on its tiny model, teacher-forced over 32 tokens.

torch prefills the prompt (float32) and decodes 32 greedy tokens; then both engines, from
torch's rows, compute the logits of those 32 positions in one step each (teacher-forced:
the same inputs), and we count positions whose argmax agrees, and the largest logit
difference. Prints a Markdown table (docs/models.md).

    PYTHONPATH=. python benchmarks/model_families_agreement.py [family ...]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from muser_cli.engines.mlx import blas as mlx_blas
from muser_cli.engines.registry import get_engine
from muser_cli.model.check import TESTED
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tiny import make_tiny
from muser_cli.model.tokens import encode_prompt

PROMPT = ("The producer computes the prompt once and ships its keys and values to the consumer in Paris. "
          "Seven quick wizards juggle 42 lazy dogs; the window slides, the rows stay exact, zebras hum.")
N = 32


def agreement(info) -> tuple[int, float]:
    torch_eng = get_engine("torch", info, dtype="float32", threads=1)
    mlx_eng = get_engine("mlx", info, dtype="float32", threads=1)
    ids = encode_prompt(info, PROMPT)
    rows = len(ids) - 1
    layers = torch_eng.prefill(ids[:-1], chunk_tokens=16)
    new = torch_eng.decode(layers, rows=rows, next_tokens=ids[-1:], max_new_tokens=N, stop_on_eos=False).token_ids
    feed = [ids[-1], *new[:-1]]
    a = torch_eng.step_logits(layers, rows=rows, next_tokens=feed)
    b = mlx_eng.step_logits(layers, rows=rows, next_tokens=feed)
    return int((a.argmax(-1) == b.argmax(-1)).sum()), float(np.abs(a - b).max())


def main(families: list[str]) -> None:
    mlx_blas.ensure_fast_blas()
    print(f"| model_type | argmax agreement ({N} teacher-forced tokens) | max |logit diff| |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in families:
            info = resolve_model(make_tiny(name, Path(tmp) / name))
            same, diff = agreement(info)
            print(f"| {name} | {same}/{N} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or sorted(TESTED["mlx"] & TESTED["torch"]))
