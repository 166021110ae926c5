"""``verify --audit N``: trust, but check the numbers.

Recompute the last N positions locally from the received prefix (N tokens of compute)
and compare K and V per layer against the pack, with a tolerance set by dtype, codec
and engine. Catches KV that is structurally valid but numerically wrong: a wrong RoPE
theta, another model's rows with the right shapes, positions shifted by one, swapped or
scaled layers.

Sliding-window layers carry only the rows the *next* token needs, so the prefix they
would need before position n-N is not in the pack; for a model with such layers the
audit recomputes the whole prefix on the pack's own schedule instead, and says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from muser_cli.kvpack import KVPack, LayerKV
from muser_cli.kvpack.quant import to_float32

# Relative tolerance (max |a-b| / max |b| per layer and K/V) by dtype.
BASE_TOLERANCE = {"float32": 2e-3, "float16": 1e-2, "bfloat16": 4e-2}
CROSS_ENGINE_FACTOR = 2.0


@dataclass
class AuditReport:
    positions: tuple[int, int]
    mode: str  # "suffix" or "full-recompute"
    tolerance: float
    layers: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(l["ok"] for l in self.layers)

    @property
    def worst(self) -> dict | None:
        return max(self.layers, key=lambda l: l["rel_max"], default=None)

    def to_json(self) -> dict:
        return {"positions": list(self.positions), "mode": self.mode, "tolerance": self.tolerance, "ok": self.ok,
                "layers": self.layers, "seconds": round(self.seconds, 4)}


def tolerance_for(pack: KVPack, engine: str) -> float:
    h = pack.header
    tol = BASE_TOLERANCE.get(h.dtype, 4e-2)
    producer = str(h.producer.get("engine", engine))
    if producer != engine:
        tol *= CROSS_ENGINE_FACTOR
    if h.quant_scheme == "int8":
        err = h.quant.get("error", {})
        peak = float(err.get("max_abs_value", 0.0)) or 1.0
        tol += 2.0 * max(float(err.get("k_max_abs", 0.0)), float(err.get("v_max_abs", 0.0))) / peak
    return tol


def _compare(ours: np.ndarray, theirs: np.ndarray, dtype: str) -> tuple[float, float]:
    a, b = to_float32(ours, dtype), to_float32(theirs, dtype)
    if a.size == 0:
        return 0.0, 0.0
    diff = float(np.abs(a - b).max())
    scale = float(np.abs(a).max()) or 1.0
    return diff, diff / scale


def audit(pack: KVPack, engine, n: int) -> AuditReport:
    """Compare ``n`` recomputed positions with the pack's rows. ``engine`` is a loaded Engine."""
    t0 = time.perf_counter()
    h = pack.header
    end = h.rows_end
    ids = list(h.token_ids)
    n = max(1, min(n, end - h.rows_start))
    start = end - n
    has_sliding = any(spec.kind == "sliding" for spec in h.layers)
    if has_sliding or start == 0:
        mode = "full-recompute"
        fresh = engine.prefill(ids[:end], chunk_tokens=h.chunk_tokens)
    else:
        mode = "suffix"
        prefix = [LayerKV(l.keys[:, : start - l.first_row], l.values[:, : start - l.first_row], l.first_row)
                  for l in pack.layers]
        fresh = engine.recompute(prefix, rows=start, token_ids=ids[start:end])
    if mode == "full-recompute":
        start = h.rows_start  # the whole prefix was paid for: compare all of it
    tol = tolerance_for(pack, engine.name)
    report = AuditReport(positions=(start, end), mode=mode, tolerance=tol)
    report.fresh = fresh  # type: ignore[attr-defined]
    for i, (mine, theirs) in enumerate(zip(fresh, pack.layers)):
        # Compare the overlap of audited positions [start, end) with what each side holds.
        lo = max(start, mine.first_row, theirs.first_row)
        a = slice(lo - mine.first_row, end - mine.first_row)
        b = slice(lo - theirs.first_row, end - theirs.first_row)
        kd, kr = _compare(mine.keys[:, a], theirs.keys[:, b], h.dtype)
        vd, vr = _compare(mine.values[:, a], theirs.values[:, b], h.dtype)
        rel = max(kr, vr)
        report.layers.append({"layer": i, "kind": h.layers[i].kind, "positions": end - lo, "k_max_abs": kd,
                              "v_max_abs": vd, "rel_max": rel, "ok": rel <= tol})
    report.seconds = time.perf_counter() - t0
    return report


def _window(l: LayerKV, lo: int, hi: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    a = slice(lo - l.first_row, hi - l.first_row)
    return to_float32(l.keys[:, a], dtype), to_float32(l.values[:, a], dtype)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape or a.size == 0:
        return float("inf")
    return float(np.abs(a - b).max()) / (float(np.abs(b).max()) or 1.0)


def diagnose(report: AuditReport, pack: KVPack) -> str:
    """Name the most likely cause of a failed audit, from the numbers alone."""
    fresh: list[LayerKV] = getattr(report, "fresh", [])
    bad = [l for l in report.layers if not l["ok"]]
    if not bad or not fresh:
        return ""
    h = pack.header
    tol = report.tolerance
    start, end = report.positions
    idx = [l["layer"] for l in bad]
    # Values agree, keys do not: the rotation differs (RoPE theta/scaling or positions).
    k_only = []
    for l in bad:
        i = l["layer"]
        lo = max(start, fresh[i].first_row, pack.layers[i].first_row)
        mk, mv = _window(fresh[i], lo, end, h.dtype)
        tk, tv = _window(pack.layers[i], lo, end, h.dtype)
        k_only.append(_rel(tv, mv) <= tol and _rel(tk, mk) > tol)
    # The first layer to diverge names the cause: later layers inherit its error.
    if k_only and k_only[0] and h.layers[idx[0]].rope is not None:
        return "keys disagree while values agree: RoPE mismatch (theta, scaling or positions) in the producer"
    # Rows shifted by one position.
    for i in idx[:1]:
        lo = max(start, fresh[i].first_row, pack.layers[i].first_row)
        if end - lo >= 2:
            mk, mv = _window(fresh[i], lo, end - 1, h.dtype)
            tk, tv = _window(pack.layers[i], lo + 1, end, h.dtype)
            if _rel(tv, mv) <= tol:
                return "rows are shifted by one position (off-by-one in the producer's positions)"
            mk, mv = _window(fresh[i], lo + 1, end, h.dtype)
            tk, tv = _window(pack.layers[i], lo, end - 1, h.dtype)
            if _rel(tv, mv) <= tol:
                return "rows are shifted by one position (off-by-one in the producer's positions)"
    # Swapped layers: a bad layer matches another layer's recomputed rows.
    for i in idx:
        for j in range(len(fresh)):
            if j == i or h.layers[j] != h.layers[i]:
                continue
            lo = max(start, fresh[j].first_row, pack.layers[i].first_row)
            mk, mv = _window(fresh[j], lo, end, h.dtype)
            tk, tv = _window(pack.layers[i], lo, end, h.dtype)
            if _rel(tk, mk) <= tol and _rel(tv, mv) <= tol:
                return f"layer {i} holds layer {j}'s rows (layers swapped or misordered)"
    # A layer scaled by a constant.
    for i in idx:
        lo = max(start, fresh[i].first_row, pack.layers[i].first_row)
        mk, mv = _window(fresh[i], lo, end, h.dtype)
        tk, tv = _window(pack.layers[i], lo, end, h.dtype)
        denom = float((mk * mk).sum()) or 1.0
        ratio = float((tk * mk).sum()) / denom
        if abs(ratio - 1.0) > tol and _rel(tk, mk * ratio) <= tol * 2:
            return f"layer {i} is scaled by {ratio:.4g}"
    if len(bad) == len(report.layers):
        return "every layer disagrees: KV from another model, prompt or position, or corrupted before packing"
    return f"layers {', '.join(map(str, idx))} disagree with local recomputation"
