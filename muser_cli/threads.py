"""How many compute threads an engine gets when the caller says 0 (no framework import: the
CLI reads this before anything heavy loads)."""

from __future__ import annotations

import os

from muser_cli.errors import ConfigError


def default_threads() -> int:
    """Compute threads when --threads is 0: ``MUSER_THREADS``, else the cores (at most 8)."""
    value = os.environ.get("MUSER_THREADS")
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ConfigError(f"MUSER_THREADS={value!r} is not a whole number",
                              hint="set it to a thread count such as 2, or unset it") from None
    return max(1, min(os.cpu_count() or 1, 8))
