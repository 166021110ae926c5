"""Gemma 3 on mlx-lm computing transformers' model in float32 too.

Gemma 3 scales the token embeddings by ``sqrt(hidden_size)``. transformers casts that factor
to the weights' dtype (exact in float32, rounded in bfloat16); mlx-lm 0.32's ``gemma3_text``
always rounds it to bfloat16. In bfloat16 the two agree; in float32 they are two models:
for the 270M checkpoint (hidden 640) 25.25 against 25.2982, 0.19 % on every embedding, and
the real model's K/V then differ by up to 2e-2 relative at some positions -- which the
numeric gate rightly refused. With the factor made transformers' the two engines agree to
2e-5 (the same float32 noise as on every other family).

:func:`match_embed_scale` leaves mlx-lm's modules and forward as they are and gives its
forward an embedding whose output is already multiplied by ``ours / theirs``, so mlx-lm's
own multiplication by its rounded factor lands on transformers' factor. The output
projection (tied to the embeddings) is the embedding's own, unchanged.
"""

from __future__ import annotations

from typing import Any


def _gemma3_text_models(model: Any) -> list[Any]:
    """The ``gemma3_text.Gemma3Model`` inside ``model`` (text-only, or a composite's language model)."""
    from mlx_lm.models import gemma3_text

    found = []
    for outer in (model, getattr(model, "language_model", None)):
        inner = getattr(outer, "model", None) if outer is not None else None
        if isinstance(inner, gemma3_text.Gemma3Model):
            found.append(inner)
    return found


def match_embed_scale(model: Any, dtype: str) -> float | None:
    """Make a loaded mlx-lm Gemma 3 scale its embeddings by ``sqrt(hidden_size)`` in ``dtype``
    (the run dtype), as transformers does; the correction applied (None: none was needed)."""
    import mlx.core as mx
    import mlx.nn as nn

    class Scaled(nn.Module):
        """The embedding, times ``ratio``; its ``as_linear`` (the tied output projection) unchanged."""

        def __init__(self, embedding: Any, ratio: float) -> None:
            super().__init__()
            self.embedding = embedding
            self.ratio = ratio

        def __call__(self, x: Any) -> Any:
            return self.embedding(x) * self.ratio

        def as_linear(self, x: Any) -> Any:
            return self.embedding.as_linear(x)

    applied = None
    for inner in _gemma3_text_models(model):  # once per load: the engine calls it on the model it just loaded
        root = inner.args.hidden_size ** 0.5
        run = getattr(mx, dtype)
        theirs = mx.array(root, mx.bfloat16).astype(run).item()  # mlx-lm's factor
        ours = mx.array(root, mx.float32).astype(run).item()  # transformers': torch.tensor(root).to(weight dtype)
        if ours != theirs:
            applied = ours / theirs
            inner.embed_tokens = Scaled(inner.embed_tokens, applied)
    return applied


__all__ = ["match_embed_scale"]
