"""What the numeric gate before the first token costs: TTFT of decoding a foreign pack with
the spot-check fused into the first decode step, with it run as a step of its own (the
path before the fusion, and still the path on hybrid models), and with it skipped
(``--no-audit``); against one decode step.

    .venv/bin/python benchmarks/bench_spot_check.py [--depths 2048,8064] [--reps 5] [--threads 1]

Per depth the embedded model prefills the corpus once in bfloat16 (torch, chunk 512); the
pack is re-labelled as made by vLLM (every digest re-made), which is what makes decode
spot-check it. Then one resident torch engine decodes it through ``muser_cli.consumer.decode.decode``
(read + verify from memory, install, check, first token, ``--new`` tokens) in the three
modes alternately A B C A B C, ``--reps`` counted after one warm-up round. TTFT is decode's
own (first input byte to first token, model load excluded). The separate mode is forced by
making ``SpotGate.fusable`` answer no, which is what a hybrid model's pack gets. The tokens
of the separate and the unchecked mode must agree (checked); the fused mode decodes from
the consumer's own recomputation of the last row in a two-token first step, equal within
the tolerance but not in every bfloat16 bit, so how many of its tokens agree is recorded.
The measurement is
:func:`muser_cli.bench.decode_costs.spot_check_cost`.
"""

from __future__ import annotations

from _common import depth_bench
from muser_cli.bench.decode_costs import spot_check_cost


WHAT = ("TTFT of a foreign (vLLM-labelled) bf16 pack: spot-check fused into the first step vs a step of its "
        "own vs skipped, and one decode step (bench_spot_check.py)")


if __name__ == "__main__":
    depth_bench("spot-check", WHAT, spot_check_cost, depths="2048,8064", reps=5, new=8, threads=1, model="default")
