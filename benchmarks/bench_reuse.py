"""Reuse and delta figures (docs/benchmarking.md rows "delta" and "reuse"), plus store lookup time.

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
import io
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from _common import corpus_ids, measure, summarize, write_receipt  # noqa: E402

CHUNK = 512


def prompt_text(info, n_tokens: int) -> str:
    """Text of the project's docs cut so it tokenizes to about ``n_tokens``."""
    from muser_cli.tokens import decode_text, encode_prompt

    ids = corpus_ids(info, n_tokens)
    text = decode_text(info, ids, skip_special_tokens=False)
    while len(encode_prompt(info, text)) > n_tokens:
        text = text[: int(len(text) * 0.995)]
    return text


def delta_rows(info, ids, layers, store_root: Path, *, chunk: int, dtype: str, reps: int, eng=None) -> list[dict]:
    """Delta bytes ÷ minimum at 25/50/75 % held, from a real pack of ``ids``. The consumer's
    stored prefix is cut from ``layers`` (all-full models) or prefilled with ``eng`` (its
    sliding rings belong to its own end)."""
    from dataclasses import replace

    from muser_cli.kvpack import read_pack_bytes, token_digest, write_pack
    from muser_cli.pack import pack
    from muser_cli.schedule import build_header
    from muser_cli.reuse import HaveManifest, Store
    from muser_cli.reuse.delta import layers_at

    header = build_header(info, ids, dtype=dtype, chunk_tokens=chunk, engine="torch", threads=1)
    buf = io.BytesIO()
    write_pack(buf, header, layers)
    full = buf.getvalue()
    rows = []
    for frac in (0.25, 0.5, 0.75):
        held = max(chunk, round(frac * (len(ids) - 1) / chunk) * chunk)
        store = Store(store_root / f"delta-{frac}")
        prefix = build_header(info, ids[: held + 1], dtype=dtype, chunk_tokens=chunk, engine="torch", threads=1)
        pre = eng.prefill(ids[:held], chunk_tokens=chunk) if eng is not None else layers_at(layers, info.layers, held)
        store.put_layers(prefix, pre)
        p = store.points(info.fingerprint, info.tokenizer_fingerprint, ids, len(ids) - 1)[0]
        assert p.held == held, (p.held, held)
        have = replace(HaveManifest(info.fingerprint, info.name, info.tokenizer_fingerprint, len(ids),
                                    token_digest(ids)), held_tokens=p.held, entry_id=p.entry, chain=p.chain,
                       scope=p.scope)
        state = {}

        def cut():
            out = io.BytesIO()
            pack(io.BytesIO(full), out, codec="none", have=have)
            state["delta"] = out.getvalue()

        t = measure(cut, reps=reps)
        delta = state["delta"]
        h = read_pack_bytes(delta).header
        minimum = 0
        for i, spec in enumerate(h.layers):
            n = min(h.rows_end, spec.window - 1) if spec.kind == "sliding" else h.rows_end - held
            minimum += n * h.logical_row_bytes(i)
        rows.append({"held_fraction": frac, "held_tokens": held, "prompt_tokens": len(ids), "delta_bytes": len(delta),
                     "minimum_bytes": minimum, "ratio": len(delta) / minimum, "full_pack_bytes": len(full),
                     "header_bytes": len(h.encode()), "frames": len(list(h.frame_plan())), "pack_have_s": t})
        print(f"  delta {info.name[:14]:<14} held {held:>5}/{len(ids) - 1} ({frac:.0%}): {len(delta)} B ÷ minimum "
              f"{minimum} B = {len(delta) / minimum:.6f}  (full pack {len(full)} B; pack --have "
              f"{t['median'] * 1e3:.1f} ms, cv {t['cv']:.1%})", flush=True)
    return rows


def ttft_ab(info, text: str, *, reps: int, threads: int) -> dict:
    """Cold local TTFT vs warm (store) TTFT, alternated A B A B after one uncounted warm-up each."""
    from muser_cli.decode import decode

    kw = dict(model=str(info.path), prompt=text, max_new_tokens=1, dtype="float32", threads=threads)
    decode(None, chunk_tokens=CHUNK, reuse=False, store=True, **kw)  # warm-up, and it fills the store
    w = decode(None, **kw)
    assert w.source == "store", w.source
    cold, warm, tokens = [], [], []
    for _ in range(reps):
        c = decode(None, chunk_tokens=CHUNK, reuse=False, **kw)
        w = decode(None, **kw)
        assert w.source == "store" and w.token_ids == c.token_ids
        cold.append(c.ttft_s)
        warm.append(w.ttft_s)
        tokens.append(c.prompt_tokens)
        print(f"  ttft cold {c.ttft_s:.3f}s  warm {w.ttft_s:.4f}s  (prompt {c.prompt_tokens} tokens)", flush=True)
    ratios = [wv / cv for wv, cv in zip(warm, cold)]
    return {"prompt_tokens": tokens[0], "cold_ttft_s": summarize(cold), "warm_ttft_s": summarize(warm),
            "warm_over_cold": summarize(ratios)}


def lookup_rows(info, ids, store_root: Path, *, reps: int) -> list[dict]:
    """Lookup time with 1, 100 and 10,000 entries (small synthetic packs in the same scope)."""
    import numpy as np

    from muser_cli.kvpack import LayerKV, LayerSpec, PackHeader
    from muser_cli.reuse import Store

    spec = LayerSpec("full", 1, 8, 8)
    rng = np.random.default_rng(0)
    store_dir = store_root / "lookup"
    filler = Store(store_dir, max_bytes=1 << 40)
    out = []
    count = 0
    for target in (1, 100, 10_000):
        t0 = time.perf_counter()
        while count < target:
            # each entry: a 600-token prompt (2 points at chunk 512); the first shares the query's prefix
            toks = ids[:600] if count == 0 else [int(t) for t in rng.integers(3, 40000, 600)]
            h = PackHeader(info.fingerprint, info.tokenizer_fingerprint, tuple(toks), (spec,), "float32", CHUNK)
            zeros = np.zeros((1, 599, 8), "<f4")
            filler.put_layers(h, [LayerKV(zeros, zeros, 0)])
            count += 1
        fill_s = time.perf_counter() - t0

        def lookup():
            st = Store(store_dir)
            pts = st.points(info.fingerprint, info.tokenizer_fingerprint, ids, len(ids) - 1)
            assert pts and pts[0].held == 512
            st.close()

        t = measure(lookup, reps=max(reps, 5))
        out.append({"entries": count, "lookup_s": t, "fill_s": fill_s})
        print(f"  lookup with {count:>6} entries: {t['median'] * 1e3:.2f} ms (cv {t['cv']:.1%}); "
              f"filling took {fill_s:.1f}s", flush=True)
    return out


def warm_read(info, depth: int, *, reps: int, threads: int, new_tokens: int = 32) -> dict:
    """The warm path's read and install, A B A B: a stored entry of ``depth`` tokens
    (random float32 rows of the model's shape, uncompressed, chunk 512: every layer spread
    over several frames) read with ``Store.load`` (memory-mapped, every frame verified) and
    installed by the torch engine with room for ``new_tokens``:

      copy   ``load()``, layers assembled from their frames, then the install copies them
             into the engine's sized cache (decode's store path today: adopt=False);
      adopt  ``load(spare_rows=new_tokens + 1)``, each full layer placed once into an array
             with room, which the install adopts as its cache (adopt=True): no copy after
             the placement.
    """
    import numpy as np

    from muser_cli.engines.registry import get_engine
    from muser_cli.kvpack import LayerKV
    from muser_cli.reuse import Store
    from muser_cli.schedule import build_header

    ids = [int(t) for t in corpus_ids(info, depth)]
    rows = len(ids) - 1
    rng = np.random.default_rng(0)
    layers = [LayerKV(rng.standard_normal((s.kv_heads, rows, s.head_dim), dtype=np.float32),
                      rng.standard_normal((s.kv_heads, rows, s.v_head_dim), dtype=np.float32), 0) for s in info.layers]
    header = build_header(info, ids, dtype="float32", chunk_tokens=CHUNK, engine="torch", threads=threads)
    st = Store()
    entry = st.put_layers(header, layers).entry
    del layers
    eng = get_engine("torch", info, dtype="float32", threads=threads)
    extra = 1 + new_tokens

    def copy() -> None:
        eng._install(st.load(entry.id).layers, rows, extra=extra)  # noqa: SLF001 (the engine's real install)

    def adopt() -> None:
        eng._install(st.load(entry.id, spare_rows=extra).layers, rows, extra=extra, adopt=True)  # noqa: SLF001

    times: dict[str, list[float]] = {"copy": [], "adopt": []}
    cpu: dict[str, list[float]] = {"copy": [], "adopt": []}
    load0 = os.getloadavg()
    for rep in range(reps + 1):  # A B A B, rep 0 uncounted
        for name, fn in (("copy", copy), ("adopt", adopt)):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            t, c = time.perf_counter() - t0, time.process_time() - c0
            if rep:
                times[name].append(t)
                cpu[name].append(c)
    out = {"entry_bytes": entry.bytes, "rows": rows, "new_tokens": new_tokens,
           "wall_s": {k: summarize(v) for k, v in times.items()}, "cpu_s": {k: summarize(v) for k, v in cpu.items()},
           "adopt_over_copy": summarize([a / c for a, c in zip(times["adopt"], times["copy"]) if c]),
           "loadavg_before": load0, "loadavg_after": os.getloadavg()}
    for k in ("copy", "adopt"):
        w, c = out["wall_s"][k], out["cpu_s"][k]
        print(f"  warm read + install, {k:5}: {w['median'] * 1e3:7.1f} ms (min {w['min'] * 1e3:.1f}, max "
              f"{w['max'] * 1e3:.1f}), CPU {c['median'] * 1e3:.1f} ms; {entry.bytes / w['median'] / 1e9:.2f} GB/s",
              flush=True)
    return out


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
    from muser_cli.engines.registry import get_engine
    from muser_cli.models import resolve_model
    from muser_cli.tinymodels import make_tiny_hybrid

    info = resolve_model("default")
    if args.warm_read:
        print(f"model {info.name}, warm read of a stored {args.depth}-token entry, float32, threads {args.threads}")
        res = warm_read(info, args.depth, reps=args.reps, threads=args.threads)
        path = write_receipt("reuse-warm-read", {"model": info.name, "fingerprint": info.fingerprint, "dtype": "float32",
                                                 "threads": args.threads, "chunk_tokens": CHUNK, "depth": args.depth,
                                                 "codec": "none", "kv": "synthetic float32", "warm_read": res,
                                                 "note": "shared machine: 2 CPUs, other agents' jobs running"})
        print(f"receipt: {path}")
        return 0
    text = prompt_text(info, args.depth)
    from muser_cli.tokens import encode_prompt

    ids = encode_prompt(info, text)
    print(f"model {info.name}, prompt {len(ids)} tokens, float32, threads {args.threads}", flush=True)
    receipt: dict = {"model": info.name, "fingerprint": info.fingerprint, "dtype": "float32", "threads": args.threads,
                     "chunk_tokens": CHUNK, "depth": len(ids), "codec": "none"}
    if not args.skip_ttft:
        receipt["ttft"] = ttft_ab(info, text, reps=args.reps, threads=args.threads)
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
    receipt["delta"] = delta_rows(info, ids, layers, home, chunk=CHUNK, dtype="float32", reps=args.reps)
    del layers
    tiny = resolve_model(make_tiny_hybrid(home / "tiny-hybrid"))
    tiny_ids = [int(t) for t in corpus_ids(tiny, 200)]
    teng = get_engine("torch", tiny, dtype="float32", threads=args.threads)
    receipt["delta_hybrid"] = delta_rows(tiny, tiny_ids, teng.prefill(tiny_ids[:-1], chunk_tokens=16), home,
                                         chunk=16, dtype="float32", reps=args.reps, eng=teng)
    if not args.skip_lookup:
        receipt["lookup"] = lookup_rows(info, ids, home, reps=args.reps)
    path = write_receipt("reuse", receipt)
    print(f"receipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
