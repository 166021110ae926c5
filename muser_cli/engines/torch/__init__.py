"""``--engine torch``: PyTorch + transformers (CPU).

* :mod:`.engine` ``TorchEngine``
* :mod:`.cache`  caches that keep their rows in place (sized full layers, sliding rings)
* :mod:`.arrays` a pack's numpy rows as torch tensors and back
* :mod:`.recompute` the masked one-step recompute of sampled positions (``recompute_at``)
* :mod:`.batch`  concurrent sequences' decode steps as one batched forward (``decode --serve``)

Importing this package imports neither torch nor transformers; :mod:`.engine` does.
"""
