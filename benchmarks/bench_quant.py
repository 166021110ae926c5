"""int8 quantization: greedy-token agreement against the unquantized pack, on fixtures.

    python benchmarks/bench_quant.py [--tokens 32] [--dtype float32]

For each fixture prompt: prefill on the embedded model, pack lossless and int8, decode
greedy from both, count identical sequences and identical tokens (up to the first
difference and in total), and record the error the int8 header reports.
"""

from __future__ import annotations

import argparse
import io
import os

from _common import write_receipt

FIXTURES = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three uses of copper:",
    "The Rhine flows through Switzerland, Germany and",
    "In 1969 the first humans landed on",
    "A recipe for pancakes starts with",
    "The difference between a virus and a bacterium is",
    "Python is a programming language that",
    "Photosynthesis converts sunlight into",
    "The best way to learn a new language is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a village by the mountains,",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from muser_cli.engines.registry import get_engine
    from muser_cli.kvpack import read_pack_bytes, write_pack
    from muser_cli.model.resolve import resolve_model
    from muser_cli.produce.pack import pack
    from muser_cli.produce.pipeline import pack_header
    from muser_cli.model.tokens import encode_prompt

    info = resolve_model("default")
    eng = get_engine("torch", info, dtype=args.dtype, threads=os.cpu_count() or 1)
    rows = []
    for text in FIXTURES:
        ids = encode_prompt(info, text, chat=True)
        layers = eng.prefill(ids[:-1], chunk_tokens=512)
        header = pack_header(info, ids, dtype=args.dtype, chunk_tokens=512, engine="torch", threads=eng.threads)
        src = io.BytesIO()
        write_pack(src, header, layers)
        lossless = read_pack_bytes(src.getvalue())
        src.seek(0)
        q = io.BytesIO()
        pack(src, q, codec="zstd+bytegroup", quant="int8")
        quant = read_pack_bytes(q.getvalue())
        a = eng.decode(lossless.layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=args.tokens,
                       stop_on_eos=False).token_ids
        b = eng.decode(quant.layers, rows=len(ids) - 1, next_tokens=[ids[-1]], max_new_tokens=args.tokens,
                       stop_on_eos=False).token_ids
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        row = {"prompt": text, "identical": a == b, "common_prefix": prefix, "tokens": len(a),
               "same_positions": sum(x == y for x, y in zip(a, b)), "bytes_lossless": len(src.getvalue()),
               "bytes_int8": len(q.getvalue()), "error": quant.header.quant["error"]}
        rows.append(row)
        print(f"{'same' if a == b else 'DIFF':4}  prefix {prefix:2}/{len(a)}  err k {row['error']['k_max_abs']:.4f} "
              f"v {row['error']['v_max_abs']:.4f}  {text[:40]!r}", flush=True)
    same = sum(r["identical"] for r in rows)
    print(f"identical sequences: {same}/{len(rows)}; tokens before first difference: "
          f"{sum(r['common_prefix'] for r in rows)}/{sum(r['tokens'] for r in rows)}")
    path = write_receipt("quant-int8", {"model": info.name, "dtype": args.dtype, "tokens": args.tokens, "rows": rows,
                                        "identical_sequences": same, "prompts": len(rows)})
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
