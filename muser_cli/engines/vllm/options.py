"""vLLM engine options: ``KEY=VALUE`` text, muser's own keys, and per-platform defaults.

Options reach :class:`~muser_cli.engines.vllm.engine.VLLMEngine` three ways, later ones
winning: muser's defaults for the platform (:func:`default_options`), the environment
variable ``MUSER_VLLM_OPTS`` (``KEY=VALUE,KEY=VALUE``), and the engine's
``vllm_options`` argument. Keys are ``vllm.LLM(...)`` / ``EngineArgs`` names
(``enforce_eager``, ``max_model_len``, ``block_size``, ``attention_backend``,
``kv_cache_dtype``, ``gpu_memory_utilization``, ...) plus muser's own:

``host``            vLLM's ``VLLM_HOST_IP`` (the address its message queue binds);
                    default ``127.0.0.1``
``kv_cache_space``  KV cache size in GiB (vLLM's ``kv_cache_memory_bytes``); CPU
                    default 1. Without it vLLM's CPU backend reserves
                    ``gpu_memory_utilization`` of the NUMA node's memory.
``in_process``      run vLLM's engine core and its one worker inside this process
                    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend
                    ="uni"``); CPU default true: on 2 cores the engine starts in ~14 s
                    instead of ~50 s, and nothing is spawned. False: vLLM's own processes
                    (spawned; a script that makes an engine then needs a main guard).

The options that fix the canonical schedule and the capture (``model``, ``dtype``,
``kv_transfer_config``, ``max_num_batched_tokens``, ``enable_chunked_prefill``,
``max_num_seqs``, ``enable_prefix_caching``) are muser's and are refused.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Mapping

from muser_cli.errors import UsageError

ENV_VAR = "MUSER_VLLM_OPTS"
MUSER_KEYS = ("host", "kv_cache_space", "in_process")
# environment variable -> the muser option that sets it
ENV_OF = {"VLLM_HOST_IP": "host", "VLLM_ENABLE_V1_MULTIPROCESSING": "in_process"}
RESERVED = ("model", "dtype", "kv_transfer_config", "max_num_batched_tokens", "enable_chunked_prefill",
            "max_num_seqs", "enable_prefix_caching")
DEFAULT_HOST = "127.0.0.1"
CPU_KV_CACHE_GIB = 1
_KEY_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def parse_value(text: str) -> Any:
    """``true``/``false``/``none``, an int, a float, else the text itself."""
    t = text.strip()
    low = t.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def parse_options(items: str | Iterable[str], *, source: str = ENV_VAR) -> dict[str, Any]:
    """``"k=v,k2=v2"`` (or a list of ``"k=v"``) -> a dict; UsageError on a malformed item."""
    parts = [p for p in (items.split(",") if isinstance(items, str) else items) if p.strip()]
    out: dict[str, Any] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not _KEY_RE.match(key):
            raise UsageError(f"{source}: {part.strip()!r} is not KEY=VALUE", hint="e.g. enforce_eager=true,max_model_len=2048")
        out[key] = parse_value(value)
    return out


def env_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    text = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return parse_options(text) if text.strip() else {}


def default_options(*, on_cpu: bool) -> dict[str, Any]:
    """muser's defaults. The producer runs prefill only, so CUDA graphs / torch.compile buy
    nothing and cost 45-70 s of warm-up per start: eager everywhere."""
    opts: dict[str, Any] = {"enforce_eager": True, "host": DEFAULT_HOST}
    if on_cpu:
        opts["kv_cache_space"] = CPU_KV_CACHE_GIB
        opts["in_process"] = True
    return opts


def check_names(opts: Mapping[str, Any], engine_args: Iterable[str] | None) -> None:
    """Refuse muser's reserved keys, and (when vLLM's EngineArgs names are known) unknown ones."""
    for key in opts:
        if key in RESERVED:
            raise UsageError(f"vLLM option {key!r} is set by muser itself (the canonical schedule and the capture)",
                             hint="use --dtype / --chunk for dtype and chunk size" if key in ("dtype", "max_num_batched_tokens") else None)
    if engine_args is None:
        return
    known = set(engine_args) | set(MUSER_KEYS)
    for key in opts:
        if key not in known:
            raise UsageError(f"vLLM option {key!r} is not a vLLM engine argument",
                             hint="see `vllm serve --help` for the names (dashes become underscores)")


def split_options(opts: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(``vllm.LLM`` keyword arguments, environment variables) for the options."""
    kwargs = {k: v for k, v in opts.items() if k not in MUSER_KEYS}
    env: dict[str, str] = {}
    if opts.get("host") is not None:
        env["VLLM_HOST_IP"] = str(opts["host"])
    in_process = opts.get("in_process")
    if in_process is not None:
        if not isinstance(in_process, bool):
            raise UsageError(f"vLLM option in_process must be true or false, got {in_process!r}")
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        if in_process:
            kwargs.setdefault("distributed_executor_backend", "uni")
    space = opts.get("kv_cache_space")
    if space is not None:
        if isinstance(space, bool) or not isinstance(space, (int, float)) or not space > 0:
            raise UsageError(f"vLLM option kv_cache_space must be a positive number of GiB, got {space!r}")
        kwargs.setdefault("kv_cache_memory_bytes", int(float(space) * (1 << 30)))
    return kwargs, env
