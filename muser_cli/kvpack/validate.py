"""Parsing and validating a kvpack header (docs/kvpack.md 1.2-1.4, 4): strict canonical
JSON, every field typed and bounded, sizes checked before anything is allocated. The
header model and the frame plan are :mod:`muser_cli.kvpack.format`."""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from muser_cli.errors import KVPackError, MuserError
from muser_cli.kvpack.digest import DIGESTS
from muser_cli.kvpack.format import (
    CODEC_NAMES, HEADER_KEYS, MAJOR, MAX_FRAME_BYTES, MAX_FRAME_ROWS, MAX_HEAD_DIM, MAX_HEADS, MAX_JSON_DEPTH,
    MAX_LAYERS, MAX_RING_EXTRA, MAX_STATE_DIMS, MAX_STATE_EVERY, MAX_TOKEN_ID, MAX_TOKENS, MAX_TOTAL_BYTES, MINOR,
    MINORS, PackHeader, canonical_json, token_digest,
)
from muser_cli.kvpack.layers import (
    DTYPES, LAYER_KINDS, LOCAL_KINDS, MAX_STATE_TENSORS, NEW_KINDS_MINOR, ROPE_STYLES, STATE_NAME_CHARS, LayerSpec,
    RopeSpec, StateTensor,
)


def _fail(msg: str) -> KVPackError:
    return KVPackError(f"bad kvpack header: {msg}")


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str, fail: Callable[[str], MuserError] = _fail) -> Any:
    if not isinstance(obj, dict):
        raise fail(f"{where} is not an object")
    if key not in obj:
        raise fail(f"missing {where}.{key}")
    value = obj[key]
    if kind is int and isinstance(value, bool):
        raise fail(f"{where}.{key} must be an integer")
    if not isinstance(value, kind):
        raise fail(f"{where}.{key} has the wrong type")
    return value


def _int(obj: Any, key: str, where: str, lo: int, hi: int, fail: Callable[[str], MuserError] = _fail) -> int:
    value = _get(obj, key, int, where, fail)
    if not lo <= value <= hi:
        raise fail(f"{where}.{key}={value} outside [{lo}, {hi}]")
    return value


def _fingerprint(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.startswith("sha256:") or len(value) != 71:
        raise _fail(f"{where} is not a sha256 fingerprint")
    try:
        int(value[7:], 16)
    except ValueError:
        raise _fail(f"{where} is not a sha256 fingerprint") from None
    return value


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _json_depth_ok(data: bytes) -> bool:
    """No array/object nesting deeper than MAX_JSON_DEPTH (checked before json.loads).

    Strings are removed first (with their escapes), then only brackets are walked, so a
    header of 100k token ids costs a regex pass, not a Python loop over every byte. An
    unterminated string leaves its quote and brackets in place: rejected either way."""
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    depth = 0
    for b in brackets:
        if b in (0x7B, 0x5B):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        else:
            depth -= 1
    return True


def parse_layer_spec(obj: Any, where: str, fail: Callable[[str], MuserError] = _fail) -> LayerSpec:
    """A :class:`LayerSpec` from its ``to_json()`` form, strictly: the one layer-spec parser
    (a pack header's ``layers[i]``, and the vLLM connector's config). Every refusal is
    ``fail(message)`` naming ``where``; by default a :class:`KVPackError` about the header."""
    kind = _get(obj, "kind", str, where, fail)
    if kind not in LAYER_KINDS:
        raise fail(f"{where}.kind {kind!r} is unknown (known: {', '.join(LAYER_KINDS)})")
    if kind == "latent":
        return _parse_latent(obj, where, fail)
    if kind == "state":
        return _parse_state(obj, where, fail)
    if kind == "chunked":
        return _parse_chunked(obj, where, fail)
    kv_heads = _int(obj, "kv_heads", where, 1, MAX_HEADS, fail)
    head_dim = _int(obj, "head_dim", where, 1, MAX_HEAD_DIM, fail)
    v_head_dim = _int(obj, "v_head_dim", where, 1, MAX_HEAD_DIM, fail)
    window = obj.get("window") if isinstance(obj, dict) else None
    if kind == "sliding":
        window = _int(obj, "window", where, 2, MAX_TOKENS, fail)
    elif window is not None:
        raise fail(f"{where}.window must be null for a full layer")
    rope = _parse_rope(obj.get("rope"), f"{where}.rope", head_dim, fail)
    return LayerSpec(kind=kind, kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, window=window, rope=rope)


def _parse_rope(rope_obj: Any, w: str, max_dims: int, fail: Callable[[str], MuserError]) -> RopeSpec | None:
    if rope_obj is None:
        return None
    theta = _get(rope_obj, "theta", (int, float), w, fail)
    if isinstance(theta, bool) or not (0 < float(theta) < 1e12):
        raise fail(f"{w}.theta out of range")
    dims = _int(rope_obj, "dims", w, 2, max_dims, fail)
    style = _get(rope_obj, "style", str, w, fail)
    if style not in ROPE_STYLES:
        raise fail(f"{w}.style {style!r} is unknown (known: {', '.join(ROPE_STYLES)})")
    scaling = rope_obj.get("scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise fail(f"{w}.scaling must be an object or null")
    return RopeSpec(theta=float(theta), dims=dims, style=style, scaling=scaling)


def _exact_keys(obj: dict, keys: set[str], where: str, fail: Callable[[str], MuserError]) -> None:
    if set(obj) != keys:
        raise fail(f"{where} must have exactly the keys {sorted(keys)} (has {sorted(obj)})")


def _parse_latent(obj: dict, where: str, fail: Callable[[str], MuserError]) -> LayerSpec:
    """v1.3 ``latent``: {kind, kv_lora_rank, rope_dim, rope} (docs/kvpack.md 1.4)."""
    _exact_keys(obj, {"kind", "kv_lora_rank", "rope_dim", "rope"}, where, fail)
    rank = _int(obj, "kv_lora_rank", where, 1, MAX_HEAD_DIM, fail)
    rope_dim = _int(obj, "rope_dim", where, 1, MAX_HEAD_DIM, fail)
    rope = _parse_rope(obj.get("rope"), f"{where}.rope", rope_dim, fail)
    return LayerSpec(kind="latent", kv_heads=1, head_dim=rank, v_head_dim=rope_dim, rope=rope)


def _parse_chunked(obj: dict, where: str, fail: Callable[[str], MuserError]) -> LayerSpec:
    """v1.4 ``chunked``: {kind, kv_heads, head_dim, v_head_dim, chunk, rope} (docs/kvpack.md 1.6)."""
    _exact_keys(obj, {"kind", "kv_heads", "head_dim", "v_head_dim", "chunk", "rope"}, where, fail)
    kv_heads = _int(obj, "kv_heads", where, 1, MAX_HEADS, fail)
    head_dim = _int(obj, "head_dim", where, 1, MAX_HEAD_DIM, fail)
    v_head_dim = _int(obj, "v_head_dim", where, 1, MAX_HEAD_DIM, fail)
    chunk = _int(obj, "chunk", where, 2, MAX_TOKENS, fail)
    rope = _parse_rope(obj.get("rope"), f"{where}.rope", head_dim, fail)
    return LayerSpec(kind="chunked", kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, chunk=chunk,
                     rope=rope)


def _parse_state(obj: dict, where: str, fail: Callable[[str], MuserError]) -> LayerSpec:
    """v1.3 ``state``: {kind, mixer, tensors: [{name, shape, dtype}, ...]} (docs/kvpack.md 1.4)."""
    _exact_keys(obj, {"kind", "mixer", "tensors"}, where, fail)
    mixer = _get(obj, "mixer", str, where, fail)
    if not 1 <= len(mixer) <= 64 or not set(mixer) <= STATE_NAME_CHARS:
        raise fail(f"{where}.mixer must be 1-64 of [a-z0-9_]")
    items = _get(obj, "tensors", list, where, fail)
    if not 1 <= len(items) <= MAX_STATE_TENSORS:
        raise fail(f"{where}.tensors: {len(items)} tensors outside [1, {MAX_STATE_TENSORS}]")
    tensors: list[StateTensor] = []
    for j, t in enumerate(items):
        w = f"{where}.tensors[{j}]"
        if not isinstance(t, dict):
            raise fail(f"{w} is not an object")
        _exact_keys(t, {"name", "shape", "dtype"}, w, fail)
        name = _get(t, "name", str, w, fail)
        if not 1 <= len(name) <= 64 or not set(name) <= STATE_NAME_CHARS:
            raise fail(f"{w}.name must be 1-64 of [a-z0-9_]")
        if any(x.name == name for x in tensors):
            raise fail(f"{w}.name {name!r} is a duplicate")
        shape = _get(t, "shape", list, w, fail)
        if not 1 <= len(shape) <= MAX_STATE_DIMS or any(
                not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= MAX_FRAME_BYTES for d in shape):
            raise fail(f"{w}.shape must be 1-{MAX_STATE_DIMS} dimensions, each in [1, {MAX_FRAME_BYTES}]")
        dtype = _get(t, "dtype", str, w, fail)
        if dtype not in DTYPES:
            raise fail(f"{w}.dtype {dtype!r} is unknown (known: {', '.join(DTYPES)})")
        tensors.append(StateTensor(name, tuple(shape), dtype))
    spec = LayerSpec(kind="state", kv_heads=0, head_dim=0, v_head_dim=0, mixer=mixer, tensors=tuple(tensors))
    if spec.state_bytes > MAX_FRAME_BYTES:
        raise fail(f"{where}: a snapshot of {spec.state_bytes} bytes exceeds {MAX_FRAME_BYTES}")
    return spec


def parse_header(header_json: bytes, major: int, minor: int) -> PackHeader:
    """Validate canonical header bytes strictly and build a :class:`PackHeader`."""
    if not _json_depth_ok(header_json):
        raise _fail(f"JSON nested deeper than {MAX_JSON_DEPTH}")
    try:
        text = header_json.decode("ascii")
    except UnicodeDecodeError:
        raise _fail("not ASCII-encoded canonical JSON") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise _fail(f"not valid JSON ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise _fail("top level is not an object")
    try:
        canon = canonical_json(obj)
    except ValueError:
        raise _fail("not canonical JSON") from None
    if canon != header_json:
        raise _fail("not canonical JSON (duplicate keys, spacing or key order)")
    if minor not in MINORS:  # the preamble check refuses newer minors first; this guards direct calls
        raise _fail(f"version {major}.{minor} is not one this reader reads (1.0 to {MAJOR}.{MINOR})")
    unknown = set(obj) - HEADER_KEYS[minor]
    if unknown:
        raise _fail(f"unknown key(s) {sorted(unknown)} for version {major}.{minor}")
    if obj.get("format") != "kvpack":
        raise _fail("format is not 'kvpack'")
    version = _get(obj, "version", list, "header")
    if version != [major, minor]:
        raise _fail(f"version field {version} disagrees with preamble {major}.{minor}")

    model = _get(obj, "model", dict, "header")
    model_fp = _fingerprint(model.get("fingerprint"), "model.fingerprint")
    model_name = _get(model, "name", str, "model")
    arch = _get(model, "architecture", str, "model")
    tok_fp = _fingerprint(_get(obj, "tokenizer", dict, "header").get("fingerprint"), "tokenizer.fingerprint")

    tokens = _get(obj, "tokens", dict, "header")
    ids = _get(tokens, "ids", list, "tokens")
    count = _int(tokens, "count", "tokens", 1, MAX_TOKENS)
    if len(ids) != count:
        raise _fail(f"tokens.count={count} but {len(ids)} ids")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_TOKEN_ID:
            raise _fail("tokens.ids holds a value that is not a token id")
    if _get(tokens, "digest", str, "tokens") != token_digest(ids):
        raise _fail("tokens.digest does not match tokens.ids")

    positions = _get(obj, "positions", dict, "header")
    rows_end = _int(positions, "end", "positions", 0, MAX_TOKENS)
    if rows_end != count - 1:
        raise _fail(f"positions.end={rows_end} must be tokens.count-1={count - 1}")
    rows_start = _int(positions, "start", "positions", 0, rows_end)

    schedule = _get(obj, "schedule", dict, "header")
    chunk = _int(schedule, "chunk_tokens", "schedule", 1, MAX_FRAME_ROWS)
    frame_tokens = _int(schedule, "frame_tokens", "schedule", 1, MAX_FRAME_ROWS)

    dtype = _get(obj, "dtype", str, "header")
    if dtype not in DTYPES:
        raise _fail(f"dtype {dtype!r} is unknown (known: {', '.join(DTYPES)})")
    layers_obj = _get(obj, "layers", list, "header")
    if not 1 <= len(layers_obj) <= MAX_LAYERS:
        raise _fail(f"{len(layers_obj)} layers outside [1, {MAX_LAYERS}]")
    layers = tuple(parse_layer_spec(layer, f"layers[{i}]") for i, layer in enumerate(layers_obj))
    for i, spec in enumerate(layers):
        if NEW_KINDS_MINOR.get(spec.kind, 0) > minor:
            raise _fail(f"layers[{i}].kind {spec.kind!r} needs kvpack 1.{NEW_KINDS_MINOR[spec.kind]} "
                        f"(this header is {major}.{minor})")

    codec = _get(obj, "codec", dict, "header")
    if codec.get("name") not in CODEC_NAMES.values():
        raise _fail(f"codec {codec.get('name')!r} is unknown (known: {', '.join(CODEC_NAMES.values())})")
    quant = _get(obj, "quant", dict, "header")
    if quant.get("scheme") not in ("none", "int8"):
        raise _fail(f"quant scheme {quant.get('scheme')!r} is unknown (known: none, int8)")
    if quant.get("scheme") == "int8":
        if quant.get("granularity") != "token_head" or quant.get("scale_dtype") != "float32":
            raise _fail("int8 quant needs granularity 'token_head' and scale_dtype 'float32'")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise _fail("int8 quant of this dtype is not defined")
    producer = _get(obj, "producer", dict, "header")
    digest = None
    if minor >= 1:
        digest = _get(obj, "digest", str, "header")
        if digest not in DIGESTS:
            raise _fail(f"digest {digest!r} is unknown (known: {', '.join(DIGESTS)})")
    ring_extra = 0
    if "ring_extra" in obj:  # only 1.2 headers may hold it (HEADER_KEYS); absent means 0
        ring_extra = _int(obj, "ring_extra", "header", 1, MAX_RING_EXTRA)
        if not any(spec.kind in LOCAL_KINDS for spec in layers):
            raise _fail("ring_extra needs a sliding or chunked layer")
    state_every = 1
    if "state_every" in obj:  # only 1.3 headers may hold it; absent means 1 (a snapshot every chunk)
        state_every = _int(obj, "state_every", "header", 2, MAX_STATE_EVERY)
        if not any(spec.kind == "state" for spec in layers):
            raise _fail("state_every needs a state layer")
    base = obj.get("base")
    if base is not None and not isinstance(base, dict):
        raise _fail("base must be an object or null")
    if rows_start > 0 and base is None:
        raise _fail("positions.start > 0 needs a base (a delta pack names its prefix)")

    header = PackHeader(
        model_fingerprint=model_fp, tokenizer_fingerprint=tok_fp, token_ids=tuple(ids), layers=layers,
        dtype=dtype, chunk_tokens=chunk, rows_start=rows_start, frame_tokens=frame_tokens,
        model_name=model_name, architecture=arch, codec=codec, quant=quant, producer=producer,
        base=base, minor=minor, raw=obj, digest=digest, ring_extra=ring_extra, state_every=state_every,
    )
    # Checked sizes: Python ints do not overflow; compare against hard caps.
    total = 0
    for i in range(len(layers)):
        if header.frame_raw_len(i, min(frame_tokens, max(header.layer_rows(i), 1))) > MAX_FRAME_BYTES:
            raise _fail(f"layers[{i}] frames would exceed {MAX_FRAME_BYTES} bytes")
        total += header.layer_raw_bytes(i)
    if total > MAX_TOTAL_BYTES:
        raise _fail(f"declared KV size {total} exceeds the {MAX_TOTAL_BYTES}-byte limit")
    return header


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")
