"""The torch engine: Hugging Face transformers on PyTorch (CPU by default).

Producer side, :meth:`TorchEngine.prefill` runs the canonical schedule (fixed chunks of
``chunk_tokens`` into one ``DynamicCache``) and extracts each layer's rows as numpy
arrays in the storage dtype (float32, or bfloat16 as its raw uint16 bits).

Consumer side, :meth:`TorchEngine.open` rebuilds a cache from such rows, its
full-attention layers sized once for the prompt and every new token
(:mod:`muser_cli.engines.torch.cache`: no generated token copies the cache).
A sliding layer holds only its last ``window - 1`` rows; transformers tracks the
absolute length separately (``cumulative_length``), which the rebuild sets to ``rows``
so that masks and positions match the producer's live cache exactly. A producer's sliding
layers keep one row more (:attr:`TorchEngine.RING_EXTRA`, a pack's ``ring_extra``,
:class:`muser_cli.engines.torch.cache.RingLayer`) without changing any number computed, so
that a consumer's spot-check can recompute the last position of every layer; installing
drops it again.

Its sequence handles (:mod:`muser_cli.engines.torch.sequence`): :meth:`TorchEngine.open` computes
the first step, :meth:`TorchEngine.fork` copies the cache for more choices, :meth:`TorchEngine.run`
steps to the end. Serving many requests (:meth:`TorchEngine.batch_decode`), each sequence computes
its first step itself, then hands its cache to a stepper thread that steps every running sequence in one
forward over a left-padded batch cache (:mod:`muser_cli.engines.torch.batch`).

:meth:`TorchEngine.generate_reference` decodes from the producer's own live cache,
without extraction: the truth the handed-off path must reproduce bit for bit.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from muser_cli.engines.base import ChunkFn, Consumer, DecodeResult, Producer, RowsOf, Sampling
from muser_cli.engines.sequence import Sequence as SequenceHandle
from muser_cli.engines.stepper import Stepper
from muser_cli.engines.torch import latent, recompute, sequence, state
from muser_cli.engines.torch.arrays import adoptable, chunk_ring, to_numpy, to_torch, view_torch
from muser_cli.engines.torch.sampling import Picker, logprobs_of, shape_logits  # noqa: F401 - importable here
from muser_cli.errors import ConfigError, DataError, UsageError
from muser_cli.kvpack.layers import LayerKV, ring_tail
from muser_cli.model.config import FAMILIES
from muser_cli.model.info import ModelInfo, ProgressFn
from muser_cli.model.resolve import quiet_transformers
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _cache_keyword(model: Any) -> str:
    """The name the installed transformers gives a model's cache argument: ``cache`` from 5.24 on
    (``past_key_values`` then warns on every call), ``past_key_values`` before (5.19-5.23 silently
    ignore ``cache=``), read from the model's own signature."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


class TorchEngine(Producer, Consumer):
    name = "torch"
    resumes_prefill = True
    streams_prefill = True
    recomputes_at = True
    #: full-attention layers in buffers sized once (False: transformers' growing
    #: ``DynamicLayer``, kept for the A/B in ``benchmarks/bench_decode.py``)
    sized_cache = True
    RING_EXTRA = 1
    _ring_ok = True
    _rope_order = False  # latent layers' rope keys reordered between the cache and a pack (latent.py)
    shapes_logits = True  # penalties, logit_bias and logprobs: torch/sampling.py Picker
    batches_decode = True  # one left-padded transformers cache over the running sequences (torch/batch.py)
    _stepper: Any = None
    decodes_alone: str | None = None  # why this model's sequences decode alone beside others, or None

    @property
    def ring_extra(self) -> int:
        return super().ring_extra if self._ring_ok else 0

    @property
    def writes_history(self) -> bool:  # type: ignore[override]
        """The sliding history rides on :class:`RingLayer`: transformers' plain sliding layers only."""
        return self._ring_ok

    def __init__(self, info: ModelInfo, *, dtype: str, threads: int) -> None:
        super().__init__(info, dtype=dtype, threads=threads)
        if dtype not in TORCH_DTYPES:
            raise UsageError(f"the torch engine has no dtype {dtype!r}", hint="choose one of: " + ", ".join(TORCH_DTYPES))
        import transformers


        family = FAMILIES.get(info.architecture)
        if family is not None and not family.torch_auto:
            raise ConfigError(f"the torch engine cannot load a {info.architecture} folder: transformers has no "
                              "language-model class for that config", hint="use --engine mlx, or save the full model's config")
        self.torch_dtype = TORCH_DTYPES[dtype]
        self._set_threads()
        start = time.perf_counter()
        try:
            with quiet_transformers():
                auto = getattr(transformers, family.torch_auto if family is not None else "AutoModelForCausalLM")
                self.model = auto.from_pretrained(str(info.path), dtype=self.torch_dtype)
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot load model {info.path}: {exc}") from exc
        self.model.eval()
        self._cache_kw = _cache_keyword(self.model)
        from muser_cli.engines.torch.batch import TORCH_DECODES_ALONE  # lazy: pulls transformers

        self.decodes_alone = TORCH_DECODES_ALONE.get(str(getattr(self.model.config, "model_type", "")))
        self.load_s = time.perf_counter() - start
        self._check_layout()

    # ------------------------------------------------------------------ producer

    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        progress: ProgressFn | None = None,
        on_chunk: ChunkFn | None = None,
    ) -> list[LayerKV]:
        ids = self._check_prompt(token_ids)
        with self._session():
            ring = self.pack_ring_extra(len(ids))
            cache = self._prefill_cache(ids, chunk_tokens, progress, on_chunk, ring=ring)
            return self._extract(cache, len(ids), ring)

    def prefill_from(
        self,
        layers: Sequence[LayerKV],
        *,
        rows: int,
        token_ids: Sequence[int],
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        progress: ProgressFn | None = None,
        on_chunk: ChunkFn | None = None,
        anywhere: bool = False,
    ) -> list[LayerKV]:
        """Continue the canonical schedule from installed rows: ``layers`` hold the cache as of
        ``rows`` positions (a multiple of ``chunk_tokens``: a chunk boundary), ``token_ids`` are
        the next prompt tokens. Returns what :meth:`prefill` over all ``rows + len(token_ids)``
        tokens returns, byte for byte (every chunk sees the same inputs and shapes)."""
        if rows == 0:
            return self.prefill(token_ids, chunk_tokens=chunk_tokens, progress=progress, on_chunk=on_chunk)
        ids = self._check_resume(rows, token_ids, chunk_tokens, anywhere)  # anywhere: see Producer.prefill_from
        total = rows + len(ids)
        with self._session():
            ring = self.pack_ring_extra(total, rows)
            cache = self._install(layers, rows, extra=len(ids), ring=ring)
            if progress:
                progress("prefill", rows, total)
            if on_chunk:
                on_chunk(rows, self._rows_of(cache, rows))
            for begin in range(0, len(ids), chunk_tokens):
                chunk = ids[begin : begin + chunk_tokens]
                self._forward(chunk, rows + begin, cache, keep=1)
                done = rows + begin + len(chunk)
                state.record(cache, self.info.layers, done)
                if progress:
                    progress("prefill", done, total)
                if on_chunk:
                    on_chunk(done, self._rows_of(cache, done))
            return self._extract(cache, total, ring)

    # ------------------------------------------------------------------ consumer

    def open(
        self,
        layers: Sequence[LayerKV],
        *,
        rows: int,
        next_tokens: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        stop_on_eos: bool = True,
        chunk_tokens: int | None = None,
        adopt: bool = False,
        check_first: Callable[[RowsOf], None] | None = None,
    ) -> SequenceHandle:
        """See :meth:`Consumer.open` (:mod:`muser_cli.engines.torch.sequence`)."""
        start = time.perf_counter()
        nxt = self._check_decode_args(rows, next_tokens, max_new_tokens)
        with self._session():
            # no local name for the cache: a batched run lets it go once the batch holds its rows
            return sequence.open_cache(
                self, self._install(layers, rows, extra=len(nxt) + max_new_tokens, adopt=adopt), rows, nxt,
                max_new_tokens, sampling, stop_on_eos, start, stats={"install_s": time.perf_counter() - start},
                check_first=check_first, may_batch=True)

    def fork(self, seq: SequenceHandle, samplings: Sequence[Sampling]) -> list[SequenceHandle]:
        """See :meth:`Consumer.fork`: each fork a copy of ``seq``'s cache."""
        with self._session():
            return sequence.fork(self, seq, samplings)

    def run(self, seq: SequenceHandle, on_token: Callable[[int], None] | None = None) -> DecodeResult:
        """See :meth:`Consumer.run`."""
        return sequence.run(self, seq, on_token)

    def batch_decode(self, turns: Any, *, on_step: Callable[[int], None] | None = None) -> None:
        """See :meth:`Consumer.batch_decode`: the sequences step in one left-padded transformers
        cache (:mod:`muser_cli.engines.torch.batch`), on the stepper's thread with this engine's
        thread count."""
        if self._stepper is None:
            from muser_cli.engines.torch.batch import TorchBatch  # lazy: pulls transformers

            self._stepper = Stepper(TorchBatch(self), turns, on_step=on_step, name="muser-torch-steps")

    def close(self) -> None:
        if self._stepper is not None:
            self._stepper.close()
            self._stepper = None

    def generate_reference(
        self,
        token_ids: Sequence[int],
        next_tokens: Sequence[int],
        max_new_tokens: int,
        *,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        sampling: Sampling = Sampling(),
        stop_on_eos: bool = True,
    ) -> DecodeResult:
        """Prefill ``token_ids`` (same schedule as :meth:`prefill`) and decode from that live
        cache, never extracting it: what a handed-off decode must reproduce."""
        ids = self._check_ids(token_ids)
        nxt = self._check_decode_args(len(ids), next_tokens, max_new_tokens)
        with self._session():
            cache = self._prefill_cache(ids, chunk_tokens, None, extra=len(nxt) + max_new_tokens)
            seq = sequence.open_cache(self, cache, len(ids), nxt, max_new_tokens, sampling, stop_on_eos,
                                      time.perf_counter(), stats={})
        return sequence.run(self, seq, None)

    def recompute(self, layers: Sequence[LayerKV], *, rows: int, token_ids: Sequence[int]) -> list[LayerKV]:
        """Install ``layers`` (positions [0, rows)) and run ``token_ids`` in one step at
        positions rows..: the rows every layer then holds (used by ``verify --audit``)."""
        ids = self._check_ids(token_ids)
        self._check_decode_args(rows, ids, 0)
        # a chunked layer keeps the recomputed rows even where they close a chunk (its decoding
        # cache would drop them): they are what the caller compares
        ring = len(ids) if any(spec.kind == "chunked" for spec in self.info.layers) else 0
        with self._session():
            cache = self._install(layers, rows, extra=len(ids), ring=ring)
            self._forward(ids, rows, cache, keep=1)
            return self._extract(cache, rows + len(ids), ring)

    def recompute_at(self, layers: Sequence[LayerKV], *, rows: int, positions: Sequence[int],
                     token_ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's K and V at ``positions`` (each < ``rows``; ``token_ids`` the tokens
        there), recomputed from ``layers``' own rows before each position: one forward of
        ``len(positions)`` tokens over the installed rows, each attending only to the rows
        before its position and to itself (a custom mask). A model with sliding-window or
        chunked layers needs their history (every row from 0, docs/kvpack.md 1.3): every layer
        is then held whole and each layer type gets its own mask (the window, the chunk), which
        transformers takes per type (:meth:`recomputes_at_hybrid`). Per layer ``(heads, m, dim)``
        arrays (:mod:`muser_cli.engines.torch.recompute`)."""
        return recompute.recompute_at(self, layers, rows=rows, positions=positions, token_ids=token_ids)

    def recomputes_at_hybrid(self, layers: Sequence[LayerKV], rows: int) -> bool:
        """Whether :meth:`recompute_at` can take this hybrid model in one step: its family
        takes per-type masks, the config names each layer's type, and every layer holds its
        rows from position 0 (``layers``: a pack with the sliding history)."""
        return recompute.recomputes_at_hybrid(self, layers, rows)

    def step_logits(self, layers: Sequence[LayerKV], *, rows: int, next_tokens: Sequence[int]) -> np.ndarray:
        """Install ``layers`` and run ``next_tokens`` once: float32 logits (len(next_tokens), vocab)."""
        nxt = self._check_decode_args(rows, next_tokens, 0)
        with self._session():
            cache = self._install(layers, rows, extra=len(nxt))
            logits = self._forward(nxt, rows, cache, keep=0)
            return logits[0].float().numpy()

    def live_logits(
        self, token_ids: Sequence[int], next_tokens: Sequence[int], *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    ) -> np.ndarray:
        """:meth:`step_logits` computed from the producer's live cache (no extraction)."""
        ids = self._check_ids(token_ids)
        nxt = self._check_decode_args(len(ids), next_tokens, 0)
        with self._session():
            cache = self._prefill_cache(ids, chunk_tokens, None, extra=len(nxt))
            return self._forward(nxt, len(ids), cache, keep=0)[0].float().numpy()

    # ------------------------------------------------------------------ internals

    def _set_threads(self) -> None:
        if self.threads and self.threads > 0 and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def _session(self) -> Any:
        self._set_threads()
        return torch.inference_mode()

    def _check_layout(self) -> None:
        """The model transformers built must have the cache layout ``info.layers`` describes."""
        from transformers import DynamicCache

        from muser_cli.engines.torch.cache import built_layout, described_layout  # lazy: pulls transformers

        cache = DynamicCache(config=self.model.config)
        built, described = built_layout(self.model, cache), described_layout(self.info.layers)
        if any(spec.kind == "latent" for spec in self.info.layers):  # MLA: a full layer of latent rows
            self._rope_order = latent.check_layout(self)
        if built != described:
            raise ConfigError(
                f"model {self.info.name}: transformers builds cache layers {built}, config.json describes {described}"
            )
        from transformers.cache_utils import DynamicSlidingWindowLayer

        # The extra ring row needs transformers' plain sliding layer (RingLayer extends it);
        # another sliding kind (chunked attention) keeps window - 1 rows and ships none.
        self._ring_ok = all(type(layer) is DynamicSlidingWindowLayer for layer in cache.layers
                            if getattr(layer, "is_sliding", False))

    def _vocab_size(self) -> int:
        return int(self.model.config.get_text_config(decoder=True).vocab_size)

    def _forward(self, ids: list[int], start: int, cache: Any, *, keep: int) -> Any:
        x = torch.tensor([ids], dtype=torch.long)
        positions = torch.arange(start, start + len(ids), dtype=torch.long).unsqueeze(0)
        out = self.model(input_ids=x, position_ids=positions, use_cache=True, logits_to_keep=keep,
                         **{self._cache_kw: cache})
        return out.logits

    def _new_cache(self, capacity: int, ring: int = 0) -> Any:
        """An empty cache with room for ``capacity`` positions in each full-attention layer
        (``ring`` > 0: its sliding layers keep that many rows more, for a pack)."""
        from muser_cli.engines.torch.cache import sized_cache, with_ring  # lazy: pulls transformers

        if self.sized_cache:
            return sized_cache(self.model.config, capacity, dtype=self.torch_dtype, ring_extra=ring)
        from transformers import DynamicCache

        return with_ring(DynamicCache(config=self.model.config), ring)

    def _prefill_cache(self, ids: list[int], chunk_tokens: int, progress: ProgressFn | None,
                       on_chunk: ChunkFn | None = None, *, extra: int = 0, ring: int = 0) -> Any:
        """The canonical schedule: ``ids`` in fixed chunks of ``chunk_tokens``, one cache
        (with room for ``extra`` positions after them; ``ring``: see :meth:`_new_cache`)."""
        if chunk_tokens < 1:
            raise UsageError(f"chunk_tokens must be at least 1 (got {chunk_tokens})")
        cache = self._new_cache(len(ids) + extra, ring)
        total = len(ids)
        if progress:
            progress("prefill", 0, total)
        for begin in range(0, total, chunk_tokens):
            chunk = ids[begin : begin + chunk_tokens]
            self._forward(chunk, begin, cache, keep=1)
            state.record(cache, self.info.layers, begin + len(chunk))
            if progress:
                progress("prefill", begin + len(chunk), total)
            if on_chunk:
                on_chunk(begin + len(chunk), self._rows_of(cache, begin + len(chunk)))
        return cache

    def warm_up(self) -> None:
        with self._session():
            self._forward([0, 0], 0, self._new_cache(2), keep=1)

    def _rows_of(self, cache: Any, n: int) -> RowsOf:
        """Absolute rows [lo, hi) of a layer of ``cache`` as of ``n`` positions."""
        def rows_of(index: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
            if self.info.layers[index].kind == "state":  # its snapshot at hi: (tensors, None)
                return state.rows_of(cache, index, self.info.layers[index], lo, hi, n)  # type: ignore[return-value]
            layer = cache.layers[index]
            held = layer.keys.shape[-2] if n and getattr(layer, "is_initialized", False) else 0
            first = n - held  # a prefill ring may hold more than a decoding cache
            if lo < first or hi > n:
                raise DataError(f"layer {index}: rows [{lo}, {hi}) are not in the cache of [{first}, {n})")
            return (to_numpy(layer.keys[0, :, lo - first : hi - first]),
                    to_numpy(latent.to_pack(self, index, layer.values[0, :, lo - first : hi - first])))
        return rows_of

    def _extract(self, cache: Any, n: int, ring: int = 0) -> list[LayerKV]:
        """Per layer K and V as (kv_heads, rows, head_dim) arrays in the storage dtype
        (``ring``: the extra rows the cache's sliding layers keep, :meth:`_new_cache`)."""
        out = []
        for index, spec in enumerate(self.info.layers):
            if spec.kind == "state":
                out.append(state.extract(cache, index, spec, n))  # type: ignore[arg-type]
                continue
            carried = spec.carried_rows(n, ring)
            layer = cache.layers[index]
            if n == 0 or not getattr(layer, "is_initialized", False):
                keys = torch.empty((spec.kv_heads, 0, spec.head_dim), dtype=self.torch_dtype)
                values = torch.empty((spec.kv_heads, 0, spec.v_head_dim), dtype=self.torch_dtype)
            else:
                keys, values = layer.keys[0], latent.to_pack(self, index, layer.values[0])  # (kv_heads, rows, head_dim)
            if spec.kind == "chunked" and keys.shape[1] > carried:  # its ring holds up to chunk - 1 (+ ring) rows
                keys, values = keys[:, keys.shape[1] - carried:], values[:, values.shape[1] - carried:]
            if tuple(keys.shape) != (spec.kv_heads, carried, spec.head_dim) or tuple(values.shape) != (
                spec.kv_heads,
                carried,
                spec.v_head_dim,
            ):
                raise DataError(
                    f"layer {index}: the live cache holds K {tuple(keys.shape)} V {tuple(values.shape)}, "
                    f"expected ({spec.kv_heads}, {carried}, {spec.head_dim}) after {n} tokens"
                )
            out.append(LayerKV(keys=to_numpy(keys), values=to_numpy(values), first_row=n - carried))
        return out

    def _install(self, layers: Sequence[LayerKV], rows: int, *, extra: int = 0, adopt: bool = False,
                 ring: int = 0) -> Any:
        """A cache holding ``layers`` as if ``rows`` tokens had been prefilled here, with room
        for ``extra`` more positions. ``adopt``: a full layer whose rows are a view of a
        larger array in the engine's dtype (see :meth:`Consumer.open`) uses that array as
        its buffer, without a copy. A sliding layer's rows older than its last ``window -
        1`` (a pack's ``ring_extra``) are dropped; ``ring``: see :meth:`_new_cache`."""
        specs = self.info.layers
        if len(layers) != len(specs):
            raise DataError(f"{len(layers)} layers of KV for a model with {len(specs)} layers")
        cache = self._new_cache(rows + extra, ring)
        for index, (spec, kv) in enumerate(zip(specs, layers)):
            if spec.kind == "state":
                state.install(cache, index, spec, kv, rows, self.torch_dtype, state.conv_kernel(self.model.config))
                continue
            carried = spec.carried_rows(rows)
            kv = ring_tail(kv, rows - carried, rows)
            want_k = (spec.kv_heads, carried, spec.head_dim)
            want_v = (spec.kv_heads, carried, spec.v_head_dim)
            if tuple(np.shape(kv.keys)) != want_k or tuple(np.shape(kv.values)) != want_v:
                raise DataError(
                    f"layer {index} ({spec.kind}): K {tuple(np.shape(kv.keys))} V {tuple(np.shape(kv.values))}, "
                    f"expected K {want_k} V {want_v} for {rows} rows"
                )
            if kv.first_row != rows - carried:
                raise DataError(f"layer {index}: rows start at position {kv.first_row}, expected {rows - carried}")
            if rows == 0:
                continue
            if adopt and spec.kind == "full" and hasattr(cache.layers[index], "adopt"):
                bufs = adoptable(kv.keys, rows + extra, self.torch_dtype), adoptable(kv.values, rows + extra,
                                                                                      self.torch_dtype)
                if bufs[0] is not None and bufs[1] is not None:
                    cache.layers[index].adopt(bufs[0], bufs[1], rows)
                    continue
            if hasattr(cache.layers[index], "adopt"):  # sized: one copy (and cast) straight into its buffer
                keys, values = view_torch(kv.keys).unsqueeze(0), view_torch(kv.values).unsqueeze(0)
            else:
                keys = to_torch(kv.keys, self.torch_dtype).unsqueeze(0)  # (1, kv_heads, rows, head_dim)
                values = to_torch(kv.values, self.torch_dtype).unsqueeze(0)
            if spec.kind == "chunked":
                keys, values = chunk_ring(keys, values, rows, spec.chunk)
            cache.update(keys, latent.from_pack(self, index, values), index)
            if spec.kind in ("sliding", "chunked"):
                cache.layers[index].cumulative_length = rows  # absolute length, not rows held
        return cache

    def _batchable(self, cache: Any) -> bool:
        from muser_cli.engines.torch.batch import batchable  # lazy: pulls transformers

        return batchable(self.info.layers, cache)
