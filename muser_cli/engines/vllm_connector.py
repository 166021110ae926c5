"""muser's vLLM KV connector: vLLM prefills, this module turns its paged KV into rows.

Configure vLLM with (vLLM 0.30-0.33, no patch to vLLM)::

    KVTransferConfig(
        kv_connector="MuserConnector",
        kv_connector_module_path="muser_cli.engines.vllm_connector",
        kv_role="kv_producer",
        kv_connector_extra_config={"muser": {...}},   # see connector_config()
    )

vLLM's factory imports this module by path and asks it for ``MuserConnector``; the
class (a ``KVConnectorBase_V1`` and ``SupportsHMA`` subclass) is built on that first
attribute access (PEP 562), so importing this module never imports vLLM or torch.

Split as vLLM splits it:

* scheduler side (:class:`SchedulerPlanner`): each step, for every captured request
  that is still in its prompt, one *save item*: which token range was computed this
  step and the request's block ids per KV cache group. The metadata sent to the
  workers is a single JSON string (:class:`MuserConnectorMetadata.payload`); nothing
  of ours is ever unpickled.
* worker side (:class:`WorkerAssembler`): after each forward (``wait_for_save``), for
  every save item and every attention layer, :func:`~muser_cli.engines.vllm_layout.gather_paged_kv`
  copies the rows just computed (only the layer's carried range: full layers every
  row, sliding layers the last ``window - 1``) off the GPU; when the request's last
  prompt chunk is done, the rows go to the sink. Saving is synchronous, so vLLM may
  free the blocks as soon as the step ends.

Sinks: ``"kvpack"`` writes ``<output_dir>/<name>.kvpack`` (vLLM's prompt is the full
prompt; rows for prompt[:-1] ship, the consumer runs the last token) through
:func:`write_kvpack`, the only function here that knows the kvpack writer;
``"spool"`` (used by ``--engine vllm``, whose vLLM prompt is already prompt[:-1]) writes
``<output_dir>/<name>.spool/`` (a JSON manifest and ``.npy`` arrays, read back with
``allow_pickle=False`` by :func:`read_spool`). A request that fails leaves
``<name>.error.json`` instead, never a partial pack.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from muser_cli.engines import vllm_layout
from muser_cli.errors import ConfigError, DataError, UsageError
from muser_cli.kvpack.layers import DTYPES, LayerKV, LayerSpec, RopeSpec

CONNECTOR_CLASS = "MuserConnector"
CONNECTOR_MODULE = "muser_cli.engines.vllm_connector"
CONFIG_KEY = "muser"  # kv_connector_extra_config[CONFIG_KEY]; kv_transfer_params[CONFIG_KEY]
CONFIG_VERSION = 1
SPOOL_FORMAT = "muser-vllm-spool"
SPOOL_VERSION = 1
SINKS = ("kvpack", "spool")
CAPTURE = ("tagged", "all")
SUPPORTED_VLLM = ">=0.30,<0.34"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# vLLM cache_dtype -> (quant, fp8 format or None). "fp8"/"fp8_e4m3" mean the platform's
# e4m3 type (e4m3fn on CUDA, e4m3fnuz on some ROCm parts): resolved on the worker.
_CACHE_DTYPES: dict[str, tuple[str, str | None]] = {
    "auto": ("none", None),
    "bfloat16": ("none", None),
    "float16": ("none", None),
    "half": ("none", None),
    "float": ("none", None),
    "float32": ("none", None),
    "fp8": ("fp8", "e4m3"),
    "fp8_e4m3": ("fp8", "e4m3"),
    "fp8_e5m2": ("fp8", "e5m2"),
    "fp8_per_token_head": ("fp8_per_token_head", "e4m3"),
}


# ---------------------------------------------------------------------------- config


def layer_spec_from_json(obj: Any, i: int = 0) -> LayerSpec:
    """A :class:`LayerSpec` from its ``to_json()`` form (strict; ConfigError on anything odd)."""
    if not isinstance(obj, dict):
        raise ConfigError(f"connector layers[{i}] is not an object")
    try:
        rope = obj.get("rope")
        rope_spec = None
        if rope is not None:
            rope_spec = RopeSpec(
                theta=float(rope["theta"]), dims=int(rope["dims"]),
                style=str(rope.get("style", "rotate_half")), scaling=rope.get("scaling"),
            )
        spec = LayerSpec(
            kind=str(obj["kind"]), kv_heads=int(obj["kv_heads"]), head_dim=int(obj["head_dim"]),
            v_head_dim=int(obj.get("v_head_dim", obj["head_dim"])),
            window=None if obj.get("window") is None else int(obj["window"]), rope=rope_spec,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"connector layers[{i}] is malformed ({type(exc).__name__}: {exc})") from None
    if spec.kind not in ("full", "sliding") or spec.kv_heads < 1 or spec.head_dim < 1 or spec.v_head_dim < 1:
        raise ConfigError(f"connector layers[{i}] is malformed")
    if spec.kind == "sliding" and (spec.window is None or spec.window < 1):
        raise ConfigError(f"connector layers[{i}] is sliding without a positive window")
    return spec


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config["muser"]``, validated. Plain JSON values only."""

    sink: str
    output_dir: Path
    layers: tuple[LayerSpec, ...]
    capture: str = "tagged"
    dtype: str | None = None  # expected storage dtype; None = whatever vLLM's cache holds
    header: dict[str, Any] = field(default_factory=dict)  # kvpack identity (sink "kvpack")

    @classmethod
    def from_extra_config(cls, extra: Any) -> "ConnectorSettings":
        if not isinstance(extra, dict) or not isinstance(extra.get(CONFIG_KEY), dict):
            raise ConfigError(
                f"kv_connector_extra_config has no {CONFIG_KEY!r} object",
                hint="build the KV transfer config with muser_cli.engines.vllm_connector.connector_config()",
            )
        cfg = extra[CONFIG_KEY]
        if cfg.get("version") != CONFIG_VERSION:
            raise ConfigError(f"muser connector config version {cfg.get('version')!r} is not {CONFIG_VERSION}")
        sink = cfg.get("sink")
        if sink not in SINKS:
            raise ConfigError(f"muser connector sink {sink!r} is unknown (known: {', '.join(SINKS)})")
        capture = cfg.get("capture", "tagged")
        if capture not in CAPTURE:
            raise ConfigError(f"muser connector capture {capture!r} is unknown (known: {', '.join(CAPTURE)})")
        out = cfg.get("output_dir")
        if not isinstance(out, str) or not out:
            raise ConfigError("muser connector config needs output_dir (a directory path)")
        layers_obj = cfg.get("layers")
        if not isinstance(layers_obj, list) or not layers_obj:
            raise ConfigError("muser connector config needs layers (a list of kvpack layer specs)")
        layers = tuple(layer_spec_from_json(o, i) for i, o in enumerate(layers_obj))
        dtype = cfg.get("dtype")
        if dtype is not None and dtype not in DTYPES:
            raise ConfigError(f"muser connector dtype {dtype!r} is unknown (known: {', '.join(DTYPES)})")
        header = cfg.get("header") or {}
        if not isinstance(header, dict):
            raise ConfigError("muser connector header must be an object")
        if sink == "kvpack":
            for key in ("model_fingerprint", "tokenizer_fingerprint"):
                if not isinstance(header.get(key), str):
                    raise ConfigError(f"sink 'kvpack' needs header.{key}")
        return cls(sink=sink, output_dir=Path(out), layers=layers, capture=capture, dtype=dtype, header=header)


def connector_config(
    *,
    sink: str,
    output_dir: str | os.PathLike[str],
    layers: Sequence[LayerSpec],
    dtype: str | None = None,
    header: dict[str, Any] | None = None,
    capture: str = "tagged",
) -> dict[str, Any]:
    """The ``kv_transfer_config`` (as a dict vLLM's ``LLM(...)`` accepts) that loads this
    connector. ``header`` (sink ``"kvpack"``): model_fingerprint, tokenizer_fingerprint,
    and optionally model_name, architecture, chunk_tokens, codec."""
    cfg: dict[str, Any] = {
        "version": CONFIG_VERSION,
        "sink": sink,
        "output_dir": os.fspath(output_dir),
        "layers": [spec.to_json() for spec in layers],
        "capture": capture,
        "dtype": dtype,
        "header": dict(header or {}),
    }
    ConnectorSettings.from_extra_config({CONFIG_KEY: cfg})  # fail early, here, not in a worker
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {CONFIG_KEY: cfg},
    }


def request_extra_args(name: str) -> dict[str, Any]:
    """``SamplingParams(extra_args=...)`` that tags a request for capture under ``name``."""
    if not _NAME_RE.match(name):
        raise UsageError(f"pack name {name!r} is not a safe file name")
    return {"kv_transfer_params": {CONFIG_KEY: {"name": name}}}


def layer_index(layer_name: str) -> int:
    """The decoder layer index in a vLLM attention layer name
    (``model.layers.7.self_attn.attn`` -> 7). Exactly one integer path component."""
    nums = [int(p) for p in layer_name.split(".") if p.isdigit()]
    if len(nums) != 1:
        raise ConfigError(f"cannot tell the layer index of vLLM layer {layer_name!r}")
    return nums[0]


# ---------------------------------------------------------------------------- scheduler side


@dataclass
class _ReqState:
    name: str
    tokens: list[int]
    target: int  # rows to ship: positions [0, target)
    blocks: list[list[int]]
    done: bool = False


def _safe_name(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "_", text)[:128].lstrip("._-")
    return name or "request"


def _request_muser_params(sampling_params: Any) -> dict[str, Any] | None:
    extra = getattr(sampling_params, "extra_args", None) or {}
    params = (extra.get("kv_transfer_params") or {}) if isinstance(extra, dict) else {}
    value = params.get(CONFIG_KEY) if isinstance(params, dict) else None
    return value if isinstance(value, dict) else None


class SchedulerPlanner:
    """Scheduler-side bookkeeping: vLLM's per-step SchedulerOutput -> a JSON save plan.

    Duck-typed over vLLM's ``SchedulerOutput`` (``scheduled_new_reqs``,
    ``scheduled_cached_reqs``, ``num_scheduled_tokens``, ``finished_req_ids``).
    """

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self._reqs: dict[str, _ReqState] = {}

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    @property
    def active(self) -> int:
        return len(self._reqs)

    def _item(self, req_id: str, st: _ReqState, start: int, stop: int, reset: bool) -> dict[str, Any] | None:
        final = stop >= st.target
        if start >= st.target and not final:
            return None
        if final:
            st.done = True
        item: dict[str, Any] = {
            "req": req_id, "name": st.name, "start": int(start), "stop": int(min(stop, st.target)),
            "target": st.target, "blocks": [list(map(int, b)) for b in st.blocks],
            "reset": bool(reset), "final": bool(final),
        }
        if final:
            item["tokens"] = list(map(int, st.tokens))
        return item

    def plan(self, scheduler_output: Any) -> str:
        items: list[dict[str, Any]] = []
        for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._reqs.pop(rid, None)
        num_sched: dict[str, int] = dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
        for nr in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            params = _request_muser_params(getattr(nr, "sampling_params", None))
            if params is None and self.settings.capture != "all":
                continue
            rid = str(nr.req_id)
            name = params.get("name") if params else None
            if not (isinstance(name, str) and _NAME_RE.match(name)):
                name = _safe_name(rid)
            tokens = getattr(nr, "prompt_token_ids", None)
            if tokens is None:
                items.append({"req": rid, "name": name, "error": "request has no prompt token ids (embeddings input)"})
                continue
            tokens = list(tokens)
            target = len(tokens) if self.settings.sink == "spool" else len(tokens) - 1
            st = _ReqState(name=name, tokens=tokens, target=max(target, 0), blocks=[list(b) for b in nr.block_ids])
            self._reqs[rid] = st
            stop = int(nr.num_computed_tokens) + int(num_sched.get(rid, 0))
            # Start at 0 even after a prefix-cache hit: cached blocks hold valid rows.
            item = self._item(rid, st, 0, stop, reset=True)
            if item is not None:
                items.append(item)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed_ids = set(getattr(cached, "resumed_req_ids", ()) or ())
            for i, rid in enumerate(cached.req_ids):
                st = self._reqs.get(rid)
                if st is None or st.done:
                    continue
                new_blocks = cached.new_block_ids[i]
                resumed = rid in resumed_ids
                if resumed:  # after preemption the list is the whole table
                    st.blocks = [list(b) for b in (new_blocks or ())]
                elif new_blocks is not None:
                    for g, extra in enumerate(new_blocks):
                        st.blocks[g].extend(extra)
                computed = int(cached.num_computed_tokens[i])
                stop = computed + int(num_sched.get(rid, 0))
                item = self._item(rid, st, 0 if resumed else computed, stop, reset=resumed)
                if item is not None:
                    items.append(item)
        for item in items:
            if item.get("final") or "error" in item:
                self._reqs.pop(item["req"], None)
        return json.dumps({"v": 1, "items": items}, separators=(",", ":"))


# ---------------------------------------------------------------------------- worker side


@dataclass
class LayerBinding:
    """One attention layer as the worker sees it."""

    name: str  # vLLM layer name
    index: int  # kvpack layer index
    spec: LayerSpec
    group: int  # KV cache group (index into the request's block id lists)
    block_size: int  # the group's manager block size
    cache: Any  # the per-layer paged tensor ("BHNC")
    scales: Callable[[], tuple[Any, Any]] | None = None  # fp8 per-tensor / per-head (k, v)


@dataclass
class _Buffer:
    name: str
    target: int
    pieces: dict[int, list[vllm_layout.GatheredKV]] = field(default_factory=dict)


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
        self.producer = dict(producer or {})
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
            if not _NAME_RE.match(name):
                name = _safe_name(name)
            try:
                if "error" in item:
                    raise DataError(str(item["error"]))
                self._apply(rid, name, item)
            except Exception as exc:  # fail closed for this request, keep vLLM alive
                self._buffers.pop(rid, None)
                self.failed.append(_write_error(self.settings.output_dir, name, exc))

    def _apply(self, rid: str, name: str, item: dict[str, Any]) -> None:
        start, stop, target = int(item["start"]), int(item["stop"]), int(item["target"])
        if item.get("reset") or rid not in self._buffers:
            self._buffers[rid] = _Buffer(name=name, target=target)
        buf = self._buffers[rid]
        blocks = item["blocks"]
        for b in self.bindings:
            first, end = vllm_layout.layer_rows_for(b.spec.kind, b.spec.window, target)
            lo, hi = max(start, first), min(stop, end)
            if lo >= hi:
                continue
            if b.group >= len(blocks):
                raise DataError(f"save plan has no block ids for KV cache group {b.group}")
            ks = vs = None
            if self.quant == "fp8" and b.scales is not None:
                ks, vs = b.scales()
            got = vllm_layout.gather_paged_kv(
                b.cache, blocks[b.group], start=lo, stop=hi, layout="BHNC",
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

    def _assemble(self, buf: _Buffer) -> tuple[list[LayerKV], str, dict[str, Any]]:
        layers: list[LayerKV] = []
        dtypes: set[str] = set()
        source: dict[str, Any] = {"quant": self.quant}
        for b in self.bindings:
            first, end = vllm_layout.layer_rows_for(b.spec.kind, b.spec.window, buf.target)
            pieces = buf.pieces.get(b.index, [])
            have = sum(p.rows for p in pieces)
            if have != end - first:
                raise DataError(f"layer {b.index}: gathered {have} rows, expected {end - first}")
            dtype = "float32" if self.quant != "none" else vllm_layout.storage_name(b.cache.dtype)
            if dtype not in DTYPES:
                raise DataError(f"layer {b.index}: cache dtype {b.cache.dtype} has no kvpack dtype")
            dtypes.add(dtype)
            keys, values = _finish_rows(pieces, b.spec, self.quant, dtype)
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
        self, name: str, tokens: list[int], target: int, layers: list[LayerKV], dtype: str, source: dict[str, Any]
    ) -> Path:
        out = self.settings.output_dir
        if self.settings.sink == "spool":
            return write_spool(out, name, layers, dtype=dtype, rows=target, tokens=len(tokens), source=source)
        producer = {"engine": "vllm", **self.producer, "source": source}
        return write_kvpack(out / f"{name}.kvpack", self.settings, tokens, dtype, layers, producer)


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
            [vllm_layout.dequantize_fp8(p.keys, p.k_scale, p.fp8_format or "e4m3fn") for p in pieces], axis=1)
        values = np.concatenate(
            [vllm_layout.dequantize_fp8(p.values, p.v_scale, p.fp8_format or "e4m3fn") for p in pieces], axis=1)
    if keys.dtype != np_dtype or keys.shape[0] != spec.kv_heads or keys.shape[2] != spec.head_dim \
            or values.shape[2] != spec.v_head_dim:
        raise DataError(f"rows {keys.dtype} {keys.shape} do not match the layer spec ({dtype})")
    return keys, values


# ---------------------------------------------------------------------------- sinks


def _atomic_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))


def _write_error(out_dir: Path, name: str, exc: BaseException) -> Path:
    path = Path(out_dir) / f"{name}.error.json"
    msg = str(exc).replace("\n", " ")[:2000] or type(exc).__name__
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"error": msg, "type": type(exc).__name__}))
        os.replace(tmp, path)
    except OSError:
        pass
    return path


def write_spool(
    out_dir: Path, name: str, layers: Sequence[LayerKV], *, dtype: str, rows: int, tokens: int,
    source: dict[str, Any] | None = None,
) -> Path:
    """``<out_dir>/<name>.spool/``: manifest.json + one .npy per array, renamed into place."""
    final = Path(out_dir) / f"{name}.spool"
    tmp = _atomic_dir(final)
    try:
        entries = []
        for i, lk in enumerate(layers):
            np.save(tmp / f"k{i}.npy", np.ascontiguousarray(lk.keys), allow_pickle=False)
            np.save(tmp / f"v{i}.npy", np.ascontiguousarray(lk.values), allow_pickle=False)
            entries.append({"index": i, "first_row": int(lk.first_row), "rows": int(lk.keys.shape[1]),
                            "keys": f"k{i}.npy", "values": f"v{i}.npy"})
        manifest = {"format": SPOOL_FORMAT, "version": SPOOL_VERSION, "name": name, "dtype": dtype,
                    "rows": int(rows), "tokens": int(tokens), "layers": entries, "source": source or {}}
        (tmp / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_spool(out_dir: Path, name: str, specs: Sequence[LayerSpec], *, remove: bool = True) -> tuple[list[LayerKV], dict[str, Any]]:
    """Load what the worker spooled for ``name`` (strictly checked), then remove it.

    Raises DataError with the worker's own message when it left an error file.
    """
    out_dir = Path(out_dir)
    err = out_dir / f"{name}.error.json"
    if err.exists():
        try:
            msg = json.loads(err.read_text()).get("error", "unknown error")
        except (OSError, ValueError):
            msg = "unreadable error file"
        if remove:
            err.unlink(missing_ok=True)
        raise DataError(f"the vLLM connector failed: {msg}")
    root = out_dir / f"{name}.spool"
    if not (root / "manifest.json").is_file():
        raise DataError(
            "vLLM finished the request but the muser connector spooled no KV",
            hint="check vLLM's log for the connector (is kv_transfer_config set?)",
        )
    try:
        man = json.loads((root / "manifest.json").read_text())
        if man.get("format") != SPOOL_FORMAT or man.get("version") != SPOOL_VERSION:
            raise DataError("spool manifest has an unknown format or version")
        dtype = man["dtype"]
        if dtype not in DTYPES:
            raise DataError(f"spool dtype {dtype!r} is unknown")
        np_dtype = np.dtype(DTYPES[dtype][1])
        entries = man["layers"]
        if len(entries) != len(specs):
            raise DataError(f"spool holds {len(entries)} layers, the model has {len(specs)}")
        rows = int(man["rows"])
        layers: list[LayerKV] = []
        for i, (entry, spec) in enumerate(zip(entries, specs)):
            first, end = vllm_layout.layer_rows_for(spec.kind, spec.window, rows)
            if entry["index"] != i or entry["first_row"] != first or entry["rows"] != end - first:
                raise DataError(f"spool layer {i} does not carry rows [{first}, {end})")
            arrays = []
            for key, dim in (("keys", spec.head_dim), ("values", spec.v_head_dim)):
                fname = entry[key]
                if not isinstance(fname, str) or "/" in fname or fname.startswith("."):
                    raise DataError(f"spool layer {i} names a bad file")
                arr = np.load(root / fname, allow_pickle=False)
                if arr.dtype != np_dtype or arr.shape != (spec.kv_heads, end - first, dim):
                    raise DataError(f"spool layer {i} {key}: {arr.dtype} {arr.shape}, expected {np_dtype} "
                                    f"{(spec.kv_heads, end - first, dim)}")
                arrays.append(arr)
            layers.append(LayerKV(keys=arrays[0], values=arrays[1], first_row=first))
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise DataError(f"spool for {name!r} is malformed ({type(exc).__name__})") from None
    if remove:
        shutil.rmtree(root, ignore_errors=True)
    return layers, man


def write_kvpack(
    path: Path, settings: ConnectorSettings, tokens: Sequence[int], dtype: str, layers: Sequence[LayerKV],
    producer: dict[str, Any],
) -> Path:
    """Hand rows to the kvpack writer: the one place this module depends on its API."""
    from muser_cli.kvpack import PackHeader, write_pack  # lazy: keeps the connector light

    h = settings.header
    header = PackHeader(
        model_fingerprint=h["model_fingerprint"],
        tokenizer_fingerprint=h["tokenizer_fingerprint"],
        token_ids=tuple(int(t) for t in tokens),
        layers=tuple(settings.layers),
        dtype=dtype,
        chunk_tokens=int(h.get("chunk_tokens", 512)),
        model_name=str(h.get("model_name", "")),
        architecture=str(h.get("architecture", "")),
        producer=producer,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write_pack(f, header, list(layers), codec=h.get("codec"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------- the vLLM classes


def _resolve_quant(cache_dtype: str, platform_fp8: str | None) -> tuple[str, str]:
    """(quant, fp8 format) for vLLM's ``cache_dtype`` string."""
    if cache_dtype not in _CACHE_DTYPES:
        raise UsageError(
            f"vLLM kv_cache_dtype {cache_dtype!r} is not supported by the muser connector",
            hint="use 'auto' (the model dtype), 'fp8', 'fp8_e4m3', 'fp8_e5m2' or 'fp8_per_token_head'",
        )
    quant, fmt = _CACHE_DTYPES[cache_dtype]
    if fmt == "e4m3":
        fmt = "e4m3fnuz" if platform_fp8 and "fnuz" in platform_fp8 else "e4m3fn"
    return quant, fmt or "e4m3fn"


def build_bindings(
    settings: ConnectorSettings,
    kv_caches: dict[str, Any],
    groups: Sequence[tuple[Sequence[str], Any]],
    forward_layers: dict[str, Any] | None = None,
) -> list[LayerBinding]:
    """Match vLLM's registered caches to kvpack layers and check them against vLLM's specs.

    ``groups``: ``(layer_names, kv_cache_spec)`` per KV cache group, in group order.
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
        if any("MLA" in k for k in kinds) or not hasattr(vspec, "num_kv_heads"):
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
        if "ChunkedLocalAttentionSpec" in kinds or "CrossAttentionSpec" in kinds:
            raise ConfigError(f"vLLM layer {name!r} uses {kind}: not supported by the muser connector")
        shape = tuple(int(s) for s in cache.shape)
        if len(shape) != 4 or shape[1] != spec.kv_heads:
            raise ConfigError(
                f"vLLM layer {name!r} cache has shape {shape}; the muser connector reads vLLM's "
                f"per-layer (blocks, kv_heads, block_size, K|V) view (vLLM {SUPPORTED_VLLM})"
            )
        scales = None
        layer_mod = (forward_layers or {}).get(name)
        if layer_mod is not None and hasattr(layer_mod, "_k_scale"):
            def scales(m: Any = layer_mod) -> tuple[Any, Any]:
                return m._k_scale, m._v_scale
        bindings.append(LayerBinding(name=name, index=idx, spec=spec, group=g,
                                     block_size=int(vspec.block_size), cache=cache, scales=scales))
    return bindings


_CLASSES: dict[str, type] = {}


def _build_classes() -> None:
    """Define the vLLM-facing classes (imports vLLM; called on first attribute access)."""
    if _CLASSES:
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )

    class MuserConnectorMetadata(KVConnectorMetadata):
        """Scheduler -> worker: one JSON text (a save plan). Plain data only."""

        def __init__(self, payload: str) -> None:
            self.payload = str(payload)

    class MuserConnector(KVConnectorBase_V1, SupportsHMA):
        """muser producer connector: captures prompt KV into kvpack rows (see module doc)."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            self._settings = ConnectorSettings.from_extra_config(
                self._kv_transfer_config.kv_connector_extra_config
            )
            par = vllm_config.parallel_config
            for attr in ("tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size"):
                if int(getattr(par, attr, 1) or 1) != 1:
                    raise UsageError(f"the muser connector needs {attr}=1 (got {getattr(par, attr)})")
            self._planner = SchedulerPlanner(self._settings) if role == KVConnectorRole.SCHEDULER else None
            self._assembler: WorkerAssembler | None = None

        # ---- worker side
        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            cfg = self._kv_cache_config
            groups = [(g.layer_names, g.kv_cache_spec) for g in cfg.kv_cache_groups]
            fwd = getattr(self._vllm_config.compilation_config, "static_forward_context", {}) or {}
            cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
            platform_fp8 = None
            try:
                from vllm.platforms import current_platform

                platform_fp8 = str(current_platform.fp8_dtype())
            except Exception:  # pragma: no cover - platform probing is best effort
                pass
            quant, fmt = _resolve_quant(cache_dtype, platform_fp8)
            import vllm

            producer: dict[str, Any] = {"vllm": str(getattr(vllm, "__version__", "?")), "kv_cache_dtype": cache_dtype}
            block_size = getattr(self._vllm_config.cache_config, "block_size", None)
            if isinstance(block_size, int):
                producer["block_size"] = block_size
            layout = getattr(self._vllm_config.cache_config, "kv_cache_layout", None)
            if layout:
                producer["kv_cache_layout"] = str(layout)
            self._assembler = WorkerAssembler(
                self._settings, build_bindings(self._settings, kv_caches, groups, fwd),
                quant=quant, fp8_format=fmt, producer=producer,
            )

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            return None

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            return None  # rows are gathered once per step, in wait_for_save

        def wait_for_save(self) -> None:
            if self._assembler is None or not self.has_connector_metadata():
                return
            meta = self._get_connector_metadata()
            payload = getattr(meta, "payload", None)
            if not isinstance(payload, str):
                return
            try:
                from vllm.utils.gpu_sync_debug import gpu_sync_allowed
            except Exception:  # older vLLM: no sync checker
                from contextlib import nullcontext as gpu_sync_allowed
            with gpu_sync_allowed():
                self._assembler.process(payload)

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            if self._assembler is not None:
                self._assembler.drop(finished_req_ids)
            return None, None

        # ---- scheduler side
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            return 0, False  # a producer never loads

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            return None

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            assert self._planner is not None
            return MuserConnectorMetadata(self._planner.plan(scheduler_output))

        def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
            if self._planner is not None:
                self._planner.forget(request.request_id)
            return False, None

        def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
            return self.request_finished(request, [])

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
            return None  # any layout: the per-layer view is read through its strides

    for cls in (MuserConnectorMetadata, MuserConnector):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        _CLASSES[cls.__name__] = cls


def __getattr__(name: str) -> Any:  # PEP 562: vLLM's factory does getattr(module, "MuserConnector")
    if name in ("MuserConnector", "MuserConnectorMetadata"):
        _build_classes()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CONNECTOR_CLASS", "CONNECTOR_MODULE", "ConnectorSettings", "LayerBinding", "SchedulerPlanner",
    "WorkerAssembler", "build_bindings", "connector_config", "layer_index", "layer_spec_from_json",
    "read_spool", "request_extra_args", "write_kvpack", "write_spool",
]
