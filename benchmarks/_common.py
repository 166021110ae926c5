"""Benchmark discipline (docs/benchmarking.md): one warm-up, >= 5 counted reps,
median and coefficient of variation, raw reps kept in a JSON receipt."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parent / "results"


def measure(fn: Callable[[], object], *, reps: int = 5, warmup: int = 1) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return summarize(times)


def summarize(times: list[float]) -> dict:
    med = statistics.median(times)
    cv = statistics.pstdev(times) / statistics.mean(times) if len(times) > 1 and statistics.mean(times) else 0.0
    return {"median": med, "cv": cv, "reps": times}


def machine() -> dict:
    import numpy

    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "numpy": numpy.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import torch
        import transformers

        info.update(torch=torch.__version__, transformers=transformers.__version__, torch_threads=torch.get_num_threads())
    except ImportError:
        pass
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     check=False).stdout.strip()
    except OSError:
        pass
    return info


def write_receipt(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.json"
    payload = {"machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return path


def corpus_ids(info, n_tokens: int) -> list[int]:
    """A deterministic prompt of exactly ``n_tokens`` ids from the project's own docs."""
    from muser_cli.tokens import encode_prompt

    root = Path(__file__).resolve().parent.parent
    text = "\n\n".join(p.read_text() for p in sorted((root / "docs").glob("*.md")))
    text += "\n\n" + (root / "README.md").read_text()
    ids = encode_prompt(info, text)
    out = []
    while len(out) < n_tokens:
        out.extend(ids)
    return out[:n_tokens]
