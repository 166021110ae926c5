"""Shim: the paged-cache readers now live in :mod:`muser_cli.engines.vllm.gather`
(and fp8 in :mod:`muser_cli.engines.vllm.fp8`)."""

from muser_cli.engines.vllm.fp8 import FP8_FORMATS, dequantize_fp8, fp8_table  # noqa: F401
from muser_cli.engines.vllm.gather import (  # noqa: F401
    LAYOUTS,
    NULL_BLOCK_ID,
    QUANTS,
    GatheredKV,
    gather_paged_kv,
    gather_slots,
    layer_rows_for,
    scatter_rows,
    slots_from_block_table,
    storage_name,
)
