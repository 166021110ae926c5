"""The muser connector's configuration: what vLLM's ``kv_transfer_config`` carries.

Everything here is plain JSON, validated where it is built (:func:`connector_config`)
and again where vLLM hands it back (:meth:`ConnectorSettings.from_extra_config`), so a
bad config fails in the caller's process, not inside a vLLM worker.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from muser_cli.errors import ConfigError, UsageError
from muser_cli.kvpack.validate import parse_layer_spec
from muser_cli.kvpack.layers import DTYPES, LayerSpec

CONNECTOR_CLASS = "MuserConnector"
CONNECTOR_MODULE = "muser_cli.engines.vllm.connector"
LEGACY_CONNECTOR_MODULE = "muser_cli.engines.vllm_connector"  # still loads (a shim)
CONFIG_KEY = "muser"  # kv_connector_extra_config[CONFIG_KEY]; kv_transfer_params[CONFIG_KEY]
CONFIG_VERSION = 1
SINKS = ("kvpack", "spool")
CAPTURE = ("tagged", "all")
SUPPORTED_VLLM = ">=0.30,<0.34"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

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


def layer_spec_from_json(obj: Any, i: int = 0) -> LayerSpec:
    """A :class:`LayerSpec` from its ``to_json()`` form, by the kvpack header's own strict
    parser (:func:`muser_cli.kvpack.validate.parse_layer_spec`); ConfigError on anything odd."""
    return parse_layer_spec(obj, f"connector layers[{i}]", fail=ConfigError)


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config["muser"]``, validated. Plain JSON values only."""

    sink: str
    output_dir: Path
    layers: tuple[LayerSpec, ...]
    capture: str = "tagged"
    dtype: str | None = None  # expected storage dtype; None = whatever vLLM's cache holds
    header: dict[str, Any] = field(default_factory=dict)  # kvpack identity (sink "kvpack")
    history: bool = False  # sliding layers: every row computed (the sliding history), not the window
    # vLLM's model permuted each head's q/k projection rows for its rotary kernel (Llama 4:
    # ``permute_qk_weight_for_rotary``): its cache holds keys as [even dims, odd dims] of the
    # checkpoint's order; the connector puts them back (:func:`unhalve_keys`)
    halved_keys: bool = False

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
        history = cfg.get("history", False)
        if type(history) is not bool:
            raise ConfigError("muser connector history must be true or false")
        halved = cfg.get("halved_keys", False)
        if type(halved) is not bool:
            raise ConfigError("muser connector halved_keys must be true or false")
        if halved and any(spec.head_dim % 2 for spec in layers):
            raise ConfigError("muser connector halved_keys needs even head dims")
        return cls(sink=sink, output_dir=Path(out), layers=layers, capture=capture, dtype=dtype, header=header,
                   history=history, halved_keys=halved)


def connector_config(
    *,
    sink: str,
    output_dir: str | os.PathLike[str],
    layers: Sequence[LayerSpec],
    dtype: str | None = None,
    header: dict[str, Any] | None = None,
    capture: str = "tagged",
    history: bool = False,
    halved_keys: bool = False,
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
        "history": bool(history),
        "halved_keys": bool(halved_keys),
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
    if not NAME_RE.match(name):
        raise UsageError(f"pack name {name!r} is not a safe file name")
    return {"kv_transfer_params": {CONFIG_KEY: {"name": name}}}


def layer_index(layer_name: str) -> int:
    """The decoder layer index in a vLLM attention layer name
    (``model.layers.7.self_attn.attn`` -> 7). Exactly one integer path component."""
    nums = [int(p) for p in layer_name.split(".") if p.isdigit()]
    if len(nums) != 1:
        raise ConfigError(f"cannot tell the layer index of vLLM layer {layer_name!r}")
    return nums[0]


def resolve_quant(cache_dtype: str, platform_fp8: str | None) -> tuple[str, str]:
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
