"""``pack``: re-encode a kvpack frame by frame (codec, later quantization and delta).

Streaming: each input frame is verified, then re-encoded and written; an input that
fails a check stops the output before its end frame, so no consumer can accept it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import BinaryIO

from muser_cli.errors import KVPackError, UsageError
from muser_cli.kvpack import FrameEvent, HeaderEvent, PackReader, PackWriter
from muser_cli.kvpack.format import CODEC_NAMES

READ_BLOCK = 1 << 20


@dataclass
class PackResult:
    frames: int
    bytes_in: int
    bytes_out: int
    raw_bytes: int
    codec: str
    seconds: float

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.bytes_out if self.bytes_out else 0.0


def pack(src: BinaryIO, out: BinaryIO, *, codec: str = "zstd+bytegroup", level: int = 1, quant: str = "none") -> PackResult:
    if codec not in CODEC_NAMES.values():
        raise UsageError(f"unknown codec {codec!r}", hint="one of: " + ", ".join(CODEC_NAMES.values()))
    if quant != "none":
        raise UsageError(f"quantization {quant!r} is not available yet", hint="use --quant none")
    if not 1 <= level <= 22:
        raise UsageError("--zstd level must be in [1, 22]")
    t0 = time.perf_counter()
    reader = PackReader()
    writer: PackWriter | None = None
    frames = 0
    while True:
        block = src.read(READ_BLOCK)
        if not block:
            break
        for ev in reader.feed(block):
            if isinstance(ev, HeaderEvent):
                header = replace(ev.header, codec={"name": codec})
                writer = PackWriter(out, header, codec=codec, level=level)
            elif isinstance(ev, FrameEvent):
                assert writer is not None
                writer.write_frame(ev.layer, ev.start, ev.keys, ev.values)
                frames += 1
    reader.finish()
    if writer is None:
        raise KVPackError("empty input: no kvpack")
    writer.finish()
    return PackResult(frames=frames, bytes_in=reader.bytes_consumed, bytes_out=writer.bytes_written,
                      raw_bytes=writer.raw_bytes, codec=codec, seconds=time.perf_counter() - t0)
