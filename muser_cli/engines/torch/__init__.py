"""``--engine torch``: PyTorch + transformers (CPU).

* :mod:`.engine` ``TorchEngine``
* :mod:`.cache`  caches that keep their rows in place (sized full layers, sliding rings)

Importing this package imports neither torch nor transformers; :mod:`.engine` does.
"""
