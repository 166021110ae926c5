"""A cut-off stream costs only what is missing: TTFT of ``decode --prompt`` given the first
k % of a pack's chunks, against a full local fallback and a whole pack, in one process.

    .venv/bin/python benchmarks/bench_cut.py [--depths 2048] [--keep 50] [--reps 5]

Per depth the embedded model prefills the prompt once (float32, chunk 512) into a kvpack
in memory; the cut input is that pack's bytes up to the end of the last frame of chunk
``keep % x chunks`` (a producer that died there). Then, alternated A B C, one thread, a
resident engine (no model load in the figures): ``local`` (no pack: prefill everything),
``cut`` (keep the verified chunks, prefill the rest) and ``whole`` (the whole pack). The
tokens of all three must be equal (checked). TTFT is decode's own (first input byte to
first token, load excluded).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import corpus_ids, summarize, write_receipt  # noqa: E402

CHUNK = 512


def frame_ends(data: bytes) -> tuple[int, list[int]]:
    from muser_cli.kvpack import FrameEvent, HeaderEvent, PackReader

    reader, pos, head, ends = PackReader(), 0, 0, []
    while pos < len(data):
        n = max(1, reader.want())
        for ev in reader.feed(data[pos : pos + n]):
            if isinstance(ev, HeaderEvent):
                head = pos + n
            elif isinstance(ev, FrameEvent):
                ends.append(pos + n)
        pos += n
    return head, ends


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="2048")
    ap.add_argument("--keep", type=int, default=50, help="percent of the chunks that arrive")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new", type=int, default=4)
    args = ap.parse_args()
    from muser_cli.decode import decode
    from muser_cli.engines.torch.engine import TorchEngine
    from muser_cli.models import resolve_model
    from muser_cli.prefill import prefill
    from muser_cli.tokens import decode_text

    info = resolve_model("default")
    eng = TorchEngine(info, dtype="float32", threads=1)
    rows_out = []
    for depth in [int(d) for d in args.depths.split(",")]:
        ids = corpus_ids(info, depth)
        prompt = decode_text(info, ids)
        from muser_cli.tokens import encode_prompt

        ids = encode_prompt(info, prompt)  # what decode --prompt will see
        out = io.BytesIO()
        prefill(prompt, out, model="default", chunk_tokens=CHUNK, dtype="float32", threads=1)
        data = out.getvalue()
        head, ends = frame_ends(data)
        layers = len(info.layers)
        chunks = len(ends) // layers
        k = max(1, min(chunks - 1, round(chunks * args.keep / 100)))
        cut = data[: ends[k * layers - 1]]
        inputs = {"local": None, "cut": cut, "whole": data}
        ttft: dict[str, list[float]] = {name: [] for name in inputs}
        tokens: dict[str, list[int]] = {}
        extra: dict[str, dict] = {}
        for rep in range(args.reps + 1):
            for name, blob in inputs.items():
                got = decode(io.BytesIO(blob) if blob is not None else None, model="default", prompt=prompt,
                             max_new_tokens=args.new, dtype="float32", threads=1, resident=eng, reuse=False,
                             chunk_tokens=CHUNK)
                tokens.setdefault(name, got.token_ids)
                extra[name] = {"source": got.source, "handoff_rows": got.handoff_rows, "local_rows": got.local_rows}
                if rep:
                    ttft[name].append(got.ttft_s)
        if not (tokens["local"] == tokens["cut"] == tokens["whole"]):
            raise SystemExit(f"depth {depth}: the three inputs decoded different tokens")
        row = {"depth": len(ids), "chunks": chunks, "kept_chunks": k, "sources": extra,
               **{f"{name}_ttft_s": summarize(v) for name, v in ttft.items()}}
        row["cut_over_local"] = row["cut_ttft_s"]["median"] / row["local_ttft_s"]["median"]
        rows_out.append(row)
        print(f"depth {len(ids)}: local {row['local_ttft_s']['median']:.2f}s, cut after {k}/{chunks} chunks "
              f"{row['cut_ttft_s']['median']:.2f}s ({row['cut_over_local']:.2f}x), whole "
              f"{row['whole_ttft_s']['median']:.2f}s", file=sys.stderr, flush=True)
    receipt = write_receipt("cut", {"what": "cut-off stream TTFT vs local fallback vs whole pack (bench_cut.py)",
                                    "args": vars(args), "load_average": os.getloadavg(), "rows": rows_out})
    print(receipt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
