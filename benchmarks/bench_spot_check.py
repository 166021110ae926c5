"""What the numeric gate before the first token costs: TTFT of decoding a foreign pack with
the spot-check fused into the first decode step, with it run as a step of its own (the
path before the fusion, and still the path on hybrid models), and with it skipped
(``--no-audit``); against one decode step.

    .venv/bin/python benchmarks/bench_spot_check.py [--depths 2048,8064] [--reps 5] [--threads 1]

Per depth the embedded model prefills the corpus once in bfloat16 (torch, chunk 512); the
pack is re-labelled as made by vLLM (every digest re-made), which is what makes decode
spot-check it. Then one resident torch engine decodes it through ``muser_cli.decode.decode``
(read + verify from memory, install, check, first token, ``--new`` tokens) in the three
modes alternately A B C A B C, ``--reps`` counted after one warm-up round. TTFT is decode's
own (first input byte to first token, model load excluded). The separate mode is forced by
making ``SpotGate.fusable`` answer no, which is what a hybrid model's pack gets. The tokens
of the separate and the unchecked mode must agree (checked); the fused mode decodes from
the consumer's own recomputation of the last row in a two-token first step, equal within
the tolerance but not in every bfloat16 bit, so how many of its tokens agree is recorded.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import corpus_ids, summarize, write_receipt  # noqa: E402


@contextmanager
def separate_check():
    from muser_cli import decode as dec

    saved = dec.SpotGate.fusable
    dec.SpotGate.fusable = staticmethod(lambda pack, positions=1: False)
    try:
        yield
    finally:
        dec.SpotGate.fusable = saved


def foreign_pack(info, ids, *, threads: int) -> tuple[bytes, int]:
    """The corpus prefix as a bf16 torch pack, re-labelled as made by vLLM; and its rows."""
    from muser_cli.kvpack import read_pack, write_pack
    from muser_cli.prefill import prefill
    from muser_cli.tokens import decode_text

    out = io.BytesIO()
    prefill(decode_text(info, ids), out, model=str(info.path), chunk_tokens=512, dtype="bfloat16", threads=threads)
    p = read_pack(io.BytesIO(out.getvalue()))
    again = io.BytesIO()
    write_pack(again, replace(p.header, producer={**p.header.producer, "engine": "vllm"}), p.layers)
    return again.getvalue(), p.header.rows_end


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="2048,8064")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    import torch

    from muser_cli.decode import decode
    from muser_cli.engines.registry import get_engine
    from muser_cli.models import resolve_model

    info = resolve_model(args.model)
    eng = get_engine("torch", info, dtype="bfloat16", threads=args.threads)
    rows_out = []
    for depth in [int(d) for d in args.depths.split(",")]:
        t = time.perf_counter()
        data, rows = foreign_pack(info, corpus_ids(info, depth), threads=args.threads)
        prefill_s = time.perf_counter() - t
        ttft: dict[str, list[float]] = {"fused": [], "separate": [], "none": []}
        check_ms: dict[str, list[float]] = {"fused": [], "separate": []}
        step_ms: list[float] = []
        tokens: dict[str, list[int]] = {}
        rel: dict[str, float] = {}
        for rep in range(args.reps + 1):
            for mode in ("fused", "separate", "none"):
                kw = {"audit": 0} if mode == "none" else {}
                with separate_check() if mode == "separate" else nullcontext():
                    out = decode(io.BytesIO(data), model=args.model, max_new_tokens=args.new, engine="torch",
                                 dtype="bfloat16", threads=args.threads, resident=eng, **kw)
                spot = out.spot_check or {}
                if mode != "none":
                    if not spot.get("ran") or not spot.get("ok") or bool(spot.get("fused")) != (mode == "fused"):
                        raise SystemExit(f"{mode}: unexpected spot-check record {spot}")
                    rel[mode] = float(spot["worst_rel"])
                tokens.setdefault(mode, out.token_ids)
                if rep:
                    ttft[mode].append(out.ttft_s * 1e3)
                    if mode != "none":
                        check_ms[mode].append(float(spot["ms"]))
                    if mode == "none":
                        step_ms.append(1e3 * out.decode_s / max(1, len(out.token_ids) - 1))
        if tokens["separate"] != tokens["none"]:
            raise SystemExit(f"depth {depth}: separate and unchecked decodes differ: {tokens}")
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
        print(f"depth {depth}: TTFT fused {f['median']:.0f} ms ({f['min']:.0f}-{f['max']:.0f}), separate "
              f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f}), none {n['median']:.0f} ({n['min']:.0f}-"
              f"{n['max']:.0f}); extra fused {row['fused_extra_ms']:.0f} ms, separate {row['separate_extra_ms']:.0f} "
              f"ms; one decode step {st['median']:.0f} ms ({st['min']:.0f}-{st['max']:.0f}); fused tokens agree "
              f"{agree}/{len(tokens['none'])}", file=sys.stderr,
              flush=True)
    path = write_receipt("spot-check", {
        "what": "TTFT of a foreign (vLLM-labelled) bf16 pack: spot-check fused into the first step vs a step of its "
                "own vs skipped, and one decode step (bench_spot_check.py)",
        "args": vars(args), "load_average": os.getloadavg(), "torch_threads": torch.get_num_threads(),
        "rows": rows_out})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
