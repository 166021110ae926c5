"""The torch engine's running batch: the sequences' caches left-padded into one transformers cache.

Each sequence comes in with its own cache (installed from rows, its first step done by its own
thread) and the token that step picked. The batch holds one ``DynamicCache`` over all of them,
built from transformers' own layers with a batch dimension:

* a full-attention (or latent, MLA) layer is a :class:`~muser_cli.engines.torch.cache.SizedLayer`
  whose ``(batch, heads, capacity, dim)`` buffers hold every sequence's rows *right-aligned* on
  one common length ``L`` (the longest sequence's rows; a shorter one's columns before its first
  row are zero padding), so that a step writes every sequence's new row in the same column;
* a sliding layer is transformers' own ``DynamicSlidingWindowLayer`` holding the last
  ``min(L, window - 1)`` columns, its ``cumulative_length`` set to ``L``;
* a recurrent-state layer (qwen3_next's gated DeltaNet, granitemoehybrid's Mamba-2) is
  transformers' own ``LinearAttentionLayer``, its conv window and recurrent matrix stacked on the
  batch dimension (no sequence dimension: nothing to pad).

A step is one forward of ``(batch, 1)`` tokens with a 2-D attention mask (0 on every padding
column) and each sequence's own absolute position (``position_ids``: RoPE sees what the solo
decode sees). transformers builds the per-layer masks from that 2-D mask in the padded
coordinates (``kv_offset`` included, so the sliding window's distance is each sequence's own);
a one-token step of a recurrent layer reads no mask. Each sequence then picks its token from
its own row of the logits with its own picker (the solo path's ``Picker``: its own seeded
generator, penalty counts, bias and logprob record), stops at its end-of-sequence tokens or its token count; a finished or departed
sequence is cut out (the cache rebuilt from the rows that stay, the leading columns no one
needs trimmed), the others untouched.

Why this and not transformers' own batching: transformers 5.24's continuous batching
(``generation/continuous_batching``) owns its paged cache and computes every request's prefill
itself from token ids; it has no way in for rows installed from a pack, and it schedules its own
requests rather than stepping sequences whose first step their threads computed, so it was not
a candidate to measure. A ``DynamicCache`` over batch tensors is what transformers' ``generate``
itself decodes a padded batch with: the model code and its masks are the ones the solo decode
runs, and a batch of one (all columns real: transformers then builds no mask) computes exactly
the solo step. Measured on SmolLM2-135M, float32, one thread (a shared 2-core machine): a step
of 8 sequences ~114 ms against ~59-62 ms for one (the matmuls of 8 rows are compute-bound:
``aten::mm`` is 84% of the step), so 8 clients decode ~4.2x one client's tokens/s once they
all run; each joining sequence's own first step (install + fused gate) runs alone between two
steps, which brings 8 clients x 64 tokens to ~3.5x end to end. Batched kernels round
differently from one-row ones (an 8-row ``linear`` is not bitwise the 1-row one), so a greedy
token can change where two logits nearly tie. float32: 16 of 16 real-model sequences of 128
greedy tokens were their solo tokens, and 8 of 8 on tiny models of 20 families. bfloat16 (not
the measured default): on tiny random models, whose logits often tie to one bfloat16 step,
4 to 8 of 8 sequences of 24 tokens kept their solo tokens.

Cost of joining and leaving: the batch cache is rebuilt (every row copied once) whenever
sequences join or leave, about one step's worth of memory traffic; a step itself copies nothing
but its new column.

Families that cannot batch this way decode alone (:data:`TORCH_DECODES_ALONE` by name, and
:func:`batchable` by the layers' kinds: a chunked layer's mask counts chunks from absolute
position 0, which left padding would shift per sequence).

Imported only by an engine that has transformers loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from muser_cli.engines.stepper import Member
from muser_cli.engines.torch.cache import SizedLayer
from muser_cli.engines.torch.state import is_state_layer, set_state

#: model_type -> why the batched decode leaves it out: its sequences decode alone, one per call,
#: even beside others (docs/serve.md). Chunked layers (Llama 4) are left out by their kind
#: (:func:`batchable`).
TORCH_DECODES_ALONE: dict[str, str] = {}

_KINDS = frozenset({"full", "sliding", "latent", "state"})


@dataclass
class Entry:
    """What a sequence brings to the batch."""

    cache: Any  # its own DynamicCache, holding every position before ``position``
    first: int  # the token its own first step picked (not yet in its cache)
    position: int  # the absolute position ``first`` goes in (= rows the cache has seen)
    pick: Callable[[torch.Tensor], int]  # its row's logits (vocab,) -> its token (its own Picker)
    max_tokens: int  # tokens to give out after ``first``
    eos: tuple[int, ...]


def batchable(specs: Sequence[Any], cache: Any) -> bool:
    """Whether these layers can join a batch: full, sliding, latent and state layers on
    transformers' plain layer kinds (a sized or dynamic full layer, the plain sliding layer, a
    linear-attention layer). A chunked layer (Llama 4) or a producer's ring is not."""
    if not specs or len(specs) != len(cache.layers):
        return False
    for spec, layer in zip(specs, cache.layers):
        if spec.kind not in _KINDS:
            return False
        if spec.kind == "state":
            if not is_state_layer(layer) or getattr(layer, "number_of_states", 1) != 1:
                return False
        elif spec.kind == "sliding":
            if type(layer) is not DynamicSlidingWindowLayer:
                return False
        elif not isinstance(layer, DynamicLayer) or getattr(layer, "is_sliding", False):
            return False
    return True


@dataclass(eq=False)
class _Row:
    member: Member
    position: int  # where its next token goes = its real columns, at the right end of the batch's
    last: int  # the token to feed
    given: int  # tokens given after its first


class TorchBatch:
    """A :class:`muser_cli.engines.stepper.Batch` over one left-padded transformers cache."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._specs = engine.info.layers
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # (batch, capacity) 1 on real columns
        self._length = 0  # L: columns every row ends at
        self._padded = False  # whether some row has padding columns (else no mask is passed)

    def __len__(self) -> int:
        return len(self._rows)

    # ------------------------------------------------------------------ membership

    def add(self, members: list[Member]) -> None:
        with self._engine._session():
            parts = [(len(self._rows), self._parts_of_batch())] if self._rows else []
            rows = list(self._rows)
            for member in members:
                e = member.entry
                parts.append((1, self._parts_of_cache(e.cache, e.position)))
                rows.append(_Row(member, e.position, e.first, 0))
                e.cache = None  # its own buffers go once merged
            self._build(rows, parts)

    def drop(self, members: list[Member]) -> None:
        gone = {id(m) for m in members}
        keep = [i for i, r in enumerate(self._rows) if id(r.member) not in gone]
        if len(keep) == len(self._rows):
            return
        with self._engine._session():
            self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        if not keep:
            self._rows, self._cache, self._mask, self._length = [], None, None, 0
            return
        whole = self._parts_of_batch()
        index = torch.tensor(keep, dtype=torch.long)
        parts = [(len(keep), [None if p is None else tuple(t.index_select(0, index) for t in p) for p in whole])]
        self._build([self._rows[i] for i in keep], parts)

    # ------------------------------------------------------------------ a step

    def step(self) -> list[tuple[Member, int, str | None]]:
        engine = self._engine
        with engine._session():
            n = len(self._rows)
            length = self._length
            assert self._mask is not None
            if self._mask.shape[1] <= length:
                self._mask = torch.nn.functional.pad(self._mask, (0, max(16, length + 1 - self._mask.shape[1])))
            self._mask[:, length] = 1
            ids = torch.tensor([[r.last] for r in self._rows], dtype=torch.long)
            positions = torch.tensor([[r.position] for r in self._rows], dtype=torch.long)
            # no padding column (one sequence, or all of one length): no mask, as the solo step
            mask = self._mask[:, :length + 1] if self._padded else None
            out = engine.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                               use_cache=True, logits_to_keep=1, **{engine._cache_kw: self._cache})
            logits = out.logits[:, -1]
            self._length = length + 1
            given, finished = [], []
            for i in range(n):
                row = self._rows[i]
                entry = row.member.entry
                token = entry.pick(logits[i])
                row.given += 1
                row.position += 1
                row.last = token
                finish = "stop" if token in entry.eos else "length" if row.given >= entry.max_tokens else None
                if finish is not None:
                    finished.append(i)
                given.append((row.member, token, finish))
            if finished:
                self._keep([i for i in range(n) if i not in finished])
            return given

    # ------------------------------------------------------------------ building the cache

    def _parts_of_cache(self, cache: Any, n: int) -> list[tuple[torch.Tensor, ...] | None]:
        """One sequence's cache as per-layer tensors with a batch dimension of 1: a row layer's
        K and V (its last rows: all of a full layer's ``n``, a sliding layer's held ones), a
        state layer's conv window and recurrent matrix."""
        out: list[tuple[torch.Tensor, ...] | None] = []
        for spec, layer in zip(self._specs, cache.layers):
            if spec.kind == "state":
                out.append((layer.conv_states[0], layer.recurrent_states[0]) if layer.has_previous_state[0] else None)
            elif n == 0 or not getattr(layer, "is_initialized", False) or layer.keys.dim() != 4:
                out.append(None)
            else:
                out.append((layer.keys, layer.values))
        return out

    def _parts_of_batch(self) -> list[tuple[torch.Tensor, ...] | None]:
        """The batch's cache as :meth:`_parts_of_cache` gives one sequence's (rows right-aligned)."""
        return self._parts_of_cache(self._cache, self._length)

    def _build(self, rows: list[_Row], parts: list[tuple[int, list[tuple[torch.Tensor, ...] | None]]]) -> None:
        """A fresh batch cache over ``rows``, whose layers' tensors ``parts`` hold group by group
        (each group's rows right-aligned on its own length), every row right-aligned on the
        longest row's length (the columns no row needs are dropped). ``parts``: (rows, per-layer
        tensors) a group."""
        engine = self._engine
        length = max(r.position for r in rows)
        room = max(r.member.entry.max_tokens - r.given for r in rows) + 1
        b = len(rows)
        counts = [count for count, _ in parts]
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        assert sum(counts) == b, (counts, b)
        cache = DynamicCache(config=engine.model.config)
        dtype = engine.torch_dtype
        for index, spec in enumerate(self._specs):
            layer = cache.layers[index]
            got = [group[index] for _, group in parts]
            if spec.kind == "state":
                if all(g is None for g in got):
                    continue
                ref = next(g for g in got if g is not None)
                conv = torch.zeros((b, *ref[0].shape[1:]), dtype=ref[0].dtype)
                rec = torch.zeros((b, *ref[1].shape[1:]), dtype=ref[1].dtype)
                for g, off, cnt in zip(got, offsets, counts):
                    if g is not None:
                        conv[off:off + cnt].copy_(g[0])
                        rec[off:off + cnt].copy_(g[1])
                set_state(layer, conv, rec, kernel=ref[0].shape[-1], rows=length)
                continue
            if all(g is None for g in got):
                continue
            ref = next(g for g in got if g is not None)
            heads, kdim, vdim = ref[0].shape[1], ref[0].shape[-1], ref[1].shape[-1]
            if spec.kind == "sliding":
                held = min(length, spec.window - 1)
                keys = torch.zeros((b, heads, held, kdim), dtype=ref[0].dtype)
                values = torch.zeros((b, heads, held, vdim), dtype=ref[1].dtype)
                self._place(keys, values, got, rows, offsets, counts, length, held)
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
                layer.cumulative_length = length
                continue
            capacity = length + room
            keys = torch.zeros((b, heads, capacity, kdim), dtype=dtype)
            values = torch.zeros((b, heads, capacity, vdim), dtype=dtype)
            self._place(keys, values, got, rows, offsets, counts, length, length)
            sized = SizedLayer(capacity, dtype)
            sized.adopt(keys, values, length)
            cache.layers[index] = sized
        mask = torch.zeros((b, length + room), dtype=torch.long)
        for i, r in enumerate(rows):
            mask[i, length - r.position:length] = 1
        self._rows, self._cache, self._mask, self._length = rows, cache, mask, length
        self._padded = any(r.position != length for r in rows)

    @staticmethod
    def _place(keys: torch.Tensor, values: torch.Tensor, got: list, rows: list[_Row], offsets: list[int],
               counts: list[int], length: int, held: int) -> None:
        """Copy each row's last columns into ``keys``/``values`` (``held`` columns ending at
        ``length``), right-aligned: row ``i`` has ``min(its length, held)`` real ones."""
        for g, off, cnt in zip(got, offsets, counts):
            if g is None:
                continue
            for j in range(cnt):
                i = off + j
                real = min(rows[i].position, held, g[0].shape[-2])
                if real:
                    keys[i, :, held - real:held].copy_(g[0][j, :, -real:])
                    values[i, :, held - real:held].copy_(g[1][j, :, -real:])


__all__ = ["Entry", "TORCH_DECODES_ALONE", "TorchBatch", "batchable"]
