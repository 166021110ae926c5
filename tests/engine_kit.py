"""What the engine tests (tests/engines/test_torch_engine.py, test_mlx_engine.py) share: their
prompt, a pack's rows as another process gets them, and what every engine's decode refuses
before it computes. It holds no tests itself."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from muser_cli.errors import DataError
from muser_cli.kvpack.layers import DTYPES, LayerKV

PROMPT = (
    "The producer computes the prompt once and ships its keys and values to the consumer in Paris. "
    "Seven quick wizards juggle 42 lazy dogs; the window slides, the rows stay exact, zebras hum."
)


def through_bytes(layers: list[LayerKV], dtype: str) -> list[LayerKV]:
    """What a consumer in another process gets: read-only arrays rebuilt from raw bytes."""
    storage = np.dtype(DTYPES[dtype][1])
    out = []
    for kv in layers:
        assert kv.keys.dtype == storage and kv.values.dtype == storage
        keys = np.frombuffer(kv.keys.tobytes(), dtype=storage).reshape(kv.keys.shape)
        values = np.frombuffer(kv.values.tobytes(), dtype=storage).reshape(kv.values.shape)
        out.append(LayerKV(keys=keys, values=values, first_row=kv.first_row))
    return out


def refuses_bad_rows(eng, ids: list[int], chunk: int) -> list[LayerKV]:
    """``eng`` (on the tiny hybrid: 3 sliding layers, window 8, then a full one) prefills
    ``ids`` but the last (20 tokens) and its decode refuses, before it computes, rows that do
    not fit: too few layers, more rows than there are, a ring one row short, int32 rows, a
    token outside the vocabulary. Returns the rows it prefilled."""
    layers = eng.prefill(ids[:-1], chunk_tokens=chunk)
    with pytest.raises(DataError, match="3 layers of KV for a model with 4"):
        eng.decode(layers[:3], rows=20, next_tokens=ids[-1:], max_new_tokens=1)
    with pytest.raises(DataError, match="layer 0"):
        eng.decode(layers, rows=21, next_tokens=ids[-1:], max_new_tokens=1)
    ring = dataclasses.replace(layers[0], keys=layers[0].keys[:, 1:], values=layers[0].values[:, 1:])  # window - 1
    shifted = [dataclasses.replace(ring, first_row=0), *layers[1:]]
    with pytest.raises(DataError, match="rows start at position 0, expected 13"):
        eng.decode(shifted, rows=20, next_tokens=ids[-1:], max_new_tokens=1)
    ints = [LayerKV(keys=kv.keys.astype(np.int32), values=kv.values, first_row=kv.first_row) for kv in layers]
    with pytest.raises(DataError, match="int32"):
        eng.decode(ints, rows=20, next_tokens=ids[-1:], max_new_tokens=1)
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        eng.decode(layers, rows=20, next_tokens=[512], max_new_tokens=1)
    return layers


def run_queued_together(turns, n: int, one) -> None:
    """``one(i)`` for i in 0..n-1, each on a thread of its own, all queued for ``turns`` (held
    here meanwhile) before any runs: then released together, so their decode steps meet."""
    turns.acquire()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(turns._queue) < n and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        turns.release()
    for t in threads:
        t.join(120)
