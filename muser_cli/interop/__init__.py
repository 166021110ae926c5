"""Other tools' KV caches in and out of kvpacks.

* :mod:`muser_cli.interop.mlx_lm`: mlx-lm prompt-cache safetensors files (no MLX import);
* :mod:`muser_cli.interop.transformers`: a transformers ``DynamicCache`` (imports torch).

Described in docs/interop.md.
"""
