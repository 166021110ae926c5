"""``muser bench pack``: kvpack pack/unpack/save/load against mlx-lm's prompt cache and memcpy.

The one method for every kvpack speed figure (``muser bench pack`` and
``benchmarks/bench_kvpack.py``, which adds a :class:`Study`'s cases to the same rounds).
The KV is real unless ``synthetic``: the model prefilled once by the torch engine in
float32 at the deepest depth and carried as bfloat16 (the dtype mlx-lm stores); each
shallower depth uses that prefill's first rows (causal: the rows of a shorter prompt).
Per depth, after one uncounted warm-up round, every counted round runs each case once,
in the same order (A B C ... A B C ...), timing wall clock and the process's CPU seconds:

* memcpy of the same bytes (``np.copyto``) into a buffer already touched: the floor;
* pack / unpack in memory: ``write_pack`` into a preallocated, touched buffer (memcpy's own
  terms) / ``read_pack_bytes`` of those bytes in place, uncompressed and zstd+bytegroup;
* save + load of a file: kvpack write + fsync + rename + folder fsync / ``read_pack``
  (memory-mapped, every frame verified) against mlx-lm's ``save_prompt_cache`` + the same
  fsyncs / ``load_prompt_cache`` with every key and value array evaluated (``mx.eval``), so
  both loads are materialized. mlx's buffer cache is cleared before every load (either
  side's), as a reader in a new process has none; the file is in the page cache for both.

Every figure is the median of the counted rounds, with its CV, min, max and raw values.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from muser_cli.bench.common import BenchResult, Progress, corpus_ids, no_progress, summarize
from muser_cli.bench.pack_study import MemorySink, fresh_load, hash_bound
from muser_cli.engines.registry import get_engine
from muser_cli.errors import UsageError
from muser_cli.fsio import atomic_writer
from muser_cli.kvpack import DEFAULT_DIGEST, LayerKV, read_pack, read_pack_bytes, write_pack
from muser_cli.kvpack.quant import from_float32
from muser_cli.produce.pipeline import pack_header
from muser_cli.units import rate_text, size_text

CODECS = ("none", "zstd+bytegroup")
DIGESTS = {"v1.1 blake3": (1, "blake3"), "v1.1 sha256": (1, "sha256"), "v1.0 sha256": (0, "sha256")}
DEFAULT_DIGEST_NAME = "v1.1 blake3"


@dataclass(frozen=True)
class Study:
    """The longer study's cases, added to the same rounds (``benchmarks/bench_kvpack.py``).

    ``digests``: more digests than the default (names of :data:`DIGESTS`): pack/unpack both
    codecs, save/load uncompressed; ``floor``: every row hashed once, no copy; ``tmpfs``:
    pack to and unpack from a file on tmpfs (no fsync); ``fresh_reps``: loads of each saved
    file in a new interpreter (what ``muser decode --pack FILE`` pays), in turn."""

    digests: tuple[str, ...] = ()
    floor: bool = False
    tmpfs: bool = False
    fresh_reps: int = 0


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process, every thread) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def fsync_write(path: Path, writer) -> None:
    """Save as muser saves a pack (``prefill -o``, ``pack -o``): a part file written with
    early writeback, fsynced, renamed onto ``path``, the folder fsynced."""

    with atomic_writer(path) as fh:
        writer(fh)


def real_kv(info, depth: int, *, threads: int, progress: Progress):
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


    rng = np.random.default_rng(0)
    layers = []
    for spec in info.layers:
        k = rng.standard_normal((spec.kv_heads, depth - 1, spec.head_dim), dtype=np.float32)
        v = rng.standard_normal((spec.kv_heads, depth - 1, spec.v_head_dim), dtype=np.float32)
        layers.append(LayerKV(from_float32(k, "bfloat16"), from_float32(v, "bfloat16"), 0))
    return corpus_ids(info, depth), layers


def prefix(layers, rows: int):
    import numpy as np


    return [LayerKV(np.ascontiguousarray(l.keys[:, :rows]), np.ascontiguousarray(l.values[:, :rows]), 0)
            for l in layers]


def _mlx():
    try:
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache
    except ImportError:
        return None
    return mx, KVCache, load_prompt_cache, save_prompt_cache


def mlx_arrays(caches) -> list:
    """What a load must evaluate to be materialized: every cache's key and value arrays
    (``KVCache.state`` also holds the offset, an int, in newer mlx-lm)."""
    return [[c.keys, c.values] for c in caches]


def _fsync(path: Path) -> None:
    for target, flags in ((path, os.O_RDONLY), (path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))):
        fd = os.open(target, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _suffix(digest_name: str) -> str:
    return "" if digest_name == DEFAULT_DIGEST_NAME else f" [{digest_name}]"


def _memory_cases(headers: dict, layers, study: Study, tmp: Path, sizes: dict) -> dict[str, Callable[[], Any]]:
    """memcpy, then pack and unpack in memory for each codec and digest, then the study's."""
    import numpy as np


    flat = np.concatenate([np.concatenate([l.keys.ravel(), l.values.ravel()]) for l in layers])
    dst = np.ones_like(flat)
    sink = MemorySink(flat.nbytes + flat.nbytes // 8 + (1 << 20))
    cases: dict[str, Callable[[], Any]] = {"memcpy": lambda: np.copyto(dst, flat)}
    if study.floor:
        cases["hash only, no copy (the floor)"] = lambda: hash_bound(layers, headers[DEFAULT_DIGEST_NAME])
    for codec in CODECS:
        for dname, header in headers.items():
            def pack(codec=codec, header=header, key=f"pack {codec}{_suffix(dname)}"):
                sink.pos = 0
                write_pack(sink, header, layers, codec=codec)
                sizes[key] = sink.pos

            cases[f"pack {codec}{_suffix(dname)}"] = pack
            cases[f"unpack {codec}{_suffix(dname)}"] = lambda: read_pack_bytes(sink.view())
    if study.tmpfs:
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
        out = shm / f"muser-bench-{os.getpid()}.kvpack"

        def to_file():
            with open(out, "wb") as fh:
                write_pack(fh, headers[DEFAULT_DIGEST_NAME], layers, codec="none")

        def from_file():
            with open(out, "rb") as fh:
                read_pack(fh)
            out.unlink()

        cases["pack none -> tmpfs file"] = to_file
        cases["unpack none <- tmpfs file, mmap"] = from_file
    return cases


def _savers(headers: dict, layers, mlx) -> dict[str, tuple[Any, Any, str]]:
    """name -> (save(path), load(path), file suffix): kvpack both codecs (and the study's
    other digests, uncompressed), then mlx-lm's prompt cache when installed."""

    def kv_save(header, codec):
        return lambda path: fsync_write(path, lambda fh: write_pack(fh, header, layers, codec=codec))

    def kv_load(path):
        with open(path, "rb") as fh:
            read_pack(fh)

    savers = {f"kvpack {c}": (kv_save(headers[DEFAULT_DIGEST_NAME], c), kv_load, ".kvpack") for c in CODECS}
    for dname in (d for d in headers if d != DEFAULT_DIGEST_NAME):
        savers[f"kvpack none [{dname}]"] = (kv_save(headers[dname], "none"), kv_load, ".kvpack")
    if mlx is not None:
        savers["mlx-lm prompt cache"] = _mlx_saver(layers, mlx)
    return savers


def _mlx_saver(layers, mlx):
    import numpy as np

    mx, KVCache, load_prompt_cache, save_prompt_cache = mlx
    caches = []
    for l in layers:
        c = KVCache()
        c.update_and_fetch(mx.array(l.keys.view(np.uint16)).view(mx.bfloat16)[None],
                           mx.array(l.values.view(np.uint16)).view(mx.bfloat16)[None])
        caches.append(c)
    mx.eval(mlx_arrays(caches))

    def save(path):
        save_prompt_cache(str(path), caches)
        _fsync(path)

    def load(path):
        mx.eval(mlx_arrays(load_prompt_cache(str(path))))

    return save, load, ".safetensors"


def _rounds(depth: int, cases: dict, savers: dict, reps: int, tmp: Path, mlx, sizes: dict, progress: Progress):
    """Every case once per round, then every save with its load; round 0 is not counted.
    Returns ({name: [wall s]}, {name: [CPU s]})."""
    wall: dict[str, list[float]] = {k: [] for k in cases}
    wall.update({f"save {name}": [] for name in savers})  # saves side by side, then loads
    wall.update({f"load {name}": [] for name in savers})
    cpu: dict[str, list[float]] = {k: [] for k in wall}
    for rnd in range(reps + 1):
        progress(f"pack {depth} tok: " + ("warm-up" if rnd == 0 else f"rep {rnd}/{reps}"))
        timed = [(name, _timed(fn)) for name, fn in cases.items()]
        for i, (name, (save, load, ext)) in enumerate(savers.items()):
            path = tmp / f"case{i}{ext}"
            timed.append((f"save {name}", _timed(lambda: save(path))))
            if mlx is not None:  # the same cache state for every load: mlx's freed buffers dropped
                mlx[0].clear_cache()
            timed.append((f"load {name}", _timed(lambda: load(path))))
            sizes[f"file {name}"] = path.stat().st_size
            path.unlink()
        if rnd:
            for name, (w, c) in timed:
                wall[name].append(w)
                cpu[name].append(c)
    return wall, cpu


def _fresh_loads(savers: dict, reps: int, tmp: Path, progress: Progress) -> dict[str, dict]:
    """Each saved file loaded once per round in a new interpreter, files in turn."""

    kept = {}
    for i, (name, (save, _load, ext)) in enumerate(savers.items()):
        kept[name] = tmp / f"fresh{i}{ext}"
        save(kept[name])
    times: dict[str, list[float]] = {name: [] for name in savers}
    for rnd in range(reps):
        progress(f"pack: fresh-process loads, rep {rnd + 1}/{reps}")
        for name, path in kept.items():
            times[name].append(fresh_load("mlx" if name.startswith("mlx") else "kvpack", path))
    for path in kept.values():
        path.unlink()
    return {name: summarize(v) for name, v in times.items()}


def _row(depth: int, header, raw: int, wall: dict, cpu: dict, sizes: dict, fresh: dict | None) -> dict[str, Any]:
    stats = {k: summarize(v) for k, v in wall.items()}
    gbps = {k: summarize([raw / t / 1e9 for t in v if t > 0]) for k, v in wall.items()}
    per_cpu = {k: summarize([raw / max(t, 1e-9) / 1e9 for t in v]) for k, v in cpu.items()}
    mc, mcc = gbps["memcpy"]["median"], per_cpu["memcpy"]["median"]
    row: dict[str, Any] = {
        "depth": depth, "cases": list(wall), "prompt_digest": header.token_digest, "raw_kv_bytes": raw,
        "seconds": stats, "GBps": gbps, "vs_memcpy": {k: v["median"] / mc for k, v in gbps.items()},
        "GB_per_cpu_s": per_cpu, "cpu_vs_memcpy": {k: v["median"] / mcc for k, v in per_cpu.items()},
        "bytes": {"raw KV": raw, **sizes},
    }
    savers = [k[5:] for k in wall if k.startswith("save ")]
    if "mlx-lm prompt cache" in savers:
        def vs_mlx(load: Callable[[str], float]) -> dict[str, float]:
            m = stats["save mlx-lm prompt cache"]["median"] + load("mlx-lm prompt cache")
            return {n: (stats[f"save {n}"]["median"] + load(n)) / m for n in savers}

        row["save_load_vs_mlx_lm"] = vs_mlx(lambda n: stats[f"load {n}"]["median"])
        row["bytes_vs_mlx_lm"] = {n: sizes[f"file {n}"] / sizes["file mlx-lm prompt cache"] for n in savers}
        if fresh:
            row["save_load_fresh_vs_mlx_lm"] = vs_mlx(lambda n: fresh[n]["median"])
    if fresh:
        row["load_fresh_process"] = fresh
    return row


def _kv(info, deepest: int, synthetic: bool, threads: int, progress: Progress):
    """(ids, layers, threads, prefill seconds or None) of the deepest depth."""
    if synthetic:
        ids, layers = synthetic_kv(info, deepest)
        return ids, layers, threads, None
    return real_kv(info, deepest, threads=threads, progress=progress)


def run_pack(info, depths: Sequence[int], *, reps: int = 5, synthetic: bool = False, threads: int = 1,
             peers: bool = True, study: Study = Study(), progress: Progress = no_progress) -> BenchResult:

    deepest = max(depths)
    ids_all, kv_all, threads, prefill_s = _kv(info, deepest, synthetic, threads, progress)
    if any(l.first_row for l in kv_all):
        raise UsageError("bench pack takes a model whose layers all keep every row (full attention)",
                         hint="-m tiny or -m default")
    mlx = _mlx() if peers else None
    tmp = Path(tempfile.mkdtemp(prefix="muser-bench-pack-"))
    rows: list[dict[str, Any]] = []
    try:
        for depth in depths:
            layers = prefix(kv_all, depth - 1)
            base = pack_header(info, ids_all[:depth], dtype="bfloat16", chunk_tokens=512, engine="torch",
                                threads=threads)
            headers = {DEFAULT_DIGEST_NAME: base}
            headers.update({d: replace(base, minor=DIGESTS[d][0], digest=DIGESTS[d][1]) for d in study.digests
                            if d != DEFAULT_DIGEST_NAME})
            sizes: dict[str, int] = {}
            cases = _memory_cases(headers, layers, study, tmp, sizes)
            savers = _savers(headers, layers, mlx)
            wall, cpu = _rounds(depth, cases, savers, reps, tmp, mlx, sizes, progress)
            fresh = _fresh_loads(savers, study.fresh_reps, tmp, progress) if study.fresh_reps else None
            raw = sum(l.keys.nbytes + l.values.nbytes for l in layers)
            rows.append(_row(depth, base, raw, wall, cpu, sizes, fresh))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    payload = {
        "model": info.name, "fingerprint": info.fingerprint, "digest": DEFAULT_DIGEST,
        "kv": ("synthetic bf16 (random rows of the model's shape: zstd ratios are not real)" if synthetic else
               f"real: torch float32 prefill of {deepest} tokens as bf16; shallower depths are its prefixes"),
        "prefill_s": prefill_s, "threads": threads, "reps": reps, "warmup": 1, "mlx_lm": mlx is not None,
        "order": "every case once per round, same order, A B C A B C", "method": "muser_cli/bench/pack.py",
        "study": {"digests": list(study.digests), "floor": study.floor, "tmpfs": study.tmpfs,
                  "fresh_reps": study.fresh_reps},
        "rows": rows,
    }
    return BenchResult("pack", payload, pack_table(rows))


def pack_table(rows: list[dict]) -> list[str]:
    """The human table: times, throughput of the raw KV's bytes (MB/s), speed against memcpy, sizes."""

    out = []
    for r in rows:
        out.append(f"{r['depth']} tokens, raw bf16 KV {size_text(r['raw_kv_bytes'])}; "
                   "throughput = raw KV bytes / time; speed as a fraction of memcpy's")
        for name, s in r["seconds"].items():
            rate = rate_text(r["GBps"][name]["median"] * 1e9)
            out.append(f"  {name:<36} {s['median'] * 1e3:9.2f} ms (cv {s['cv']:5.1%})  {rate:>12}  "
                       f"{r['vs_memcpy'][name]:6.3f}x memcpy")
        for name, s in r.get("load_fresh_process", {}).items():
            rel = ""
            if "save_load_fresh_vs_mlx_lm" in r:
                rel = f"  save+load {r['save_load_fresh_vs_mlx_lm'][name]:.2f}x mlx-lm's time"
            out.append(f"  {'load ' + name + ', new process':<36} {s['median'] * 1e3:9.2f} ms (cv {s['cv']:5.1%}){rel}")
        for name, b in r["bytes"].items():
            rel = ""
            if name.startswith("file ") and "bytes_vs_mlx_lm" in r:
                rel = f"  {r['bytes_vs_mlx_lm'][name[5:]]:.3f}x mlx-lm's bytes"
                rel += f", save+load {r['save_load_vs_mlx_lm'][name[5:]]:.2f}x mlx-lm's time"
            out.append(f"  bytes {name:<30} {size_text(b):>10}{rel}")
    return out
