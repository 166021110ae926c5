"""What a decode pays before and per token, as library calls for the scripts in benchmarks/:
the numeric gate (sampled and fused), the spot-check's three paths, decode speed from
installed rows against the bandwidth floor, and a cut-off stream against a local fallback.

Each function runs the measurement of its script's docstring (benchmarks/bench_gate.py,
bench_spot_check.py, bench_decode.py, bench_cut.py) and returns the receipt's figures; a
line per depth goes to ``progress``. Nothing here prints or exits: a run whose decodes
disagree raises :class:`DataError`.
"""

from __future__ import annotations

import io
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Iterator, Sequence

import numpy as np

from muser_cli.bench.common import Progress, corpus_ids, no_progress, summarize
from muser_cli.consumer import decode as dec
from muser_cli.consumer.decode import decode
from muser_cli.engines.registry import get_engine
from muser_cli.errors import DataError
from muser_cli.kvpack import read_pack, write_pack
from muser_cli.kvpack.parser import frame_ends
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tokens import decode_text, encode_prompt
from muser_cli.produce.prefill import prefill

CUT_CHUNK = 512


def foreign_pack(info, ids, *, threads: int) -> tuple[bytes, int]:
    """The corpus prefix as a bf16 torch pack, re-labelled as made by vLLM; and its rows."""

    out = io.BytesIO()
    prefill(decode_text(info, ids), out, model=str(info.path), chunk_tokens=512, dtype="bfloat16", threads=threads)
    p = read_pack(io.BytesIO(out.getvalue()))
    again = io.BytesIO()
    write_pack(again, replace(p.header, producer={**p.header.producer, "engine": "vllm"}), p.layers)
    return again.getvalue(), p.header.rows_end


@contextmanager
def separate_check() -> Iterator[None]:
    """Decode's spot-check as a step of its own (what a hybrid model's pack gets)."""

    saved = dec.SpotGate.fusable
    dec.SpotGate.fusable = staticmethod(lambda pack, positions=1: False)
    try:
        yield
    finally:
        dec.SpotGate.fusable = saved


def _foreign_packs(depths: Sequence[int], model: str, threads: int, new: int) -> Iterator[tuple[Any, ...]]:
    """Per depth: the foreign pack, its rows, the local prefill's seconds, and a call that
    decodes it on one resident bf16 torch engine (``decode``'s keywords added)."""

    info = resolve_model(model)
    eng = get_engine("torch", info, dtype="bfloat16", threads=threads)
    for depth in depths:
        t = time.perf_counter()
        data, rows = foreign_pack(info, corpus_ids(info, depth), threads=threads)
        prefill_s = time.perf_counter() - t

        def run(data: bytes = data, **kw: Any) -> Any:
            return decode(io.BytesIO(data), model=model, max_new_tokens=new, engine="torch", dtype="bfloat16",
                          threads=threads, resident=eng, **kw)

        yield depth, data, rows, prefill_s, run


def _machine_load() -> dict[str, Any]:
    import torch

    return {"load_average": os.getloadavg(), "torch_threads": torch.get_num_threads()}


def gate_cost(depths: Sequence[int], *, reps: int = 3, new: int = 4, threads: int = 1, model: str = "default",
              progress: Progress = no_progress) -> dict[str, Any]:
    """TTFT with the default sampled gate against ``--no-audit`` (bench_gate.py)."""
    rows_out = []
    for depth, data, rows, prefill_s, run in _foreign_packs(depths, model, threads, new):
        ttft: dict[str, list[float]] = {"gate": [], "none": []}
        sampled_ms: list[float] = []
        worst: list[float] = []
        for rep in range(reps + 1):
            for mode in ("gate", "none"):
                out = run(audit=0 if mode == "none" else None)
                spot = out.spot_check or {}
                if mode == "gate":
                    s = spot.get("sampled") or {}
                    if not (spot.get("ok") and s.get("ok") and len(s.get("positions", [])) == 32):
                        raise DataError(f"unexpected gate record {spot}")
                    if rep:
                        sampled_ms.append(float(s["ms"]))
                        worst.append(float(s["worst_rel"]))
                if rep:
                    ttft[mode].append(out.ttft_s * 1e3)
        row = {"depth": depth, "rows": rows, "pack_bytes": len(data), "local_prefill_s": round(prefill_s, 2),
               "ttft_ms": {m: summarize(v) for m, v in ttft.items()}, "sampled_check_ms": summarize(sampled_ms),
               "worst_rel": max(worst)}
        g, n = row["ttft_ms"]["gate"]["median"], row["ttft_ms"]["none"]["median"]
        row["extra_ms"] = g - n
        row["extra_pct_of_ttft"] = 100.0 * (g - n) / g
        row["sampled_pct_of_ttft"] = 100.0 * row["sampled_check_ms"]["median"] / g
        row["sampled_pct_of_local_prefill"] = 100.0 * row["sampled_check_ms"]["median"] / (1e3 * prefill_s)
        rows_out.append(row)
        progress(f"depth {depth}: TTFT gate {g:.0f} ms, none {n:.0f} ms (extra {g - n:.0f} ms, "
                 f"{row['extra_pct_of_ttft']:.0f} %); sampled check {row['sampled_check_ms']['median']:.0f} ms "
                 f"({row['sampled_pct_of_ttft']:.0f} % of TTFT, {row['sampled_pct_of_local_prefill']:.2f} % of the "
                 f"{prefill_s:.1f} s local prefill)")
    return {**_machine_load(), "rows": rows_out}


def spot_check_cost(depths: Sequence[int], *, reps: int = 5, new: int = 8, threads: int = 1, model: str = "default",
                    progress: Progress = no_progress) -> dict[str, Any]:
    """TTFT with the spot-check fused, as a step of its own, and skipped (bench_spot_check.py)."""
    rows_out = []
    for depth, data, rows, prefill_s, run in _foreign_packs(depths, model, threads, new):
        ttft: dict[str, list[float]] = {"fused": [], "separate": [], "none": []}
        check_ms: dict[str, list[float]] = {"fused": [], "separate": []}
        step_ms: list[float] = []
        tokens: dict[str, list[int]] = {}
        rel: dict[str, float] = {}
        for rep in range(reps + 1):
            for mode in ("fused", "separate", "none"):
                kw = {"audit": 0} if mode == "none" else {}
                with separate_check() if mode == "separate" else nullcontext():
                    out = run(**kw)
                spot = out.spot_check or {}
                if mode != "none":
                    if not spot.get("ran") or not spot.get("ok") or bool(spot.get("fused")) != (mode == "fused"):
                        raise DataError(f"{mode}: unexpected spot-check record {spot}")
                    rel[mode] = float(spot["worst_rel"])
                tokens.setdefault(mode, out.token_ids)
                if rep:
                    ttft[mode].append(out.ttft_s * 1e3)
                    if mode != "none":
                        check_ms[mode].append(float(spot["ms"]))
                    if mode == "none":
                        step_ms.append(1e3 * out.decode_s / max(1, len(out.token_ids) - 1))
        if tokens["separate"] != tokens["none"]:
            raise DataError(f"depth {depth}: separate and unchecked decodes differ: {tokens}")
        agree = next((i for i, (a, b) in enumerate(zip(tokens["fused"], tokens["none"])) if a != b),
                     len(tokens["none"]))
        row = {"depth": depth, "rows": rows, "pack_bytes": len(data), "prefill_s": round(prefill_s, 2),
               "ttft_ms": {m: summarize(v) for m, v in ttft.items()},
               "check_ms": {m: summarize(v) for m, v in check_ms.items()},
               "decode_step_ms": summarize(step_ms), "worst_rel": rel,
               "fused_tokens_agree": agree, "new_tokens": len(tokens["none"]), "tokens": tokens}
        none = row["ttft_ms"]["none"]["median"]
        for m in ("fused", "separate"):
            extra = row["ttft_ms"][m]["median"] - none
            row[f"{m}_extra_ms"] = extra
            row[f"{m}_extra_pct_of_ttft"] = 100.0 * extra / row["ttft_ms"][m]["median"]
        rows_out.append(row)
        f, s, n, st = (row["ttft_ms"]["fused"], row["ttft_ms"]["separate"], row["ttft_ms"]["none"],
                       row["decode_step_ms"])
        progress(f"depth {depth}: TTFT fused {f['median']:.0f} ms ({f['min']:.0f}-{f['max']:.0f}), separate "
                 f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f}), none {n['median']:.0f} ({n['min']:.0f}-"
                 f"{n['max']:.0f}); extra fused {row['fused_extra_ms']:.0f} ms, separate "
                 f"{row['separate_extra_ms']:.0f} ms; one decode step {st['median']:.0f} ms ({st['min']:.0f}-"
                 f"{st['max']:.0f}); fused tokens agree {agree}/{len(tokens['none'])}")
    return {**_machine_load(), "rows": rows_out}


def memcpy_rate(mib: int = 256, reps: int = 5) -> float:
    """This machine's copy rate, bytes/s: numpy copy of ``mib`` MiB, median of ``reps``."""
    a = np.ones(mib << 20, dtype=np.uint8)
    b = np.empty_like(a)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return a.nbytes / float(np.median(times[1:]))


def decode_speed(depths: Sequence[int], *, reps: int = 5, new: int = 32, threads: int = 1, model: str = "default",
                 progress: Progress = no_progress) -> dict[str, Any]:
    """ms per token, sized cache against DynamicCache against the floor (bench_decode.py)."""
    from muser_cli.engines.torch.engine import TorchEngine  # lazy: pulls torch

    info = resolve_model(model)
    sized = TorchEngine(info, dtype="float32", threads=threads)
    grown = TorchEngine(info, dtype="float32", threads=threads)
    grown.model = sized.model
    grown.sized_cache = False
    weight_bytes = sum(p.numel() * p.element_size() for p in sized.model.parameters())
    rate = memcpy_rate()
    rows_out = []
    for depth in depths:
        ids = corpus_ids(info, depth)
        t = time.perf_counter()
        layers = sized.prefill(ids[:-1], chunk_tokens=512)
        prefill_s = time.perf_counter() - t
        kv_bytes = sum(kv.keys.nbytes + kv.values.nbytes for kv in layers)
        floor_s = (weight_bytes + kv_bytes) / rate
        per: dict[str, list[float]] = {"sized": [], "grown": []}
        tokens: dict[str, list[int]] = {}
        for rep in range(reps + 1):
            for name, eng in (("sized", sized), ("grown", grown)):
                out = eng.decode(layers, rows=depth - 1, next_tokens=[ids[-1]], max_new_tokens=new,
                                 stop_on_eos=False)
                tokens.setdefault(name, out.token_ids)
                if out.token_ids != tokens[name]:
                    raise DataError(f"{name}: tokens changed between reps")
                if rep:
                    per[name].append(out.decode_s / (len(out.token_ids) - 1))
        if tokens["sized"] != tokens["grown"]:
            raise DataError(f"depth {depth}: the sized and the growing cache decoded different tokens")
        row = {"depth": depth, "prefill_s": round(prefill_s, 3), "kv_bytes": kv_bytes, "floor_ms": 1e3 * floor_s,
               "sized_ms": summarize([1e3 * x for x in per["sized"]]),
               "grown_ms": summarize([1e3 * x for x in per["grown"]])}
        row["sized_over_floor"] = row["sized_ms"]["median"] / row["floor_ms"]
        row["grown_over_floor"] = row["grown_ms"]["median"] / row["floor_ms"]
        rows_out.append(row)
        s, g = row["sized_ms"], row["grown_ms"]
        progress(f"depth {depth:5d}: sized {s['median']:.1f} ms/token ({s['min']:.1f}-{s['max']:.1f}), "
                 f"growing {g['median']:.1f} ({g['min']:.1f}-{g['max']:.1f}), floor {row['floor_ms']:.1f} ms: "
                 f"{row['sized_over_floor']:.2f}x vs {row['grown_over_floor']:.2f}x")
    return {**_machine_load(), "weight_bytes": weight_bytes, "memcpy_bytes_per_s": rate, "rows": rows_out}


def cut_cost(depths: Sequence[int], *, keep: int = 50, reps: int = 5, new: int = 4,
             progress: Progress = no_progress) -> dict[str, Any]:
    """TTFT of a pack cut after ``keep`` % of its chunks, against local and whole (bench_cut.py)."""
    from muser_cli.engines.torch.engine import TorchEngine  # lazy: pulls torch

    info = resolve_model("default")
    eng = TorchEngine(info, dtype="float32", threads=1)
    rows_out = []
    for depth in depths:
        prompt = decode_text(info, corpus_ids(info, depth))
        ids = encode_prompt(info, prompt)  # what decode --prompt will see
        out = io.BytesIO()
        prefill(prompt, out, model="default", chunk_tokens=CUT_CHUNK, dtype="float32", threads=1)
        data = out.getvalue()
        _head, ends = frame_ends(data)
        layers = len(info.layers)
        chunks = len(ends) // layers
        k = max(1, min(chunks - 1, round(chunks * keep / 100)))
        inputs = {"local": None, "cut": data[: ends[k * layers - 1]], "whole": data}
        ttft: dict[str, list[float]] = {name: [] for name in inputs}
        tokens: dict[str, list[int]] = {}
        extra: dict[str, dict] = {}
        for rep in range(reps + 1):
            for name, blob in inputs.items():
                got = decode(io.BytesIO(blob) if blob is not None else None, model="default", prompt=prompt,
                             max_new_tokens=new, dtype="float32", threads=1, resident=eng, reuse=False,
                             chunk_tokens=CUT_CHUNK)
                tokens.setdefault(name, got.token_ids)
                extra[name] = {"source": got.source, "handoff_rows": got.handoff_rows, "local_rows": got.local_rows}
                if rep:
                    ttft[name].append(got.ttft_s)
        if not (tokens["local"] == tokens["cut"] == tokens["whole"]):
            raise DataError(f"depth {depth}: the three inputs decoded different tokens")
        row = {"depth": len(ids), "chunks": chunks, "kept_chunks": k, "sources": extra,
               **{f"{name}_ttft_s": summarize(v) for name, v in ttft.items()}}
        row["cut_over_local"] = row["cut_ttft_s"]["median"] / row["local_ttft_s"]["median"]
        rows_out.append(row)
        progress(f"depth {len(ids)}: local {row['local_ttft_s']['median']:.2f}s, cut after {k}/{chunks} chunks "
                 f"{row['cut_ttft_s']['median']:.2f}s ({row['cut_over_local']:.2f}x), whole "
                 f"{row['whole_ttft_s']['median']:.2f}s")
    return {"load_average": os.getloadavg(), "rows": rows_out}
