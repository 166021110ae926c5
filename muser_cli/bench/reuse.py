"""Reuse and delta figures (docs/benchmarking.md rows "delta" and "reuse"), store lookup
time and the warm read (``benchmarks/bench_reuse.py`` calls these; see its docstring).

Nothing here prints or exits: progress goes through a callback.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

from muser_cli.bench.common import Progress, corpus_ids, measure, no_progress, summarize
from muser_cli.consumer.decode import decode
from muser_cli.engines.registry import get_engine
from muser_cli.errors import DataError
from muser_cli.kvpack import LayerKV, LayerSpec, PackHeader, read_pack_bytes, token_digest, write_pack
from muser_cli.model.tokens import decode_text, encode_prompt
from muser_cli.produce.pack import pack
from muser_cli.produce.pipeline import pack_header
from muser_cli.reuse import HaveManifest, Store
from muser_cli.reuse.delta import layers_at
from muser_cli.units import rate_text

CHUNK = 512


def prompt_text(info, n_tokens: int) -> str:
    """Text of the project's docs cut so it tokenizes to about ``n_tokens``."""

    ids = corpus_ids(info, n_tokens)
    text = decode_text(info, ids, skip_special_tokens=False)
    while len(encode_prompt(info, text)) > n_tokens:
        text = text[: int(len(text) * 0.995)]
    return text


def delta_rows(info, ids, layers, store_root: Path, *, chunk: int, dtype: str, reps: int, eng=None,
               progress: Progress = no_progress) -> list[dict]:
    """Delta bytes ÷ minimum at 25/50/75 % held, from a real pack of ``ids``. The consumer's
    stored prefix is cut from ``layers`` (all-full models) or prefilled with ``eng`` (its
    sliding rings belong to its own end)."""
    from dataclasses import replace


    header = pack_header(info, ids, dtype=dtype, chunk_tokens=chunk, engine="torch", threads=1)
    buf = io.BytesIO()
    write_pack(buf, header, layers)
    full = buf.getvalue()
    rows = []
    for frac in (0.25, 0.5, 0.75):
        held = max(chunk, round(frac * (len(ids) - 1) / chunk) * chunk)
        store = Store(store_root / f"delta-{frac}")
        prefix = pack_header(info, ids[: held + 1], dtype=dtype, chunk_tokens=chunk, engine="torch", threads=1)
        pre = eng.prefill(ids[:held], chunk_tokens=chunk) if eng is not None else layers_at(layers, info.layers, held)
        store.put_layers(prefix, pre)
        p = store.points(info.fingerprint, info.tokenizer_fingerprint, ids, len(ids) - 1)[0]
        _check(p.held == held, f"the store holds {p.held} tokens, not {held}")
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
        progress(f"  delta {info.name[:14]:<14} held {held:>5}/{len(ids) - 1} ({frac:.0%}): {len(delta)} B ÷ "
                 f"minimum {minimum} B = {len(delta) / minimum:.6f}  (full pack {len(full)} B; pack --have "
                 f"{t['median'] * 1e3:.1f} ms, cv {t['cv']:.1%})")
    return rows


def ttft_ab(info, text: str, *, reps: int, threads: int, progress: Progress = no_progress) -> dict:
    """Cold local TTFT vs warm (store) TTFT, alternated A B A B after one uncounted warm-up each."""

    kw = dict(model=str(info.path), prompt=text, max_new_tokens=1, dtype="float32", threads=threads)
    decode(None, chunk_tokens=CHUNK, reuse=False, store=True, **kw)  # warm-up, and it fills the store
    w = decode(None, **kw)
    _check(w.source == "store", f"the warm decode came from {w.source}, not the store")
    cold, warm, tokens = [], [], []
    for _ in range(reps):
        c = decode(None, chunk_tokens=CHUNK, reuse=False, **kw)
        w = decode(None, **kw)
        _check(w.source == "store" and w.token_ids == c.token_ids, "warm and cold decodes disagree")
        cold.append(c.ttft_s)
        warm.append(w.ttft_s)
        tokens.append(c.prompt_tokens)
        progress(f"  ttft cold {c.ttft_s:.3f}s  warm {w.ttft_s:.4f}s  (prompt {c.prompt_tokens} tokens)")
    ratios = [wv / cv for wv, cv in zip(warm, cold)]
    return {"prompt_tokens": tokens[0], "cold_ttft_s": summarize(cold), "warm_ttft_s": summarize(warm),
            "warm_over_cold": summarize(ratios)}


def lookup_rows(info, ids, store_root: Path, *, reps: int, progress: Progress = no_progress) -> list[dict]:
    """Lookup time with 1, 100 and 10,000 entries (small synthetic packs in the same scope)."""
    import numpy as np


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
            _check(bool(pts) and pts[0].held == 512, "the lookup did not find the 512-token point")
            st.close()

        t = measure(lookup, reps=max(reps, 5))
        out.append({"entries": count, "lookup_s": t, "fill_s": fill_s})
        progress(f"  lookup with {count:>6} entries: {t['median'] * 1e3:.2f} ms (cv {t['cv']:.1%}); "
              f"filling took {fill_s:.1f}s")
    return out


def warm_read(info, depth: int, *, reps: int, threads: int, new_tokens: int = 32,
              progress: Progress = no_progress) -> dict:
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


    ids = [int(t) for t in corpus_ids(info, depth)]
    rows = len(ids) - 1
    rng = np.random.default_rng(0)
    layers = [LayerKV(rng.standard_normal((s.kv_heads, rows, s.head_dim), dtype=np.float32),
                      rng.standard_normal((s.kv_heads, rows, s.v_head_dim), dtype=np.float32), 0) for s in info.layers]
    header = pack_header(info, ids, dtype="float32", chunk_tokens=CHUNK, engine="torch", threads=threads)
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
        progress(f"  warm read + install, {k:5}: {w['median'] * 1e3:7.1f} ms (min {w['min'] * 1e3:.1f}, max "
                 f"{w['max'] * 1e3:.1f}), CPU {c['median'] * 1e3:.1f} ms; {rate_text(entry.bytes / w['median'])}")
    return out


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise DataError(f"bench reuse: {what}")
