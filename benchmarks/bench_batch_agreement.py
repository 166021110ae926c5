"""How often batched decode changes a greedy answer (issue 37, item 5): each prompt decoded
alone (one sequence per call: ``decode --serve --exact``), then in batches of B sequences
stepped together (the default of ``decode --serve`` where the engine batches), same engine,
same dtype, temperature 0.

    .venv/bin/python benchmarks/bench_batch_agreement.py [--engine mlx] [--dtype float32,bfloat16]
        [--prompts 32] [--tokens 32] [--batch 2,4,8,16] [--model default]

For each (dtype, B): the share of sequences whose tokens equal their solo tokens, the share of
tokens before the first difference (free running: after a difference the texts go their own
ways, so later tokens are not compared), and where the first differences fell. Prompts: distinct
chat requests on the model's own template. One thread. The receipt
(benchmarks/results/batch-agreement-*.json) keeps every sequence's first difference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from _common import RESULTS, stderr

from muser_cli.bench.common import BenchResult, parse_ints, receipt_path, write_receipt
from muser_cli.consumer.turns import TurnEngine, Turns
from muser_cli.engines.base import Sampling
from muser_cli.engines.registry import get_engine
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tokens import encode_prompt

TOPICS = ["bridges", "rivers", "the moon", "bread", "chess", "volcanoes", "jazz", "trains", "bees", "glass", "maps",
          "clocks", "salt", "kites", "owls", "ice", "tides", "paper", "copper", "wolves", "tea", "deserts", "violins",
          "lighthouses", "honey", "comets", "orchards", "canals", "wool", "fog", "mirrors", "lanterns"]
ASKS = ["Write two sentences about {t} for a child.", "Explain in a short paragraph why {t} matter to people.",
        "List three surprising facts about {t}.", "Describe {t} as a poet would, in four lines."]


def prompts(n: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(t=TOPICS[i % len(TOPICS)]) + f" (request {i})" for i in range(n)]


def decode_all(engine, turns: Turns | None, info, texts: list[str], tokens: int, together: int) -> list[list[int]]:
    """Each text's greedy tokens; ``together`` sequences at once (1: one after another)."""
    def one(text: str) -> list[int]:
        ids = encode_prompt(info, [{"role": "user", "content": text}], chat=True)
        if turns is not None:
            turns.join()
        try:
            layers = engine.prefill(ids[:-1])
            return engine.decode(layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=tokens,
                                 sampling=Sampling()).token_ids
        finally:
            if turns is not None:
                turns.leave()

    out: list[list[int]] = []
    for start in range(0, len(texts), together):
        group = texts[start:start + together]
        with ThreadPoolExecutor(len(group)) as pool:
            out.extend(pool.map(one, group))
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="mlx")
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", default="2,4,8,16")
    args = ap.parse_args()
    info = resolve_model(args.model)
    texts = prompts(args.prompts)
    sizes = parse_ints(args.batch, what="--batch")
    path = receipt_path("batch-agreement", RESULTS)
    rows: list[dict] = []
    for dtype in [d for d in args.dtype.split(",") if d]:
        alone_engine = get_engine(args.engine, info, dtype=dtype, threads=1)
        t0 = time.perf_counter()
        solo = decode_all(alone_engine, None, info, texts, args.tokens, 1)
        stderr(f"{dtype}: {len(texts)} prompts alone in {time.perf_counter() - t0:.1f} s")
        alone_engine.close()
        for b in sizes:
            raw = get_engine(args.engine, info, dtype=dtype, threads=1)
            turns = Turns()
            steps: list[int] = []
            raw.batch_decode(turns, on_step=steps.append)
            t0 = time.perf_counter()
            got = decode_all(TurnEngine(raw, turns), turns, info, texts, args.tokens, b)
            wall = time.perf_counter() - t0
            raw.close()
            firsts = [first_difference(s, g) for s, g in zip(solo, got)]
            same = sum(f is None for f in firsts)
            agreed = sum(len(s) if f is None else f for s, f in zip(solo, firsts))
            row = {"dtype": dtype, "batch": b, "sequences": len(texts), "equal": same,
                   "equal_share": round(same / len(texts), 4), "tokens_before_first_difference": agreed,
                   "token_share": round(agreed / sum(len(s) for s in solo), 4),
                   "first_differences": [f for f in firsts if f is not None],
                   "mean_batch": round(statistics.mean(steps), 2) if steps else 0, "wall_s": round(wall, 2)}
            rows.append(row)
            stderr(f"{dtype} B={b:2d}: {same}/{len(texts)} sequences equal, {row['token_share']:.1%} of tokens "
                   f"before a first difference (at {row['first_differences']}), mean batch {row['mean_batch']}, "
                   f"{wall:.1f} s")
            write_receipt(BenchResult("batch-agreement", {"engine": args.engine, "model": str(info.path),
                                                          "prompts": len(texts), "tokens": args.tokens, "rows": rows}),
                          path)
    print(f"receipt: {path}")


if __name__ == "__main__":
    main()
