"""``muser batch`` vs a shell loop of ``muser decode`` (issue 15's measurement; the measuring is
muser_cli/bench/batch_loop.py).

One document of ~DOC_TOKENS tokens (the project's own docs) asked QUESTIONS questions:

  * loop-local : ``for q: muser decode --prompt doc+q``            (every job: process, load, full prefill)
  * batch-local: ``muser batch jobs.jsonl``                        (one load; the document prefilled once)
  * loop-pull  : ``for q: muser decode --producer P --prompt doc+q`` (every job: process, load, full handoff)
  * batch-pull : ``muser batch jobs.jsonl --producer P``           (one handoff, then deltas, pulls overlapped)

The consumer runs on one core and the resident producer on another (``taskset -c``), one
compute thread each; every run starts from an empty store. Whole-process wall times; the
batches are repeated --reps times (the loops once: each is already QUESTIONS runs). The
tokens of every job are checked equal across the four. Receipt: benchmarks/results/batch-*.json.

    .venv/bin/python benchmarks/bench_batch.py -m default            # the measurement (~20 min)
    .venv/bin/python benchmarks/bench_batch.py -m TINY --doc-tokens 600 --questions 4 --reps 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json

from _common import write_receipt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--doc-tokens", type=int, default=6000)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("-n", "--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None, help="the canonical schedule's chunk (default: muser's, 512)")
    ap.add_argument("--skip-loops", action="store_true", help="measure the batches only")
    ap.add_argument("--loop-questions", type=int, default=0,
                    help="run the loops on the first K questions only and scale their median per job to all "
                         "(every loop job is the same work: a process, a load, a full prefill); 0 = all")
    args = ap.parse_args()

    from muser_cli.bench.batch_loop import run_batch_vs_loop

    out = run_batch_vs_loop(model=args.model, doc_tokens=args.doc_tokens, questions=args.questions,
                            max_tokens=args.max_tokens, reps=args.reps, chunk=args.chunk, skip_loops=args.skip_loops,
                            loop_questions=args.loop_questions, progress=lambda line: print(line, flush=True))
    path = write_receipt("batch", out)
    print(json.dumps(out, indent=1))
    print(f"receipt: {path}")


if __name__ == "__main__":
    main()
