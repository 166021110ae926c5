"""The numeric gate for packs with recurrent state layers (kvpack 1.3 ``state``, issue 27).

A state layer's snapshot at position e summarizes every position before e: unlike a row, it
cannot be recomputed at a sampled position from the rows before it. It is recomputed from a
*checkpoint* instead: the pack's own snapshot at an earlier chunk end c (the zero state at
0) with the pack's row layers before c, then the positions [c, e) in one forward -- what the
producer computed for those chunks. The recomputed snapshot at e and the row layers' rows
[c, e) are compared with the pack's: each state tensor within the tolerance of its own dtype,
the rows within the pack's (:func:`muser_cli.gate.audit.tolerance_for`), doubled for another
engine's pack. A fault anywhere before e in a row layer changes what the recomputation
reads, and a fault in a snapshot changes what it starts from or what it is compared with.

Checked: the last chunk a snapshot pair spans (the state decode continues from) always, and
up to ``count - 1`` more chunk spans drawn from the seed. A pack read whole keeps every
superseded snapshot (``StateKV.earlier``); a streamed one its last two.
"""

from __future__ import annotations

import random
import time
from typing import Any, Sequence

import numpy as np

from muser_cli.errors import GateIncomplete
from muser_cli.gate.audit import BASE_TOLERANCE, CROSS_ENGINE_FACTOR, layer_tolerance, sampled_refusal, tolerance_for
from muser_cli.kvpack import KVPack, LayerKV, StateKV
from muser_cli.kvpack.layers import DTYPES
from muser_cli.kvpack.quant import to_float32
from muser_cli.reuse.delta import layers_at

DEFAULT_STATE_SPANS = 4  # chunk spans recomputed from a checkpoint (the last one always)


def has_state(header: Any) -> bool:
    return any(spec.kind == "state" for spec in header.layers)


def _held(layers: Sequence[Any], states: list[int], rows: int, lo: int) -> list[int]:
    """Positions in [lo, rows] where every state layer holds a snapshot (0: the zero state)."""
    out = [0] if lo == 0 else []
    ends: set[int] | None = None
    for i in states:
        lk = layers[i]
        have = ({lk.position} if lk.tensors else set()) | set(lk.earlier)
        ends = have if ends is None else ends & have
    return out + sorted(p for p in (ends or set()) if lo <= p <= rows and p > 0)


def _prefix(header: Any, layers: Sequence[Any], c: int) -> list[Any]:
    """The cache as of ``c`` positions from the pack's own layers (empty at 0)."""
    if c == 0:
        np_dtype = np.dtype(DTYPES[header.dtype][1])
        return [StateKV(tensors={}, position=0) if s.kind == "state" else
                LayerKV(np.empty((s.kv_heads, 0, s.head_dim), np_dtype), np.empty((s.kv_heads, 0, s.v_head_dim), np_dtype))
                for s in header.layers]

    return layers_at(layers, header.layers, c)


def _rel(ours: np.ndarray, theirs: np.ndarray) -> float:
    if ours.size == 0:
        return 0.0
    scale = float(np.abs(ours).max()) or 1.0
    return float(np.abs(ours - theirs).max()) / scale


def state_check(header: Any, layers: Sequence[Any], engine: Any, *, count: int = DEFAULT_STATE_SPANS,
                seed: int = 0, rows: int | None = None, lo: int = 0) -> tuple[list[int], float, list[dict], float]:
    """Recompute chunk spans [c, e) from the pack's own checkpoints at c and compare every
    layer at e (state) or over [c, e) (rows): (the span ends, the rows' tolerance, a report
    per layer as :class:`muser_cli.gate.sampled.SampleCheck` keeps it, seconds). SpotCheckFailed
    naming the worst layer on a mismatch; GateIncomplete when no span ending at ``rows`` has
    both its snapshots here."""

    t0 = time.perf_counter()
    rows = header.rows_end if rows is None else rows
    states = [i for i, s in enumerate(header.layers) if s.kind == "state"]
    held = _held(layers, states, rows, lo)
    spans = [(c, e) for c, e in zip(held, held[1:])]
    if not spans or spans[-1][1] != rows:
        made_by = (header.producer or {}).get("engine") or "an unnamed engine"
        raise GateIncomplete(
            f"pack refused by the numeric gate before the first token: its state layers' snapshot at {rows} cannot be "
            f"recomputed here (no earlier snapshot of every state layer at or after position {lo} is held)",
            hint=f"decode with --prompt to prefill locally, have {made_by} send the whole pack, or --audit 0 to skip the gate")
    chosen = [spans[-1]] + sorted(random.Random(seed).sample(spans[:-1], min(len(spans) - 1, max(0, count - 1))))
    probe = KVPack(header=header, layers=list(layers), root_digest=b"", total_bytes=0, stored_bytes=0)
    tol = tolerance_for(probe, engine.name)
    cross = str((header.producer or {}).get("engine", engine.name)) != engine.name
    ids = list(header.token_ids)
    worst: dict[int, tuple[float, int]] = {}
    for c, e in chosen:
        fresh = engine.recompute(_prefix(header, layers, c), rows=c, token_ids=ids[c:e])
        for i, spec in enumerate(header.layers):
            if spec.kind == "state":
                theirs = layers[i].at(e)
                rel = max(_rel(np.asarray(fresh[i].tensors[t.name], np.float32),
                               to_float32(np.asarray(theirs[t.name]), t.dtype)) / _state_tol(t.dtype, cross)
                          for t in spec.tensors)
            else:
                mine, pack_kv = fresh[i], layers[i]
                a = max(c, mine.first_row, pack_kv.first_row)
                k1, v1 = mine.keys[:, a - mine.first_row: e - mine.first_row], mine.values[:, a - mine.first_row: e - mine.first_row]
                k2 = pack_kv.keys[:, a - pack_kv.first_row: e - pack_kv.first_row]
                v2 = pack_kv.values[:, a - pack_kv.first_row: e - pack_kv.first_row]
                ours_k, ours_v = to_float32(k1, header.dtype), to_float32(v1, header.dtype)
                rel = max(_rel(ours_k, to_float32(k2, header.dtype)), _rel(ours_v, to_float32(v2, header.dtype)))
                rel /= layer_tolerance(tol, probe, i)
            if i not in worst or rel > worst[i][0]:
                worst[i] = (rel, e)
    report = []
    for i, spec in enumerate(header.layers):
        rel_units, at = worst[i]
        lt = _state_tol(spec.tensors[0].dtype, cross) if spec.kind == "state" else layer_tolerance(tol, probe, i)
        report.append({"layer": i, "kind": spec.kind, "positions": len(chosen), "rel_max": rel_units * lt,
                       "worst_position": at, "tolerance": lt, "ok": rel_units <= 1.0})
    if not all(l["ok"] for l in report):
        w = max(report, key=lambda l: l["rel_max"] / (l["tolerance"] or 1.0))
        raise sampled_refusal(report, w, engine.name,
                              f"{len(chosen)} chunk spans from the pack's own state checkpoints (seed {seed})", header,
                              wrote="rows or state")
    return [e for _, e in chosen], tol, report, time.perf_counter() - t0


def _state_tol(dtype: str, cross: bool) -> float:
    return BASE_TOLERANCE.get(dtype, 4e-2) * (CROSS_ENGINE_FACTOR if cross else 1.0)
