"""kvpack at memory speed, and against the peers, same KV, one run (A B A B ...).

The everyday form of this benchmark is ``muser bench pack`` (muser_cli/bench/pack.py, with
--plot); this script keeps the longer study: every digest, tmpfs files, GB per CPU-second,
and ``muser pack --no-zstd`` against ``cat``.

    python benchmarks/bench_kvpack.py [--depths 512,2048,8064] [--reps 5] [--synthetic]

Per depth, interleaved in every rep:
  * memcpy of the same bytes (np.copyto), the yardstick;
  * the floor under any verified pack: every row hashed once on the worker pool, no copy;
  * pack into a preallocated, reused buffer (the memcpy's own terms);
  * pack / unpack in memory (write_pack to BytesIO / read_pack_bytes), uncompressed and
    zstd+bytegroup, for each digest: v1.1 blake3 (the default), v1.1 sha256, v1.0 sha256;
  * save + load of a file (write + fsync / read_pack of the file, memory-mapped): kvpack
    uncompressed and zstd+bytegroup vs mlx-lm save_prompt_cache + load_prompt_cache;
    the load also once per rep in a fresh interpreter (what a consumer process pays: no
    heap or allocator cache left by earlier reads), and save+load with that load.
Another tree's kvpack is timed by the same script with ``PYTHONPATH=OLD`` (its floor then
hashes one frame per task, as that tree did).
At the deepest depth, `muser pack --no-zstd < pack > out` throughput vs `cat < pack > out`
(process start subtracted: the same commands on a 3 KB pack), by wall clock and per CPU
second of the child (wait4), output on tmpfs. ``--cli-only`` runs just that comparison
(on ``--cli-pack FILE`` if given); ``--baseline DIR`` times an older tree's ``muser pack``
in the same rounds (DIR holds its muser_cli/, e.g. ``git archive REV muser_cli | tar -x -C DIR``).

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


class MemorySink:
    """A preallocated, reused buffer that a pack is written into (``write`` copies the
    bytes in): the same terms as the memcpy yardstick, which also copies into a buffer
    whose pages are already there. BytesIO also pays for growing and first-touching its
    pages, so its rows measure BytesIO as much as the pack."""

    def __init__(self, size: int) -> None:
        self.buf = np.ones(size, dtype=np.uint8)  # touched: no first-use page faults in the timing
        self.pos = 0

    def write(self, data) -> int:
        m = memoryview(data).cast("B")
        n = len(m)
        self.buf[self.pos : self.pos + n] = np.frombuffer(m, dtype=np.uint8)
        self.pos += n
        return n

    def flush(self) -> None:
        pass


def hash_bound(layers, header) -> None:
    """The floor under any verified pack: every row hashed once with the pack's digest on
    the worker pool, frames in runs of ``task_bytes`` a task (as write_pack and
    read_buffer hand them out), nothing copied."""
    from muser_cli.kvpack.digest import hasher, payload_digest, pool

    try:
        from muser_cli.kvpack.digest import task_bytes
    except ImportError:  # an older tree (--baseline runs, PYTHONPATH=OLD): one task a frame, as it did
        def task_bytes(total: int) -> int:
            return 1

    h = hasher(header.digest)
    frames = []
    for layer, start, count in header.frame_plan():
        lk = layers[layer]
        a = start - lk.first_row
        heads = [lk.keys[hd, a : a + count] for hd in range(lk.keys.shape[0])]
        heads += [lk.values[hd, a : a + count] for hd in range(lk.values.shape[0])]
        frames.append([memoryview(np.ascontiguousarray(x)).cast("B") for x in heads])  # contiguous already
    size = sum(len(p) for f in frames for p in f)
    runs, n = [[]], 0
    for f in frames:
        runs[-1].append(f)
        n += sum(len(p) for p in f)
        if n >= task_bytes(size):
            runs.append([])
            n = 0
    ex = pool()
    if ex is None:
        [payload_digest(h, f) for f in frames]
    else:
        list(ex.map(lambda run: [payload_digest(h, f) for f in run], [r for r in runs if r]))


_FRESH_LOAD = """
import sys, time
kind, path = sys.argv[1], sys.argv[2]
if kind == "mlx":
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    def load():
        mx.eval([c.state for c in load_prompt_cache(path)])
else:
    from muser_cli.kvpack import read_pack

    def load():
        with open(path, "rb") as fh:
            read_pack(fh)
t0 = time.perf_counter()
load()
print(time.perf_counter() - t0)
"""


def fresh_load(kind: str, path: Path) -> float:
    """Seconds of one load of ``path`` in a new interpreter, imports done before the clock
    starts (this tree's muser_cli unless PYTHONPATH names another)."""
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(ROOT))
    out = subprocess.run([sys.executable, "-c", _FRESH_LOAD, kind, str(path)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed2(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process, every thread)."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _run_child(cmd: list[str], src_path: Path, out: Path, env: dict | None) -> tuple[float, float]:
    """(wall s, CPU s of the child: user + sys from wait4) of one run of ``cmd < src > out``."""
    with open(src_path, "rb") as src, open(out, "wb") as dst:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=src, stdout=dst, stderr=subprocess.DEVNULL, env=env)
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}")
    return wall, ru.ru_utime + ru.ru_stime


def cli_rates(cmds: dict[str, tuple[list[str], dict | None]], big: Path, tiny: Path, out: Path, reps: int) -> dict:
    """Per command: seconds per run on ``big`` minus on ``tiny`` (process start), as GB/s,
    by wall clock and by the child's CPU seconds; every command in turn in every rep
    (A B C A B C ...), after one uncounted round."""
    raw: dict[str, dict[str, list[float]]] = {n: {"big": [], "tiny": [], "big_cpu": [], "tiny_cpu": []} for n in cmds}
    for rep in range(reps + 1):
        for name, (cmd, env) in cmds.items():
            for path, key in ((big, "big"), (tiny, "tiny")):
                wall, cpu = _run_child(cmd, path, out, env)
                if rep:
                    raw[name][key].append(wall)
                    raw[name][f"{key}_cpu"].append(cpu)
    size = big.stat().st_size
    result = {}
    for name, r in raw.items():
        net = [b - t for b, t in zip(r["big"], r["tiny"])]
        net_cpu = [b - t for b, t in zip(r["big_cpu"], r["tiny_cpu"])]
        result[name] = {"big_s": summarize(r["big"]), "start_s": summarize(r["tiny"]),
                        "big_cpu_s": summarize(r["big_cpu"]), "start_cpu_s": summarize(r["tiny_cpu"]),
                        "GBps": summarize([size / n / 1e9 for n in net if n > 0] or [float("nan")]),
                        "GB_per_cpu_s": summarize([size / n / 1e9 for n in net_cpu if n > 0] or [float("nan")])}
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="512,2048,8064")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--synthetic", action="store_true", help="random bf16 rows of the real model's shape")
    ap.add_argument("--no-cli", action="store_true", help="skip muser pack vs cat")
    ap.add_argument("--kv-cache", default="", help="an .npz of the prefilled KV: read if present, else written")
    ap.add_argument("--cli-only", action="store_true", help="only muser pack --no-zstd vs cat")
    ap.add_argument("--cli-pack", default="", help="the pack to time muser pack and cat on (default: one written here)")
    ap.add_argument("--baseline", default="", help="a folder holding an older muser_cli/ (git archive REV muser_cli "
                                                    "| tar -x -C DIR): its muser pack is timed too, in turn")
    ap.add_argument("--cli-reps", type=int, default=0, help="counted rounds of the CLI comparison (default: reps)")
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
    if args.cli_only and args.cli_pack:
        ids_all, kv_all, threads = [], [], 0
        depths = []
    elif cache is not None and cache.exists() and not args.synthetic:
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
    depths_timed: list[int] = [] if args.cli_only else depths
    tmp = Path(tempfile.mkdtemp(prefix="muser-bench-"))
    rows_out = []
    for depth in depths_timed:
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

        mem = MemorySink(raw_kv + raw_kv // 8 + (1 << 20))
        for rep in range(args.reps + 1):  # rep 0 warms up
            t = timed2(lambda: np.copyto(dst, flat))
            if rep:
                note("memcpy", t)
            t = timed2(lambda: hash_bound(layers, headers["v1.1 blake3"]))
            if rep:
                note("hash only, no copy (the floor) [v1.1 blake3]", t)
            mem.pos = 0
            t = timed2(lambda: write_pack(mem, headers["v1.1 blake3"], layers, codec="none"))
            if rep:
                note("pack none -> preallocated memory [v1.1 blake3]", t)
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
                if have_mlx:  # mlx keeps freed buffers for reuse; a reader in a new process has none, nor has glibc's heap here
                    mx.clear_cache()
                tl = timed(lambda: load(path))
                sizes[name] = path.stat().st_size
                if rep:
                    times[name]["save"].append(ts)
                    times[name]["load"].append(tl)
                path.unlink()

        # the load a consumer pays: one read in a fresh process (imports before the clock),
        # with no heap or allocator cache left by earlier reads
        fresh: dict[str, list[float]] = {name: [] for name in variants}
        kept = {}
        for name, (save, _load, ext) in variants.items():
            kept[name] = tmp / f"fresh-{abs(hash(name))}{ext}"
            save(kept[name])
        for rep in range(args.reps):
            for name in variants:
                fresh[name].append(fresh_load("mlx" if name.startswith("mlx") else "kvpack", kept[name]))
        for path in kept.values():
            path.unlink()

        row = {"depth": depth, "raw_kv_bytes": raw_kv, "sizes": sizes,
               "pack_bytes": {f"{c} [{n}]": len(b) for (c, n), b in blobs.items()},
               "throughput_GBps": {k: summarize(v) for k, v in ops.items()},
               "GB_per_cpu_second": {k: summarize(v) for k, v in cpu.items()},
               "save": {k: summarize(v["save"]) for k, v in times.items()},
               "load": {k: summarize(v["load"]) for k, v in times.items()},
               "load_fresh_process": {k: summarize(v) for k, v in fresh.items()}}
        mc = row["throughput_GBps"]["memcpy"]["median"]
        row["vs_memcpy"] = {k: v["median"] / mc for k, v in row["throughput_GBps"].items()}
        mcc = row["GB_per_cpu_second"]["memcpy"]["median"]
        row["cpu_vs_memcpy"] = {k: v["median"] / mcc for k, v in row["GB_per_cpu_second"].items()}
        if have_mlx:
            m = row["save"]["mlx-lm prompt cache"]["median"] + row["load"]["mlx-lm prompt cache"]["median"]
            row["save_load_vs_mlx"] = {k: (row["save"][k]["median"] + row["load"][k]["median"]) / m for k in variants}
            mf = row["save"]["mlx-lm prompt cache"]["median"] + row["load_fresh_process"]["mlx-lm prompt cache"]["median"]
            row["save_load_fresh_vs_mlx"] = {k: (row["save"][k]["median"] + row["load_fresh_process"][k]["median"]) / mf
                                             for k in variants}
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
            lf = row["load_fresh_process"][name]
            relf = f"  save+load {row['save_load_fresh_vs_mlx'][name]:.2f}x mlx-lm" if have_mlx else ""
            print(f"  {'':<36} {'':>8}     load in a fresh process {lf['median'] * 1e3:7.1f} ms (cv {lf['cv']:.1%}){relf}",
                  flush=True)

    cli = None
    if not args.no_cli:
        load_before = os.getloadavg()
        if args.cli_pack:
            big = Path(args.cli_pack)
            depth, digest = None, "as the file's header says"
        else:
            depth = max(depths)
            header = replace(build_header(info, ids_all, dtype="bfloat16", chunk_tokens=512, engine="torch",
                                          threads=threads), minor=1, digest="blake3")
            big = tmp / "big.kvpack"
            fsync_write(big, lambda fh: write_pack(fh, header, prefix(kv_all, depth - 1), codec="none"))
            digest = "v1.1 blake3"
        tiny = ROOT / "tests" / "golden" / "v1_1-full-rope-none-blake3.kvpack"
        out = (Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp) / f"muser-bench-out-{os.getpid()}.kvpack"
        muser = [str(Path(sys.executable).parent / "muser"), "pack", "--no-zstd"]
        cmds: dict[str, tuple[list[str], dict | None]] = {"muser pack --no-zstd": (muser, None), "cat": (["cat"], None)}
        if args.baseline:
            env = dict(os.environ, PYTHONPATH=str(Path(args.baseline).resolve()))
            cmds = {"muser pack --no-zstd [baseline]": (muser, env), **cmds}
        rates = cli_rates(cmds, big, tiny, out, args.cli_reps or args.reps)
        out.unlink(missing_ok=True)
        cli = {"bytes": big.stat().st_size, "depth": depth, "digest": digest, "pack": str(big),
               "baseline": args.baseline or None, "out": str(out.parent), **rates,
               "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
        cat = rates["cat"]
        for name in cmds:
            if name == "cat":
                continue
            cli[f"ratio {name}"] = rates[name]["GBps"]["median"] / cat["GBps"]["median"]
            cli[f"cpu ratio {name}"] = rates[name]["GB_per_cpu_s"]["median"] / cat["GB_per_cpu_s"]["median"]
            print(f"\n== {name} vs cat, {cli['bytes'] / 1e6:.1f} MB pack (process start subtracted): "
                  f"{rates[name]['GBps']['median']:.2f} vs {cat['GBps']['median']:.2f} GB/s wall = "
                  f"{cli[f'ratio {name}']:.3f}x; per CPU-second {rates[name]['GB_per_cpu_s']['median']:.2f} vs "
                  f"{cat['GB_per_cpu_s']['median']:.2f} = {cli[f'cpu ratio {name}']:.3f}x", flush=True)
        cli["ratio"] = cli["ratio muser pack --no-zstd"]
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
