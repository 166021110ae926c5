"""The benchmark discipline (docs/benchmarking.md), as library code.

One uncounted warm-up, then counted repetitions; each figure is kept as its median, its
coefficient of variation (population standard deviation / mean), its spread (min, max)
and every raw repetition. A receipt is a JSON file with the machine, the git commit, the
model and the date next to the raw repetitions.

Nothing here prints or exits: progress goes through a callback, errors are
:mod:`muser_cli.errors` classes.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from muser_cli.errors import UsageError
from muser_cli.fsio import check_output_path, write_bytes_atomic
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tiny import make_tiny_long_llama
from muser_cli.model.tokens import encode_prompt
from muser_cli.paths import cache_dir, data_dir, ensure_dir

Progress = Callable[[str], None]
"""A one-line note about what a benchmark is doing now ("lane 512 tok: rep 2/5")."""

# A source checkout keeps its receipts under benchmarks/results/ (they are committed).
SOURCE_ROOT = Path(__file__).resolve().parent.parent.parent
SOURCE_RESULTS = SOURCE_ROOT / "benchmarks" / "results"


def no_progress(_line: str) -> None:
    return None


# --------------------------------------------------------------------------- statistics
def summarize(values: Sequence[float]) -> dict[str, Any]:
    """``{"median", "cv", "min", "max", "reps"}`` of the counted repetitions."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": None, "cv": None, "min": None, "max": None, "reps": []}
    mean = statistics.mean(vals)
    cv = statistics.pstdev(vals) / mean if len(vals) > 1 and mean else 0.0
    return {"median": statistics.median(vals), "cv": cv, "min": min(vals), "max": max(vals), "reps": vals}


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by linear interpolation between order statistics
    (q=0.9 of one value is that value)."""
    vals = sorted(float(v) for v in values)
    if not vals:
        raise ValueError("no values")
    pos = q * (len(vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def measure(fn: Callable[[], object], *, reps: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Seconds per call of ``fn``: ``warmup`` uncounted calls, then ``reps`` counted ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return summarize(times)


def check_reps(reps: int) -> int:
    if reps < 1:
        raise UsageError(f"--reps must be at least 1, not {reps}",
                         hint="docs/benchmarking.md asks for 5 or more counted repetitions")
    return reps


def parse_ints(text: str, *, what: str, low: int = 1, high: int | None = None) -> list[int]:
    """``"512,2048,8064"`` -> ``[512, 2048, 8064]``; anything else is a usage error."""
    items = [t.strip() for t in str(text).split(",")]
    if not items or any(not t for t in items):
        raise UsageError(f"{what} must be a comma-separated list of whole numbers, not {text!r}",
                         hint=f"for example {what} 512,2048")
    out = []
    for t in items:
        try:
            n = int(t)
        except ValueError:
            raise UsageError(f"{what} must be a comma-separated list of whole numbers, not {text!r}",
                             hint=f"for example {what} 512,2048") from None
        if n < low or (high is not None and n > high):
            span = f"{low}..{high}" if high is not None else f"at least {low}"
            raise UsageError(f"{what}: {n} is out of range ({span})")
        out.append(n)
    return out


# --------------------------------------------------------------------------- machine
def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict[str, Any]:
    """The machine a receipt was measured on (docs/benchmarking.md rule 2)."""
    import numpy

    info: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
        "cpus_allowed": len(allowed_cpus()), "numpy": numpy.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg": load_average(),
    }
    if "torch" in sys.modules or _importable("torch"):
        try:
            import torch

            info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
        except ImportError:
            pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    info["git"] = git_commit()
    return info


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def git_commit() -> str | None:
    if not (SOURCE_ROOT / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        out = subprocess.run(["git", "-C", str(SOURCE_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=False, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


# --------------------------------------------------------------------------- pinning
def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class Pinning:
    """Producer and consumer on two different cores (docs/benchmarking.md, "two machines on
    one host"), or nothing pinned when only one core is available."""

    producer: int | None
    consumer: int | None
    taskset: str | None
    original: tuple[int, ...] = ()

    @property
    def pinned(self) -> bool:
        return self.producer is not None

    def describe(self) -> str:
        if not self.pinned:
            return "not pinned (one core available)"
        return f"producer cpu {self.producer}, consumer cpu {self.consumer}"

    def command(self, role: str, argv: list[str]) -> list[str]:
        """``argv`` under ``taskset -c CPU`` for ``role`` ("producer" or "consumer")."""
        cpu = self.producer if role == "producer" else self.consumer
        if cpu is None or self.taskset is None:
            return argv
        return [self.taskset, "-c", str(cpu), *argv]

    def enter(self, role: str) -> None:
        """Move this process onto ``role``'s core for an in-process phase: the calling thread
        and every worker thread (the kvpack writer's and reader's hashing and zstd pool), so a
        consumer phase never borrows the producer's core."""
        cpu = self.producer if role == "producer" else self.consumer
        if cpu is not None:
            _set_all_threads({cpu})

    def release(self) -> None:
        """Give every thread of this process back the cores the process had before."""
        if self.pinned and self.original:
            _set_all_threads(set(self.original))


def _set_all_threads(cpus: set[int]) -> None:
    os.sched_setaffinity(0, cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that has ended meanwhile
            pass


def pinning(enabled: bool = True) -> Pinning:
    cpus = allowed_cpus()
    if not enabled or len(cpus) < 2 or not hasattr(os, "sched_setaffinity"):
        return Pinning(None, None, None, tuple(cpus))
    return Pinning(cpus[0], cpus[1], shutil.which("taskset"), tuple(cpus))


# --------------------------------------------------------------------------- models and prompts
TINY = "tiny"


def resolve_bench_model(ref: str | None, *, progress: Progress = no_progress):
    """``tiny`` (a 1-layer random Llama with 132k positions, written once under the cache
    folder), ``default`` (the embedded model) or a model folder / .gguf file."""

    if ref == TINY and not Path(TINY).exists():
        folder = cache_dir() / "bench" / "tiny-long-llama"
        if not (folder / "config.json").exists():
            progress("writing the tiny model (once)")
            import tempfile


            parent = ensure_dir(folder.parent)
            tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=parent))
            make_tiny_long_llama(tmp / "m")
            try:
                os.replace(tmp / "m", folder)
            except OSError:
                if not (folder / "config.json").exists():  # not another writer's finished copy
                    raise
            shutil.rmtree(tmp, ignore_errors=True)
        return resolve_model(folder)
    return resolve_model(ref)


def check_depths(info, depths: Sequence[int]) -> None:
    limit = getattr(info, "max_positions", None) or getattr(info, "context", None)
    for d in depths:
        if d < 2:
            raise UsageError(f"--depths: a prompt of {d} token(s) leaves nothing to hand off", hint="use 2 or more")
        if limit and d + 1 > int(limit):
            raise UsageError(f"--depths: {d} tokens do not fit the model's context of {limit}",
                             hint="use shallower depths, or a long-context model: -m tiny has 132k positions")


def corpus_text() -> str:
    """The project's own docs (or, installed, its sources) as one text: the benchmarks' prompts."""
    docs = SOURCE_ROOT / "docs"
    files = sorted(docs.glob("*.md")) if docs.is_dir() else []
    if (SOURCE_ROOT / "README.md").is_file():
        files.append(SOURCE_ROOT / "README.md")
    if not files:  # an installed package: its own sources
        files = sorted(Path(__file__).resolve().parent.parent.rglob("*.py"))
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def corpus_ids(info, n_tokens: int) -> list[int]:
    """A deterministic prompt of exactly ``n_tokens`` ids from the project's own docs."""

    ids = encode_prompt(info, corpus_text())
    out: list[int] = []
    while len(out) < n_tokens:
        out.extend(ids)
    return out[:n_tokens]


# --------------------------------------------------------------------------- receipts
@dataclass
class BenchResult:
    """What a benchmark returns: its receipt payload and a table for people."""

    name: str
    payload: dict[str, Any]
    table: list[str] = field(default_factory=list)
    receipt: Path | None = None
    plot: Path | None = None

    def to_json(self) -> dict[str, Any]:
        out = dict(self.payload)
        out["receipt"] = str(self.receipt) if self.receipt else None
        out["plot"] = str(self.plot) if self.plot else None
        return out


def receipt_path(name: str, where: str | os.PathLike | None) -> Path:
    """Where the receipt goes: ``where`` (a file, or an existing folder), else the source
    checkout's benchmarks/results/, else ``<data dir>/bench``."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    if where is not None:
        p = Path(where)
        return p / f"{name}-{stamp}.json" if p.is_dir() else p
    if SOURCE_RESULTS.is_dir():
        return SOURCE_RESULTS / f"{name}-{stamp}.json"

    return ensure_dir(data_dir() / "bench") / f"{name}-{stamp}.json"


def check_receipt_path(name: str, where: str | os.PathLike | None) -> Path:
    path = receipt_path(name, where)
    check_output_path(path)
    return path


def write_receipt(result: BenchResult, path: Path) -> Path:
    """Add the machine description and write the receipt atomically."""

    result.payload = {"benchmark": result.name, "machine": machine(), **result.payload}
    write_bytes_atomic(path, (json.dumps(result.payload, indent=1, sort_keys=True, default=str) + "\n").encode())
    result.receipt = path
    return path
