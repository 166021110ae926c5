"""``--engine mlx``: MLX + mlx-lm.

* :mod:`.engine` ``MLXEngine``
* :mod:`.cache`  rows into and out of mlx-lm's rotating caches
* :mod:`.config` a transformers folder's config read for mlx-lm (names, rope checks, refusals)
* :mod:`.sampling` the token picker (greedy, temperature + top-p)
* :mod:`.blas`   a fast BLAS for MLX's CPU backend, chosen before ``mlx.core`` loads

Importing this package imports no MLX: :mod:`.blas` must run before ``mlx.core`` is imported.
"""
