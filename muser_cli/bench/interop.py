"""kvpack <-> mlx-lm prompt cache: muser's export/import against mlx-lm's own save/load
(``benchmarks/bench_interop.py`` calls :func:`run_interop`; see its docstring).

mlx-lm's side is materialized as ``bench pack``'s is (:func:`muser_cli.bench.pack.mlx_arrays`).
Call ``muser_cli.engines.mlx.blas.ensure_fast_blas()`` before this imports mlx. Nothing
here prints or exits.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from muser_cli.bench.common import Progress, corpus_ids, no_progress, summarize
from muser_cli.bench.pack import mlx_arrays
from muser_cli.engines.registry import get_engine
from muser_cli.interop.mlx_lm import export_mlx_lm, import_mlx_lm
from muser_cli.kvpack import read_pack, write_pack
from muser_cli.produce.pipeline import pack_header


def make_pack(info, n: int, folder: Path, progress: Progress = no_progress) -> Path:
    """A real torch prefill (float32, chunk 512) of exactly ``n`` tokens of the docs, uncompressed."""

    path = folder / f"real-{n}.kvpack"
    ids = corpus_ids(info, n)
    eng = get_engine("torch", info, dtype="float32", threads=0)
    t0 = time.perf_counter()
    layers = eng.prefill(ids[:-1], chunk_tokens=512)
    progress(f"prefill {n} tokens: {time.perf_counter() - t0:.1f}s")
    header = pack_header(info, ids, dtype="float32", chunk_tokens=512, engine="torch", threads=0)
    with open(path, "wb") as out:
        write_pack(out, header, layers, codec="none")
    return path


def _cases(info, pack: Path, folder: Path) -> dict[str, Callable[[], Any]]:
    """export, mlx-lm save, import (both codecs), mlx-lm load, each ready to time."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache


    with open(pack, "rb") as fh:
        ids = list(read_pack(fh).header.token_ids)
    ours, theirs = folder / "ours.safetensors", folder / "theirs.safetensors"

    def export() -> None:
        with open(pack, "rb") as src, open(ours, "wb") as out:
            export_mlx_lm(src, out, model=str(info.path))

    export()
    cache = load_prompt_cache(str(ours))
    mx.eval(mlx_arrays(cache))

    def save() -> None:
        save_prompt_cache(str(theirs), cache, {"model": str(info.path), "tokenizer_config": "{}"})

    def importer(codec: str):
        def run() -> None:
            with open(folder / "imported.kvpack", "wb") as out:
                import_mlx_lm(str(theirs), out, model=str(info.path), token_ids=ids, codec=codec)
        return run

    save()
    return {"muser_export": export, "mlx_lm_save": save, "muser_import_none": importer("none"),
            "muser_import_zstd": importer("zstd+bytegroup"),
            "mlx_lm_load": lambda: mx.eval(mlx_arrays(load_prompt_cache(str(theirs))))}


def run_interop(info, tokens: Sequence[int], *, reps: int = 5, progress: Progress = no_progress) -> dict[str, Any]:
    """Per prompt length: every case once per round (A B A B) after one warm-up; sizes."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for n in tokens:
            pack = make_pack(info, n, folder, progress)
            cases = _cases(info, pack, folder)
            for fn in cases.values():  # warm-up
                fn()
            times: dict[str, list[float]] = {k: [] for k in cases}
            for _ in range(reps):
                for name, fn in cases.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            sizes = {"kvpack_bytes": pack.stat().st_size, "ours_bytes": (folder / "ours.safetensors").stat().st_size,
                     "theirs_bytes": (folder / "theirs.safetensors").stat().st_size,
                     "imported_zstd_bytes": (folder / "imported.kvpack").stat().st_size}
            results[str(n)] = {"sizes": sizes, **{k: summarize(v) for k, v in times.items()}}
    return results
