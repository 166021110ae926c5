"""The numeric gate across the whole prompt: recompute positions sampled across the pack, in
every layer, from the pack's own rows before them, and compare (docs/reliability.md, "The
numeric gate"). The comparison's tolerance and the diagnosis of a mismatch are
:mod:`muser_cli.gate.audit`'s.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

import numpy as np

from muser_cli.errors import GateIncomplete
from muser_cli.gate.audit import AuditReport, diagnose, layer_tolerance, prefix_rows, sampled_refusal, tolerance_for
from muser_cli.gate.state import has_state, state_check
from muser_cli.kvpack import KVPack, LayerKV
from muser_cli.kvpack.quant import to_float32

# Positions recomputed across the whole prompt, in every layer (docs/reliability.md, "The
# numeric gate"). A fault at a share f of one layer's positions is missed only when no sample
# lands on one of them: at most (1 - f) ** 32, 1.0e-4 for f = 1/4.
DEFAULT_SAMPLE_POSITIONS = 32


def sample_positions(rows: int, count: int, seed: int, lo: int = 0) -> list[int]:
    """``count`` distinct positions of [lo, rows), uniformly drawn from ``seed`` (all of them
    when the range is that short), sorted."""
    if rows - lo <= count:
        return list(range(lo, rows))
    return sorted(random.Random(seed).sample(range(lo, rows), count))


def new_seed() -> int:
    """A seed the producer cannot predict (so it cannot place its faults where no sample lands)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


@dataclass
class SampleCheck:
    """What :func:`sample_check` compared: ``positions`` (drawn from ``seed``) in each layer."""

    seed: int
    positions: list[int]
    tolerance: float
    layers: list[dict]  # per layer: positions compared, the largest deviation and where
    method: str  # "one-step" (every sampled position in one masked forward) or "per-position"
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(l["ok"] for l in self.layers)

    @property
    def complete(self) -> bool:
        """Every layer compared at every sampled position (False: a sliding layer's window
        before some position is not carried, so layers from it up went unchecked there)."""
        return all(l["positions"] == len(self.positions) for l in self.layers)

    @property
    def worst(self) -> dict:
        return max(self.layers, key=lambda l: l["rel_max"] / (l["tolerance"] or 1.0), default={})

    def to_json(self) -> dict:
        w = self.worst
        return {"ok": self.ok, "complete": self.complete, "seed": self.seed, "positions": self.positions,
                "method": self.method,
                "layers": [l["layer"] for l in self.layers if l["positions"]],
                "layers_partial": [l["layer"] for l in self.layers if 0 < l["positions"] < len(self.positions)],
                "layers_unchecked": [l["layer"] for l in self.layers if not l["positions"]],
                "worst_layer": w.get("layer"), "worst_position": w.get("worst_position"),
                "worst_rel": w.get("rel_max"), "tolerance": self.tolerance, "ms": round(self.seconds * 1e3, 3)}


def _fresh_rows(header, layers: list[LayerKV], engine, positions: list[int], rows: int):
    """Per layer: the recomputed K and V at ``positions`` ((heads, m, dim) each) and, per
    position, whether it is exact in that layer (False: a sliding layer's window before it
    is not carried, so it and the layers after it are not compared there)."""
    ids = list(header.token_ids)
    if engine.recomputes_at and (all(spec.kind in ("full", "latent") for spec in header.layers)
                                 or engine.recomputes_at_hybrid(layers, rows)):
        fresh = engine.recompute_at(layers, rows=rows, positions=positions, token_ids=[ids[p] for p in positions])
        return fresh, [[True] * len(positions) for _ in header.layers], "one-step"
    out_k = [[] for _ in header.layers]
    out_v = [[] for _ in header.layers]
    exact = [[] for _ in header.layers]
    for p in positions:
        prefix, first_incomplete = prefix_rows(header.layers, layers, p)
        got = engine.recompute(prefix, rows=p, token_ids=[ids[p]])
        for i, l in enumerate(got):
            out_k[i].append(l.keys[:, p - l.first_row : p - l.first_row + 1])
            out_v[i].append(l.values[:, p - l.first_row : p - l.first_row + 1])
            exact[i].append(i <= first_incomplete)
    fresh = [(np.concatenate(k, axis=1), np.concatenate(v, axis=1)) for k, v in zip(out_k, out_v)]
    return fresh, exact, "per-position"


def sample_check(header, layers: list[LayerKV], engine, *, count: int = DEFAULT_SAMPLE_POSITIONS,
                 seed: int | None = None, rows: int | None = None, lo: int = 0, reason: str = "",
                 partial_ok: bool = False) -> SampleCheck:
    """Recompute ``count`` positions drawn across [lo, rows) (default: all the pack's rows), each
    from the pack's own rows before it and the prompt's token there, in every layer, and
    compare K and V with the pack's; raise SpotCheckFailed on a mismatch, and GateIncomplete
    when some layer could not be compared at some sampled position (a sliding-window model
    past its window, its pack without the sliding history: ``ring_extra`` short of
    ``rows - window + 1``) unless ``partial_ok`` (a report, as ``verify --audit`` gives).
    ``lo``: the rows before it are trusted (a delta's base, checked or made here).

    Why this detects a fault: a layer's K/V at position p are a function of the rows of the
    layers below at positions <= p and of token p. A recomputation of p from the pack's own
    prefix therefore reproduces the pack's rows at p exactly when they are what the model makes
    of that prefix; by induction a pack that agrees at every position is the prompt's true
    cache. A layer whose rows are wrong at p disagrees at p (its inputs come from the layers
    below, not from its own rows); the layers above it disagree at every later sampled
    position too (their attention read the wrong rows). ``layers``: full rows from position 0."""
    t0 = time.perf_counter()
    rows = header.rows_end if rows is None else rows
    seed = new_seed() if seed is None else int(seed)
    if has_state(header):  # recurrent state: recomputed from the pack's own checkpoints instead
        checked, tol, report, seconds = state_check(header, layers, engine, seed=seed, rows=rows, lo=lo)
        return SampleCheck(seed, checked, tol, report, "state-checkpoint", seconds)
    positions = sample_positions(rows, max(1, int(count)), seed, lo)
    fresh, exact, method = _fresh_rows(header, layers, engine, positions, rows)
    probe = KVPack(header=header, layers=layers, root_digest=b"", total_bytes=0, stored_bytes=0)
    tol = tolerance_for(probe, engine.name)
    report, mine, their = [], [], []
    for i, ((fk, fv), theirs) in enumerate(zip(fresh, layers)):
        keep = [j for j, p in enumerate(positions) if exact[i][j] and p >= theirs.first_row]
        idx = [positions[j] - theirs.first_row for j in keep]
        tk, tv = theirs.keys[:, idx], theirs.values[:, idx]
        a_k, a_v = to_float32(fk[:, keep], header.dtype), to_float32(fv[:, keep], header.dtype)
        b_k, b_v = to_float32(tk, header.dtype), to_float32(tv, header.dtype)
        dev = np.maximum(np.abs(a_k - b_k).max(axis=(0, 2), initial=0.0),
                         np.abs(a_v - b_v).max(axis=(0, 2), initial=0.0))  # per sampled position
        scale = max(float(np.abs(a_k).max(initial=0.0)), float(np.abs(a_v).max(initial=0.0))) or 1.0
        rel = float(dev.max(initial=0.0)) / scale
        lt = layer_tolerance(tol, probe, i)
        mine.append((fk, fv))
        their.append(keep)
        report.append({"layer": i, "kind": header.layers[i].kind, "positions": len(keep), "rel_max": rel,
                       "worst_position": positions[keep[int(dev.argmax())]] if keep else None,
                       "tolerance": lt, "ok": rel <= lt})
    result = SampleCheck(seed, positions, tol, report, method, time.perf_counter() - t0)
    if not result.ok:
        # side by side for the diagnosis: the positions compared in every layer
        common = [j for j in range(len(positions)) if all(j in keep for keep in their)]
        theirs_at = [LayerKV(l.keys[:, [positions[j] - l.first_row for j in common]],
                             l.values[:, [positions[j] - l.first_row for j in common]], 0) for l in layers]
        _refuse_sampled(result, header, engine.name, [LayerKV(k[:, common], v[:, common], 0) for k, v in mine],
                        theirs_at)
    if not result.complete and not partial_ok:
        _refuse_incomplete(result, header)
    return result


def _refuse_incomplete(result: SampleCheck, header) -> None:
    """GateIncomplete: which layers went unchecked where, and what would make the pack checkable."""

    m = len(result.positions)
    short = [l for l in result.layers if l["positions"] < m]
    missed = m - min(l["positions"] for l in short)
    first = short[0]["layer"]
    windows = sorted({s.window for s in header.layers if s.kind == "sliding" and s.window})
    chunks = sorted({s.chunk for s in header.layers if s.kind == "chunked" and s.chunk})
    reach = ([f"the sliding window ({', '.join(map(str, windows))} tokens)"] if windows else []) + (
        [f"the current attention chunk ({', '.join(map(str, chunks))} tokens)"] if chunks else [])
    made_by = (header.producer or {}).get("engine") or "an unnamed engine"
    raise GateIncomplete(
        f"pack refused by the numeric gate before the first token: it cannot be checked in full here -- layers "
        f"{first}..{short[-1]['layer']} could not be recomputed at {missed} of {m} positions sampled across the "
        f"prompt (seed {result.seed}): they lie before {' or '.join(reach) or 'the rows it carries'}, "
        f"whose older rows this pack does not carry (ring_extra {header.ring_extra}); rows nobody checked are not "
        f"decoded from",
        hint=f"have the producer ({made_by}) write the sliding history (muser prefill --history; a pull-lane "
             f"producer sends it when asked), decode with --prompt to prefill locally, or --audit 0 to skip the gate")


def _refuse_sampled(result: SampleCheck, header, engine: str, mine: list[LayerKV], their: list[LayerKV]) -> None:
    """SpotCheckFailed naming the worst layer, where, and the likely cause (:func:`diagnose`
    on the sampled rows, side by side)."""
    m = their[0].keys.shape[1] if their else 0
    side = KVPack(header=header, layers=their, root_digest=b"", total_bytes=0, stored_bytes=0)
    report = AuditReport(positions=(0, m), mode="sampled", tolerance=result.tolerance, layers=result.layers,
                         fresh=mine)
    cause = diagnose(report, side, contiguous=False) or "the rows disagree with local recomputation"
    raise sampled_refusal(result.layers, result.worst, engine,
                          f"{len(result.positions)} positions sampled across the prompt (seed {result.seed})", header,
                          cause=cause)
