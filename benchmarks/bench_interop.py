"""kvpack <-> mlx-lm prompt cache: muser's export/import vs mlx-lm's own save/load.

    python benchmarks/bench_interop.py --tokens 2048 [--tokens 8064] [--reps 5]

Rows: a real torch prefill of the embedded model (float32, chunk 512) over a prompt of
exactly N tokens taken from the project's docs. Each rep runs, alternated A B A B:

* muser export: verify + read an uncompressed kvpack, write the mlx-lm file;
* mlx-lm save: ``save_prompt_cache`` of the same cache (loaded from that file, evaluated);
* muser import: parse + check an mlx-lm file written by ``save_prompt_cache``, write a kvpack
  (uncompressed, and zstd+bytegroup level 1);
* mlx-lm load: ``load_prompt_cache`` of that file, every array evaluated.

Files go to a temporary folder (no fsync on either side). One warm-up, median and CV,
JSON receipt in benchmarks/results/interop-*.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import corpus_ids, summarize, write_receipt  # noqa: E402

from muser_cli.engines.mlx import blas as mlx_blas  # noqa: E402

mlx_blas.ensure_fast_blas()


def make_pack(info, n: int, folder: Path) -> Path:
    from muser_cli.engines.registry import get_engine
    from muser_cli.kvpack import write_pack
    from muser_cli.schedule import build_header

    path = folder / f"real-{n}.kvpack"
    ids = corpus_ids(info, n)
    eng = get_engine("torch", info, dtype="float32", threads=0)
    t0 = time.perf_counter()
    layers = eng.prefill(ids[:-1], chunk_tokens=512)
    print(f"prefill {n} tokens: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    header = build_header(info, ids, dtype="float32", chunk_tokens=512, engine="torch", threads=0)
    with open(path, "wb") as out:
        write_pack(out, header, layers, codec="none")
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, action="append")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from muser_cli.interop.mlx_lm import export_mlx_lm, import_mlx_lm
    from muser_cli.kvpack import read_pack
    from muser_cli.models import resolve_model

    info = resolve_model("default")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for n in args.tokens or [2048]:
            pack = make_pack(info, n, folder)
            ids = list(read_pack(open(pack, "rb")).header.token_ids)
            ours_file, theirs_file = folder / "ours.safetensors", folder / "theirs.safetensors"

            def export() -> None:
                with open(pack, "rb") as src, open(ours_file, "wb") as out:
                    export_mlx_lm(src, out, model=str(info.path))

            export()
            cache = load_prompt_cache(str(ours_file))
            mx.eval([c.state[:2] for c in cache])

            def save() -> None:
                save_prompt_cache(str(theirs_file), cache, {"model": str(info.path), "tokenizer_config": "{}"})

            save()

            def load() -> None:
                c = load_prompt_cache(str(theirs_file))
                mx.eval([x.state[:2] for x in c])

            def importer(codec: str):
                def run() -> None:
                    with open(folder / "imported.kvpack", "wb") as out:
                        import_mlx_lm(str(theirs_file), out, model=str(info.path), token_ids=ids, codec=codec)
                return run

            cases = {"muser_export": export, "mlx_lm_save": save, "muser_import_none": importer("none"),
                     "muser_import_zstd": importer("zstd+bytegroup"), "mlx_lm_load": load}
            for fn in cases.values():  # warm-up
                fn()
            times: dict[str, list[float]] = {k: [] for k in cases}
            for _ in range(args.reps):  # A B A B: every case once per round
                for name, fn in cases.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            sizes = {"kvpack_bytes": pack.stat().st_size, "ours_bytes": ours_file.stat().st_size,
                     "theirs_bytes": theirs_file.stat().st_size,
                     "imported_zstd_bytes": (folder / "imported.kvpack").stat().st_size}
            results[str(n)] = {"sizes": sizes, **{k: summarize(v) for k, v in times.items()}}
            for k, v in times.items():
                s = summarize(v)
                print(f"{n:>6} {k:<20} median {s['median'] * 1000:8.1f} ms  CV {s['cv'] * 100:5.1f} %")
            print(f"{n:>6} sizes {sizes}")
    path = write_receipt("interop", {"model": info.name, "dtype": "float32", "reps": args.reps, "results": results,
                                     "note": "2 shared cores, other agents running"})
    print(path)


if __name__ == "__main__":
    main()
