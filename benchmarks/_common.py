"""Benchmark discipline (docs/benchmarking.md) for the scripts in benchmarks/: a thin layer
over the library's :mod:`muser_cli.bench.common` (one warm-up, >= 5 counted reps, median,
CV and spread, raw reps kept in a JSON receipt under benchmarks/results/)."""

from __future__ import annotations

from pathlib import Path

from muser_cli.bench.common import BenchResult, corpus_ids, machine, measure, receipt_path, summarize  # noqa: F401
from muser_cli.bench.common import write_receipt as _write_receipt

RESULTS = Path(__file__).resolve().parent / "results"


def write_receipt(name: str, payload: dict) -> Path:
    """``benchmarks/results/<name>-<UTC timestamp>.json`` with the machine added, written atomically."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    return _write_receipt(BenchResult(name, dict(payload)), receipt_path(name, RESULTS))
