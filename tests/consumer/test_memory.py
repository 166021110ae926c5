"""The turn memory (muser_cli/consumer/memory.py) on its own: where an entry may be cut, the
byte bound, the wait for an answer still being extended; and, on a real tiny model, that a
held prefix continued by ``decode(held=...)`` gives the rows of a prefill whose schedule breaks
at the held point (``prefill_from(anywhere=True)``), while the canonical resume check stays."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from muser_cli.consumer.memory import TurnMemory, common_prefix
from muser_cli.kvpack import LayerKV
from muser_cli.kvpack.layers import StateKV

KEY = ("model", "tokenizer", "torch", "float32")


def full(rows: int, fill: float = 1.0) -> LayerKV:
    return LayerKV(keys=np.full((2, rows, 4), fill, np.float32), values=np.full((2, rows, 4), -fill, np.float32))


def sliding(end: int, window: int = 4) -> LayerKV:
    held = min(end, window - 1)
    return LayerKV(keys=np.full((2, held, 4), end, np.float32), values=np.full((2, held, 4), end, np.float32),
                   first_row=end - held)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0


def test_full_layers_are_cut_at_any_token():
    memory = TurnMemory(["full", "latent"], KEY, 1 << 20)
    tokens = list(range(10, 30))
    layers = [full(20), full(20, 2.0)]
    assert memory.keep(memory.begin(tokens), tokens, layers)
    held = memory.find(tokens[:13] + [99, 98])  # the common prefix: 13 tokens
    assert held is not None and held.rows == 13 and held.exact_points == ()
    assert held.layers[0].keys.shape == (2, 13, 4) and held.layers[1].values[0, 0, 0] == -2.0
    whole = memory.find(tokens + [1, 2])  # the whole entry, and more: all 20 rows held
    assert whole is not None and whole.rows == 20
    same = memory.find(tokens)  # the entry's own tokens as a prompt: its rows but the last
    assert same is not None and same.rows == 19
    assert memory.find([7, 8, 9]) is None
    assert memory.find(tokens, key=("another",)) is None  # another model, engine or dtype: nothing


def test_sliding_and_state_layers_are_cut_only_at_a_point_held():
    memory = TurnMemory(["sliding", "full", "state"], KEY, 1 << 20)
    tokens = list(range(100, 120))  # 20 tokens; the prompt it answered ended at row 12
    state_at = {p: StateKV(tensors={"s": np.full((3,), p, np.float32)}, position=p) for p in (12, 20)}
    prompt = [sliding(12), full(12), state_at[12]]
    assert memory.keep(memory.begin(tokens), tokens, [sliding(20), full(20), state_at[20]], {12: prompt})
    held = memory.find(tokens[:16] + [1, 2])  # a common prefix of 16: the cut falls back to 12
    assert held is not None and held.rows == 12 and held.exact_points == (12, 20)
    assert held.layers[0].first_row == 9 and held.layers[1].keys.shape[1] == 12
    assert held.layers[2].position == 12 and held.layers[2].tensors["s"][0] == 12
    end = memory.find(tokens + [5, 6])
    assert end is not None and end.rows == 20 and end.layers[2].position == 20
    assert memory.find(tokens[:11] + [1, 2]) is None  # no point within 11 tokens


def test_the_byte_bound_evicts_the_least_recently_used():
    one = 2 * (2 * 10 * 4 * 4)  # an entry of 10 rows, one full layer: K and V float32
    memory = TurnMemory(["full"], KEY, 2 * one)
    a, b, c = ([k] * 10 for k in (1, 2, 3))
    for tokens in (a, b):
        assert memory.keep(memory.begin(tokens), tokens, [full(10)])
    assert memory.find(a + [0]) is not None  # a used: b is now the least recently used
    assert memory.keep(memory.begin(c), c, [full(10)])
    assert len(memory) == 2 and memory.evicted == 1 and memory.nbytes <= 2 * one
    assert memory.find(b + [0]) is None and memory.find(a + [0]).rows == 10 and memory.find(c + [0]).rows == 10
    big = [4] * 40
    assert not memory.keep(memory.begin(big), big, [full(40)])  # over the bound alone: not kept, nothing evicted
    assert len(memory) == 2


def test_an_entry_the_next_one_extends_is_dropped():
    memory = TurnMemory(["full"], KEY, 1 << 20)
    first, longer = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]
    memory.keep(memory.begin(first), first, [full(4)])
    memory.keep(memory.begin(longer), longer, [full(6)])
    assert len(memory) == 1 and memory.find(first + [9]).entry_tokens == 6


def test_a_lookup_waits_for_an_answer_being_extended():
    memory = TurnMemory(["full"], KEY, 1 << 20)
    tokens = list(range(1, 21))
    ticket = memory.begin(tokens)

    def later():
        time.sleep(0.3)
        memory.keep(ticket, tokens, [full(20)])

    t0 = time.monotonic()  # before the answer's 0.3 s start: a loaded machine may start the thread late, never early
    threading.Thread(target=later).start()
    held = memory.find(tokens[:15] + [0])
    assert held is not None and held.rows == 15 and time.monotonic() - t0 >= 0.25
    gone = memory.begin([9] * 10)
    t0 = time.monotonic()
    # nothing it would serve, while another answer is being extended: no wait (a wait would be
    # WAIT_S, 30 s; the bound is what any machine meets, far below it)
    assert memory.find([50, 51, 52]) is None and time.monotonic() - t0 < 5
    memory.end(gone)  # an extension that failed: the wait ends with it
    assert memory.find([9] * 5, wait_s=5) is None


def test_a_held_prefix_continued_equals_a_prefill_with_a_schedule_break(tiny_llama):
    """decode(held=...) computes the rest from the held point, its chunks starting there: the
    rows equal prefill + prefill_from(anywhere=True), bit for bit; the rows before the cut are
    the held ones. A resume off the grid without ``anywhere`` is still refused."""
    from muser_cli.consumer.decode import decode
    from muser_cli.engines.registry import get_engine
    from muser_cli.errors import UsageError
    from muser_cli.model.tokens import encode_prompt

    eng = get_engine("torch", tiny_llama, dtype="float32", threads=1)
    ids = encode_prompt(tiny_llama, "The producer computes the prompt once and ships its keys and values.")
    cut = 13
    assert len(ids) > cut + 8  # a cut off the chunk grid (8), and a rest of more than a chunk
    first = eng.prefill(ids[:cut], chunk_tokens=8)
    with pytest.raises(UsageError):
        eng.prefill_from(first, rows=cut, token_ids=ids[cut:-1], chunk_tokens=8)
    want = eng.prefill_from(first, rows=cut, token_ids=ids[cut:-1], chunk_tokens=8, anywhere=True)
    memory = TurnMemory([s.kind for s in tiny_llama.layers], KEY, 1 << 30)
    memory.keep(memory.begin(ids[:cut]), ids[:cut], first)
    held = memory.find(ids)
    assert held is not None and held.rows == cut
    seen = []
    out = decode(None, model=str(tiny_llama.path), prompt_ids=ids, info=tiny_llama, max_new_tokens=4, dtype="float32",
                 threads=1, chunk_tokens=8, reuse=False, resident=eng, held=held, on_rows=seen.append)
    assert out.source == "held" and out.held_tokens == cut and out.computed_tokens == len(ids) - 1 - cut
    assert out.reuse == {"held_tokens": cut, "computed_tokens": len(ids) - 1 - cut}
    got = seen[-1].layers
    for a, b in zip(got, want):
        assert np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values)
    ref = eng.decode(want, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=4, chunk_tokens=8)
    assert out.token_ids == list(ref.token_ids)
