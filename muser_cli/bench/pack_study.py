"""The longer kvpack study's extra measures (``benchmarks/bench_kvpack.py``), beside ``bench pack``'s.

* :class:`MemorySink`: a preallocated, touched buffer a pack is written into -- the terms of
  the memcpy yardstick (``io.BytesIO`` also pays for growing and first-touching its pages);
* :func:`hash_bound`: the floor under any verified pack, every row hashed once, no copy;
* :func:`fresh_load`: one load of a file in a new interpreter, imports before the clock;
* :func:`cli_rates`: whole commands (``muser pack --no-zstd`` against ``cat``) on a big and
  a tiny input, process start subtracted, by wall clock and by the child's CPU seconds.

Nothing here prints or exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from muser_cli.bench.common import SOURCE_ROOT, summarize
from muser_cli.errors import MuserError
from muser_cli.kvpack import digest


class MemorySink:
    """A preallocated buffer a pack is written into (``write`` copies the bytes in)."""

    def __init__(self, size: int) -> None:
        import numpy as np

        self.buf = np.ones(size, dtype=np.uint8)  # touched: no first-use page faults in the timing
        self.pos = 0

    def write(self, data) -> int:
        import numpy as np

        m = memoryview(data).cast("B")
        n = len(m)
        if self.pos + n > len(self.buf):
            raise MuserError(f"bench: the memory sink of {len(self.buf)} bytes is too small")
        self.buf[self.pos : self.pos + n] = np.frombuffer(m, dtype=np.uint8)
        self.pos += n
        return n

    def flush(self) -> None:
        return None

    def view(self) -> memoryview:
        """The bytes written, read-only (a reader parses them in place, with no copy)."""
        out = self.buf[: self.pos]
        out.flags.writeable = False
        return memoryview(out)


def hash_bound(layers, header) -> None:
    """Every row hashed once with the pack's digest on the worker pool, in runs of
    ``task_bytes`` a task (as ``write_pack`` and ``read_buffer`` hand them out); no copy."""
    import numpy as np

    hasher, payload_digest, pool, task_bytes = digest.hasher, digest.payload_digest, digest.pool, digest.task_bytes

    h = hasher(header.digest)
    frames = []
    for layer, start, count in header.frame_plan():
        lk = layers[layer]
        a = start - lk.first_row
        heads = [lk.keys[hd, a : a + count] for hd in range(lk.keys.shape[0])]
        heads += [lk.values[hd, a : a + count] for hd in range(lk.values.shape[0])]
        frames.append([memoryview(np.ascontiguousarray(x)).cast("B") for x in heads])
    runs, n, limit = [[]], 0, task_bytes(sum(len(p) for f in frames for p in f))
    for f in frames:
        runs[-1].append(f)
        n += sum(len(p) for p in f)
        if n >= limit:
            runs.append([])
            n = 0
    ex = pool()
    if ex is None:
        [payload_digest(h, f) for f in frames]
    else:
        list(ex.map(lambda run: [payload_digest(h, f) for f in run], [r for r in runs if r]))


# mlx's arrays are materialized as the in-process load does (pack.mlx_arrays): keys and values.
_FRESH_LOAD = """
import sys, time
kind, path = sys.argv[1], sys.argv[2]
if kind == "mlx":
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    def load():
        mx.eval([[c.keys, c.values] for c in load_prompt_cache(path)])
else:
    from muser_cli.kvpack import read_pack

    def load():
        with open(path, "rb") as fh:
            read_pack(fh)
t0 = time.perf_counter()
load()
print(time.perf_counter() - t0)
"""


def fresh_load(kind: str, path: Path, tree: Path | None = None) -> float:
    """Seconds of one load of ``path`` ("kvpack" or "mlx") in a new interpreter, imports done
    before the clock starts, with ``tree``'s muser_cli (default: this one)."""
    env = dict(os.environ, PYTHONPATH=str(tree or SOURCE_ROOT))
    out = subprocess.run([sys.executable, "-c", _FRESH_LOAD, kind, str(path)], env=env, check=True,
                         capture_output=True, text=True, cwd=str(tree or SOURCE_ROOT)).stdout
    return float(out.strip().splitlines()[-1])


def _run_child(cmd: list[str], src_path: Path, out: Path, env: dict | None) -> tuple[float, float]:
    """(wall s, CPU s of the child: user + sys from wait4) of one run of ``cmd < src > out``."""
    with open(src_path, "rb") as src, open(out, "wb") as dst:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=src, stdout=dst, stderr=subprocess.DEVNULL, env=env)
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise MuserError(f"bench: {' '.join(cmd)} exited {code}")
    return wall, ru.ru_utime + ru.ru_stime


def cli_rates(cmds: dict[str, tuple[list[str], dict | None]], big: Path, tiny: Path, out: Path, reps: int) -> dict:
    """Per command: seconds on ``big`` minus seconds on ``tiny`` (process start), as GB per second by
    wall clock and per CPU second of the child; every command in turn in every round
    (A B A B), after one uncounted round."""
    keys = ("big", "tiny", "big_cpu", "tiny_cpu")
    raw: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in cmds}
    for rnd in range(reps + 1):
        for name, (cmd, env) in cmds.items():
            for path, key in ((big, "big"), (tiny, "tiny")):
                wall, cpu = _run_child(cmd, path, out, env)
                if rnd:
                    raw[name][key].append(wall)
                    raw[name][f"{key}_cpu"].append(cpu)
    size = big.stat().st_size

    def rate(bigs, tinys):
        return summarize([size / (b - t) / 1e9 for b, t in zip(bigs, tinys) if b > t] or [float("nan")])

    return {name: {"big_s": summarize(r["big"]), "start_s": summarize(r["tiny"]),
                   "big_cpu_s": summarize(r["big_cpu"]), "start_cpu_s": summarize(r["tiny_cpu"]),
                   "GBps": rate(r["big"], r["tiny"]), "GB_per_cpu_s": rate(r["big_cpu"], r["tiny_cpu"])}
            for name, r in raw.items()}


def pack_vs_cat(big: Path, *, reps: int, baseline: str | None = None) -> dict:
    """``muser pack --no-zstd`` against ``cat`` on ``big`` (the 3 KB golden pack's run
    subtracted as process start), output on tmpfs; ``baseline`` (a folder holding an older
    muser_cli/) is timed in the same rounds."""
    tiny = SOURCE_ROOT / "tests" / "golden" / "v1_1-full-rope-none-blake3.kvpack"
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else big.parent
    out = shm / f"muser-bench-out-{os.getpid()}.kvpack"
    muser = [str(Path(sys.executable).parent / "muser"), "pack", "--no-zstd"]
    cmds: dict[str, tuple[list[str], dict | None]] = {"muser pack --no-zstd": (muser, None), "cat": (["cat"], None)}
    if baseline:
        env = dict(os.environ, PYTHONPATH=str(Path(baseline).resolve()))
        cmds = {"muser pack --no-zstd [baseline]": (muser, env), **cmds}
    before = os.getloadavg()
    try:
        rates = cli_rates(cmds, big, tiny, out, reps)
    finally:
        out.unlink(missing_ok=True)
    res = {"bytes": big.stat().st_size, "baseline": baseline, "out": str(shm), **rates,
           "loadavg_before": before, "loadavg_after": os.getloadavg()}
    cat = rates["cat"]
    for name in cmds:
        if name != "cat":
            res[f"ratio {name}"] = rates[name]["GBps"]["median"] / cat["GBps"]["median"]
            res[f"cpu ratio {name}"] = rates[name]["GB_per_cpu_s"]["median"] / cat["GB_per_cpu_s"]["median"]
    res["ratio"] = res["ratio muser pack --no-zstd"]
    return res
