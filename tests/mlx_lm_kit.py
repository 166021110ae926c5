"""What the mlx-lm interop tests (tests/interop/test_interop_mlx_lm*.py) share: MLX loaded as
muser loads it (its BLAS picked before the first import of mlx.core in this process), the
importing module skipped where mlx or mlx-lm is missing, and their prompt. A module imports it
before anything of mlx or mlx-lm. It holds no tests itself."""

from __future__ import annotations

import pytest

from muser_cli.engines.mlx import blas as mlx_blas

mlx_blas.ensure_fast_blas()  # before the first import of mlx.core in this process
mx = pytest.importorskip("mlx.core", reason="mlx not installed")
pytest.importorskip("mlx_lm", reason="mlx-lm not installed")

PROMPT = ("The producer computes the prompt once and ships its keys and values to the consumer. "
          "A sliding window layer keeps only the last few rows.")
