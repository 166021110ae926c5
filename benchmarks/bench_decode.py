"""Decode speed from installed rows: ms per generated token at several context depths,
the torch engine's sized cache against transformers' growing ``DynamicCache``, and both
against the bandwidth floor.

    .venv/bin/python benchmarks/bench_decode.py [--depths 512,2048,8064] [--new 32] [--reps 5]

The floor is what one token must at least move: every weight byte and the K and V bytes
of the context, read once, at this machine's memcpy rate (numpy copy of 256 MiB, measured
in the same run). Per depth the rows are prefilled once (embedded model, float32, chunk
512), then the two caches decode ``--new`` greedy tokens alternately A B A B, one thread,
``--reps`` counted after one warm-up each; the tokens of both must be equal (checked).
The measurement is :func:`muser_cli.bench.decode_costs.decode_speed`.
"""

from __future__ import annotations

from _common import depth_bench
from muser_cli.bench.decode_costs import decode_speed


WHAT = ("decode ms/token from installed rows: sized cache vs transformers' DynamicCache vs the bandwidth "
        "floor (bench_decode.py)")


if __name__ == "__main__":
    depth_bench("decode", WHAT, decode_speed, depths="512,2048,8064", new=32, reps=5, threads=1, model="default")
