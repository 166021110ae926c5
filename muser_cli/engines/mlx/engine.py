"""The MLX engine: mlx-lm on Apple silicon, or ``mlx[cpu]`` on Linux (the heterogeneous lane).

Loading. The same Hugging Face folder the torch engine reads is loaded with mlx-lm, after
translating what the two libraries name differently (:func:`mlx_config_overrides`):
transformers 5.x keeps RoPE under ``rope_parameters``, mlx-lm reads a top-level
``rope_theta``/``rope_scaling``; Cohere2 states ``layer_types``, mlx-lm derives them from
``sliding_window_pattern``; mlx-lm's gemma2 has no sliding window, so its sliding layers get
one (:mod:`muser_cli.engines.mlx.gemma2`). Then the loaded model is checked against ``info.layers``
before anything runs (:func:`~muser_cli.engines.mlx.config.check_model`): the cache layout mlx-lm builds
(full vs sliding, window), KV heads and head dims, and, per layer, the RoPE the model
really applies, read from its modules and probed numerically against the
:class:`~muser_cli.kvpack.layers.RopeSpec` (theta, dims, style, scaling). A difference
raises :class:`~muser_cli.errors.IdentityMismatch` naming the field: a lost
``rope_theta`` once made valid KV decode to garbage.

Cache layout. Full layers are mlx-lm ``KVCache``; sliding layers ``RotatingKVCache``
(``max_size == window``, ``keep == 0``) whose ring is stored in physical order. A kvpack
carries a sliding layer's last ``window - 1`` rows in temporal order (and, from this
engine, one older ring row, :attr:`MLXEngine.RING_EXTRA`: mlx-lm's ring holds at least
``window`` rows after a prefill chunk anyway, so nothing computed changes; installing
drops it). Installing them
reproduces the state mlx-lm itself reaches after a prefill
(:func:`~muser_cli.engines.mlx.cache.install_rotating`), so the first decode step
overwrites the oldest slot, not a newer one; extraction un-rotates the ring
(:func:`~muser_cli.engines.mlx.cache.temporal`). Chunked layers (Llama 4, through
mlx-lm's ``llama4``) are ``ChunkedKVCache``: it holds rows ``[start_position, offset)`` and
masks by absolute chunk, so a pack's rows of the current chunk go in as they are.

Schedule. :meth:`MLXEngine.prefill` runs token_ids in fixed chunks of ``chunk_tokens``
into one set of caches (the same schedule as ``mlx_lm.generate_step`` with
``prefill_step_size=chunk_tokens``), then extracts numpy rows: float32 as ``np.float32``,
bfloat16 as raw ``uint16`` bits. Decoding goes by sequence handles
(:mod:`muser_cli.engines.mlx.sequence`: open, fork, run), its steps pipelined with
``mx.async_eval`` as mlx-lm's own loop does.

BLAS. On Linux the engine makes MKL (or OpenBLAS) global before MLX loads
(:mod:`muser_cli.engines.mlx.blas`); which BLAS is in use goes into
``DecodeResult.stats["blas"]`` and :meth:`MLXEngine.producer_info`.
"""

from __future__ import annotations

import functools
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Sequence

import numpy as np

from muser_cli.engines.base import ChunkFn, Consumer, DecodeResult, Producer, RowsOf, Sampling
from muser_cli.engines.mlx import blas as mlx_blas
from muser_cli.engines.mlx import sequence, state
from muser_cli.engines.mlx.batch import MlxBatch
from muser_cli.engines.mlx.cache import cut_rows, install_rotating, ring_slot, temporal  # noqa: F401 - ring_slot: importable here
from muser_cli.engines.mlx.config import (  # noqa: F401
    APPLIES_ROPE,
    MLX_DECODES_ALONE,
    MLX_REFUSED,
    check_dtype,
    check_model,
    check_rope,
    check_supported,
    mlx_config_overrides,
    model_classes,
    read_config,
)
from muser_cli.engines.mlx.gemma3 import match_embed_scale
from muser_cli.engines.sequence import Sequence as SequenceHandle
from muser_cli.engines.stepper import Stepper
from muser_cli.errors import ConfigError, DataError, UsageError
from muser_cli.kvpack.layers import LOCAL_KINDS, LayerKV, ring_tail
from muser_cli.model.info import ModelInfo, ProgressFn
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS

MLX_DTYPES = ("float32", "bfloat16")
_STORAGE = {np.dtype("<f4"): "float32", np.dtype("<f2"): "float16", np.dtype("<u2"): "bfloat16"}
# transformers' tie_word_embeddings default per model type, for configs that omit the key
# (mlx-lm's llama assumes True, which silently drops a separate lm_head).


def _own_snaps(method: Callable) -> Callable:
    """A public call that prefills or installs rows: the calling thread's state snapshots are
    let go when it returns (they serve that call only), so none outlive their thread."""
    @functools.wraps(method)
    def call(self: "MLXEngine", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self._snaps_of.pop(threading.get_ident(), None)
    return call


class MLXEngine(Producer, Consumer):
    name = "mlx"
    resumes_prefill = True
    streams_prefill = True
    RING_EXTRA = 1
    writes_history = True  # each chunk's sliding rows, collected before the ring drops them
    batches_decode = True  # mlx-lm's generation batch over its batch caches (engines/mlx/batch.py)
    shapes_logits = True  # penalties, logit_bias and logprobs: engines/mlx/sampling.py
    _stepper: Any = None

    @property
    def _snaps(self) -> dict:
        """State layers' snapshots by chunk end (engines/mlx/state.py) of the prefill or install
        the calling thread runs: each serving thread has its own (a prefill passes the engine's
        turn between chunks, and another thread's prefill or install must not reset them). Held
        on the engine, not in a ``threading.local``: mlx arrays must not outlive their thread's
        stream at a thread's end."""
        return self._snaps_of.setdefault(threading.get_ident(), {})

    @_snaps.setter
    def _snaps(self, value: dict) -> None:
        self._snaps_of[threading.get_ident()] = value

    def __init__(self, info: ModelInfo, *, dtype: str, threads: int) -> None:
        super().__init__(info, dtype=dtype, threads=threads)
        self._snaps_of: dict[int, dict] = {}  # thread ident -> that thread's snapshots (see _snaps)
        if dtype not in MLX_DTYPES:
            raise UsageError(f"the mlx engine has no dtype {dtype!r}", hint="choose one of: " + ", ".join(MLX_DTYPES))
        if info.architecture in MLX_REFUSED:
            raise ConfigError(f"the mlx engine cannot run {info.architecture}: {MLX_REFUSED[info.architecture]}",
                              hint="use --engine torch")
        self.blas = mlx_blas.ensure_fast_blas()  # before mlx.core is imported
        try:
            import mlx.core as mx
            from mlx_lm.models.cache import make_prompt_cache
            from mlx_lm.utils import load_model
        except ImportError as exc:
            raise ConfigError(f"the mlx engine needs mlx and mlx-lm: {exc}", hint="pip install 'muser[mlx]'") from exc
        self.mx = mx
        self._make_cache = make_prompt_cache
        self.mx_dtype = getattr(mx, dtype)
        self._set_threads()
        start = time.perf_counter()
        config = read_config(info)
        check_supported(info, config)
        self.decodes_alone = MLX_DECODES_ALONE.get(str(config.get("model_type")))  # why, or None: it batches
        self.overrides = mlx_config_overrides(config)
        try:
            self.model, self.config = load_model(info.path, model_config=self.overrides, get_model_classes=model_classes)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"mlx-lm cannot load model {info.path}: {exc}") from exc
        check_dtype(info, self.model, dtype)
        if dtype != "float32" or _param_dtype(self.model) != mx.float32:
            self.model.set_dtype(self.mx_dtype)
        # the weights computed now, on this thread: a lazy cast would carry this thread's stream,
        # which another thread (a serving request's, the batch's stepper) cannot run
        mx.eval(self.model.parameters())
        # Gemma 3: transformers' embedding scale in float32 too (engines/mlx/gemma3.py); None elsewhere
        self.embed_scale_fix = match_embed_scale(self.model, dtype)
        self.load_s = time.perf_counter() - start
        check_model(info, self.model, self._make_cache(self.model))

    # ------------------------------------------------------------------ producer

    @_own_snaps
    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        progress: ProgressFn | None = None,
        on_chunk: ChunkFn | None = None,
    ) -> list[LayerKV]:
        ids = self._check_prompt(token_ids)
        history = self._new_history(None, 0)
        caches = self._prefill_caches(ids, chunk_tokens, progress, on_chunk, history)
        return self._extract(caches, len(ids), self.pack_ring_extra(len(ids)), history)

    @_own_snaps
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
        ``rows`` positions (a chunk boundary), ``token_ids`` are the next prompt tokens.
        Returns what :meth:`prefill` over all ``rows + len(token_ids)`` tokens returns, byte
        for byte (the installed caches are laid out as mlx-lm's own at that boundary)."""
        if rows == 0:
            return self.prefill(token_ids, chunk_tokens=chunk_tokens, progress=progress, on_chunk=on_chunk)
        ids = self._check_resume(rows, token_ids, chunk_tokens, anywhere)  # anywhere: see Producer.prefill_from
        total = rows + len(ids)
        caches = self._install(layers, rows, chunk_tokens)
        history = self._new_history(caches, rows)
        if on_chunk:
            on_chunk(rows, self._rows_of(caches, rows))
        self._run_chunks(caches, ids, rows, chunk_tokens, progress, on_chunk, history)
        return self._extract(caches, total, self.pack_ring_extra(total, rows), history)

    def producer_info(self) -> dict:
        """Recorded in a kvpack's ``producer`` field by ``prefill``."""
        return {"blas": self.blas.name, **_versions()}

    # ------------------------------------------------------------------ consumer

    @_own_snaps
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
        """See :meth:`Consumer.open` (:mod:`muser_cli.engines.mlx.sequence`). ``chunk_tokens``
        (the pack header's) lets a sliding layer's ring be laid out exactly as the producer's own
        MLX cache would be, so that MLX -> MLX decoding is bit-identical to decoding from the
        live cache; without it the default chunk size is assumed (tokens agree either way,
        logits to the ulp)."""
        start = time.perf_counter()
        nxt = self._check_decode_args(rows, next_tokens, max_new_tokens)
        caches = self._install(layers, rows, chunk_tokens)
        self.mx.eval([c.state[:2] for c in caches if not c.empty()])
        stats = {"install_s": time.perf_counter() - start}
        return sequence.open_caches(self, caches, rows, nxt, max_new_tokens, sampling, stop_on_eos, start, stats,
                                    check_first=check_first)

    def fork(self, seq: SequenceHandle, samplings: Sequence[Sampling]) -> list[SequenceHandle]:
        """See :meth:`Consumer.fork`: each fork a copy of ``seq``'s caches, evaluated here."""
        return sequence.fork(self, seq, samplings)

    def run(self, seq: SequenceHandle, on_token: Callable[[int], None] | None = None) -> DecodeResult:
        """See :meth:`Consumer.run`."""
        return sequence.run(self, seq, on_token)

    def batch_decode(self, turns: Any, *, on_step: Callable[[int], None] | None = None) -> None:
        """See :meth:`Consumer.batch_decode`: the sequences step in mlx-lm's own generation batch."""
        if self._stepper is None:
            self._stepper = Stepper(MlxBatch(self.mx, self.model), turns, on_step=on_step, name="muser-mlx-steps")

    def close(self) -> None:
        if self._stepper is not None:
            self._stepper.close()
            self._stepper = None

    @_own_snaps
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
        """Prefill ``token_ids`` on the canonical schedule and decode from those live caches,
        never extracting them: what a handed-off decode must reproduce."""
        ids = self._check_ids(token_ids)
        nxt = self._check_decode_args(len(ids), next_tokens, max_new_tokens)
        caches = self._prefill_caches(ids, chunk_tokens, None)
        seq = sequence.open_caches(self, caches, len(ids), nxt, max_new_tokens, sampling, stop_on_eos,
                                   time.perf_counter(), {})
        return sequence.run(self, seq, None)

    @_own_snaps
    def step_logits(self, layers: Sequence[LayerKV], *, rows: int, next_tokens: Sequence[int],
                    chunk_tokens: int | None = None) -> np.ndarray:
        """Install ``layers`` and run ``next_tokens`` once: float32 logits (len(next_tokens), vocab)."""
        nxt = self._check_decode_args(rows, next_tokens, 0)
        caches = self._install(layers, rows, chunk_tokens)
        logits = self.model(self.mx.array([nxt]), cache=caches)[0]
        return np.array(logits.astype(self.mx.float32))

    @_own_snaps
    def recompute(
        self,
        layers: Sequence[LayerKV],
        rows: int,
        token_ids: Sequence[int],
        start: int | None = None,
        *,
        chunk_tokens: int | None = None,
    ) -> list[LayerKV]:
        """Install the rows of ``layers`` (which cover positions [0, rows)) for positions
        [0, start) (default ``start = rows``), run ``token_ids`` at positions start,
        start+1, ... and return their new rows: one :class:`LayerKV` per layer with
        ``len(token_ids)`` rows and ``first_row == start`` (what ``verify --audit`` compares).

        ``chunk_tokens`` cuts the run at absolute multiples of it (the canonical grid);
        ``None`` runs all of ``token_ids`` at once. A sliding layer needs its
        ``window - 1`` rows before ``start``; a kvpack carries those before ``rows`` and
        ``ring_extra`` more, so on models with sliding layers ``start`` may be at most
        ``ring_extra`` below ``rows`` unless ``layers`` holds more (else
        :class:`DataError` naming the layer).
        """
        start = rows if start is None else start
        ids = self._check_ids(token_ids)
        if not ids:
            raise UsageError("recompute needs at least one token")
        if not 0 <= start <= rows:
            raise UsageError(f"recompute start {start} is outside [0, {rows}]")
        if start + len(ids) > self.info.max_positions:
            raise UsageError(f"positions up to {start + len(ids)} exceed the model's context of {self.info.max_positions}")
        if chunk_tokens is not None and chunk_tokens < 1:
            raise UsageError(f"chunk_tokens must be at least 1 (got {chunk_tokens})")
        caches = self._install(cut_rows(self.info.layers, layers, rows, start), start)
        keys: list[list[Any]] = [[] for _ in caches]
        values: list[list[Any]] = [[] for _ in caches]
        position = start
        while position < start + len(ids):
            end = start + len(ids)
            if chunk_tokens is not None:
                end = min(end, (position // chunk_tokens + 1) * chunk_tokens)
            self.model(self.mx.array([ids[position - start : end - start]]), cache=caches)
            n = end - position
            for index, cache in enumerate(caches):
                if self.info.layers[index].kind == "state":
                    continue
                k, v = temporal(cache)  # (1, kv_heads, held, head_dim)
                keys[index].append(k[0, :, -n:, :])
                values[index].append(v[0, :, -n:, :])
            self.mx.eval(keys, values)
            position = end
        mx = self.mx
        return [  # a state layer: its snapshot after the run
            state.extract({}, cache, i, spec, start + len(ids)) if spec.kind == "state" else
            LayerKV(keys=self._to_numpy(mx.concatenate(k, axis=1)), values=self._to_numpy(mx.concatenate(v, axis=1)),
                    first_row=start)
            for i, (spec, cache, k, v) in enumerate(zip(self.info.layers, caches, keys, values))
        ]

    # ------------------------------------------------------------------ checks

    def _set_threads(self) -> None:
        """BLAS threads are per process (MKL's): set them on every call, as torch's are."""
        self.blas_threads = mlx_blas.set_threads(self.threads) if self.threads and self.threads > 0 else self.blas.threads

    def _vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or (self.config.get("text_config") or {}).get("vocab_size") or 0)

    # ------------------------------------------------------------------ caches

    def _new_history(self, caches: list[Any] | None, rows: int) -> dict[int, list] | None:
        """Where a prefill with the sliding history (:attr:`keeps_history`) collects each sliding
        layer's rows as every chunk computes them (mlx-lm's ring drops them later): None without
        it. Continuing from ``rows`` installed ones, their last ``window - 1`` come first."""
        if not self.keeps_history:
            return None
        history: dict[int, list] = {}
        for i, spec in enumerate(self.info.layers):
            if spec.kind not in LOCAL_KINDS:
                continue
            history[i] = []
            if caches is not None and rows:
                k, v = temporal(caches[i])
                keep = min(rows, spec.carried_rows(rows), k.shape[2])
                history[i].append((self._to_numpy(k[0, :, k.shape[2] - keep :, :]),
                                   self._to_numpy(v[0, :, v.shape[2] - keep :, :])))
        return history

    def _prefill_caches(self, ids: list[int], chunk_tokens: int, progress: ProgressFn | None,
                        on_chunk: ChunkFn | None = None, history: dict[int, list] | None = None) -> list[Any]:
        """The canonical schedule: ``ids`` in fixed chunks of ``chunk_tokens``, one set of caches."""
        if chunk_tokens < 1:
            raise UsageError(f"chunk_tokens must be at least 1 (got {chunk_tokens})")
        self._set_threads()
        caches = self._make_cache(self.model)
        self._snaps = {}  # state layers' snapshots by chunk end (engines/mlx/state.py): this thread's
        self._run_chunks(caches, ids, 0, chunk_tokens, progress, on_chunk, history)
        return caches

    def _run_chunks(self, caches: list[Any], ids: list[int], base: int, chunk_tokens: int,
                    progress: ProgressFn | None, on_chunk: ChunkFn | None = None,
                    history: dict[int, list] | None = None) -> None:
        """Run ``ids`` (positions base, base+1, ...) through ``caches`` in chunks of ``chunk_tokens``
        (``history``: each sliding layer's new rows appended after every chunk)."""
        total = base + len(ids)
        if progress:
            progress("prefill", base, total)
        for begin in range(0, len(ids), chunk_tokens):
            chunk = ids[begin : begin + chunk_tokens]
            self.model(self.mx.array([chunk]), cache=caches)  # logits stay unevaluated (lazy)
            self.mx.eval([c.cache if state.is_state_cache(c) else c.state[:2] for c in caches])
            state.record(self._snaps, caches, self.info.layers, base + begin + len(chunk))
            for i, got in (history or {}).items():  # the chunk's rows: the ring's newest, still held
                k, v = temporal(caches[i])
                got.append((self._to_numpy(k[0, :, k.shape[2] - len(chunk) :, :]),
                            self._to_numpy(v[0, :, v.shape[2] - len(chunk) :, :])))
            if progress:
                progress("prefill", base + begin + len(chunk), total)
            if on_chunk:
                on_chunk(base + begin + len(chunk), self._rows_of(caches, base + begin + len(chunk)))

    def _rows_of(self, caches: list[Any], n: int) -> RowsOf:
        """Absolute rows [lo, hi) of a layer's cache as of ``n`` positions."""
        def rows_of(index: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
            if self.info.layers[index].kind == "state":  # its snapshot at hi: (tensors, None)
                return state.rows_of(self._snaps, caches, index, self.info.layers[index], hi, n)  # type: ignore
            k, v = temporal(caches[index])  # (1, kv_heads, held, head_dim), oldest first; row n-1 last
            held = k.shape[2]
            if hi > n or lo < n - held:
                raise DataError(f"layer {index}: rows [{lo}, {hi}) are not in the cache of [{n - held}, {n})")
            a, b = held - (n - lo), held - (n - hi)
            return self._to_numpy(k[0, :, a:b, :]), self._to_numpy(v[0, :, a:b, :])
        return rows_of

    def _extract(self, caches: list[Any], n: int, ring: int = 0,
                 history: dict[int, list] | None = None) -> list[LayerKV]:
        """Per layer K and V as (kv_heads, rows, head_dim) numpy arrays in the storage dtype;
        a sliding layer's last ``window - 1 + ring`` rows (after a prefill chunk mlx-lm's
        ring holds at least ``window``), or with ``history`` the rows collected chunk by chunk."""
        out = []
        for index, (spec, cache) in enumerate(zip(self.info.layers, caches)):
            if spec.kind == "state":
                out.append(state.extract(self._snaps, cache, index, spec, n))
                continue
            carried = spec.carried_rows(n, ring)
            if history and index in history and history[index]:
                keys = np.concatenate([k for k, _ in history[index]], axis=1)[:, -carried:]
                values = np.concatenate([v for _, v in history[index]], axis=1)[:, -carried:]
            elif n == 0 or cache.empty():
                keys = np.empty((spec.kv_heads, 0, spec.head_dim), dtype=_np_storage(self.dtype))
                values = np.empty((spec.kv_heads, 0, spec.v_head_dim), dtype=_np_storage(self.dtype))
            else:
                k, v = temporal(cache)  # (1, kv_heads, held, head_dim), oldest first
                if cache.offset != n or k.shape[2] < carried:
                    raise DataError(f"layer {index}: the live cache holds {k.shape[2]} rows at offset {cache.offset}, "
                                    f"expected {carried} of {n}")
                keys = self._to_numpy(k[0, :, k.shape[2] - carried :, :])
                values = self._to_numpy(v[0, :, v.shape[2] - carried :, :])
            if keys.shape != (spec.kv_heads, carried, spec.head_dim) or values.shape != (spec.kv_heads, carried, spec.v_head_dim):
                raise DataError(f"layer {index}: extracted K {keys.shape} V {values.shape}, expected "
                                f"({spec.kv_heads}, {carried}, {spec.head_dim}) after {n} tokens")
            out.append(LayerKV(keys=keys, values=values, first_row=n - carried))
        return out

    def _install(self, layers: Sequence[LayerKV], rows: int, chunk_tokens: int | None = None) -> list[Any]:
        """mlx-lm caches holding ``layers`` as if ``rows`` tokens had been prefilled here
        in chunks of ``chunk_tokens`` (default: :data:`DEFAULT_CHUNK_TOKENS`)."""
        specs = self.info.layers
        if len(layers) != len(specs):
            raise DataError(f"{len(layers)} layers of KV for a model with {len(specs)} layers")
        self._set_threads()
        caches = self._make_cache(self.model)
        self._snaps = {}
        for index, (spec, kv, cache) in enumerate(zip(specs, layers, caches)):
            if spec.kind == "state":
                state.install(self._snaps, cache, index, spec, kv, rows, self.mx_dtype)
                continue
            carried = spec.carried_rows(rows)
            kv = ring_tail(kv, rows - carried, rows)  # a pack's ring_extra rows: not part of a decoding cache
            want_k = (spec.kv_heads, carried, spec.head_dim)
            want_v = (spec.kv_heads, carried, spec.v_head_dim)
            if tuple(np.shape(kv.keys)) != want_k or tuple(np.shape(kv.values)) != want_v:
                raise DataError(f"layer {index} ({spec.kind}): K {tuple(np.shape(kv.keys))} V {tuple(np.shape(kv.values))}, "
                                f"expected K {want_k} V {want_v} for {rows} rows")
            if kv.first_row != rows - carried:
                raise DataError(f"layer {index}: rows start at position {kv.first_row}, expected {rows - carried}")
            if rows == 0:
                continue
            keys = self._to_mx(kv.keys)[None]  # (1, kv_heads, carried, head_dim)
            values = self._to_mx(kv.values)[None]
            if spec.kind == "sliding":
                install_rotating(self.mx, cache, keys, values, rows, chunk_tokens or DEFAULT_CHUNK_TOKENS)
            elif spec.kind == "chunked":  # mlx-lm's ChunkedKVCache holds rows [start_position, offset)
                if carried:
                    cache.update_and_fetch(keys, values)
                cache.offset, cache.start_position = rows, rows - carried
            else:
                cache.update_and_fetch(keys, values)
        return caches

    # ------------------------------------------------------------------ decoding

    def _stats(self) -> dict:
        """What every decode's stats carry about this engine (its load, threads, BLAS, versions)."""
        return dict(load_s=self.load_s, threads=self.blas_threads or 1, blas=self.blas.name, blas_path=self.blas.path,
                    **_versions())

    # ------------------------------------------------------------------ conversions

    def _to_mx(self, a: Any) -> Any:
        a = np.asarray(a)
        source = _STORAGE.get(a.dtype)
        if source is None:
            raise DataError(f"KV arrays of numpy dtype {a.dtype} are not a storage dtype (float32, float16, bfloat16 bits)")
        x = self.mx.array(np.ascontiguousarray(a))
        if source == "bfloat16":
            x = x.view(self.mx.bfloat16)
        return x if x.dtype == self.mx_dtype else x.astype(self.mx_dtype)

    def _to_numpy(self, x: Any) -> np.ndarray:
        mx = self.mx
        if x.dtype == mx.bfloat16:
            return np.array(x.view(mx.uint16))  # raw bits; numpy has no bfloat16
        if x.dtype in (mx.float32, mx.float16):
            return np.array(x)
        raise DataError(f"unexpected cache dtype {x.dtype}")


def _param_dtype(model: Any) -> Any:
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    return params[0][1].dtype if params else None


def _np_storage(dtype: str) -> np.dtype:
    return np.dtype({"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}[dtype])


def _versions() -> dict[str, str]:
    out = {}
    for name in ("mlx", "mlx-lm"):
        try:
            out[name.replace("-", "_")] = version(name)
        except PackageNotFoundError:
            pass
    return out
