"""mlx-lm prompt caches in and out of kvpacks (``muser pack --export/--import mlx-lm``).

mlx-lm's ``save_prompt_cache`` writes one safetensors file: the tensors are each
layer's cache ``state`` flattened as ``"<layer>.<field>"``, and ``__metadata__`` holds
three trees flattened the same way: ``0.<key>`` the user's metadata (``mlx_lm.generate``
reads ``model`` and ``tokenizer_config``), ``1.<layer>`` the cache class names, and
``2.*`` a table naming which tensors are Python scalars (``2.0`` is an empty string;
``2.<j>.0`` a tensor name, ``2.<j>.1`` ``scalar``/``string``/``none``). For the three
classes muser reads (mlx-lm 0.25 - 0.32; ``ChunkedKVCache`` from 0.32's ``llama4``):

* ``KVCache``: ``state = (keys, values, offset)``; keys ``(1, kv_heads, L, head_dim)``,
  the first ``offset <= L`` rows valid (mlx-lm's buffer grows in steps of 256);
* ``RotatingKVCache``: ``state = (keys, values, offset, keep, max_size, _idx)``; a ring
  in physical order whose next write goes to ``_idx`` (wrapped when ``_idx < offset``);
* ``ChunkedKVCache``: ``state = (keys, values, offset, chunk_size, start_position)``; the
  first ``offset - start_position`` rows valid (grown as ``KVCache``'s), positions
  ``[start_position, offset)``: trimmed to ``chunk_size`` rows before each forward.

Class names in the file are data, never code: a closed table maps ``KVCache`` to a full
layer, ``RotatingKVCache`` to a sliding one (``keep == 0``) and ``ChunkedKVCache`` to a
kvpack 1.4 chunked one (Llama 4, its ``chunk_size`` the model's); any other name is refused.
MLA's latent rows (DeepSeek-V3) are mlx-lm's ``KVCache`` of (latent, rope key); state
layers are refused by name.

Boundary. A kvpack carries prompt[:-1] and its consumer runs the last prompt token. An
exported file holds exactly the pack's rows (offset = tokens - 1); the mlx-lm user feeds
the last prompt token first (recorded in the metadata as ``muser_kvpack.next_token_ids``),
and then gets the tokens ``muser decode`` gives. Sliding layers' rings are laid out as
muser's MLX engine lays them out for the pack's chunk size, so the two decodes run the
same arithmetic. An imported file may hold prompt[:-1] or the whole prompt, as
``mlx_lm.cache_prompt`` writes it: then the last row is left out (the consumer computes it).

No MLX import: files are read and written with :mod:`muser_cli.interop.safetensors_io`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Sequence

import numpy as np

from muser_cli.engines.mlx.engine import ring_slot
from muser_cli.errors import DataError, IdentityMismatch, UsageError
from muser_cli.fsio import open_regular
from muser_cli.interop import safetensors_io as st
from muser_cli.kvpack import KVPack, LayerKV, PackHeader, read_pack, token_digest, write_pack
from muser_cli.kvpack.layers import DTYPES, ring_tail
from muser_cli.model.binding import require_identity
from muser_cli.model.info import ModelInfo
from muser_cli.model.resolve import known_model, resolve_model
from muser_cli.model.tokens import encode_prompt
from muser_cli.schedule import build_header, check_chunk, check_prompt

#: the cache classes muser reads and writes: name -> (layer kind, number of state fields)
CLASSES: dict[str, tuple[str, int]] = {"KVCache": ("full", 3), "RotatingKVCache": ("sliding", 6),
                                       "ChunkedKVCache": ("chunked", 5)}
FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
ST_DTYPES = {v: k for k, v in FLOAT_DTYPES.items()}
#: mlx-lm's default prefill step (generate_step, cache_prompt): the schedule recorded for an
#: imported file unless the caller names another.
MLX_LM_PREFILL_STEP = 2048
METADATA_KEY = "muser_kvpack"


@dataclass(frozen=True)
class MlxCacheLayer:
    """One layer of an mlx-lm prompt cache, as stored (physical order)."""

    cls: str
    keys: np.ndarray  # (1, kv_heads, L, head_dim), storage dtype (bfloat16 as uint16 bits)
    values: np.ndarray
    offset: int
    keep: int = 0
    max_size: int | None = None  # RotatingKVCache's ring size; ChunkedKVCache's chunk_size
    idx: int | None = None
    start: int = 0  # ChunkedKVCache's start_position: the position of its first row

    def temporal(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(keys, values, first position): the valid rows oldest first, as mlx-lm's own
        ``_temporal_order`` reads them; ``(kv_heads, held, dim)`` arrays."""
        k, v = self.keys[0], self.values[0]
        if self.cls == "KVCache":
            return k[:, : self.offset], v[:, : self.offset], 0
        if self.cls == "ChunkedKVCache":
            held = self.offset - self.start
            return k[:, :held], v[:, :held], self.start
        size, idx = k.shape[1], int(self.idx or 0)
        if idx == size:
            tk, tv = k, v
        elif idx < self.offset:  # wrapped: slots [idx, size) are older than [0, idx)
            tk, tv = np.concatenate([k[:, idx:], k[:, :idx]], axis=1), np.concatenate([v[:, idx:], v[:, :idx]], axis=1)
        else:
            tk, tv = k[:, :idx], v[:, :idx]
        return tk, tv, self.offset - tk.shape[1]


@dataclass(frozen=True)
class MlxPromptCache:
    layers: list[MlxCacheLayer]
    metadata: dict[str, str]  # the user's metadata (tree 0)
    dtype: str  # storage dtype name of the rows

    @property
    def offset(self) -> int:
        return self.layers[0].offset if self.layers else 0


# --------------------------------------------------------------------------- reading


def parse_prompt_cache(buffer: Any, *, name: str = "input") -> MlxPromptCache:
    """Check and read an mlx-lm prompt cache file held in ``buffer`` (structure only: no
    model yet). Raises :class:`DataError` naming the first problem."""
    f = st.parse(buffer, name=name)
    user: dict[str, str] = {}
    classes: dict[int, str] = {}
    table: dict[int, dict[int, str]] = {}
    empty_marker = None
    for key, value in f.metadata.items():
        tree, _, rest = key.partition(".")
        if tree == "0" and rest:
            user[rest] = value
        elif tree == "1" and rest.isdigit():
            classes[int(rest)] = value
        elif tree == "2" and rest == "0":
            empty_marker = value
        elif tree == "2" and rest.count(".") == 1 and all(p.isdigit() for p in rest.split(".")):
            j, part = (int(p) for p in rest.split("."))
            if part not in (0, 1):
                raise DataError(f"{name}: unexpected metadata key {key!r}")
            table.setdefault(j, {})[part] = value
        else:
            raise DataError(f"{name}: metadata key {key!r} is not part of mlx-lm's prompt-cache layout")
    if not classes:
        raise DataError(f"{name}: no cache classes in the metadata: not an mlx-lm prompt cache")
    if sorted(classes) != list(range(len(classes))):
        raise DataError(f"{name}: cache classes are not numbered 0..{len(classes) - 1}")
    if empty_marker != "":
        raise DataError(f"{name}: the scalar table of an mlx-lm prompt cache starts with an empty entry")
    kinds: dict[str, str] = {}
    for j, entry in sorted(table.items()):
        if set(entry) != {0, 1}:
            raise DataError(f"{name}: scalar table entry {j} is incomplete")
        if entry[0] in kinds:
            raise DataError(f"{name}: tensor {entry[0]!r} appears twice in the scalar table")
        kinds[entry[0]] = entry[1]
    layers: list[MlxCacheLayer] = []
    dtype = None
    for index in range(len(classes)):
        cls = classes[index]
        if cls not in CLASSES:
            raise DataError(f"{name}: layer {index} is an mlx-lm {cls!r}; muser reads only "
                            + ", ".join(CLASSES) + " (no quantized, batched or sink caches)")
        fields = CLASSES[cls][1]
        for field_no in range(fields):
            key = f"{index}.{field_no}"
            if key not in f.tensors:
                raise DataError(f"{name}: layer {index} ({cls}) has no state field {field_no} (tensor {key!r})")
            marked = kinds.get(key)
            if field_no < 2 and marked is not None:
                what = "empty" if marked == "none" else f"a {marked}"
                raise DataError(f"{name}: layer {index} ({cls}) keys/values are {what}, not rows")
            if field_no >= 2 and marked != "scalar":
                raise DataError(f"{name}: layer {index} ({cls}) state field {field_no} must be an integer scalar")
        keys, values = f.tensors[f"{index}.0"], f.tensors[f"{index}.1"]
        for label, t in (("keys", keys), ("values", values)):
            if t.dtype not in FLOAT_DTYPES:
                raise DataError(f"{name}: layer {index} {label} are {t.dtype}; muser reads F32, F16 and BF16")
            if len(t.shape) != 4 or t.shape[0] != 1:
                raise DataError(f"{name}: layer {index} {label} have shape {list(t.shape)}, "
                                "expected [1, kv_heads, rows, head_dim]")
        if keys.dtype != values.dtype or (dtype is not None and FLOAT_DTYPES[keys.dtype] != dtype):
            raise DataError(f"{name}: layer {index} mixes dtypes ({keys.dtype} keys, {values.dtype} values, "
                            f"{dtype} before)")
        dtype = FLOAT_DTYPES[keys.dtype]
        if keys.shape[:3] != values.shape[:3]:
            raise DataError(f"{name}: layer {index} keys {list(keys.shape)} and values {list(values.shape)} disagree")
        scalars = [_scalar(f.tensors[f"{index}.{n}"], name, index, n) for n in range(2, fields)]
        rows = keys.shape[2]
        if cls == "KVCache":
            (offset,) = scalars
            if offset > rows:
                raise DataError(f"{name}: layer {index} (KVCache) offset {offset} is past the {rows} rows it holds")
            layer = MlxCacheLayer(cls, keys.array, values.array, offset)
        elif cls == "ChunkedKVCache":
            offset, chunk_size, start = scalars
            if start > offset or offset - start > rows:
                raise DataError(f"{name}: layer {index} (ChunkedKVCache) holds positions [{start}, {offset}) "
                                f"in {rows} rows")
            layer = MlxCacheLayer(cls, keys.array, values.array, offset, max_size=chunk_size, start=start)
        else:
            offset, keep, max_size, idx = scalars
            if keep:
                raise DataError(f"{name}: layer {index} is a RotatingKVCache keeping {keep} sink rows "
                                "(mlx-lm --max-kv-size), not a sliding window: a kvpack cannot carry it")
            if idx > rows:
                raise DataError(f"{name}: layer {index} (RotatingKVCache) write index {idx} is past its {rows} slots")
            layer = MlxCacheLayer(cls, keys.array, values.array, offset, keep, max_size, idx)
            held = layer.temporal()[0].shape[1]
            if held > offset:
                raise DataError(f"{name}: layer {index} (RotatingKVCache) holds {held} rows but its offset is {offset}")
        layers.append(layer)
    extra = set(f.tensors) - {f"{i}.{n}" for i, layer in enumerate(layers) for n in range(CLASSES[layer.cls][1])}
    if extra:
        raise DataError(f"{name}: tensor {sorted(extra)[0]!r} belongs to no cache layer")
    offsets = {layer.offset for layer in layers}
    if len(offsets) != 1:
        raise DataError(f"{name}: layers disagree on the cached length (offsets {sorted(offsets)})")
    assert dtype is not None
    return MlxPromptCache(layers=layers, metadata=user, dtype=dtype)


def _scalar(t: st.Tensor, name: str, index: int, field_no: int) -> int:
    if t.shape != () or not t.dtype.startswith(("I", "U")):
        raise DataError(f"{name}: layer {index} state field {field_no} is {t.dtype}{list(t.shape)}, not an integer")
    value = int(t.array)
    if value < 0:
        raise DataError(f"{name}: layer {index} state field {field_no} is negative ({value})")
    return value


def _rows_only(specs: Sequence[Any]) -> None:
    """Refuse state layers by name: a pack needs a snapshot per chunk, a finished cache holds one."""
    if any(spec.kind == "state" for spec in specs):
        raise DataError("the mlx-lm prompt-cache import/export carries rows only, not state layers",
                        hint="muser prefill / muser decode --engine mlx move them")


def cache_to_layers(cache: MlxPromptCache, info: ModelInfo, token_ids: Sequence[int], *,
                    name: str = "input") -> tuple[list[LayerKV], bool]:
    """The rows a kvpack of ``token_ids`` carries, taken from ``cache`` after checking its
    layout against the model: layer count and kinds, windows, KV heads, head dims, and the
    cached length (``len(token_ids) - 1``, or ``len(token_ids)``: then the last row is left
    out). Returns (layers, whether a last row was left out). Chunked layers give the current
    chunk's rows (kvpack 1.4), sliding layers their
    last ``window - 1`` rows (no ``ring_extra``: the pack is a v1.1 one, as mlx-lm's file
    does not say which extra rows are real after every schedule)."""
    specs = info.layers
    _rows_only(specs)
    if len(cache.layers) != len(specs):
        raise DataError(f"{name}: {len(cache.layers)} cache layers, model {info.name} has {len(specs)}")
    n, tokens = cache.offset, len(token_ids)
    rows = tokens - 1
    if n not in (rows, tokens):
        raise DataError(f"{name}: the cache holds {n} positions, the prompt is {tokens} tokens",
                        hint=f"the file must hold the prompt ({tokens}) or all but its last token ({rows})")
    out = []
    for index, (spec, layer) in enumerate(zip(specs, cache.layers)):
        kind = CLASSES[layer.cls][0]
        if kind == "full" and spec.kind == "latent":  # mlx-lm's MLA caches the latent and the rope key in a KVCache
            kind = "latent"
        if kind != spec.kind:
            raise DataError(f"{name}: layer {index} is an mlx-lm {layer.cls}, model {info.name} has a {spec.kind} "
                            "attention layer there")
        if kind == "sliding" and layer.max_size != spec.window:
            raise DataError(f"{name}: layer {index} ring holds {layer.max_size} positions, the model's window is "
                            f"{spec.window}")
        if kind == "chunked" and layer.max_size != spec.chunk:
            raise DataError(f"{name}: layer {index} has chunks of {layer.max_size} positions, the model's are "
                            f"{spec.chunk}")
        _, heads, _, kdim = layer.keys.shape
        vdim = layer.values.shape[3]
        if (heads, kdim, vdim) != (spec.kv_heads, spec.head_dim, spec.v_head_dim):
            raise DataError(f"{name}: layer {index} has {heads} KV heads of dims {kdim}/{vdim}, the model "
                            f"{spec.kv_heads} of {spec.head_dim}/{spec.v_head_dim}")
        keys, values, first_held = layer.temporal()
        carried = spec.carried_rows(rows)
        first = rows - carried
        if first < first_held:
            raise DataError(f"{name}: layer {index} holds positions [{first_held}, {n}), a kvpack needs "
                            f"[{first}, {rows})")
        a, b = first - first_held, rows - first_held
        out.append(LayerKV(keys=np.ascontiguousarray(keys[:, a:b]), values=np.ascontiguousarray(values[:, a:b]),
                           first_row=first))
    return out, n == tokens


@dataclass
class ImportResult:
    header: PackHeader
    tokens: int
    cached_positions: int
    dropped_last_row: bool
    bytes_in: int
    bytes_out: int
    seconds: float


def read_prompt_cache_file(path: str) -> tuple[MlxPromptCache, int, Any]:
    """Map ``path`` and parse it; returns (cache, file size, the mapping to close)."""
    import mmap
    import os

    fd = open_regular(path)  # a FIFO or a device is refused before any read (66), never waited on
    try:
        if (size := os.fstat(fd).st_size) == 0:
            raise DataError(f"{path}: empty file, not an mlx-lm prompt cache")
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return parse_prompt_cache(mapping, name=path), size, mapping


def import_mlx_lm(src: str | bytes, out: BinaryIO, *, model: str | None, prompt: str | None = None,
                  token_ids: Sequence[int] | None = None, chat: bool = False, chunk_tokens: int | None = None,
                  codec: str = "zstd+bytegroup", level: int = 1) -> ImportResult:
    """Turn an mlx-lm prompt cache (a path, or the file's bytes) into a kvpack on ``out``,
    bound to ``model`` and the prompt (text, or its ``token_ids``). mlx-lm's file carries
    neither token ids nor a model hash, so both are required."""

    t0 = time.perf_counter()
    if model is None:
        raise UsageError("importing an mlx-lm prompt cache needs the model (-m)",
                         hint="mlx-lm's file carries no model hash")
    if (prompt is None) == (token_ids is None):
        raise UsageError("importing an mlx-lm prompt cache needs the prompt (--prompt FILE)",
                         hint="mlx-lm's file carries no token ids")
    check_chunk(chunk_tokens)
    info = resolve_model(model)
    ids = list(token_ids) if token_ids is not None else encode_prompt(info, prompt or "", chat=chat)
    check_prompt(info, ids)
    mapping = None
    if isinstance(src, (bytes, bytearray, memoryview)):
        cache, size = parse_prompt_cache(src), len(src)
        name = "input"
    else:
        cache, size, mapping = read_prompt_cache_file(src)
        name = src
    try:
        _check_muser_record(cache, info, ids, name)
        layers, dropped = cache_to_layers(cache, info, ids, name=name)
    finally:
        del cache
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:  # a view still alive: the mapping goes with it
                pass
    header = build_header(info, ids, dtype=layers_dtype(layers), chunk_tokens=chunk_tokens or MLX_LM_PREFILL_STEP,
                          engine="mlx-lm", threads=0,
                          extra={"imported": "mlx-lm prompt cache", "mlx_lm_positions": len(ids) - (0 if dropped else 1)})
    require_identity(header, info, prompt_ids=ids)
    writer = write_pack(out, header, layers, codec=codec, level=level)
    return ImportResult(header=writer.header, tokens=len(ids), cached_positions=len(ids) - (0 if dropped else 1),
                        dropped_last_row=dropped, bytes_in=size, bytes_out=writer.bytes_written,
                        seconds=time.perf_counter() - t0)


def _check_muser_record(cache: MlxPromptCache, info: ModelInfo, ids: Sequence[int], name: str) -> None:
    """A file muser exported names its model and prompt (``muser_kvpack``): they must be these."""

    raw = cache.metadata.get(METADATA_KEY)
    if raw is None:
        return  # a file mlx-lm wrote itself: nothing to compare
    try:
        record = json.loads(raw)
    except json.JSONDecodeError:
        raise DataError(f"{name}: its {METADATA_KEY} metadata is not JSON") from None
    if not isinstance(record, dict):
        raise DataError(f"{name}: its {METADATA_KEY} metadata is not a JSON object")
    for key, mine in (("model_fingerprint", info.fingerprint), ("tokenizer_fingerprint", info.tokenizer_fingerprint),
                      ("token_digest", token_digest(list(ids)))):
        theirs = record.get(key)
        if theirs is not None and theirs != mine:
            what = "prompt" if key == "token_digest" else key.split("_")[0]
            raise IdentityMismatch(f"{name}: exported by muser for another {what} ({key} {str(theirs)[:23]}, "
                                   f"here {mine[:23]})")


def layers_dtype(layers: Sequence[LayerKV]) -> str:
    names = {np.dtype(v).str: k for k, (_, v) in DTYPES.items()}
    found = {names.get(np.asarray(kv.keys).dtype.str) for kv in layers}
    if len(found) != 1 or None in found:
        raise DataError(f"rows of mixed or unknown dtypes: {sorted(str(x) for x in found)}")
    return found.pop()  # type: ignore[return-value]


# --------------------------------------------------------------------------- writing


def _ring(keys: np.ndarray, rows: int, window: int, chunk_tokens: int) -> tuple[np.ndarray, int]:
    """A sliding layer's carried rows (``(kv_heads, carried, dim)``, oldest first) as the
    ring mlx-lm's RotatingKVCache holds after a prefill of ``rows`` tokens in chunks of
    ``chunk_tokens``: (ring ``(1, kv_heads, slots, dim)``, next write index)."""

    if rows < window:
        return keys[None], rows
    slot = ring_slot(rows, window, chunk_tokens)
    spare = np.zeros((keys.shape[0], 1, keys.shape[2]), keys.dtype)
    ring = np.concatenate([spare, keys], axis=1)  # temporal ring starting at the spare slot
    if slot:
        ring = np.concatenate([ring[:, window - slot :], ring[:, : window - slot]], axis=1)
    return ring[None], slot or window


def prompt_cache_tensors(header: PackHeader, layers: Sequence[LayerKV], *, model_ref: str,
                         root_digest: bytes | None = None) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str]]:
    """The tensors and metadata of mlx-lm's prompt-cache file for a pack's rows."""
    if header.rows_start or header.base is not None:
        raise DataError(f"a delta pack (rows from position {header.rows_start}) cannot be exported to mlx-lm: "
                        "its cache needs the whole prefix", hint="merge the delta first (muser decode holds the base)")
    if header.dtype not in ST_DTYPES:
        raise DataError(f"rows of dtype {header.dtype} have no mlx-lm equivalent")
    _rows_only(header.layers)
    rows = header.rows_end
    sdt = ST_DTYPES[header.dtype]
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    meta = {"model": model_ref, "tokenizer_config": "{}"}
    classes: list[str] = []
    scalars: list[str] = []

    def scalar(key: str, value: int) -> None:
        tensors[key] = ("I32", np.array(value, dtype="<i4"))
        scalars.append(key)

    for index, (spec, kv) in enumerate(zip(header.layers, layers)):
        # A v1.2 pack's extra ring rows (ring_extra) are dropped: the ring mlx-lm rebuilds holds
        # window - 1 rows and a spare slot, as after its own prefill.
        kv = ring_tail(kv, rows - spec.carried_rows(rows), rows)
        keys, values = np.asarray(kv.keys), np.asarray(kv.values)
        if spec.kind in ("full", "latent"):  # latent (MLA): mlx-lm's KVCache of the latent and the rope key
            classes.append("KVCache")
            tensors[f"{index}.0"] = (sdt, keys[None])
            tensors[f"{index}.1"] = (sdt, values[None])
            scalar(f"{index}.2", rows)
        elif spec.kind == "sliding":
            assert spec.window is not None
            classes.append("RotatingKVCache")
            ring_k, idx = _ring(keys, rows, spec.window, header.chunk_tokens)
            ring_v, _ = _ring(values, rows, spec.window, header.chunk_tokens)
            tensors[f"{index}.0"] = (sdt, ring_k)
            tensors[f"{index}.1"] = (sdt, ring_v)
            scalar(f"{index}.2", rows)
            scalar(f"{index}.3", 0)
            scalar(f"{index}.4", spec.window)
            scalar(f"{index}.5", idx)
        elif spec.kind == "chunked":  # kvpack 1.4 (Llama 4): mlx-lm's ChunkedKVCache, rows [start_position, offset)
            classes.append("ChunkedKVCache")
            tensors[f"{index}.0"] = (sdt, keys[None])
            tensors[f"{index}.1"] = (sdt, values[None])
            scalar(f"{index}.2", rows)
            scalar(f"{index}.3", int(spec.chunk or 0))
            scalar(f"{index}.4", rows - keys.shape[1])
        else:
            raise DataError(f"layer {index}: a {spec.kind} layer has no mlx-lm cache class muser exports")
    meta[METADATA_KEY] = json.dumps({
        "tokens": len(header.token_ids), "rows": rows, "next_token_ids": [header.token_ids[-1]],
        "model_fingerprint": header.model_fingerprint, "tokenizer_fingerprint": header.tokenizer_fingerprint,
        "token_digest": header.token_digest, "chunk_tokens": header.chunk_tokens, "dtype": header.dtype,
        "quant": header.quant_scheme, "root_digest": root_digest.hex() if root_digest else None,
    }, sort_keys=True, separators=(",", ":"))
    flat = {f"0.{k}": v for k, v in meta.items()}
    flat.update({f"1.{i}": c for i, c in enumerate(classes)})
    flat["2.0"] = ""
    for j, key in enumerate(scalars, start=1):
        flat[f"2.{j}.0"] = key
        flat[f"2.{j}.1"] = "scalar"
    return tensors, flat


@dataclass
class ExportResult:
    header: PackHeader
    rows: int
    next_token_ids: list[int]
    model_ref: str
    model_resolved: bool  # model_ref is a folder mlx-lm can load
    bytes_in: int
    bytes_out: int
    seconds: float


def export_mlx_lm(src: BinaryIO | KVPack, out: BinaryIO, *, model: str | None = None) -> ExportResult:
    """Verify a kvpack and write it to ``out`` as an mlx-lm prompt cache. ``model`` (a folder
    or name muser resolves) is checked against the pack and recorded as the file's
    ``model``, which ``mlx_lm.generate --prompt-cache-file`` loads (and compares with its
    ``--model``); without it the pack's model is looked up among the models muser knows."""

    t0 = time.perf_counter()
    pack = src if isinstance(src, KVPack) else read_pack(src)
    header = pack.header
    info: ModelInfo | None
    if model is not None:
        info = resolve_model(model)
        require_identity(header, info)
    else:
        info = known_model(header.model_fingerprint)
    model_ref = str(info.path) if info is not None else (header.model_name or header.model_fingerprint)
    tensors, meta = prompt_cache_tensors(header, pack.layers, model_ref=model_ref, root_digest=pack.root_digest)
    written = st.write(out, tensors, meta)
    return ExportResult(header=header, rows=header.rows_end, next_token_ids=[header.token_ids[-1]],
                        model_ref=model_ref, model_resolved=info is not None, bytes_in=pack.total_bytes,
                        bytes_out=written, seconds=time.perf_counter() - t0)
