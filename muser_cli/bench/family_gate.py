"""What the numeric gate costs per model family (issue #26): a consumer's check of a foreign
pack at one prompt depth, on each family's tiny random model, as a share of the local prefill
it saves and of the first token. The measurement of benchmarks/bench_family_gate.py.

Per family: the tiny model (:func:`muser_cli.model.tiny.make_tiny`, its positions raised to
hold the prompt) in a temporary folder; ``depth`` ids of the project's corpus; the local
prefill of ``depth - 1`` of them on a resident torch engine (timed, ``reps`` after one
warm-up); the pack torch makes of them (with the sliding history where the family has rings,
as :func:`muser_cli.produce.prefill.prefill` writes it for another engine), re-labelled as made by
vLLM (every digest re-made) so that decode gates it; then decode on the resident engine
with the default gate and with ``--audit 0`` alternately, ``reps`` counted after one
warm-up. The gate's time is its own record (sampled positions + the last position fused
into the first step). Nothing here prints or exits; a gate that does not pass raises
:class:`DataError`.
"""

from __future__ import annotations

import io
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from muser_cli.bench.common import Progress, corpus_ids, no_progress, summarize
from muser_cli.consumer.decode import decode
from muser_cli.engines.registry import get_engine
from muser_cli.errors import DataError
from muser_cli.kvpack import read_pack, write_pack
from muser_cli.model.check import TESTED
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tiny import make_tiny
from muser_cli.model.tokens import decode_text
from muser_cli.produce.prefill import prefill

FIXED_SIZES = frozenset({"llama", "cohere2", "muse_glimmer_text"})  # tiny makers without room for a long prompt


def families() -> list[str]:
    """The families the torch engine is tested on whose tiny model can hold a long prompt."""

    return sorted(TESTED["torch"] - FIXED_SIZES)


def family_gate_cost(names: Sequence[str], *, depth: int = 2048, reps: int = 3, new: int = 2, threads: int = 1,
                     dtype: str = "float32", progress: Progress = no_progress) -> dict[str, Any]:
    import os

    import torch

    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rows_out.append(_one(name, Path(tmp), depth=depth, reps=reps, new=new, threads=threads, dtype=dtype))
            r = rows_out[-1]
            progress(f"{name}: local prefill {r['local_prefill_ms']['median']:.0f} ms; gate "
                     f"{r['gate_ms']['median']:.1f} ms ({r['gate_pct_of_prefill']:.1f} % of it, "
                     f"{r['gate_pct_of_ttft']:.0f} % of TTFT), {r['method']}; load {os.getloadavg()[0]:.2f}")
    return {"depth": depth, "dtype": dtype, "load_average_end": os.getloadavg(),
            "torch_threads": torch.get_num_threads(), "rows": rows_out}


def _one(name: str, tmp: Path, *, depth: int, reps: int, new: int, threads: int, dtype: str) -> dict[str, Any]:
    import os


    load_before = os.getloadavg()
    info = resolve_model(make_tiny(name, tmp / name, sizes={"max_position_embeddings": depth + 64}))
    eng = get_engine("torch", info, dtype=dtype, threads=threads)
    ids = corpus_ids(info, depth)
    prefill_ms = []
    for rep in range(reps + 1):
        t = time.perf_counter()
        eng.prefill(ids[:-1], chunk_tokens=512)
        if rep:
            prefill_ms.append(1e3 * (time.perf_counter() - t))
    made = io.BytesIO()
    text = decode_text(info, ids)
    prefill(text, made, model=str(info.path), chunk_tokens=512, dtype=dtype, threads=threads)
    p = read_pack(io.BytesIO(made.getvalue()))
    if list(p.header.token_ids) != ids:
        raise DataError(f"{name}: the corpus text does not tokenize back to its {depth} ids")
    foreign = io.BytesIO()
    write_pack(foreign, replace(p.header, producer={**p.header.producer, "engine": "vllm"}), p.layers)
    data = foreign.getvalue()
    ttft: dict[str, list[float]] = {"gate": [], "none": []}
    gate_ms, sampled_ms, last_ms = [], [], []
    method = ""
    for rep in range(reps + 1):
        for mode in ("gate", "none"):
            out = decode(io.BytesIO(data), model=str(info.path), max_new_tokens=new, engine="torch", dtype=dtype,
                         threads=threads, resident=eng, **({"audit": 0} if mode == "none" else {}))
            spot = out.spot_check or {}
            if mode == "gate":
                sampled = spot.get("sampled") or {}
                if not (spot.get("ran") and spot.get("ok") and sampled.get("ok") and not spot.get("layers_unchecked")):
                    raise DataError(f"{name}: unexpected gate record {spot}")
                method = str(sampled.get("method", ""))
                if rep:
                    sampled_ms.append(float(sampled["ms"]))
                    last_ms.append(float(spot["ms"]))
                    gate_ms.append(float(sampled["ms"]) + float(spot["ms"]))
            if rep:
                ttft[mode].append(1e3 * out.ttft_s)
    row = {"family": name, "layers": [s.kind for s in info.layers], "rows": p.header.rows_end,
           "ring_extra": p.header.ring_extra, "pack_bytes": len(data), "method": method,
           "local_prefill_ms": summarize(prefill_ms), "gate_ms": summarize(gate_ms),
           "sampled_ms": summarize(sampled_ms), "last_position_ms": summarize(last_ms),
           "ttft_ms": {m: summarize(v) for m, v in ttft.items()}, "load_average_before": load_before}
    row["gate_pct_of_prefill"] = 100.0 * row["gate_ms"]["median"] / row["local_prefill_ms"]["median"]
    row["gate_pct_of_ttft"] = 100.0 * row["gate_ms"]["median"] / row["ttft_ms"]["gate"]["median"]
    return row
