"""Worker side of the connector: save plans applied to vLLM's paged caches.

After each forward (``wait_for_save``), for every save item and every attention layer,
the layer's reader (:mod:`.layouts`, :mod:`.gather`) copies the rows just computed (only
the layer's carried range: full layers every row, sliding layers the last
``window - 1``) off the device; when the request's last prompt chunk is done, the rows
go to the sink (:mod:`.sinks`). Saving is synchronous, so vLLM may free the blocks as
soon as the step ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from muser_cli.engines.vllm import gather as vllm_layout
from muser_cli.engines.vllm.blocks import carried_range
from muser_cli.engines.vllm.config import NAME_RE, SUPPORTED_VLLM, ConnectorSettings, layer_index
from muser_cli.engines.vllm.fp8 import dequantize_fp8
from muser_cli.engines.vllm.layouts import CacheLayout, latent_layout, layer_layout, producer_record, state_layout
from muser_cli.engines.vllm.planner import safe_name
from muser_cli.engines.vllm.sinks import write_error, write_kvpack, write_spool
from muser_cli.errors import ConfigError, DataError
from muser_cli.kvpack.layers import DTYPES, LayerKV, LayerSpec, StateKV


@dataclass
class LayerBinding:
    """One attention layer as the worker sees it."""

    name: str  # vLLM layer name
    index: int  # kvpack layer index
    spec: LayerSpec
    group: int  # KV cache group (index into the request's block id lists)
    block_size: int  # the group's manager block size
    cache: Any  # the per-layer paged tensor, read as ``layout.layout`` says
    layout: CacheLayout  # the backend's layout, checked (layouts.resolve_layout)
    scales: Callable[[], tuple[Any, Any]] | None = None  # fp8 per-tensor / per-head (k, v)
    module: Any = None  # a state layer's vLLM module: its ``kv_cache`` (conv, recurrent) views, read each step
    swap_recurrent: bool = False  # a state layer's recurrent matrix is cached with its last two axes swapped


def _state_views(b: LayerBinding) -> tuple[Any, Any]:
    views = getattr(b.module, "kv_cache", None)
    if isinstance(views, (list, tuple)) and len(views) == 1 and isinstance(views[0], (list, tuple)):
        views = views[0]  # one virtual engine's (conv, recurrent)
    if not isinstance(views, (list, tuple)) or len(views) != 2:
        raise DataError(f"vLLM layer {b.name!r} holds no (conv, recurrent) state views")
    return views[0], views[1]


def snapshot_state(b: LayerBinding, slot: int) -> dict[str, np.ndarray]:
    """A state layer's snapshot in vLLM's state slot ``slot``, as kvpack carries it: the conv
    window ``(channels, kernel - 1)`` (vLLM's "SD" layout transposed) and the recurrent matrix,
    both float32 (a bfloat16 window widens exactly), fresh copies."""
    conv, rec = _state_views(b)
    c, r = conv[int(slot)], rec[int(slot)]
    if b.layout.layout == "STATE_SD":
        c = c.transpose(0, 1)
    if b.swap_recurrent:
        r = r.transpose(-1, -2)
    out = {"conv": c.detach().float().cpu().numpy().copy(), "recurrent": r.detach().float().cpu().numpy().copy()}
    for t in b.spec.tensors:
        if tuple(out[t.name].shape) != tuple(t.shape):
            raise DataError(f"layer {b.index}: vLLM's {t.name} state is {tuple(out[t.name].shape)}, the kvpack spec "
                            f"says {tuple(t.shape)}")
    return out


@dataclass
class _Buffer:
    name: str
    target: int
    pieces: dict[int, list[vllm_layout.GatheredKV]] = field(default_factory=dict)
    states: dict[int, dict[int, dict[str, np.ndarray]]] = field(default_factory=dict)  # layer -> position -> tensors


class WorkerAssembler:
    """Worker-side: apply save plans to the paged caches, hand finished requests to the sink."""

    def __init__(
        self,
        settings: ConnectorSettings,
        bindings: Sequence[LayerBinding],
        *,
        quant: str = "none",
        fp8_format: str = "e4m3fn",
        producer: dict[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self.bindings = sorted(bindings, key=lambda b: b.index)
        self.quant = quant
        self.fp8_format = fp8_format
        self.producer = {**dict(producer or {}), **producer_record({b.index: b.layout for b in self.bindings})}
        self._buffers: dict[str, _Buffer] = {}
        self.emitted: list[Path] = []
        self.failed: list[Path] = []
        got = [b.index for b in self.bindings]
        if got != list(range(len(settings.layers))):
            raise ConfigError(
                f"vLLM's attention layers map to kvpack layers {got[:8]}{'...' if len(got) > 8 else ''}, "
                f"expected 0..{len(settings.layers) - 1}"
            )

    def drop(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self._buffers.pop(rid, None)

    @property
    def pending(self) -> int:
        return len(self._buffers)

    def process(self, payload: str) -> None:
        """Apply one step's plan. Never raises for a bad request: it leaves an error file."""
        try:
            plan = json.loads(payload)
            items = plan["items"]
            if plan.get("v") != 1 or not isinstance(items, list):
                raise ValueError("unknown plan version")
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"connector metadata is not a muser save plan ({exc})") from None
        for item in items:
            rid, name = str(item.get("req")), str(item.get("name"))
            if not NAME_RE.match(name):
                name = safe_name(name)
            try:
                if "error" in item:
                    raise DataError(str(item["error"]))
                self._apply(rid, name, item)
            except Exception as exc:  # fail closed for this request, keep vLLM alive
                self._buffers.pop(rid, None)
                self.failed.append(write_error(self.settings.output_dir, name, exc))

    def _rows_for(self, spec: LayerSpec, target: int) -> tuple[int, int]:
        """The rows of a layer a request of ``target`` rows ships: with the sliding history
        (``settings.history``) every row of a sliding layer too, gathered step by step while
        vLLM still holds each step's blocks; else the layer's carried range."""
        return carried_range(spec, target, self.settings.history)

    def _apply(self, rid: str, name: str, item: dict[str, Any]) -> None:
        start, stop, target = int(item["start"]), int(item["stop"]), int(item["target"])
        if item.get("reset") or rid not in self._buffers:
            self._buffers[rid] = _Buffer(name=name, target=target)
        buf = self._buffers[rid]
        blocks = item["blocks"]
        for b in self.bindings:
            if b.spec.kind == "state":
                self._snapshot(b, buf, item, start, stop)
                continue
            first, end = self._rows_for(b.spec, target)
            lo, hi = max(start, first), min(stop, end)
            if lo >= hi:
                continue
            if b.group >= len(blocks):
                raise DataError(f"save plan has no block ids for KV cache group {b.group}")
            ks = vs = None
            if self.quant == "fp8" and b.scales is not None:
                ks, vs = b.scales()
            if b.layout.layout == "MLA_ROWS":
                got = vllm_layout.gather_latent_rows(b.cache, blocks[b.group], start=lo, stop=hi,
                                                     rank=b.spec.head_dim, block_size=b.block_size)
            else:
                got = vllm_layout.gather_paged_kv(
                    b.cache, blocks[b.group], start=lo, stop=hi, layout=b.layout.layout,
                    head_dim=b.spec.head_dim, v_head_dim=b.spec.v_head_dim, block_size=b.block_size,
                    quant=self.quant, fp8_format=self.fp8_format, k_scale=ks, v_scale=vs,
                )
            pieces = buf.pieces.setdefault(b.index, [])
            expect = pieces[-1].first_row + pieces[-1].rows if pieces else first
            if got.first_row != expect:
                raise DataError(f"layer {b.index}: rows resume at {got.first_row}, expected {expect}")
            pieces.append(got)
        if item.get("final"):
            del self._buffers[rid]
            layers, dtype, source = self._assemble(buf)
            tokens = [int(t) for t in item.get("tokens", [])]
            self.emitted.append(self._emit(name, tokens, target, layers, dtype, source))

    def _snapshot(self, b: LayerBinding, buf: _Buffer, item: dict[str, Any], start: int, stop: int) -> None:
        """After this step's forward vLLM's state slot holds the state after positions
        ``[0, ran)``: kept as the snapshot at ``stop`` when the step ran no further (a chunk
        end of the canonical schedule, or the pack's end). A step that ran past the pack's end
        (sink kvpack: the last prompt token's forward) leaves no snapshot at it: refused."""
        ran = int(item.get("ran", stop))
        if ran != stop:
            if item.get("final"):
                raise ConfigError(f"layer {b.index}: vLLM's state slot holds the state after {ran} positions, the "
                                  f"pack needs it after {stop}",
                                  hint="a state layer's pack comes from a prefill of the rows alone (muser prefill "
                                       "--engine vllm), not from a served request's whole prompt")
            return
        if b.group >= len(item["blocks"]) or not item["blocks"][b.group]:
            raise DataError(f"save plan has no state slot for KV cache group {b.group}")
        if stop > start:
            buf.states.setdefault(b.index, {})[stop] = snapshot_state(b, item["blocks"][b.group][0])

    def _assemble(self, buf: _Buffer) -> tuple[list[Any], str, dict[str, Any]]:
        layers: list[Any] = []
        dtypes: set[str] = set()
        source: dict[str, Any] = {"quant": self.quant}
        for b in self.bindings:
            if b.spec.kind == "state":
                snaps = buf.states.get(b.index, {})
                if buf.target not in snaps:
                    raise DataError(f"layer {b.index}: no state snapshot after {buf.target} positions")
                layers.append(StateKV(tensors=snaps[buf.target], position=buf.target,
                                      earlier={p: t for p, t in snaps.items() if p < buf.target}))
                continue
            first, end = self._rows_for(b.spec, buf.target)
            pieces = buf.pieces.get(b.index, [])
            have = sum(p.rows for p in pieces)
            if have != end - first:
                raise DataError(f"layer {b.index}: gathered {have} rows, expected {end - first}")
            dtype = "float32" if self.quant != "none" else vllm_layout.storage_name(b.cache.dtype)
            if dtype not in DTYPES:
                raise DataError(f"layer {b.index}: cache dtype {b.cache.dtype} has no kvpack dtype")
            dtypes.add(dtype)
            keys, values = _finish_rows(pieces, b.spec, self.quant, dtype)
            if self.settings.halved_keys:
                keys = unhalve_keys(keys)
            layers.append(LayerKV(keys=keys, values=values, first_row=first))
            if self.quant != "none" and pieces:
                source["fp8_format"] = pieces[0].fp8_format
                source["scales"] = _scale_kind(pieces[0])
        if len(dtypes) != 1:
            raise DataError(f"layers store {sorted(dtypes)}: a pack has one dtype")
        dtype = dtypes.pop()
        if self.settings.dtype is not None and dtype != self.settings.dtype:
            raise DataError(f"vLLM's KV is {dtype}, the connector was configured for {self.settings.dtype}")
        return layers, dtype, source

    def _emit(
        self, name: str, tokens: list[int], target: int, layers: list[Any], dtype: str, source: dict[str, Any]
    ) -> Path:
        out = self.settings.output_dir
        if self.settings.sink == "spool":
            return write_spool(out, name, layers, dtype=dtype, rows=target, tokens=len(tokens), source=source,
                               producer=self.producer)
        producer = {"engine": "vllm", **self.producer, "source": source}
        return write_kvpack(out / f"{name}.kvpack", self.settings, tokens, dtype, layers, producer)


def fail_plan(out_dir: Path, payload: str, exc: BaseException) -> list[Path]:
    """An error file for every request a save plan names (the connector refused to read)."""
    try:
        items = json.loads(payload).get("items", [])
    except (ValueError, AttributeError):
        return []
    names = []
    for item in items if isinstance(items, list) else []:
        name = str(item.get("name")) if isinstance(item, dict) else ""
        name = name if NAME_RE.match(name) else safe_name(name)
        if name not in names:
            names.append(name)
    return [write_error(out_dir, n, exc) for n in names]


def _scale_kind(p: vllm_layout.GatheredKV) -> dict[str, str]:
    def kind(scale: np.ndarray | None) -> str:
        if p.quant == "fp8_per_token_head":
            return "per_token_head"
        return "per_tensor" if scale is not None and scale.shape == () else "per_head"

    return {"k": kind(p.k_scale), "v": kind(p.v_scale)}


def _finish_rows(
    pieces: list[vllm_layout.GatheredKV], spec: LayerSpec, quant: str, dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate a layer's pieces; fp8 is dequantized to float32 (kvpack has no fp8 dtype)."""
    np_dtype = np.dtype(DTYPES[dtype][1])
    if not pieces:
        return (np.empty((spec.kv_heads, 0, spec.head_dim), dtype=np_dtype),
                np.empty((spec.kv_heads, 0, spec.v_head_dim), dtype=np_dtype))
    if quant == "none":
        keys = np.concatenate([p.keys for p in pieces], axis=1)
        values = np.concatenate([p.values for p in pieces], axis=1)
    else:
        keys = np.concatenate(
            [dequantize_fp8(p.keys, p.k_scale, p.fp8_format or "e4m3fn") for p in pieces], axis=1)
        values = np.concatenate(
            [dequantize_fp8(p.values, p.v_scale, p.fp8_format or "e4m3fn") for p in pieces], axis=1)
    if keys.dtype != np_dtype or keys.shape[0] != spec.kv_heads or keys.shape[2] != spec.head_dim \
            or values.shape[2] != spec.v_head_dim:
        raise DataError(f"rows {keys.dtype} {keys.shape} do not match the layer spec ({dtype})")
    return keys, values


def unhalve_keys(keys: np.ndarray) -> np.ndarray:
    """Keys (heads, rows, dim) that vLLM stores as [dims 0, 2, 4, …, dims 1, 3, 5, …] of each
    head (its Llama 4 permutes the q/k projections so, for a rotary kernel on halves) in the
    checkpoint's order again: ``out[2j + t] = keys[t * dim / 2 + j]``. Queries are permuted
    alike, so vLLM's attention is the model's; only the cache's dim order differs."""
    heads, rows, dim = keys.shape
    return np.ascontiguousarray(keys.reshape(heads, rows, 2, dim // 2).swapaxes(2, 3).reshape(heads, rows, dim))


def build_bindings(
    settings: ConnectorSettings,
    kv_caches: dict[str, Any],
    groups: Sequence[tuple[Sequence[str], Any]],
    forward_layers: dict[str, Any] | None = None,
    *,
    cache_dtype: str = "auto",
    kv_cache_layout: str | None = None,
) -> list[LayerBinding]:
    """Match vLLM's registered caches to kvpack layers and check them against vLLM's specs.

    ``groups``: ``(layer_names, kv_cache_spec)`` per KV cache group, in group order.
    ``forward_layers``: vLLM's attention layer modules by name (the static forward
    context): each tells its backend (and, on CPU, its kernel ISA), from which the
    layer's reader is chosen; a layer whose backend is not checked is refused.
    """
    where: dict[str, tuple[int, Any]] = {}
    for g, (names, spec) in enumerate(groups):
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        for n in names:
            where[n] = (g, per_layer[n] if isinstance(per_layer, dict) and n in per_layer else spec)
    bindings: list[LayerBinding] = []
    seen: dict[int, str] = {}
    for name, cache in kv_caches.items():
        if name not in where:
            raise ConfigError(f"vLLM layer {name!r} is in no KV cache group")
        g, vspec = where[name]
        idx = layer_index(name)
        if idx in seen:
            raise ConfigError(f"vLLM layers {seen[idx]!r} and {name!r} both map to kvpack layer {idx}")
        if idx >= len(settings.layers):
            raise ConfigError(f"vLLM layer {name!r} has no kvpack layer spec ({len(settings.layers)} given)")
        seen[idx] = name
        spec = settings.layers[idx]
        kinds = {c.__name__ for c in type(vspec).__mro__}
        kind = type(vspec).__name__
        layer_mod = (forward_layers or {}).get(name)
        if any("MLA" in k for k in kinds) or spec.kind == "latent":
            bindings.append(_latent_binding(name, idx, spec, g, vspec, cache, layer_mod, kinds, cache_dtype))
            continue
        if "MambaSpec" in kinds or spec.kind == "state":
            bindings.append(_state_binding(name, idx, spec, g, vspec, cache, layer_mod, kinds))
            continue
        if not hasattr(vspec, "num_kv_heads"):
            raise ConfigError(f"vLLM layer {name!r} uses {kind}: the muser connector supports standard K/V attention")
        if int(vspec.num_kv_heads) != spec.kv_heads or int(vspec.head_size) != spec.head_dim or \
                int(getattr(vspec, "head_size_v", vspec.head_size)) != spec.v_head_dim:
            raise ConfigError(
                f"vLLM layer {name!r} caches {vspec.num_kv_heads} heads x {vspec.head_size}, "
                f"the kvpack spec says {spec.kv_heads} x {spec.head_dim}"
            )
        vwin = getattr(vspec, "sliding_window", None)
        if "SlidingWindowSpec" in kinds:
            if spec.kind != "sliding":
                raise ConfigError(f"vLLM layer {name!r} is sliding-window, the kvpack spec says full attention")
            if int(vwin) < int(spec.window or 0):
                raise ConfigError(
                    f"vLLM layer {name!r} keeps a {vwin}-token window, the pack needs {spec.window}"
                )
        if "ChunkedLocalAttentionSpec" in kinds:
            vchunk = getattr(vspec, "attention_chunk_size", None)
            if spec.kind != "chunked" or vchunk is None or int(vchunk) != int(spec.chunk or 0):
                raise ConfigError(f"vLLM layer {name!r} attends in chunks of {vchunk}, the kvpack spec says "
                                  f"{spec.kind}" + (f" in chunks of {spec.chunk}" if spec.kind == "chunked" else ""))
        elif spec.kind == "chunked":
            raise ConfigError(f"vLLM layer {name!r} uses {kind}, the kvpack spec says chunked attention")
        if "CrossAttentionSpec" in kinds:
            raise ConfigError(f"vLLM layer {name!r} uses {kind}: not supported by the muser connector")
        shape = tuple(int(s) for s in cache.shape)
        if len(shape) != 4 or shape[1] != spec.kv_heads:
            raise ConfigError(
                f"vLLM layer {name!r} cache has shape {shape}; the muser connector reads vLLM's "
                f"per-layer (blocks, kv_heads, block_size, K|V) view (vLLM {SUPPORTED_VLLM})"
            )
        layout = layer_layout(layer_mod, cache, block_size=int(vspec.block_size), cache_dtype=cache_dtype,
                              kv_cache_layout=kv_cache_layout, layer=name)
        scales = _scale_getter(layer_mod) if layer_mod is not None and hasattr(layer_mod, "_k_scale") else None
        bindings.append(LayerBinding(name=name, index=idx, spec=spec, group=g,
                                     block_size=int(vspec.block_size), cache=cache, layout=layout, scales=scales))
    return bindings


def _scale_getter(layer_mod: Any) -> Callable[[], tuple[Any, Any]]:
    """Read a layer's fp8 scales when needed (vLLM may update them after loading weights)."""
    return lambda: (layer_mod._k_scale, layer_mod._v_scale)


def _latent_binding(name: str, idx: int, spec: LayerSpec, g: int, vspec: Any, cache: Any, layer_mod: Any,
                    kinds: set[str], cache_dtype: str) -> LayerBinding:
    """An MLA layer: vLLM's rows ``[latent | rope key]`` against the kvpack ``latent`` spec."""
    if spec.kind != "latent" or not any("MLA" in k for k in kinds):
        raise ConfigError(f"vLLM layer {name!r} uses {type(vspec).__name__}, the kvpack spec says {spec.kind}")
    width = spec.head_dim + spec.v_head_dim
    if int(getattr(vspec, "num_kv_heads", 0)) != 1 or int(getattr(vspec, "head_size", 0)) != width:
        raise ConfigError(f"vLLM layer {name!r} caches {getattr(vspec, 'num_kv_heads', '?')} x "
                          f"{getattr(vspec, 'head_size', '?')}, the kvpack latent spec says 1 x {spec.head_dim} + "
                          f"{spec.v_head_dim}")
    built = (getattr(layer_mod, "kv_lora_rank", None), getattr(layer_mod, "qk_rope_head_dim", None))
    if built != (spec.head_dim, spec.v_head_dim):
        raise ConfigError(f"vLLM layer {name!r} caches latent {built[0]} + rope {built[1]}, the kvpack spec says "
                          f"{spec.head_dim} + {spec.v_head_dim}")
    if spec.rope is not None and spec.rope.style != "interleaved":  # vLLM's DeepSeek rotates GPT-J style, always
        raise ConfigError(f"vLLM layer {name!r} rotates its rope key interleaved, the kvpack spec says "
                          f"{spec.rope.style}: vLLM would run another model")
    layout = latent_layout(layer_mod, block_size=int(vspec.block_size), cache_dtype=cache_dtype, layer=name)
    return LayerBinding(name=name, index=idx, spec=spec, group=g, block_size=int(vspec.block_size), cache=cache,
                        layout=layout)


def _state_binding(name: str, idx: int, spec: LayerSpec, g: int, vspec: Any, cache: Any, layer_mod: Any,
                   kinds: set[str]) -> LayerBinding:
    """A Mamba-2 / gated DeltaNet layer: its state slot's (conv, recurrent) views against the
    kvpack ``state`` spec."""
    if spec.kind != "state" or "MambaSpec" not in kinds:
        raise ConfigError(f"vLLM layer {name!r} uses {type(vspec).__name__}, the kvpack spec says {spec.kind}")
    mode = str(getattr(vspec, "mamba_cache_mode", "none"))
    if mode != "none":  # "align"/"all": the state moves with the position (prefix caching of states)
        raise ConfigError(f"vLLM layer {name!r} keeps its state in mamba_cache_mode {mode!r}; the muser connector "
                          "reads the one state slot of mode 'none'", hint="leave prefix caching off")
    if int(getattr(vspec, "num_speculative_blocks", 0) or 0):
        raise ConfigError(f"vLLM layer {name!r} keeps speculative state blocks: not read by the muser connector")
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        conv_layout = str(get_conv_state_layout())
    except ImportError:  # an older vLLM: the "DS" layout only
        conv_layout = "DS"
    on_gpu = getattr(getattr(cache, "device", None), "type", "cpu") != "cpu"
    layout = state_layout(layer_mod, mixer=spec.mixer, conv_layout=conv_layout, on_gpu=on_gpu, layer=name)
    # vLLM declares the gated DeltaNet state (v_heads, v_dim, k_dim), the GPU kernels' order; its CPU
    # kernel reads the same bytes as (v_heads, k_dim, v_dim) -- transformers' and kvpack's (measured).
    swap = spec.mixer == "gated_delta_net" and on_gpu
    b = LayerBinding(name=name, index=idx, spec=spec, group=g, block_size=int(getattr(vspec, "block_size", 1)),
                     cache=cache, layout=layout, module=layer_mod, swap_recurrent=swap)
    conv, rec = _state_views(b)
    want = {t.name: tuple(t.shape) for t in spec.tensors}
    got_conv = tuple(int(x) for x in conv.shape[1:])
    got_conv = got_conv[::-1] if conv_layout == "SD" else got_conv
    got_rec = tuple(int(x) for x in rec.shape[1:])
    got_rec = got_rec[:-2] + got_rec[-2:][::-1] if swap else got_rec
    if set(want) != {"conv", "recurrent"} or want["conv"] != got_conv or want["recurrent"] != got_rec:
        raise ConfigError(f"vLLM layer {name!r} keeps conv {got_conv} and recurrent {got_rec}, the kvpack spec says "
                          f"{want}")
    return b
