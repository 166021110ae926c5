"""Reuse and delta figures (the measuring is muser_cli/bench/reuse.py) (docs/benchmarking.md rows "delta" and "reuse"), plus store lookup time.

    python benchmarks/bench_reuse.py [--depth 8191] [--reps 5] [--threads 1] [--skip-ttft]

  delta    bytes of a delta pack (`pack --have`, codec none) ÷ the theoretical minimum
           (new full-attention rows + sliding-window rings), at 25/50/75 % of the prompt
           held; on the embedded model (all full attention) at --depth and on the tiny
           hybrid model (3 sliding : 1 full) at 200 tokens. Bytes are deterministic; the
           time of `pack --have` is given with its spread.
  reuse    warm TTFT (`decode --prompt`, whole prompt in the store: no prefill) ÷ cold
           local TTFT (`decode --prompt --no-reuse`: canonical prefill), at --depth on
           the embedded model, float32, measured A B A B in one run.
  --warm-read: only the store's read + the torch engine's install of a stored entry,
           copying (load, then install copies) against adopting (load with room, the
           install adopts it), A B A B (see warm_read).
  lookup   store lookup (chain hashes of the --depth prompt + the index query, a fresh
           Store each time, so opening the index is included) with 1, 100 and 10,000
           entries in the store.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from _common import corpus_ids, write_receipt


def note(line: str) -> None:
    print(line, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=8191, help="prompt tokens (8191 + 1 new token = the context)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--skip-lookup", action="store_true")
    ap.add_argument("--warm-read", action="store_true",
                    help="only the store read + install A/B (copy vs adopt) at --depth, synthetic rows")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="bench-reuse-"))
    os.environ["MUSER_HOME"] = str(home)  # a private store: the user's is never touched
    os.environ.setdefault("MUSER_MODELS", str(Path(__file__).resolve().parent.parent / "tests" / ".cache" / "models"))
    from muser_cli.bench.reuse import CHUNK, delta_rows, lookup_rows, prompt_text, ttft_ab, warm_read
    from muser_cli.engines.registry import get_engine
    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tiny import make_tiny_hybrid

    info = resolve_model("default")
    if args.warm_read:
        print(f"model {info.name}, warm read of a stored {args.depth}-token entry, float32, threads {args.threads}")
        res = warm_read(info, args.depth, reps=args.reps, threads=args.threads, progress=note)
        path = write_receipt("reuse-warm-read", {"model": info.name, "fingerprint": info.fingerprint, "dtype": "float32",
                                                 "threads": args.threads, "chunk_tokens": CHUNK, "depth": args.depth,
                                                 "codec": "none", "kv": "synthetic float32", "warm_read": res,
                                                 "note": "shared machine: 2 CPUs, other agents' jobs running"})
        print(f"receipt: {path}")
        return 0
    text = prompt_text(info, args.depth)
    from muser_cli.model.tokens import encode_prompt

    ids = encode_prompt(info, text)
    print(f"model {info.name}, prompt {len(ids)} tokens, float32, threads {args.threads}", flush=True)
    receipt: dict = {"model": info.name, "fingerprint": info.fingerprint, "dtype": "float32", "threads": args.threads,
                     "chunk_tokens": CHUNK, "depth": len(ids), "codec": "none"}
    if not args.skip_ttft:
        receipt["ttft"] = ttft_ab(info, text, reps=args.reps, threads=args.threads, progress=note)
        r = receipt["ttft"]["warm_over_cold"]
        print(f"reuse: warm TTFT ÷ cold TTFT = {r['median']:.5f} (1/{1 / r['median']:.0f}), cv {r['cv']:.1%}", flush=True)
    # delta bytes: the entry the TTFT run stored is the full prefill (verified as it is read)
    from muser_cli.reuse import Store

    st = Store()
    entries = [e for e in st.entries() if e.tokens == len(ids)]
    if entries:
        layers = st.load(entries[0].id).layers
    else:
        eng = get_engine("torch", info, dtype="float32", threads=args.threads)
        layers = eng.prefill(ids[:-1], chunk_tokens=CHUNK)
        del eng
    receipt["delta"] = delta_rows(info, ids, layers, home, chunk=CHUNK, dtype="float32", reps=args.reps,
                                  progress=note)
    del layers
    tiny = resolve_model(make_tiny_hybrid(home / "tiny-hybrid"))
    tiny_ids = [int(t) for t in corpus_ids(tiny, 200)]
    teng = get_engine("torch", tiny, dtype="float32", threads=args.threads)
    receipt["delta_hybrid"] = delta_rows(tiny, tiny_ids, teng.prefill(tiny_ids[:-1], chunk_tokens=16), home,
                                         chunk=16, dtype="float32", reps=args.reps, eng=teng, progress=note)
    if not args.skip_lookup:
        receipt["lookup"] = lookup_rows(info, ids, home, reps=args.reps, progress=note)
    path = write_receipt("reuse", receipt)
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
