"""Shim: ``--engine vllm`` now lives in :mod:`muser_cli.engines.vllm.engine`."""

from muser_cli.engines.vllm.engine import (  # noqa: F401
    INSTALL_HINT,
    SUPPORTED_BELOW,
    SUPPORTED_MIN,
    SUPPORTED_TEXT,
    VLLMEngine,
    from_float32,
    parse_version,
    require_vllm,
)
