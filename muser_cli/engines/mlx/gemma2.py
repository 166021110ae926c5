"""Gemma 2 on mlx-lm with its sliding window: what mlx-lm 0.32's ``gemma2`` module leaves out.

mlx-lm 0.32's ``gemma2`` builds one plain ``KVCache`` per layer and one causal mask (from
layer 0's cache) that every layer shares: every layer attends to the whole prefix. Gemma 2
alternates sliding-window layers (even indices in transformers' ``layer_types``, window
``sliding_window``) with full ones, so past the window mlx-lm computes another model (while
the prompt is within the window the two are identical). Its ``Model`` also always ties the
output projection to the embeddings.

:func:`windowed_gemma2` keeps mlx-lm's own modules and forward and changes only what they are
given: a ``RotatingKVCache`` of the window for each sliding layer (``make_cache``, what
mlx-lm's ``gemma3_text`` builds for its sliding layers), and a mask per layer made from that
layer's own cache by mlx-lm's own ``create_attention_mask`` (with the window on sliding
layers) in place of the shared one. An untied checkpoint (``tie_word_embeddings: false``)
gets its ``lm_head``. The layer plan comes from :func:`muser_cli.model.resolve.layer_specs`, the
reading of the config that made the pack's layer descriptions; the engine's layout check
(:func:`~muser_cli.engines.mlx.config.check_model`) then compares the caches with them.
"""

from __future__ import annotations

from typing import Any

from muser_cli.model.resolve import layer_specs


def windowed_gemma2(model_cls: Any, config: dict[str, Any]) -> Any:
    """A subclass of mlx-lm's gemma2 ``Model`` whose sliding layers see only their window."""
    import mlx.nn as nn
    from mlx_lm.models import gemma2
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import KVCache, RotatingKVCache


    windows = [spec.window if spec.kind == "sliding" else None for spec in layer_specs(config)]
    tied = bool(config.get("tie_word_embeddings", True))  # Gemma2Config's default

    class Block(gemma2.TransformerBlock):  # type: ignore[misc, name-defined]
        """mlx-lm's block, attending through a mask made from its own cache and window."""

        def __init__(self, args: Any, window: int | None) -> None:
            super().__init__(args)
            self.window = window

        def __call__(self, x: Any, mask: Any = None, cache: Any = None) -> Any:
            own = create_attention_mask(x, cache, window_size=self.window, return_array=True)
            return super().__call__(x, own, cache)

    class WindowedGemma2(model_cls):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any) -> None:
            super().__init__(args)
            if len(windows) != args.num_hidden_layers:
                raise ValueError(f"gemma2: {len(windows)} layer types for {args.num_hidden_layers} layers")
            self.model.layers = [Block(args, window) for window in windows]
            if not tied:
                self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

        def __call__(self, inputs: Any, cache: Any = None) -> Any:
            if tied:
                return super().__call__(inputs, cache)
            import mlx.core as mx

            cap = self.final_logit_softcapping
            return mx.tanh(self.lm_head(self.model(inputs, cache)) / cap) * cap

        def make_cache(self) -> list[Any]:
            return [RotatingKVCache(max_size=window) if window else KVCache() for window in windows]

    return WindowedGemma2
