"""One entry point per benchmark: check every input first, measure, keep the receipt, draw the chart.

Every input is checked before anything is measured (a bad ``--depths``, ``--reps`` or
``--plot`` path costs nothing), the receipt is written atomically, and the chart (when
asked for) is drawn from the receipt's own payload, so the picture shows exactly the
figures the file keeps.
"""

from __future__ import annotations

import os
from pathlib import Path

from muser_cli.bench.common import (
    BenchResult, Progress, check_depths, check_receipt_path, check_reps, git_commit, load_average, no_progress,
    parse_ints, resolve_bench_model, write_receipt,
)
from muser_cli.bench.depth import run_depth
from muser_cli.bench.lane import run_lane
from muser_cli.bench.pack import DIGESTS, Study, run_pack
from muser_cli.bench.plot import PLOTTERS, check_plot_path, plot
from muser_cli.bench.plot import plot as draw
from muser_cli.bench.wire import run_wire
from muser_cli.errors import DataError, MissingInput, UsageError

DEFAULT_DEPTHS = "512,2048,8064"
DEFAULT_SIZES_MB = "1,8,64"
DEFAULT_DEEP = "8192,32768,130815"


def _started() -> dict:
    """The commit, load and time when measuring began (the receipt's machine is taken at the end)."""
    import time


    return {"git": git_commit(), "loadavg": load_average(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _prepare(name: str, reps: int, plot: str | os.PathLike | None, receipt: str | os.PathLike | None):
    check_reps(reps)
    plot_path = None
    if plot is not None:
        plot_path = check_plot_path(plot)
    return plot_path, check_receipt_path(name, receipt)


def _finish(result: BenchResult, receipt_path: Path, plot_path: Path | None, started: dict) -> BenchResult:
    result.payload["started"] = started
    write_receipt(result, receipt_path)
    if plot_path is not None:
        result.plot = plot(result.name, result.payload, plot_path)
    return result


def bench_lane(*, model: str | None = "default", depths: str = DEFAULT_DEPTHS, reps: int = 5,
               dtype: str = "float32", codec: str = "none", threads: int = 0, pin: bool = True,
               live: bool = False, settle: float = 8.0, plot: str | os.PathLike | None = None,
               receipt: str | os.PathLike | None = None, progress: Progress = no_progress) -> BenchResult:

    ds = parse_ints(depths, what="--depths", low=2)
    if codec not in ("none", "zstd+bytegroup"):
        raise UsageError(f"--codec must be none or zstd+bytegroup, not {codec!r}")
    if dtype not in ("float32", "bfloat16"):
        raise UsageError(f"--dtype must be float32 or bfloat16, not {dtype!r}")
    if settle < 0:
        raise UsageError(f"--settle must be 0 or more seconds, not {settle}")
    plot_path, receipt_path = _prepare("lane", reps, plot, receipt)
    started = _started()
    info = resolve_bench_model(model, progress=progress)
    check_depths(info, ds)
    result = run_lane(info, ds, reps=reps, dtype=dtype, codec=codec, threads=threads or None, pin=pin, live=live,
                      model_ref=None if model in (None, "default") else str(info.path), settle=settle,
                      progress=progress)
    if model in (None, "default"):
        result.payload["model_ref"] = "default"
    return _finish(result, receipt_path, plot_path, started)


def bench_pack(*, model: str | None = "default", depths: str = DEFAULT_DEPTHS, reps: int = 5,
               synthetic: bool = False, threads: int = 0, peers: bool = True,
               plot: str | os.PathLike | None = None, receipt: str | os.PathLike | None = None,
               study=None, progress: Progress = no_progress) -> BenchResult:
    """``study``: a :class:`muser_cli.bench.pack.Study` of more cases in the same rounds
    (``benchmarks/bench_kvpack.py``); ``muser bench pack`` runs without."""

    ds = parse_ints(depths, what="--depths", low=2)
    plot_path, receipt_path = _prepare("pack", reps, plot, receipt)
    started = _started()
    info = resolve_bench_model(model, progress=progress)
    check_depths(info, ds)
    study = study or Study()
    unknown = [d for d in study.digests if d not in DIGESTS]
    if unknown or study.fresh_reps < 0:
        raise UsageError(f"bench pack: digests must be among {', '.join(DIGESTS)}; fresh reps 0 or more")
    if threads < 1:
        threads = max(1, min(os.cpu_count() or 1, 8))
    result = run_pack(info, ds, reps=reps, synthetic=synthetic, threads=threads, peers=peers, study=study,
                      progress=progress)
    return _finish(result, receipt_path, plot_path, started)


def bench_wire(*, sizes: str = DEFAULT_SIZES_MB, reps: int = 5, probe_seconds: float = 1.0, pin: bool = True,
               plot: str | os.PathLike | None = None, receipt: str | os.PathLike | None = None,
               progress: Progress = no_progress) -> BenchResult:

    mbs = parse_ints(sizes, what="--sizes", low=1, high=4096)
    if not 0.05 <= probe_seconds <= 60:
        raise UsageError(f"--probe-seconds must be between 0.05 and 60, not {probe_seconds}")
    plot_path, receipt_path = _prepare("wire", reps, plot, receipt)
    started = _started()
    result = run_wire(mbs, reps=reps, probe_seconds=probe_seconds, pin=pin, progress=progress)
    return _finish(result, receipt_path, plot_path, started)



def bench_depth(*, model: str | None = "tiny", depths: str = DEFAULT_DEEP, reps: int = 3, chunk: int = 4096,
                dtype: str = "float32", plot: str | os.PathLike | None = None,
                receipt: str | os.PathLike | None = None, progress: Progress = no_progress) -> BenchResult:
    """Every path to a first token by depth (:mod:`muser_cli.bench.depth`)."""
    ds = parse_ints(depths, what="--depths", low=4)
    if dtype not in ("float32", "bfloat16"):
        raise UsageError(f"--dtype must be float32 or bfloat16, not {dtype!r}")
    if not 8 <= chunk <= 1 << 20:
        raise UsageError(f"--chunk must be between 8 and 1048576 tokens, not {chunk}")
    plot_path, receipt_path = _prepare("depth", reps, plot, receipt)
    started = _started()
    info = resolve_bench_model(model, progress=progress)
    check_depths(info, ds)
    ref = "default" if model in (None, "default") else str(info.path)
    return _finish(run_depth(info, ref, ds, reps=reps, chunk=chunk, dtype=dtype, progress=progress), receipt_path,
                   plot_path, started)


def chart(receipt: str | os.PathLike, plot: str | os.PathLike) -> Path:
    """Draw the chart of a receipt written by ``bench lane|pack|wire|depth`` (the same picture ``--plot`` draws)."""
    import json


    plot_path = check_plot_path(plot)
    src = Path(receipt)
    if not src.is_file():
        raise MissingInput(f"no such receipt: {receipt}")
    try:
        payload = json.loads(src.read_bytes()[: 64 << 20])
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{receipt} is not a JSON receipt: {exc}") from None
    name = payload.get("benchmark") if isinstance(payload, dict) else None
    if name not in PLOTTERS:  # a closed set: never dispatch on a name from the file otherwise
        raise DataError(f"{receipt} is not a receipt of muser bench lane, pack, wire or depth",
                        hint="receipts of the older benchmark scripts have no chart")
    try:
        return draw(name, payload, plot_path)
    except (KeyError, TypeError, IndexError, ValueError, ZeroDivisionError) as exc:
        raise DataError(f"{receipt}: a {name} receipt without the figures its chart needs ({exc!r})") from None
