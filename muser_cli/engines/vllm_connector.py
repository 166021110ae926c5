"""Shim: the muser vLLM connector now lives in :mod:`muser_cli.engines.vllm`.

Kept so that a vLLM config with ``kv_connector_module_path =
"muser_cli.engines.vllm_connector"`` still loads: vLLM's factory does
``getattr(module, "MuserConnector")``, which resolves (PEP 562) to the class in
:mod:`muser_cli.engines.vllm.connector`. Importing this module imports no vLLM.
"""

from __future__ import annotations

from typing import Any

from muser_cli.engines.vllm import connector
from muser_cli.engines.vllm.assembler import LayerBinding, WorkerAssembler, build_bindings  # noqa: F401
from muser_cli.engines.vllm.config import (  # noqa: F401
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    ConnectorSettings,
    connector_config,
    layer_index,
    layer_spec_from_json,
    request_extra_args,
)
from muser_cli.engines.vllm.planner import SchedulerPlanner  # noqa: F401
from muser_cli.engines.vllm.sinks import read_spool, write_kvpack, write_spool  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in ("MuserConnector", "MuserConnectorMetadata"):
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
