"""kvpack at memory speed, and against the peers, same KV, one run (A B A B ...).

The everyday form of this benchmark is ``muser bench pack`` (muser_cli/bench/pack.py, with
--plot); this script keeps the longer study: every digest, tmpfs files, GB per CPU-second,
and ``muser pack --no-zstd`` against ``cat``.

    python benchmarks/bench_kvpack.py [--depths 512,2048,8064] [--reps 5] [--synthetic]

Per depth, interleaved in every rep:
  * memcpy of the same bytes (np.copyto), the yardstick;
  * pack / unpack in memory (write_pack to BytesIO / read_pack_bytes), uncompressed and
    zstd+bytegroup, for each digest: v1.1 blake3 (the default), v1.1 sha256, v1.0 sha256;
  * save + load of a file (write + fsync / read_pack of the file, memory-mapped): kvpack
    uncompressed and zstd+bytegroup vs mlx-lm save_prompt_cache + load_prompt_cache.
At the deepest depth, `muser pack --no-zstd < pack > out` throughput vs `cat < pack > out`
(process start subtracted: the same commands on a 3 KB pack).

The KV is real unless --synthetic: SmolLM2-135M prefilled once by the torch engine in
float32 at the deepest depth and carried as bfloat16 (the dtype mlx-lm stores); each
shallower depth uses that prefill's first rows (causal: the rows of a shorter prompt).
--synthetic uses random bf16 rows of the same shape (zstd ratios are then not real).
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import summarize, write_receipt  # noqa: E402

from muser_cli.bench import pack as _lib  # noqa: E402

DIGESTS = {"v1.1 blake3": (1, "blake3"), "v1.1 sha256": (1, "sha256"), "v1.0 sha256": (0, "sha256")}
ROOT = Path(__file__).resolve().parent.parent


# The KV and the file helpers are the library's (muser_cli/bench/pack.py, also `muser bench pack`).
fsync_write = _lib.fsync_write
prefix = _lib.prefix


def real_kv(info, depth: int):
    ids, layers, threads, prefill_s = _lib.real_kv(info, depth, threads=os.cpu_count() or 1, progress=print)
    print(f"prefill of {depth} tokens: {prefill_s:.1f} s", flush=True)
    return ids, layers, threads


def synthetic_kv(info, depth: int):
    ids, layers = _lib.synthetic_kv(info, depth)
    return ids, layers, os.cpu_count() or 1


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed2(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process, every thread)."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def cli_rate(cmd: list[str], big: Path, tiny: Path, out: Path, reps: int) -> dict:
    """Seconds per run on ``big`` minus on ``tiny`` (process start), as GB/s; interleaved."""
    big_t, tiny_t = [], []
    for rep in range(reps + 1):
        for path, sink in ((big, big_t), (tiny, tiny_t)):
            with open(path, "rb") as src, open(out, "wb") as dst:
                t = timed(lambda: subprocess.run(cmd, stdin=src, stdout=dst, stderr=subprocess.DEVNULL, check=True))
            if rep:
                sink.append(t)
    size = big.stat().st_size
    net = [b - t for b, t in zip(big_t, tiny_t)]
    return {"big_s": summarize(big_t), "start_s": summarize(tiny_t),
            "GBps": summarize([size / n / 1e9 for n in net if n > 0] or [float("nan")])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="512,2048,8064")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--synthetic", action="store_true", help="random bf16 rows of the real model's shape")
    ap.add_argument("--no-cli", action="store_true", help="skip muser pack vs cat")
    ap.add_argument("--kv-cache", default="", help="an .npz of the prefilled KV: read if present, else written")
    args = ap.parse_args()

    from muser_cli.kvpack import read_pack, read_pack_bytes, write_pack
    from muser_cli.kvpack.digest import workers
    from muser_cli.models import resolve_model
    from muser_cli.schedule import build_header

    try:
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache
        have_mlx = True
    except ImportError:
        have_mlx = False

    depths = [int(d) for d in args.depths.split(",")]
    info = resolve_model("default")
    cache = Path(args.kv_cache) if args.kv_cache else None
    if cache is not None and cache.exists() and not args.synthetic:
        from muser_cli.kvpack import LayerKV

        z = np.load(cache)
        ids_all = z["ids"].tolist()
        kv_all = [LayerKV(z[f"k{i}"], z[f"v{i}"], 0) for i in range(len(info.layers))]
        threads = int(z["threads"])
        if len(ids_all) < max(depths):
            raise SystemExit(f"{cache} holds {len(ids_all)} tokens, fewer than {max(depths)}")
    else:
        ids_all, kv_all, threads = (synthetic_kv if args.synthetic else real_kv)(info, max(depths))
        if cache is not None and not args.synthetic:
            np.savez(cache, ids=np.array(ids_all), threads=threads,
                     **{f"k{i}": l.keys for i, l in enumerate(kv_all)}, **{f"v{i}": l.values for i, l in enumerate(kv_all)})
    tmp = Path(tempfile.mkdtemp(prefix="muser-bench-"))
    rows_out = []
    for depth in depths:
        ids = ids_all[:depth]
        layers = prefix(kv_all, depth - 1)
        base = build_header(info, ids, dtype="bfloat16", chunk_tokens=512, engine="torch", threads=threads)
        headers = {name: replace(base, minor=m, digest=d) for name, (m, d) in DIGESTS.items()}
        raw_kv = sum(l.keys.nbytes + l.values.nbytes for l in layers)
        flat = np.concatenate([np.concatenate([l.keys.ravel(), l.values.ravel()]) for l in layers])
        dst = np.empty_like(flat)

        # ---- in memory: pack / unpack vs memcpy
        ops: dict[str, list[float]] = {"memcpy": []}
        cpu: dict[str, list[float]] = {"memcpy": []}  # GB per CPU-second (all threads)
        blobs: dict[tuple[str, str], bytes] = {}
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp

        def note(key, wall_cpu):
            ops.setdefault(key, []).append(raw_kv / wall_cpu[0] / 1e9)
            cpu.setdefault(key, []).append(raw_kv / max(wall_cpu[1], 1e-9) / 1e9)

        for rep in range(args.reps + 1):  # rep 0 warms up
            t = timed2(lambda: np.copyto(dst, flat))
            if rep:
                note("memcpy", t)
            for codec in ("none", "zstd+bytegroup"):
                for name, header in headers.items():
                    if codec != "none" and name == "v1.1 sha256":
                        continue
                    buf = io.BytesIO()
                    tp = timed2(lambda: write_pack(buf, header, layers, codec=codec))
                    blobs[(codec, name)] = blob = buf.getvalue()
                    tu = timed2(lambda: read_pack_bytes(blob))
                    if rep:
                        note(f"pack {codec} [{name}]", tp)
                        note(f"unpack {codec} [{name}]", tu)
            # to a file in memory (tmpfs): the writev path, no fsync
            out = shm / f"muser-bench-{os.getpid()}.kvpack"
            with open(out, "wb") as fh:
                tf = timed2(lambda: write_pack(fh, headers["v1.1 blake3"], layers, codec="none"))
            with open(out, "rb") as fh:
                tr = timed2(lambda: read_pack(fh))  # memory-mapped
            out.unlink()
            if rep:
                note("pack none -> tmpfs file [v1.1 blake3]", tf)
                note("unpack none <- tmpfs file, mmap [v1.1 blake3]", tr)

        # ---- files: save + load vs mlx-lm
        def kv_save(header, codec):
            return lambda path: fsync_write(path, lambda fh: write_pack(fh, header, layers, codec=codec))

        def kv_load(path):
            with open(path, "rb") as fh:
                read_pack(fh)

        variants = {
            "kvpack none [v1.1 blake3]": (kv_save(headers["v1.1 blake3"], "none"), kv_load, ".kvpack"),
            "kvpack zstd+bytegroup [v1.1 blake3]": (kv_save(headers["v1.1 blake3"], "zstd+bytegroup"), kv_load, ".kvpack"),
            "kvpack none [v1.0 sha256]": (kv_save(headers["v1.0 sha256"], "none"), kv_load, ".kvpack"),
        }
        if have_mlx:
            caches = []
            for l in layers:
                c = KVCache()
                c.update_and_fetch(mx.array(l.keys.view(np.uint16)).view(mx.bfloat16)[None],
                                   mx.array(l.values.view(np.uint16)).view(mx.bfloat16)[None])
                caches.append(c)
            mx.eval([c.state for c in caches])

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
        for rep in range(args.reps + 1):
            for name, (save, load, ext) in variants.items():  # interleaved: A B C A B C ...
                path = tmp / f"{abs(hash(name))}{ext}"
                ts = timed(lambda: save(path))
                tl = timed(lambda: load(path))
                sizes[name] = path.stat().st_size
                if rep:
                    times[name]["save"].append(ts)
                    times[name]["load"].append(tl)
                path.unlink()

        row = {"depth": depth, "raw_kv_bytes": raw_kv, "sizes": sizes,
               "pack_bytes": {f"{c} [{n}]": len(b) for (c, n), b in blobs.items()},
               "throughput_GBps": {k: summarize(v) for k, v in ops.items()},
               "GB_per_cpu_second": {k: summarize(v) for k, v in cpu.items()},
               "save": {k: summarize(v["save"]) for k, v in times.items()},
               "load": {k: summarize(v["load"]) for k, v in times.items()}}
        mc = row["throughput_GBps"]["memcpy"]["median"]
        row["vs_memcpy"] = {k: v["median"] / mc for k, v in row["throughput_GBps"].items()}
        mcc = row["GB_per_cpu_second"]["memcpy"]["median"]
        row["cpu_vs_memcpy"] = {k: v["median"] / mcc for k, v in row["GB_per_cpu_second"].items()}
        if have_mlx:
            m = row["save"]["mlx-lm prompt cache"]["median"] + row["load"]["mlx-lm prompt cache"]["median"]
            row["save_load_vs_mlx"] = {k: (row["save"][k]["median"] + row["load"][k]["median"]) / m for k in variants}
        rows_out.append(row)
        print(f"\n== {depth} tokens, raw bf16 KV {raw_kv / 1e6:.2f} MB (pool {workers()} threads)")
        for k, v in row["throughput_GBps"].items():
            print(f"  {k:<46} {v['median']:6.2f} GB/s (cv {v['cv']:.1%})  {row['vs_memcpy'][k]:.3f}x memcpy"
                  f"  | per CPU-s {row['GB_per_cpu_second'][k]['median']:6.2f} = {row['cpu_vs_memcpy'][k]:.3f}x")
        for name in variants:
            s, l = row["save"][name], row["load"][name]
            rel = f"  save+load {row['save_load_vs_mlx'][name]:.2f}x mlx-lm" if have_mlx else ""
            print(f"  {name:<36} {sizes[name] / 1e6:8.2f} MB  save {s['median'] * 1e3:7.1f} ms (cv {s['cv']:.1%})  "
                  f"load {l['median'] * 1e3:7.1f} ms (cv {l['cv']:.1%}){rel}", flush=True)

    cli = None
    if not args.no_cli:
        depth = max(depths)
        header = replace(build_header(info, ids_all, dtype="bfloat16", chunk_tokens=512, engine="torch",
                                      threads=threads), minor=1, digest="blake3")
        big = tmp / "big.kvpack"
        fsync_write(big, lambda fh: write_pack(fh, header, prefix(kv_all, depth - 1), codec="none"))
        tiny = ROOT / "tests" / "golden" / "v1_1-full-rope-none-blake3.kvpack"
        out = tmp / "out.kvpack"
        muser = [str(Path(sys.executable).parent / "muser"), "pack", "--no-zstd"]
        cli = {"bytes": big.stat().st_size, "depth": depth, "digest": "v1.1 blake3"}
        for rep in range(2):  # A B A B at the process level too
            for name, cmd in (("muser pack --no-zstd", muser), ("cat", ["cat"])):
                cli.setdefault(name, []).append(cli_rate(cmd, big, tiny, out, max(2, args.reps // 2)))
        for name in ("muser pack --no-zstd", "cat"):
            rates = [g for r in cli[name] for g in r["GBps"]["reps"]]
            cli[f"{name} GBps"] = summarize(rates)
        cli["ratio"] = cli["muser pack --no-zstd GBps"]["median"] / cli["cat GBps"]["median"]
        print(f"\n== muser pack --no-zstd vs cat, {cli['bytes'] / 1e6:.1f} MB pack: "
              f"{cli['muser pack --no-zstd GBps']['median']:.2f} vs {cli['cat GBps']['median']:.2f} GB/s "
              f"= {cli['ratio']:.3f}x")
    load = os.getloadavg()
    path = write_receipt("kvpack-speed", {
        "model": info.name, "fingerprint": info.fingerprint, "kv": "synthetic bf16" if args.synthetic else
        "real: SmolLM2 torch float32 prefill of the deepest depth, as bf16; shallower depths are its prefixes",
        "rows": rows_out, "cli": cli, "mlx_lm": have_mlx, "pool_threads": workers(), "loadavg_at_end": load,
        "note": "shared machine: 2 CPUs, other agents' jobs running (load average recorded)"})
    print(f"\nreceipt: {path} (load average {load[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
