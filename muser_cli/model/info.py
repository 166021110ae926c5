"""What a model is, without loading its weights: the facts every layer above shares.

Below the engines, the tokenizer, the identity checks and the store: each of them takes
a :class:`ModelInfo`, and none of them needs an engine to do so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from muser_cli.kvpack.layers import LayerSpec

ProgressFn = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class ModelInfo:
    """What a model is, without loading its weights (no torch import needed)."""

    path: Path  # Hugging Face-style folder: config.json, *.safetensors, tokenizer files
    name: str
    fingerprint: str  # "sha256:<hex>" over canonical config + weight bytes
    tokenizer_fingerprint: str  # "sha256:<hex>" over the tokenizer files
    architecture: str
    layers: tuple[LayerSpec, ...]
    max_positions: int
    eos_token_ids: tuple[int, ...] = ()
    # Rows of the embedding (config.json's vocab_size, checked against the weights'
    # header): every token id must lie in [0, vocab_size). 0 = unknown, and then the
    # identity checks refuse every pack (fail closed).
    vocab_size: int = 0
