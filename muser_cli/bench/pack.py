"""``muser bench pack``: kvpack pack/unpack/save/load against mlx-lm's prompt cache and memcpy.

The KV is real unless ``synthetic``: the model prefilled once by the torch engine in
float32 at the deepest depth and carried as bfloat16 (the dtype mlx-lm stores); each
shallower depth uses that prefill's first rows (causal: the rows of a shorter prompt).
Per depth, after one uncounted warm-up round, every counted round runs each case once,
in the same order (A B C ... A B C ...):

* memcpy of the same bytes (``np.copyto``): the floor;
* pack / unpack in memory (``write_pack`` to a buffer / ``read_pack_bytes``), uncompressed
  and zstd+bytegroup, default digest;
* save + load of a file: write + fsync / ``read_pack`` (memory-mapped), kvpack uncompressed
  and zstd+bytegroup, against mlx-lm's ``save_prompt_cache`` + fsync / ``load_prompt_cache``
  with every array evaluated (when mlx-lm is installed).
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from muser_cli.bench.common import BenchResult, Progress, corpus_ids, no_progress, summarize

CODECS = ("none", "zstd+bytegroup")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fsync_write(path: Path, writer) -> None:
    """Save as muser saves a pack (``prefill -o``, ``pack -o``): a part file written with
    early writeback, fsynced, renamed onto ``path``, the folder fsynced."""
    from muser_cli.fsio import atomic_writer

    with atomic_writer(path) as fh:
        writer(fh)


def real_kv(info, depth: int, *, threads: int, progress: Progress):
    from muser_cli.engines.registry import get_engine
    from muser_cli.kvpack import LayerKV
    from muser_cli.kvpack.quant import from_float32

    ids = corpus_ids(info, depth)
    eng = get_engine("torch", info, dtype="float32", threads=threads)
    progress(f"pack: prefill of {depth} tokens (torch float32, once)")
    t0 = time.perf_counter()
    f32 = eng.prefill(ids[:-1], chunk_tokens=512)
    prefill_s = time.perf_counter() - t0
    layers = [LayerKV(from_float32(l.keys, "bfloat16"), from_float32(l.values, "bfloat16"), l.first_row) for l in f32]
    return ids, layers, eng.threads, prefill_s


def synthetic_kv(info, depth: int):
    import numpy as np

    from muser_cli.kvpack import LayerKV
    from muser_cli.kvpack.quant import from_float32

    rng = np.random.default_rng(0)
    layers = []
    for spec in info.layers:
        k = rng.standard_normal((spec.kv_heads, depth - 1, spec.head_dim), dtype=np.float32)
        v = rng.standard_normal((spec.kv_heads, depth - 1, spec.v_head_dim), dtype=np.float32)
        layers.append(LayerKV(from_float32(k, "bfloat16"), from_float32(v, "bfloat16"), 0))
    return corpus_ids(info, depth), layers


def prefix(layers, rows: int):
    import numpy as np

    from muser_cli.kvpack import LayerKV

    return [LayerKV(np.ascontiguousarray(l.keys[:, :rows]), np.ascontiguousarray(l.values[:, :rows]), 0)
            for l in layers]


def _mlx():
    try:
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache
    except ImportError:
        return None
    return mx, KVCache, load_prompt_cache, save_prompt_cache


def run_pack(info, depths: Sequence[int], *, reps: int = 5, synthetic: bool = False, threads: int = 1,
             peers: bool = True, progress: Progress = no_progress) -> BenchResult:
    import numpy as np

    from muser_cli.kvpack import DEFAULT_DIGEST, read_pack, read_pack_bytes, write_pack
    from muser_cli.schedule import build_header

    deepest = max(depths)
    prefill_s = None
    if synthetic:
        ids_all, kv_all = synthetic_kv(info, deepest)
    else:
        ids_all, kv_all, threads, prefill_s = real_kv(info, deepest, threads=threads, progress=progress)
    if any(l.first_row for l in kv_all):
        from muser_cli.errors import UsageError

        raise UsageError("bench pack takes a model whose layers all keep every row (full attention)",
                         hint="-m tiny or -m default")
    mlx = _mlx() if peers else None
    tmp = Path(tempfile.mkdtemp(prefix="muser-bench-pack-"))
    rows: list[dict[str, Any]] = []
    try:
        for depth in depths:
            ids = ids_all[:depth]
            layers = prefix(kv_all, depth - 1)
            header = build_header(info, ids, dtype="bfloat16", chunk_tokens=512, engine="torch", threads=threads)
            raw = sum(l.keys.nbytes + l.values.nbytes for l in layers)
            flat = np.concatenate([np.concatenate([l.keys.ravel(), l.values.ravel()]) for l in layers])
            dst = np.empty_like(flat)
            cases: dict[str, Any] = {"memcpy": lambda: np.copyto(dst, flat)}
            blobs: dict[str, bytes] = {}
            for codec in CODECS:
                def pack(codec=codec):
                    buf = io.BytesIO()
                    write_pack(buf, header, layers, codec=codec)
                    blobs[codec] = buf.getvalue()

                def unpack(codec=codec):
                    read_pack_bytes(blobs[codec])

                cases[f"pack {codec}"] = pack
                cases[f"unpack {codec}"] = unpack

            savers: dict[str, tuple[Any, Any, str]] = {}

            def kv_save(codec):
                return lambda path: fsync_write(path, lambda fh: write_pack(fh, header, layers, codec=codec))

            def kv_load(path):
                with open(path, "rb") as fh:
                    read_pack(fh)

            for codec in CODECS:
                savers[f"kvpack {codec}"] = (kv_save(codec), kv_load, ".kvpack")
            if mlx is not None:
                mx, KVCache, load_prompt_cache, save_prompt_cache = mlx
                caches = []
                for l in layers:
                    c = KVCache()
                    c.update_and_fetch(mx.array(l.keys.view(np.uint16)).view(mx.bfloat16)[None],
                                       mx.array(l.values.view(np.uint16)).view(mx.bfloat16)[None])
                    caches.append(c)
                mx.eval([c.state for c in caches])

                def mlx_save(path, caches=caches):
                    save_prompt_cache(str(path), caches)
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)

                def mlx_load(path):
                    loaded = load_prompt_cache(str(path))
                    mx.eval([c.state for c in loaded])

                savers["mlx-lm prompt cache"] = (mlx_save, mlx_load, ".safetensors")

            times: dict[str, list[float]] = {k: [] for k in cases}
            times.update({f"save {name}": [] for name in savers})  # saves side by side, then loads
            times.update({f"load {name}": [] for name in savers})
            sizes: dict[str, int] = {}
            for rnd in range(reps + 1):  # round 0 warms up
                progress(f"pack {depth} tok: " + ("warm-up" if rnd == 0 else f"rep {rnd}/{reps}"))
                for name, fn in cases.items():
                    t = _timed(fn)
                    if rnd:
                        times[name].append(t)
                for i, (name, (save, load, ext)) in enumerate(savers.items()):
                    path = tmp / f"case{i}{ext}"
                    ts = _timed(lambda: save(path))
                    if mlx is not None:  # mlx keeps freed buffers for reuse; a reader in a new process has none, nor has glibc's heap here
                        mx.clear_cache()
                    tl = _timed(lambda: load(path))
                    sizes[name] = path.stat().st_size
                    path.unlink()
                    if rnd:
                        times[f"save {name}"].append(ts)
                        times[f"load {name}"].append(tl)
            stats = {k: summarize(v) for k, v in times.items()}
            gbps = {k: summarize([raw / t / 1e9 for t in v if t > 0]) for k, v in times.items()}
            mc = gbps["memcpy"]["median"]
            row: dict[str, Any] = {
                "depth": depth, "cases": list(times), "prompt_digest": header.token_digest, "raw_kv_bytes": raw, "seconds": stats, "GBps": gbps,
                "vs_memcpy": {k: v["median"] / mc for k, v in gbps.items()},
                "bytes": {"raw KV": raw, **{f"pack {c}": len(b) for c, b in blobs.items()},
                          **{f"file {k}": v for k, v in sizes.items()}},
            }
            if mlx is not None:
                m = stats["save mlx-lm prompt cache"]["median"] + stats["load mlx-lm prompt cache"]["median"]
                row["save_load_vs_mlx_lm"] = {
                    name: (stats[f"save {name}"]["median"] + stats[f"load {name}"]["median"]) / m for name in savers}
                row["bytes_vs_mlx_lm"] = {name: sizes[name] / sizes["mlx-lm prompt cache"] for name in savers}
            rows.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    payload = {
        "model": info.name, "fingerprint": info.fingerprint, "digest": DEFAULT_DIGEST,
        "kv": ("synthetic bf16 (random rows of the model's shape: zstd ratios are not real)" if synthetic else
               f"real: torch float32 prefill of {deepest} tokens as bf16; shallower depths are its prefixes"),
        "prefill_s": prefill_s, "threads": threads, "reps": reps, "warmup": 1, "mlx_lm": mlx is not None,
        "order": "every case once per round, same order, A B C A B C", "rows": rows,
    }
    return BenchResult("pack", payload, pack_table(rows))


def pack_table(rows: list[dict]) -> list[str]:
    """The human table: times, throughput of the raw KV's bytes (MB/s), speed against memcpy, sizes."""
    from muser_cli.units import rate_text, size_text

    out = []
    for r in rows:
        out.append(f"{r['depth']} tokens, raw bf16 KV {size_text(r['raw_kv_bytes'])}; "
                   "throughput = raw KV bytes / time; speed as a fraction of memcpy's")
        for name, s in r["seconds"].items():
            rate = rate_text(r["GBps"][name]["median"] * 1e9)
            out.append(f"  {name:<36} {s['median'] * 1e3:9.2f} ms (cv {s['cv']:5.1%})  {rate:>12}  "
                       f"{r['vs_memcpy'][name]:6.3f}x memcpy")
        for name, b in r["bytes"].items():
            rel = ""
            if name.startswith("file ") and "bytes_vs_mlx_lm" in r:
                rel = f"  {r['bytes_vs_mlx_lm'][name[5:]]:.3f}x mlx-lm's bytes"
                rel += f", save+load {r['save_load_vs_mlx_lm'][name[5:]]:.2f}x mlx-lm's time"
            out.append(f"  bytes {name:<30} {size_text(b):>10}{rel}")
    return out
