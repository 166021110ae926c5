"""``pack``: re-encode a kvpack frame by frame (codec, quantization, delta).

Streaming: each input frame is verified, then re-encoded and written; an input that
fails a check stops the output before its end frame, so no consumer can accept it.
With a consumer's have manifest the output is a delta: full-attention rows the consumer
lacks plus the sliding-window rings, with ``base`` naming its prefix (docs/reuse.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from muser_cli.errors import DataError, IdentityMismatch, KVPackError, MissingInput, UsageError
from muser_cli.kvpack import EndEvent, FrameEvent, HeaderEvent, PackReader, PackWriter, buffer_events, read_pack
from muser_cli.kvpack.format import CODEC_NAMES, CODEC_RAW
from muser_cli.kvpack.quant import QUANT_SCHEMES, int8_error
from muser_cli.kvpack.reader import map_file, read_step
from muser_cli.kvpack.summary import summarize
from muser_cli.reuse.chain import scope_of_header
from muser_cli.reuse.delta import cut_frame, delta_header
from muser_cli.reuse.manifest import HaveManifest

if TYPE_CHECKING:
    from muser_cli.kvpack import PackHeader

def _events(src: BinaryIO, reader: PackReader):
    """Feed ``src`` to ``reader`` one parser step at a time, yielding each event as it verifies.

    Each step (preamble, header, frame header, frame body, end digest) is read with
    ``readinto`` into a buffer of exactly its size that the reader then owns: frames parse
    in place, nothing is gathered or copied again, and a pipe's frame moves on as soon as
    its last byte arrived (never held back for a larger block). Past the end frame one
    more byte is asked for, so trailing bytes are refused."""
    while True:
        chunk = read_step(src, reader)  # grows with the bytes that arrive, not with declared lengths
        if not len(chunk):
            return
        yield from reader.feed(chunk, owned=True)


@dataclass
class PackResult:
    frames: int
    bytes_in: int
    bytes_out: int
    raw_bytes: int
    codec: str
    seconds: float
    held_tokens: int = 0  # the output is a delta from this position

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.bytes_out if self.bytes_out else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"frames": self.frames, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "kv_bytes": self.raw_bytes, "ratio": round(self.ratio, 4), "codec": self.codec,
                "seconds": round(self.seconds, 4), "held_tokens": self.held_tokens}


def codec_for(no_zstd: bool) -> str:
    """The output codec ``pack`` and ``--import`` write: uncompressed, or byte-grouped zstd."""
    return "none" if no_zstd else "zstd+bytegroup"


def read_have(src: BinaryIO) -> HaveManifest:
    """A consumer's have manifest from ``src``, read no further than one byte past its size limit."""
    return HaveManifest.loads(src.read(1 << 20 | 1))


def delta_for(header: "PackHeader", have: HaveManifest) -> "PackHeader":
    """``header`` cut to what the consumer of ``have`` lacks; refuses another model, prompt or schedule."""
    have.check_model(header.model_fingerprint, header.tokenizer_fingerprint, what="this pack's model")
    have.check_prompt(list(header.token_ids))
    held = have.held_tokens
    if header.rows_start > held:
        raise DataError(f"this pack is a delta from position {header.rows_start}; the consumer holds only {held}",
                        hint="pack the full prefill (or one cut for this manifest) instead")
    if held == 0:
        return header
    scope = scope_of_header(header)
    if scope != have.scope:
        assert have.scope is not None
        raise IdentityMismatch(
            f"the consumer's prefix was computed with chunk {have.scope.chunk_tokens} in {have.scope.dtype}, "
            f"this pack with chunk {scope.chunk_tokens} in {scope.dtype}: the merge would not be exact",
            hint=f"prefill with --have (or --chunk {have.scope.chunk_tokens} --dtype {have.scope.dtype})")
    return delta_header(header, scope, held, have.chain)


def pack(src: BinaryIO, out: BinaryIO, *, codec: str = "zstd+bytegroup", level: int = 1, quant: str = "none",
         have: HaveManifest | None = None) -> PackResult:
    if codec not in CODEC_NAMES.values():
        raise UsageError(f"unknown codec {codec!r}", hint="one of: " + ", ".join(CODEC_NAMES.values()))
    if quant not in QUANT_SCHEMES:
        raise UsageError(f"unknown quantization {quant!r}", hint="one of: " + ", ".join(QUANT_SCHEMES))
    if not 1 <= level <= 22:
        raise UsageError("--zstd level must be in [1, 22]")
    t0 = time.perf_counter()
    if quant == "int8":
        return _pack_quantized(src, out, codec=codec, level=level, t0=t0, have=have)
    writer: PackWriter | None = None
    frames = 0
    source = _Source(src)
    for ev in source.events():
        if isinstance(ev, HeaderEvent):
            header = delta_for(ev.header, have) if have is not None else ev.header
            header = replace(header, codec={"name": codec})
            writer = PackWriter(out, header, codec=codec, level=level)
        elif isinstance(ev, FrameEvent):
            assert writer is not None
            if source.header is not None and source.header.quant_scheme != "none":
                raise UsageError("this pack is already quantized; re-encode it with its own --quant")
            part = _cut(writer.header, ev)
            if part is not None:
                if (ev.codec == CODEC_RAW and ev.stored is not None and part[0] == ev.start
                        and (part[1].ndim != 3 or part[1].shape[1] == ev.count)):  # ndim 1: a state snapshot
                    # the frame whole and uncompressed: its verified payload goes on as it is,
                    # and its payload digest (v1.1) is linked, not computed a second time
                    writer.write_stored(ev.layer, ev.start, ev.count, ev.stored, payload_digest=ev.payload_digest,
                                        digest=source.digest)
                else:
                    writer.write_frame(ev.layer, *part)
                out.flush()  # each verified frame moves on at once (a pipe downstream streams)
                frames += 1
    source.finish()
    if writer is None:
        raise KVPackError("empty input: no kvpack")
    writer.finish()
    return PackResult(frames=frames, bytes_in=source.bytes_in, bytes_out=writer.bytes_written,
                      raw_bytes=writer.raw_bytes, codec=codec, seconds=time.perf_counter() - t0,
                      held_tokens=writer.header.rows_start)


class _Source:
    """The verified events of the input pack. A regular file is memory-mapped and read as
    :func:`~muser_cli.kvpack.buffer_events` (payloads hashed on the worker pool ahead of
    the frame being passed on; a frame goes out as a view of the map); a pipe is read step
    by step (:func:`_events`). Same verdicts either way."""

    def __init__(self, src: BinaryIO) -> None:
        self._src = src
        self._reader: PackReader | None = None
        self._mapped = map_file(src)
        self.header: "PackHeader | None" = None
        self.bytes_in = 0

    @property
    def digest(self) -> str | None:
        if self._reader is not None:
            return self._reader.digest
        h = self.header
        return None if h is None else ("sha256" if h.minor == 0 else h.digest or "sha256")

    def events(self):
        if self._mapped is None:
            self._reader = PackReader()
            for ev in _events(self._src, self._reader):
                if isinstance(ev, HeaderEvent):
                    self.header = ev.header
                yield ev
            return
        view, end = self._mapped
        try:
            for ev in buffer_events(view):
                if isinstance(ev, HeaderEvent):
                    self.header = ev.header
                elif isinstance(ev, EndEvent):
                    self.bytes_in = ev.total_bytes
                yield ev
        finally:
            self._src.seek(end)

    def finish(self) -> None:
        if self._reader is not None:
            self._reader.finish()
            self.bytes_in = self._reader.bytes_consumed


def _cut(header: "PackHeader", ev: FrameEvent):
    """(start, keys, values) of the part of an input frame that ``header`` carries, or None."""
    if header.rows_start == 0:
        return ev.start, ev.keys, ev.values

    return cut_frame(header, ev.layer, ev.start, ev.keys, ev.values, ev.count)


def _pack_quantized(src: BinaryIO, out: BinaryIO, *, codec: str, level: int, t0: float,
                    have: HaveManifest | None = None) -> PackResult:
    """int8: the measured error goes in the header, so every frame is read (and verified) first."""
    reader = PackReader()
    frames: list[FrameEvent] = []
    header = None
    for ev in _events(src, reader):
        if isinstance(ev, HeaderEvent):
            header = ev.header
            if header.quant_scheme != "none":
                raise UsageError("this pack is already quantized")
            if have is not None:
                header = delta_for(header, have)
        elif isinstance(ev, FrameEvent):
            assert header is not None
            part = _cut(header, ev)
            if part is not None:
                count = part[1].shape[1] if part[1].ndim == 3 else ev.start + ev.count - part[0]  # a state snapshot
                frames.append(replace(ev, start=part[0], count=count, keys=part[1], values=part[2],
                                      stored=None, payload_digest=None))
    reader.finish()
    if header is None:
        raise KVPackError("empty input: no kvpack")
    totals = {"k_max_abs": 0.0, "v_max_abs": 0.0, "k_sum": 0.0, "v_sum": 0.0, "k_n": 0.0, "v_n": 0.0, "max_value": 0.0}
    for ev in frames:
        if header.layers[ev.layer].kind == "state":  # snapshots are never quantized (docs/kvpack.md 3.1)
            continue
        e = int8_error(ev.keys, ev.values, header.dtype)
        totals["k_max_abs"] = max(totals["k_max_abs"], e["k_max_abs"])
        totals["v_max_abs"] = max(totals["v_max_abs"], e["v_max_abs"])
        totals["max_value"] = max(totals["max_value"], e["k_max_value"], e["v_max_value"])
        for kv in "kv":
            totals[f"{kv}_sum"] += e[f"{kv}_sum_abs"]
            totals[f"{kv}_n"] += e[f"{kv}_n"]
    error = {
        "k_max_abs": totals["k_max_abs"], "v_max_abs": totals["v_max_abs"],
        "k_mean_abs": totals["k_sum"] / max(totals["k_n"], 1.0), "v_mean_abs": totals["v_sum"] / max(totals["v_n"], 1.0),
        "max_abs_value": totals["max_value"],
    }
    error = {k: float(f"{v:.6g}") for k, v in error.items()}
    quant_spec = {"scheme": "int8", "granularity": "token_head", "scale_dtype": "float32", "error": error}
    new_header = replace(header, codec={"name": codec}, quant=quant_spec)
    writer = PackWriter(out, new_header, codec=codec, level=level)
    for ev in frames:
        writer.write_frame(ev.layer, ev.start, ev.keys, ev.values)
    writer.finish()
    return PackResult(frames=len(frames), bytes_in=reader.bytes_consumed, bytes_out=writer.bytes_written,
                      raw_bytes=new_header.total_logical_bytes(), codec=f"{codec}+int8",
                      seconds=time.perf_counter() - t0, held_tokens=new_header.rows_start)


def pack_info(src: BinaryIO) -> dict:
    """What a user inspects before trusting a file: read and verify it, then summarize
    (layers by class, tokens, bytes by class, codec, ratio, quantization error, identity)."""
    t0 = time.perf_counter()
    p = read_pack(src)
    info = summarize(p)
    h = p.header
    info.update({
        "frames": len(list(h.frame_plan())),
        "quant": h.quant,
        "delta": h.rows_start > 0,
        "base": h.base,
        "window_rows": {str(i): h.layer_rows(i) for i, s in enumerate(h.layers) if s.kind == "sliding"},
        "verified": True,
        "seconds": round(time.perf_counter() - t0, 6),
    })
    return info


# ---------------------------------------------------------------- another tool's cache file (--export / --import)
INTEROP_FORMATS = ("mlx-lm",)


def interop_format(export_to: str | None, import_from: str | None) -> str:
    """The one cache format named by ``--export`` or ``--import`` (not both)."""
    if export_to is not None and import_from is not None:
        raise UsageError("--export and --import exclude each other")
    fmt = export_to if export_to is not None else import_from
    if fmt not in INTEROP_FORMATS:
        raise UsageError(f"unknown cache format {fmt!r}", hint="the one format is: mlx-lm")
    return fmt


def check_import(src: str | None, *, model: str | None, prompt: str | None) -> None:
    """What ``--import mlx-lm`` needs: a model, a prompt, and an existing file (not stdin)."""
    if model is None or prompt is None:
        raise UsageError("--import mlx-lm needs -m MODEL and --prompt FILE",
                         hint="mlx-lm's file carries no model hash and no token ids")
    if src in ("-", None):
        raise UsageError("--import mlx-lm reads a file, not stdin", hint="name the .safetensors file")
    if not Path(src).exists():
        raise MissingInput(f"no such file: {src}")
    if Path(src).is_dir():
        raise UsageError(f"{src} is a directory, not a file")


def export_summary(res: Any) -> dict[str, Any]:
    """The JSON summary of an :class:`~muser_cli.interop.mlx_lm.ExportResult`."""
    return {"format": "mlx-lm", "rows": res.rows, "next_token_ids": res.next_token_ids, "model": res.model_ref,
            "bytes_in": res.bytes_in, "bytes_out": res.bytes_out, "seconds": round(res.seconds, 4)}


def import_summary(res: Any) -> dict[str, Any]:
    """The JSON summary of an :class:`~muser_cli.interop.mlx_lm.ImportResult`."""
    return {"format": "mlx-lm", "tokens": res.tokens, "cached_positions": res.cached_positions,
            "dropped_last_row": res.dropped_last_row, "bytes_in": res.bytes_in, "bytes_out": res.bytes_out,
            "seconds": round(res.seconds, 4)}
