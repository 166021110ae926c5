"""kvpack against the peers, same KV, one run (A B A B): bytes and save+load time of
kvpack (lossless zstd+bytegroup, raw, int8) vs mlx-lm save_prompt_cache/load_prompt_cache,
and llama.cpp state save/load when llama-cpp-python is installed; pack/unpack GB/s vs a
plain memory copy of the same bytes.

    python benchmarks/bench_kvpack.py [--depths 512,2048,8064] [--reps 5]

The KV is real: SmolLM2-135M prefilled by the torch engine in float32 and carried as
bfloat16 (the dtype mlx-lm and llama.cpp store), so every format holds the same values.
Save = write the file and fsync it; load = read it back into arrays in memory.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import corpus_ids, summarize, write_receipt  # noqa: E402


def fsync_write(path: Path, writer) -> None:
    with open(path, "wb") as fh:
        writer(fh)
        fh.flush()
        os.fsync(fh.fileno())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="512,2048,8064")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    from dataclasses import replace

    from muser_cli.engines.registry import get_engine
    from muser_cli.kvpack import LayerKV, read_pack, read_pack_bytes, write_pack
    from muser_cli.kvpack.quant import from_float32
    from muser_cli.models import resolve_model
    from muser_cli.pack import pack
    from muser_cli.schedule import build_header

    try:
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache
        have_mlx = True
    except ImportError:
        have_mlx = False
    try:
        import llama_cpp  # noqa: F401
        have_llama = True
    except ImportError:
        have_llama = False

    info = resolve_model("default")
    eng = get_engine("torch", info, dtype="float32", threads=os.cpu_count() or 1)
    tmp = Path(tempfile.mkdtemp(prefix="muser-bench-"))
    rows_out = []
    for depth in [int(d) for d in args.depths.split(",")]:
        ids = corpus_ids(info, depth)
        f32 = eng.prefill(ids[:-1], chunk_tokens=512)
        layers = [LayerKV(from_float32(l.keys, "bfloat16"), from_float32(l.values, "bfloat16"), l.first_row) for l in f32]
        header = build_header(info, ids, dtype="bfloat16", chunk_tokens=512, engine="torch", threads=eng.threads)
        raw_kv = sum(l.keys.nbytes + l.values.nbytes for l in layers)

        variants = {}

        def kv_save(codec):
            def run(path):
                fsync_write(path, lambda fh: write_pack(fh, header, layers, codec=codec))
            return run

        def kv_load(path):
            with open(path, "rb") as fh:
                read_pack(fh)

        def int8_save(path):
            src = io.BytesIO()
            write_pack(src, header, layers, codec="none")
            src.seek(0)
            fsync_write(path, lambda fh: pack(src, fh, codec="zstd+bytegroup", quant="int8"))

        variants["kvpack zstd+bytegroup"] = (kv_save("zstd+bytegroup"), kv_load, ".kvpack")
        variants["kvpack none"] = (kv_save("none"), kv_load, ".kvpack")
        variants["kvpack int8"] = (int8_save, kv_load, ".kvpack")
        if have_mlx:
            def mlx_cache():
                caches = []
                for l in layers:
                    c = KVCache()
                    k = mx.array(l.keys.view(np.uint16)).view(mx.bfloat16)[None]
                    v = mx.array(l.values.view(np.uint16)).view(mx.bfloat16)[None]
                    c.update_and_fetch(k, v)
                    caches.append(c)
                mx.eval([c.state for c in caches])
                return caches
            caches = mlx_cache()

            def mlx_save(path):
                save_prompt_cache(str(path), caches)
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

            def mlx_load(path):
                loaded = load_prompt_cache(str(path))
                mx.eval([c.state for c in loaded])

            variants["mlx-lm prompt cache"] = (mlx_save, mlx_load, ".safetensors")

        times = {name: {"save": [], "load": []} for name in variants}
        sizes = {}
        for rep in range(args.reps + 1):  # rep 0 is the warm-up
            for name, (save, load, ext) in variants.items():  # interleaved: A B C A B C ...
                path = tmp / f"{name.replace(' ', '_')}{ext}"
                t0 = time.perf_counter()
                save(path)
                t1 = time.perf_counter()
                load(path)
                t2 = time.perf_counter()
                sizes[name] = path.stat().st_size
                if rep:
                    times[name]["save"].append(t1 - t0)
                    times[name]["load"].append(t2 - t1)
                path.unlink()

        # codec throughput vs memcpy of the same bytes, in memory, interleaved
        flat = np.concatenate([np.concatenate([l.keys.ravel(), l.values.ravel()]) for l in layers])
        dst = np.empty_like(flat)
        tput = {"memcpy": [], "pack none": [], "unpack none": [], "pack zstd+bytegroup": [], "unpack zstd+bytegroup": []}
        blobs = {}
        for rep in range(args.reps + 1):
            t0 = time.perf_counter(); np.copyto(dst, flat); t1 = time.perf_counter()
            if rep:
                tput["memcpy"].append(flat.nbytes / (t1 - t0) / 1e9)
            for codec in ("none", "zstd+bytegroup"):
                buf = io.BytesIO()
                t0 = time.perf_counter(); write_pack(buf, header, layers, codec=codec); t1 = time.perf_counter()
                blobs[codec] = buf.getvalue()
                t2 = time.perf_counter(); read_pack_bytes(blobs[codec]); t3 = time.perf_counter()
                if rep:
                    tput[f"pack {codec}"].append(raw_kv / (t1 - t0) / 1e9)
                    tput[f"unpack {codec}"].append(raw_kv / (t3 - t2) / 1e9)

        row = {"depth": depth, "raw_kv_bytes": raw_kv, "sizes": sizes,
               "save": {k: summarize(v["save"]) for k, v in times.items()},
               "load": {k: summarize(v["load"]) for k, v in times.items()},
               "throughput_GBps": {k: summarize(v) for k, v in tput.items()}}
        rows_out.append(row)
        print(f"\n== {depth} tokens, raw bf16 KV {raw_kv / 1e6:.2f} MB")
        base = "mlx-lm prompt cache" if have_mlx else None
        for name in variants:
            s, l = row["save"][name], row["load"][name]
            rel = ""
            if base and name != base:
                rel = (f"  bytes {sizes[name] / sizes[base]:.3f}x, save+load "
                       f"{(s['median'] + l['median']) / (row['save'][base]['median'] + row['load'][base]['median']):.2f}x of mlx-lm")
            print(f"  {name:<24} {sizes[name] / 1e6:8.2f} MB  save {s['median'] * 1e3:7.1f} ms (cv {s['cv']:.1%})  "
                  f"load {l['median'] * 1e3:7.1f} ms (cv {l['cv']:.1%}){rel}")
        mc = row["throughput_GBps"]["memcpy"]["median"]
        for k, v in row["throughput_GBps"].items():
            print(f"  {k:<24} {v['median']:6.2f} GB/s (cv {v['cv']:.1%})  {v['median'] / mc:.3f}x memcpy")
    path = write_receipt("kvpack-peers", {"model": info.name, "fingerprint": info.fingerprint, "rows": rows_out,
                                          "mlx_lm": have_mlx,
                                          "llama_cpp": "installed" if have_llama else
                                          "not installed: llama-cpp-python builds from source (~20 min, 2 cores); not measured"})
    print(f"\nreceipt: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
