"""Where finished rows go: a spool directory (``--engine vllm``) or a kvpack file.

``"spool"``: ``<output_dir>/<name>.spool/`` (a JSON manifest and ``.npy`` arrays, read
back with ``allow_pickle=False`` by :func:`read_spool`). ``"kvpack"``:
``<output_dir>/<name>.kvpack`` through :func:`write_kvpack`, the only function here that
knows the kvpack writer. A request that fails leaves ``<name>.error.json`` instead,
never a partial pack. Both are written to a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from muser_cli.engines.vllm.blocks import carried_range
from muser_cli.engines.vllm.config import ConnectorSettings
from muser_cli.errors import ConfigError, DataError
from muser_cli.kvpack import PackHeader, write_pack
from muser_cli.kvpack.layers import DTYPES, LayerKV, LayerSpec, StateKV, ring_extra_held

SPOOL_FORMAT = "muser-vllm-spool"
SPOOL_VERSION = 1

def _atomic_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))


def write_error(out_dir: Path, name: str, exc: BaseException) -> Path:
    path = Path(out_dir) / f"{name}.error.json"
    msg = str(exc).replace("\n", " ")[:2000] or type(exc).__name__
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        hint = getattr(exc, "hint", None)
        tmp.write_text(json.dumps({"error": msg, "type": type(exc).__name__,
                                   "hint": hint if isinstance(hint, str) else None}))
        os.replace(tmp, path)
    except OSError:
        pass
    return path


def write_spool(
    out_dir: Path, name: str, layers: Sequence[LayerKV], *, dtype: str, rows: int, tokens: int,
    source: dict[str, Any] | None = None, producer: dict[str, Any] | None = None,
) -> Path:
    """``<out_dir>/<name>.spool/``: manifest.json + one .npy per array, renamed into place."""
    final = Path(out_dir) / f"{name}.spool"
    tmp = _atomic_dir(final)
    try:
        entries = []
        for i, lk in enumerate(layers):
            if isinstance(lk, StateKV):  # a state layer: its snapshots, one per chunk end, files s{i}_{pos}_{name}
                snaps = []
                for pos, tensors in sorted({**lk.earlier, lk.position: lk.tensors}.items()):
                    files = {}
                    for tname, arr in tensors.items():
                        files[tname] = f"s{i}_{int(pos)}_{tname}.npy"
                        np.save(tmp / files[tname], np.ascontiguousarray(arr), allow_pickle=False)
                    snaps.append([int(pos), files])
                entries.append({"index": i, "first_row": 0, "rows": int(lk.position), "state": snaps})
                continue
            np.save(tmp / f"k{i}.npy", np.ascontiguousarray(lk.keys), allow_pickle=False)
            np.save(tmp / f"v{i}.npy", np.ascontiguousarray(lk.values), allow_pickle=False)
            entries.append({"index": i, "first_row": int(lk.first_row), "rows": int(lk.keys.shape[1]),
                            "keys": f"k{i}.npy", "values": f"v{i}.npy"})
        manifest = {"format": SPOOL_FORMAT, "version": SPOOL_VERSION, "name": name, "dtype": dtype,
                    "rows": int(rows), "tokens": int(tokens), "layers": entries, "source": source or {},
                    "producer": producer or {}}
        (tmp / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_spool(out_dir: Path, name: str, specs: Sequence[LayerSpec], *, remove: bool = True,
               history: bool = False) -> tuple[list[Any], dict[str, Any]]:
    """Load what the worker spooled for ``name`` (strictly checked), then remove it.
    ``history``: sliding layers hold every row (the connector's ``history`` setting).

    Raises DataError with the worker's own message when it left an error file.
    """
    out_dir = Path(out_dir)
    err = out_dir / f"{name}.error.json"
    if err.exists():
        try:
            obj = json.loads(err.read_text())
            msg, kind, hint = str(obj.get("error", "unknown error")), obj.get("type"), obj.get("hint")
        except (OSError, ValueError, AttributeError):
            msg, kind, hint = "unreadable error file", None, None
        if remove:
            err.unlink(missing_ok=True)
        hint = hint if isinstance(hint, str) else None
        if kind in ("ConfigError", "UsageError"):  # a refusal: the setup, not the data, is wrong
            raise ConfigError(f"the vLLM connector refused: {msg}", hint=hint)
        raise DataError(f"the vLLM connector failed: {msg}", hint=hint)
    root = out_dir / f"{name}.spool"
    if not (root / "manifest.json").is_file():
        raise DataError(
            "vLLM finished the request but the muser connector spooled no KV",
            hint="check vLLM's log for the connector (is kv_transfer_config set?)",
        )
    try:
        man = json.loads((root / "manifest.json").read_text())
        if man.get("format") != SPOOL_FORMAT or man.get("version") != SPOOL_VERSION:
            raise DataError("spool manifest has an unknown format or version")
        dtype = man["dtype"]
        if dtype not in DTYPES:
            raise DataError(f"spool dtype {dtype!r} is unknown")
        np_dtype = np.dtype(DTYPES[dtype][1])
        entries = man["layers"]
        if len(entries) != len(specs):
            raise DataError(f"spool holds {len(entries)} layers, the model has {len(specs)}")
        rows = int(man["rows"])
        layers: list[Any] = []
        for i, (entry, spec) in enumerate(zip(entries, specs)):
            if spec.kind == "state":
                layers.append(_read_state(root, i, entry, spec, rows))
                continue
            first, end = carried_range(spec, rows, history)
            if entry["index"] != i or entry["first_row"] != first or entry["rows"] != end - first:
                raise DataError(f"spool layer {i} does not carry rows [{first}, {end})")
            arrays = []
            for key, dim in (("keys", spec.head_dim), ("values", spec.v_head_dim)):
                fname = entry[key]
                if not isinstance(fname, str) or "/" in fname or fname.startswith("."):
                    raise DataError(f"spool layer {i} names a bad file")
                arr = np.load(root / fname, allow_pickle=False)
                if arr.dtype != np_dtype or arr.shape != (spec.kv_heads, end - first, dim):
                    raise DataError(f"spool layer {i} {key}: {arr.dtype} {arr.shape}, expected {np_dtype} "
                                    f"{(spec.kv_heads, end - first, dim)}")
                arrays.append(arr)
            layers.append(LayerKV(keys=arrays[0], values=arrays[1], first_row=first))
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise DataError(f"spool for {name!r} is malformed ({type(exc).__name__})") from None
    if remove:
        shutil.rmtree(root, ignore_errors=True)
    return layers, man


def _read_state(root: Path, i: int, entry: dict[str, Any], spec: LayerSpec, rows: int) -> StateKV:
    """A state layer's snapshots from the spool: positions ascending, the last at ``rows``, each
    the spec's tensors in their declared shape and dtype."""
    snaps = entry["state"]
    if entry["index"] != i or not isinstance(snaps, list) or not snaps:
        raise DataError(f"spool layer {i} holds no state snapshots")
    held: dict[int, dict[str, Any]] = {}
    for pos, files in snaps:
        if not isinstance(pos, int) or not 0 < pos <= rows or pos in held or not isinstance(files, dict) \
                or set(files) != {t.name for t in spec.tensors}:
            raise DataError(f"spool layer {i} holds a malformed state snapshot")
        tensors = {}
        for t in spec.tensors:
            fname = files[t.name]
            if not isinstance(fname, str) or "/" in fname or fname.startswith("."):
                raise DataError(f"spool layer {i} names a bad file")
            arr = np.load(root / fname, allow_pickle=False)
            if arr.dtype != np.dtype(DTYPES[t.dtype][1]) or tuple(arr.shape) != tuple(t.shape):
                raise DataError(f"spool layer {i} {t.name} state: {arr.dtype} {arr.shape}, expected {t.dtype} "
                                f"{tuple(t.shape)}")
            tensors[t.name] = arr
        held[pos] = tensors
    if rows not in held:
        raise DataError(f"spool layer {i} holds no state snapshot after {rows} positions")
    return StateKV(tensors=held.pop(rows), position=rows, earlier=held)


def write_kvpack(
    path: Path, settings: ConnectorSettings, tokens: Sequence[int], dtype: str, layers: Sequence[LayerKV],
    producer: dict[str, Any],
) -> Path:
    """Hand rows to the kvpack writer: the one place this module depends on its API."""

    h = settings.header
    header = PackHeader(
        model_fingerprint=h["model_fingerprint"],
        tokenizer_fingerprint=h["tokenizer_fingerprint"],
        token_ids=tuple(int(t) for t in tokens),
        layers=tuple(settings.layers),
        dtype=dtype,
        chunk_tokens=int(h.get("chunk_tokens", 512)),
        model_name=str(h.get("model_name", "")),
        architecture=str(h.get("architecture", "")),
        producer=producer,
        ring_extra=ring_extra_held(settings.layers, list(layers), len(tokens) - 1),  # > 0: the sliding history
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write_pack(f, header, list(layers), codec=h.get("codec"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
