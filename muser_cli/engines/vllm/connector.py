"""The vLLM-facing classes: ``MuserConnector`` and its metadata (imports vLLM).

Configure vLLM with (vLLM 0.30-0.33, no patch to vLLM)::

    KVTransferConfig(
        kv_connector="MuserConnector",
        kv_connector_module_path="muser_cli.engines.vllm.connector",
        kv_role="kv_producer",
        kv_connector_extra_config={"muser": {...}},   # see config.connector_config()
    )

vLLM's factory imports this module by path and asks it for ``MuserConnector``; the
class (a ``KVConnectorBase_V1`` and ``SupportsHMA`` subclass) is built on that first
attribute access (PEP 562), so importing this module never imports vLLM or torch. The
old path ``muser_cli.engines.vllm_connector`` is a shim that resolves to the same class.
"""

from __future__ import annotations

from typing import Any

from muser_cli.engines.vllm.assembler import WorkerAssembler, build_bindings, fail_plan
from muser_cli.engines.vllm.config import ConnectorSettings, resolve_quant
from muser_cli.engines.vllm.planner import SchedulerPlanner
from muser_cli.errors import ConfigError, UsageError

_CLASSES: dict[str, type] = {}


def kv_cache_layout_name(cache_config: Any) -> str | None:
    """vLLM's resolved ``KVCacheLayout`` member name, or None where vLLM does not tell."""
    getter = getattr(cache_config, "get_resolved_kv_cache_layout", None)
    value = None
    if callable(getter):
        try:
            value = getter()
        except (ValueError, AttributeError):
            value = None
    if value is None:
        value = getattr(cache_config, "kv_cache_layout", None)
    if value is None:
        return None
    return str(getattr(value, "name", value))


def _assembler_for(settings: ConnectorSettings, vllm_config: Any, kv_cache_config: Any,
                   kv_caches: dict[str, Any]) -> WorkerAssembler:
    """The worker half for vLLM's registered caches: layouts checked, readers chosen."""
    groups = [(g.layer_names, g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
    fwd = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    platform_fp8 = None
    try:
        from vllm.platforms import current_platform

        platform_fp8 = str(current_platform.fp8_dtype())
    except Exception:  # platform probing is best effort: only the fp8 flavour depends on it
        pass
    quant, fmt = resolve_quant(cache_dtype, platform_fp8)
    import vllm

    producer: dict[str, Any] = {"vllm": str(getattr(vllm, "__version__", "?"))}
    bindings = build_bindings(settings, kv_caches, groups, fwd, cache_dtype=cache_dtype,
                              kv_cache_layout=kv_cache_layout_name(vllm_config.cache_config))
    return WorkerAssembler(settings, bindings, quant=quant, fp8_format=fmt, producer=producer)


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
            self._refusal: Exception | None = None

        # ---- worker side
        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            try:
                self._assembler = _assembler_for(self._settings, self._vllm_config, self._kv_cache_config, kv_caches)
            except (ConfigError, UsageError) as exc:
                # Refused (an unchecked backend, ISA or cache dtype): vLLM keeps running and
                # every captured request gets this error instead of a pack.
                self._refusal = exc

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            return None

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            return None  # rows are gathered once per step, in wait_for_save

        def wait_for_save(self) -> None:
            if not self.has_connector_metadata():
                return
            meta = self._get_connector_metadata()
            payload = getattr(meta, "payload", None)
            if not isinstance(payload, str):
                return
            if self._refusal is not None:
                fail_plan(self._settings.output_dir, payload, self._refusal)
                return
            if self._assembler is None:
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


__all__ = ["MuserConnector", "MuserConnectorMetadata", "kv_cache_layout_name"]
