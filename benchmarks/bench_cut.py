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
The measurement is :func:`muser_cli.bench.decode_costs.cut_cost`.
"""

from __future__ import annotations

from _common import depth_bench
from muser_cli.bench.decode_costs import cut_cost


def keep(ap) -> None:
    ap.add_argument("--keep", type=int, default=50, help="percent of the chunks that arrive")


if __name__ == "__main__":
    depth_bench("cut", "cut-off stream TTFT vs local fallback vs whole pack (bench_cut.py)", cut_cost, keep,
                depths="2048", reps=5, new=4)
