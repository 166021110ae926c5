"""What the sampled numeric gate costs (issue 30): TTFT of decoding a foreign pack with the
default gate (32 positions sampled across the prompt in every layer, plus the last position
fused into the first step) against the same decode with the gate skipped (``--no-audit``),
and the sampled check's own time, as a share of the first token; the local prefill it saves
for scale.

    .venv/bin/python benchmarks/bench_gate.py [--depths 2048,8064] [--reps 3] [--threads 1]

Per depth the embedded model prefills the corpus once in bfloat16 (torch, chunk 512; timed:
the local prefill a fallback would pay); the pack is re-labelled as made by vLLM (every
digest re-made). One resident torch engine then decodes it through ``muser_cli.consumer.decode.decode``
(read + verify from memory, install, gate, first token, ``--new`` tokens) with and without
the gate, alternately A B A B, ``--reps`` counted after one warm-up round. The measurement
is :func:`muser_cli.bench.decode_costs.gate_cost`.
"""

from __future__ import annotations

from _common import depth_bench
from muser_cli.bench.decode_costs import gate_cost


WHAT = ("TTFT of a foreign (vLLM-labelled) bf16 pack with the default numeric gate (32 sampled positions in "
        "every layer + the fused last position) vs --no-audit (bench_gate.py)")


if __name__ == "__main__":
    depth_bench("gate", WHAT, gate_cost, depths="2048,8064", reps=3, new=4, threads=1, model="default")
