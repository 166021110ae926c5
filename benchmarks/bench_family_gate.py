"""What the numeric gate costs per model family (issue #26): at one prompt depth (2048 tokens),
on each family's tiny random model, the gate a consumer runs on a foreign pack against the
local prefill it saves, and as a share of the first token.

    .venv/bin/python benchmarks/bench_family_gate.py [--depth 2048] [--reps 3] [--threads 1] [--families a,b]

Per family: the tiny model with its positions raised to hold the prompt; the local prefill
(torch, float32, chunk 512) timed on a resident engine; the pack torch makes (with the
sliding history where the family has rings), re-labelled as made by vLLM (every digest
re-made); decode on the resident engine with the default gate and with ``--audit 0``
alternately, ``--reps`` counted after one warm-up. The gate's time is decode's own record
(32 sampled positions in every layer + the last position fused into the first step). The
tiny models are 4 layers of hidden 64: the gate's fixed costs weigh more than on a real
model. The measurement is :func:`muser_cli.bench.family_gate.family_gate_cost`.
"""

from __future__ import annotations

from _common import bench_args, run, stderr, write_receipt
from muser_cli.bench.family_gate import families, family_gate_cost

WHAT = ("numeric gate on a foreign (vLLM-labelled) float32 pack per tiny family at one depth, against the "
        "local prefill and the first token (bench_family_gate.py)")


def main() -> int:
    args = bench_args(depth=2048, reps=3, threads=1, families="")
    names = [f for f in args.families.split(",") if f] or families()
    got = family_gate_cost(names, depth=args.depth, reps=args.reps, threads=args.threads, progress=stderr)
    print(write_receipt("family-gate", {"what": WHAT, "args": vars(args), **got}))
    return 0


if __name__ == "__main__":
    run(main)
