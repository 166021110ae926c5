"""Benchmark discipline (docs/benchmarking.md) for the scripts in benchmarks/: a thin layer
over the library's :mod:`muser_cli.bench.common` (one warm-up, >= 5 counted reps, median,
CV and spread, raw reps kept in a JSON receipt under benchmarks/results/)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from muser_cli.bench.common import BenchResult, corpus_ids, machine, measure, receipt_path, summarize  # noqa: F401
from muser_cli.bench.common import write_receipt as _write_receipt
from muser_cli.errors import MuserError

RESULTS = Path(__file__).resolve().parent / "results"


def write_receipt(name: str, payload: dict) -> Path:
    """``benchmarks/results/<name>-<UTC timestamp>.json`` with the machine added, written atomically."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    return _write_receipt(BenchResult(name, dict(payload)), receipt_path(name, RESULTS))


def bench_args(*extra: Callable[[argparse.ArgumentParser], Any], **defaults: Any) -> argparse.Namespace:
    """Options, each with the default given and of its type (``depths="512,2048"``, ``reps=5``,
    ``probe_seconds=1.0`` for ``--probe-seconds``), then ``extra`` adders; parsed from argv."""
    ap = argparse.ArgumentParser()
    for name, value in defaults.items():
        ap.add_argument(f"--{name.replace('_', '-')}", default=value, type=type(value))
    for add in extra:
        add(ap)
    return ap.parse_args()


def depths(text: str) -> list[int]:
    return [int(d) for d in text.split(",")]


def stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(main: Callable[[], int]) -> None:
    """Exit with ``main``'s status; a library error is its one line (as the scripts always said)."""
    try:
        status = main()
    except MuserError as exc:
        raise SystemExit(str(exc)) from None
    raise SystemExit(status)


def depth_bench(name: str, what: str, measure: Callable[..., dict], *extra: Callable[[argparse.ArgumentParser], Any],
                **defaults: Any) -> None:
    """A script over depths, run to its exit: the options of :func:`bench_args`, ``measure(depths,
    **the others, progress=...)``, then its receipt ``name`` (``what``, the options, the figures)."""

    def main() -> int:
        args = bench_args(*extra, **defaults)
        kw = {k: v for k, v in vars(args).items() if k != "depths"}
        got = measure(depths(args.depths), progress=stderr, **kw)
        print(write_receipt(name, {"what": what, "args": vars(args), **got}))
        return 0

    run(main)
