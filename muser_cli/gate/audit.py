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
from typing import Callable

import numpy as np

from muser_cli.errors import DataError, SpotCheckFailed, UsageError
from muser_cli.kvpack import KVPack, LayerKV
from muser_cli.kvpack.quant import to_float32

# Relative tolerance (max |a-b| / max |b| per layer and K/V) by dtype.
BASE_TOLERANCE = {"float32": 2e-3, "float16": 1e-2, "bfloat16": 4e-2}
CROSS_ENGINE_FACTOR = 2.0


class _LayerVerdicts:
    """``ok`` and ``worst`` of a comparison's per-layer results (``layers``: dicts with ``ok``,
    ``rel_max`` and ``tolerance``, else the comparison's own ``tolerance``)."""

    layers: list[dict]
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(l["ok"] for l in self.layers)

    @property
    def worst(self) -> dict | None:
        """The layer furthest over (or nearest to) its tolerance."""
        return max(self.layers, key=lambda l: l["rel_max"] / (l.get("tolerance") or self.tolerance or 1.0),
                   default=None)


@dataclass
class AuditReport(_LayerVerdicts):
    positions: tuple[int, int]
    mode: str  # "suffix" or "full-recompute"
    tolerance: float
    layers: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    #: the recomputed rows compared (what :func:`diagnose` reads the cause from)
    fresh: list[LayerKV] = field(default_factory=list, repr=False)

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


def _quant_rel(pack: KVPack) -> float:
    """The int8 quantization error relative to the largest value (0 for an unquantized pack)."""
    h = pack.header
    if h.quant_scheme != "int8":
        return 0.0
    err = h.quant.get("error", {})
    peak = float(err.get("max_abs_value", 0.0)) or 1.0
    return max(float(err.get("k_max_abs", 0.0)), float(err.get("v_max_abs", 0.0))) / peak


# Growth of the error a quantized prefix causes, per layer below, in units of the
# quantization error (measured: 2-4x on the tiny random models), and a ceiling that keeps
# wrong rows (swapped, misread, scaled: relative errors of 0.3 and more) refused.
QUANT_DEPTH_FACTOR = 4.0
MAX_QUANT_TOLERANCE = 0.2


def layer_tolerance(tol: float, pack: KVPack, layer: int) -> float:
    """The tolerance for ``layer`` when recomputing from the pack's own (possibly quantized) prefix.

    A quantized prefix perturbs the attention of every layer, and the perturbation
    accumulates with depth. Exact-prefix comparisons (full recomputation) use ``tol``."""
    q = _quant_rel(pack)
    if not q:
        return tol
    return max(tol, min(MAX_QUANT_TOLERANCE, tol + QUANT_DEPTH_FACTOR * q * layer))


def _compare(ours: np.ndarray, theirs: np.ndarray, dtype: str) -> tuple[float, float]:
    a, b = to_float32(ours, dtype), to_float32(theirs, dtype)
    if a.size == 0:
        return 0.0, 0.0
    diff = float(np.abs(a - b).max())
    scale = float(np.abs(a).max()) or 1.0
    return diff, diff / scale


def _rows_only(header) -> None:
    """A pack with recurrent state layers is checked from its snapshot checkpoints
    (:mod:`muser_cli.gate.state`), not by recomputing positions from rows: refused here by name."""
    if any(spec.kind == "state" for spec in header.layers):
        raise DataError("this pack has recurrent state layers: positions are not recomputed from rows, its state is "
                        "recomputed from its own snapshot checkpoints (the numeric gate, verify --audit)")


def audit(pack: KVPack, engine, n: int) -> AuditReport:
    """Compare ``n`` recomputed positions with the pack's rows. ``engine`` is a loaded Engine."""
    t0 = time.perf_counter()
    h = pack.header
    _rows_only(h)
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
    report = AuditReport(positions=(start, end), mode=mode, tolerance=tol, fresh=fresh)
    for i, (mine, theirs) in enumerate(zip(fresh, pack.layers)):
        lt = layer_tolerance(tol, pack, i) if mode == "suffix" else tol
        report.layers.append(_layer_verdict(i, mine, theirs, (start, end), h, lt))
    report.seconds = time.perf_counter() - t0
    return report


def _layer_verdict(i: int, mine: LayerKV, theirs: LayerKV, positions: tuple[int, int], h, tolerance: float) -> dict:
    """Layer ``i``'s recomputed rows (``mine``) against the pack's (``theirs``) over the overlap
    of the audited positions [start, end) with what each side holds, within ``tolerance``."""
    start, end = positions
    lo = max(start, mine.first_row, theirs.first_row)
    a = slice(lo - mine.first_row, end - mine.first_row)
    b = slice(lo - theirs.first_row, end - theirs.first_row)
    kd, kr = _compare(mine.keys[:, a], theirs.keys[:, b], h.dtype)
    vd, vr = _compare(mine.values[:, a], theirs.values[:, b], h.dtype)
    rel = max(kr, vr)
    return {"layer": i, "kind": h.layers[i].kind, "positions": end - lo, "k_max_abs": kd, "v_max_abs": vd,
            "rel_max": rel, "tolerance": tolerance, "ok": rel <= tolerance}


def _window(l: LayerKV, lo: int, hi: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    a = slice(lo - l.first_row, hi - l.first_row)
    return to_float32(l.keys[:, a], dtype), to_float32(l.values[:, a], dtype)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape or a.size == 0:
        return float("inf")
    return float(np.abs(a - b).max()) / (float(np.abs(b).max()) or 1.0)


def diagnose(report: AuditReport, pack: KVPack, *, contiguous: bool = True) -> str:
    """Name the most likely cause of a failed audit, from the numbers alone (``contiguous``
    False: the positions compared are scattered samples, so a shift is not looked for)."""
    fresh = report.fresh
    bad = [l for l in report.layers if not l["ok"]]
    if not bad or not fresh:
        return ""
    h = pack.header
    tol = max([report.tolerance] + [float(l.get("tolerance", 0.0)) for l in bad])
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
    for i in idx[:1] if contiguous else []:
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


# --------------------------------------------------------------------------- the spot-check
# Codecs that return the exact bytes they were given (no numeric risk of their own).
LOSSLESS_CODECS = frozenset({"none", "zstd+bytegroup"})
DEFAULT_SPOT_POSITIONS = 1


def spot_check_reason(header, *, engine: str, dtype: str | None = None) -> str | None:
    """Why a pack must be spot-checked before decoding it on ``engine`` (in ``dtype``), or None.

    A pack made the way this consumer would make it (same engine, the storage dtype it
    decodes in, no quantization, a lossless codec) is not; anything else -- another
    engine, an unnamed one, another dtype, int8, an unknown codec -- is."""
    reasons = []
    made_by = str((header.producer or {}).get("engine") or "")
    if made_by != engine:
        reasons.append(f"made by {made_by or 'an unnamed engine'}, decoded on {engine}")
    if dtype is not None and header.dtype != dtype:
        reasons.append(f"stored as {header.dtype}, decoded as {dtype}")
    if header.quant_scheme != "none":
        reasons.append(f"quantized ({header.quant_scheme})")
    codec = str(header.codec.get("name", "none"))
    if codec not in LOSSLESS_CODECS:
        reasons.append(f"codec {codec}")
    return "; ".join(reasons) or None


@dataclass
class SpotCheck(_LayerVerdicts):
    """What :func:`spot_check` compared: positions [start, end) of ``checked`` layers."""

    positions: tuple[int, int]
    tolerance: float
    layers: list[dict]
    checked: int  # layers compared (0..checked-1); the rest are named in ``unchecked``
    unchecked: list[int]
    reason: str
    seconds: float
    fused: bool = False  # run inside the first decode step (SpotGate), not as a step of its own

    def to_json(self) -> dict:
        worst = self.worst or {}
        return {"ran": True, "ok": self.ok, "reason": self.reason, "positions": list(self.positions),
                "tolerance": self.tolerance, "layers_checked": self.checked, "layers_unchecked": self.unchecked,
                "worst_layer": worst.get("layer"), "worst_rel": worst.get("rel_max"),
                "ms": round(self.seconds * 1e3, 3), "fused": self.fused}


def _spot_prefix(pack: KVPack, start: int) -> tuple[list[LayerKV], int]:
    """Each layer's rows as of ``start`` positions, as an engine installs them; and the index of
    the first layer whose rows before ``start`` the pack does not carry (padded with zeros
    here: its own recomputed rows are still exact, every later layer's are not)."""
    return prefix_rows(pack.header.layers, pack.layers, start)


def prefix_rows(specs, layers: list[LayerKV], start: int) -> tuple[list[LayerKV], int]:
    """:func:`_spot_prefix` of bare layers (``specs``: their LayerSpecs)."""
    prefix: list[LayerKV] = []
    first_incomplete = len(specs)
    for i, (spec, l) in enumerate(zip(specs, layers)):
        want = spec.carried_rows(start)
        lo = start - want
        have_lo = min(max(lo, l.first_row), start)  # a ring may start after ``start``: none held
        a = max(0, have_lo - l.first_row)
        keys, values = l.keys[:, a : a + (start - have_lo)], l.values[:, a : a + (start - have_lo)]
        missing = want - keys.shape[1]
        if missing > 0:
            first_incomplete = min(first_incomplete, i)
            zk = np.zeros((keys.shape[0], missing, keys.shape[2]), dtype=keys.dtype)
            zv = np.zeros((values.shape[0], missing, values.shape[2]), dtype=values.dtype)
            keys, values = np.concatenate([zk, keys], axis=1), np.concatenate([zv, values], axis=1)
        prefix.append(LayerKV(keys, values, lo))  # views: the engine's install is the one copy
    return prefix, first_incomplete


def spot_check(pack: KVPack, engine, *, positions: int = DEFAULT_SPOT_POSITIONS, reason: str = "") -> SpotCheck:
    """Recompute the pack's last ``positions`` position(s) from its own prefix on ``engine`` (a
    loaded Engine for the pack's model) and compare K/V per layer; raise SpotCheckFailed.

    One recompute step of ``positions`` tokens -- no prefill. Full-attention layers are
    compared wherever the pack holds the prefix. A sliding-window layer needs the
    ``window - 1`` rows before the first recomputed position: a v1.2 pack's sliding layers
    carry ``ring_extra`` rows more than ``window - 1`` (torch and MLX write 1), so up to
    ``ring_extra`` positions are recomputed exactly in every layer. Asked for more (or a
    pack without the extra rows: v1.0/v1.1, vLLM's), the layers up to and including the
    first sliding one short of rows are compared exactly and the rest are reported in
    ``unchecked``. The tolerance is :func:`tolerance_for` (the audit's: dtype,
    cross-engine, int8 error).

    ``decode`` does not call this when it can help it: :class:`SpotGate` runs the same
    comparison inside the first decode step, at no extra step.
    """

    t0 = time.perf_counter()
    h = pack.header
    _rows_only(h)
    if h.rows_start != 0:
        raise UsageError("spot-check a delta pack after merging it with its base (positions must start at 0)")
    end = h.rows_end
    n = max(1, min(int(positions), end))
    start = end - n
    prefix, first_incomplete = _spot_prefix(pack, start)
    checked = len(h.layers) if first_incomplete >= len(h.layers) else first_incomplete + 1
    ids = list(h.token_ids)
    fresh = engine.recompute(prefix, rows=start, token_ids=ids[start:end])
    return _judge(pack, fresh, (start, end), checked, engine.name,
                  reason or (spot_check_reason(h, engine=engine.name) or ""), t0)


def _judge(pack: KVPack, fresh: list[LayerKV], positions: tuple[int, int], checked: int, engine: str, reason: str,
           t0: float) -> SpotCheck:
    """Compare ``fresh`` (a consumer's recomputation) with ``pack``'s rows over ``positions``
    for layers [0, checked); the SpotCheck, or SpotCheckFailed naming the likely cause."""

    h = pack.header
    start, end = positions
    tol = tolerance_for(pack, engine)
    layers = []
    for i in range(checked):
        layers.append(_layer_verdict(i, fresh[i], pack.layers[i], (start, end), h, layer_tolerance(tol, pack, i)))
    result = SpotCheck((start, end), tol, layers, checked, list(range(checked, len(h.layers))), reason,
                       time.perf_counter() - t0)
    if not result.ok:
        report = AuditReport(positions=(start, end), mode="suffix", tolerance=tol, layers=layers, fresh=fresh)
        cause = diagnose(report, pack) or "the rows disagree with local recomputation"
        worst = result.worst or {}
        made_by = (h.producer or {}).get("engine") or "an unnamed engine"
        bad = [l["layer"] for l in layers if not l["ok"]]
        first = f", first layer {bad[0]}" if bad and bad[0] != worst.get("layer") else ""
        raise SpotCheckFailed(
            f"pack refused by the spot-check before the first token: {len(bad)} of {checked} layers differ from "
            f"{engine}'s recomputation of positions [{start}, {end}), worst layer {worst.get('layer')} "
            f"({worst.get('kind')}, rel {worst.get('rel_max', 0.0):.3g}, tolerance {worst.get('tolerance', tol):.3g}{first}); "
            f"likely cause: {cause}",
            hint=f"the producer ({made_by}) wrote wrong rows; decode with --prompt to prefill locally",
        )
    return result


def sampled_refusal(layers: list[dict], worst: dict, engine: str, recomputed: str, header, *, cause: str = "",
                    wrote: str = "rows") -> Exception:
    """The SpotCheckFailed of a gate that recomputed scattered positions (``recomputed``: how
    many, of what, from which seed): how many of ``layers`` differ, the ``worst`` one and where
    it was worst, the first, the likely ``cause`` where one was named; the producer ``wrote``
    the wrong ones. The sampled gate's and the state gate's one message."""

    bad = [l for l in layers if not l["ok"]]
    made_by = (header.producer or {}).get("engine") or "an unnamed engine"
    likely = f"; likely cause: {cause}" if cause else ""
    return SpotCheckFailed(
        f"pack refused by the spot-check before the first token: {len(bad)} of {len(layers)} layers differ from "
        f"{engine}'s recomputation of {recomputed}, worst layer {worst['layer']} ({worst['kind']}, rel "
        f"{worst['rel_max']:.3g}, tolerance {worst['tolerance']:.3g}) at position {worst['worst_position']}, "
        f"first layer {bad[0]['layer']}{likely}",
        hint=f"the producer ({made_by}) wrote wrong {wrote}; decode with --prompt to prefill locally")


class SpotGate:
    """The spot-check fused into the first decode step.

    Decoding a pack of ``rows`` positions normally installs them all and runs the last
    prompt token. The gate instead hands the engine the rows of [0, start) -- views, no
    copy -- and the tokens of [start, rows] as the first step's input: that one forward
    recomputes positions [start, rows) *and* gives the first token's logits. Before the
    token is picked the engine calls the gate with its live rows (``check(rows_of)``); the
    gate compares them with the pack's own (copied out first: an adopting engine writes its
    recomputation into the pack's memory) and raises SpotCheckFailed on a mismatch, so
    nothing is emitted from rows that failed. From then on decoding goes on from the
    consumer's own recomputation of the last ``positions`` rows, which agree with the
    pack's within the tolerance.

    Only possible when every layer carries the rows it needs before ``start``
    (:meth:`fusable`): on a hybrid model past its window, when the pack's ``ring_extra``
    covers the checked positions (see :func:`spot_check`); else ``decode`` runs the
    separate check.
    """

    def __init__(self, pack: KVPack, engine: str, *, positions: int = DEFAULT_SPOT_POSITIONS, reason: str = "",
                 on_pass: Callable[[], None] | None = None) -> None:
        h = pack.header
        if h.rows_start != 0:
            raise ValueError("a spot gate needs a merged pack (positions from 0)")
        self.pack, self.engine, self.reason, self.on_pass = pack, engine, reason, on_pass
        self.end = h.rows_end
        self.start = self.end - max(1, min(int(positions), self.end))
        prefix, first_incomplete = _spot_prefix(pack, self.start)
        if first_incomplete < len(h.layers):
            raise ValueError("this pack cannot be spot-checked in the first step (see SpotGate.fusable)")
        self.prefix = prefix
        # The pack's own rows of [start, end), before the engine may overwrite them.
        self._theirs = KVPack(header=h, root_digest=pack.root_digest, total_bytes=pack.total_bytes,
                              stored_bytes=pack.stored_bytes, layers=[
            LayerKV(l.keys[:, self.start - l.first_row : self.end - l.first_row].copy(),
                    l.values[:, self.start - l.first_row : self.end - l.first_row].copy(), self.start)
            for l in pack.layers])
        self.result: SpotCheck | None = None

    @staticmethod
    def fusable(pack: KVPack, positions: int = DEFAULT_SPOT_POSITIONS) -> bool:
        h = pack.header
        if h.rows_start != 0 or h.rows_end < 2:
            return False
        end = h.rows_end
        start = end - max(1, min(int(positions), end))
        after = end + 1  # the engine's rows as of the first step: the checked ones plus the last prompt token
        for spec, l in zip(h.layers, pack.layers):
            if start - spec.carried_rows(start) < l.first_row:  # the prefix to install
                return False
            if start < after - spec.carried_rows(after):  # the checked rows still held after the step
                return False
        return True

    def restore(self, layers: list[LayerKV]) -> None:
        """Put the pack's own rows of [start, end) back where an adopting engine wrote its
        recomputation (``layers``: the rows decode gave, full length), so that what is kept
        afterwards (``decode --store``) is the pack, bit for bit."""
        for mine, theirs in zip(layers, self._theirs.layers):
            for arr, orig in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                view = arr[:, self.start - mine.first_row : self.end - mine.first_row]
                if not np.array_equal(view, orig):  # only a buffer the engine wrote (so writable) differs
                    view[...] = orig

    @property
    def token_ids(self) -> list[int]:
        """The pack's tokens of [start, end): fed before the rest of the first step."""
        return list(self.pack.header.token_ids[self.start : self.end])

    def __call__(self, rows_of) -> None:
        """``rows_of(layer, lo, hi)``: the engine's live rows after the first forward."""
        t0 = time.perf_counter()
        fresh = []
        for i in range(len(self.pack.layers)):
            k, v = rows_of(i, self.start, self.end)
            fresh.append(LayerKV(k, v, self.start))
        self.result = _judge(self._theirs, fresh, (self.start, self.end), len(fresh), self.engine, self.reason, t0)
        self.result.fused = True
        if self.on_pass is not None:
            self.on_pass()
