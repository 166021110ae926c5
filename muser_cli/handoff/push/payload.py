"""What a handoff asserts about its payload, computed by streaming the kvpack through its reader.

Both sides use :class:`PayloadInspector`: the sender to learn, from the first bytes of
its input, what the V3 header binds (:class:`PackStart`) and, at the end, the size and
root digest its trailer declares; the receiver to check, frame by frame as bytes
arrive, that the payload is exactly what the MAC'd header declared (kvpack header
digest, model binding, size bound), and to know how many bytes have verified so far
(:attr:`PayloadInspector.verified`): those, and only those, may be forwarded downstream.

No separate hash of the payload is needed: the kvpack reader checks that padding and
reserved bytes are zero and chains every frame header and stored byte into the root
digest (docs/kvpack.md), so a verified root digest that equals the MAC'd one
authenticates every byte.

Memory: the reader holds at most one kvpack frame (or the kvpack header) at a time, so
an inspector's memory is bounded by the largest frame, never by the pack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from muser_cli.errors import DataError, IdentityMismatch, KVPackError
from muser_cli.handoff.wire.header import MAX_PAYLOAD_BYTES, HandoffHeader
from muser_cli.kvpack import EndEvent, FrameEvent, HeaderEvent, PackReader
from muser_cli.kvpack.format import DIGEST_BLOCK, FRAME_HEADER, PREAMBLE, TAG_DATA, TAG_END, header_digest, pad_len

END_FRAME_BYTES = 128  # end frame header + digest block (docs/kvpack.md 2.4)


@dataclass(frozen=True)
class PackStart:
    """What the first bytes of a kvpack (preamble + header) bind, known before any frame exists."""

    header_digest: str  # hex d_header (docs/kvpack.md 2.3)
    size_bound: int  # no valid pack with this header is longer
    head_bytes: int  # preamble + header JSON + padding
    frames: int  # data frames the header plans
    model_fingerprint: str
    tokenizer_fingerprint: str
    token_digest: str
    rows_start: int


@dataclass(frozen=True)
class PayloadInfo:
    size: int
    root_digest: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    token_digest: str
    rows_start: int


def size_bound(header, head_bytes: int) -> tuple[int, int]:
    """(upper bound on the bytes of any valid pack with this kvpack header, frames planned).

    Each data frame is 64 header bytes, at most ``raw_len + 1024`` stored bytes padded to
    64, and a 64-byte digest block (the reader's own limits, docs/kvpack.md 4).
    """

    total, frames = head_bytes + END_FRAME_BYTES, 0
    for layer, _start, count in header.frame_plan():
        stored_max = header.frame_raw_len(layer, count) + 1024  # a state frame: one snapshot
        total += FRAME_HEADER.size + stored_max + pad_len(stored_max) + DIGEST_BLOCK
        frames += 1
    return min(total, MAX_PAYLOAD_BYTES), frames


class PayloadInspector:
    """Feed payload bytes in order; :attr:`start` once the kvpack header verified,
    :attr:`verified` bytes so far that verified (kvpack header and whole frames, never the
    end frame), :meth:`finish` at the end returns what the payload is.

    With ``expect`` (the receiver's verified V3 header) the kvpack header digest and the
    model binding are checked as soon as the kvpack header is in. Errors are
    :class:`~muser_cli.errors.DataError` subclasses; bytes that verified before the bad
    one stay counted in :attr:`verified`.
    """

    def __init__(self, *, expect: HandoffHeader | None = None, max_bytes: int | None = None) -> None:
        limit = expect.size_bound if expect is not None else max_bytes
        self._reader = PackReader(max_bytes=limit, decode=False)
        self._expect = expect
        self.size = 0  # bytes fed
        self.verified = 0  # bytes up to the end of the last verified kvpack header or data frame
        self.frames = 0  # data frames verified
        self.start: PackStart | None = None
        self._head: bytearray | None = bytearray()
        self._pack_header = None
        self._root: bytes | None = None

    @property
    def complete(self) -> bool:
        return self._root is not None

    def want(self) -> int:
        """Bytes the reader needs to finish its current step (0 once the end frame verified)."""
        return self._reader.want()

    def feed(self, data: bytes | memoryview) -> None:
        """Feed the reader exactly what each step needs, so every event marks a byte boundary."""

        view = memoryview(data)
        while len(view):
            need = self._reader.want()
            piece = view[:need] if need else view  # done: the reader refuses what follows
            view = view[len(piece):]
            if self._head is not None:
                self._head += piece
            events = self._reader.feed(piece)
            self.size += len(piece)
            for event in events:
                if isinstance(event, HeaderEvent):
                    self._on_header(event.header)
                    self.verified = self.size
                elif isinstance(event, FrameEvent):
                    self.frames += 1
                    self.verified = self.size
                elif isinstance(event, EndEvent):
                    self._root = event.root_digest

    def _on_header(self, header) -> None:
        head = bytes(self._head or b"")
        self._head = None
        hlen = PREAMBLE.unpack_from(head)[3]
        digest = header_digest(head[: PREAMBLE.size], head[PREAMBLE.size : PREAMBLE.size + hlen]).hex()
        bound, frames = size_bound(header, len(head))
        self._pack_header = header
        self.start = PackStart(
            header_digest=digest, size_bound=bound, head_bytes=len(head), frames=frames,
            model_fingerprint=header.model_fingerprint, tokenizer_fingerprint=header.tokenizer_fingerprint,
            token_digest=header.token_digest, rows_start=header.rows_start,
        )
        if self._expect is not None:
            self._check_binding(self._expect, self.start)

    @staticmethod
    def _check_binding(expect: HandoffHeader, start: PackStart) -> None:
        pairs = (
            ("header digest", expect.pack_header_digest, start.header_digest),
            ("model fingerprint", expect.model_fingerprint, start.model_fingerprint),
            ("tokenizer fingerprint", expect.tokenizer_fingerprint, start.tokenizer_fingerprint),
            ("token digest", expect.token_digest, start.token_digest),
            ("first position", expect.rows_start, start.rows_start),
        )
        for what, declared, actual in pairs:
            if declared != actual:
                raise IdentityMismatch(f"kvpack {what} {actual!r} differs from the handoff header's {declared!r}")

    def finish(self) -> PayloadInfo:
        self._reader.finish()
        if self.start is None or self._root is None:
            raise KVPackError("kvpack ended without a header or an end frame")
        s = self.start
        return PayloadInfo(
            size=self.size, root_digest=self._root.hex(), model_fingerprint=s.model_fingerprint,
            tokenizer_fingerprint=s.tokenizer_fingerprint, token_digest=s.token_digest, rows_start=s.rows_start,
        )


class StreamTail:
    """The sender's view of the payload after its verified kvpack header: it follows the
    frame layout (each 64-byte frame header's tag and stored length) without hashing, so
    it knows the moment the end frame is complete -- the trailer can go out then, not
    when the producer's process finally closes its output -- and where the root digest is.

    The sender does not re-hash the frames it forwards -- the receiver verifies every one
    against the chain, and accepts no trailer for a root it did not compute itself -- so
    forwarding costs the producer's machine no hashing. What is checked here is
    structural: frames in sequence, an end frame whose sequence number is the number of
    data frames the header plans, zero padding after the root, nothing after it.
    """

    def __init__(self, start: PackStart, head: bytes) -> None:
        self.start = start
        self.size = len(head)
        self.frames = 0  # data frames seen
        self.complete = False
        self._hdr = bytearray()  # the frame header being collected
        self._skip = 0  # bytes left of the current frame after its header
        self._in_end = False
        self._digest = bytearray()  # the end frame's digest block

    def feed(self, data: bytes | memoryview) -> None:
        """Account for ``data``; KVPackError for bytes after the end frame or a bad frame tag."""
        import struct


        view = memoryview(data)
        off, n = 0, len(view)
        while off < n:
            if self.complete:
                raise KVPackError("bytes after the kvpack's end frame")
            if self._skip == 0 and not self._in_end:  # at a frame boundary: collect its header
                take = min(FRAME_HEADER.size - len(self._hdr), n - off)
                self._hdr += view[off : off + take]
                off += take
                if len(self._hdr) < FRAME_HEADER.size:
                    continue
                tag, seq = struct.unpack_from("<4sI", self._hdr)
                if seq != self.frames:
                    raise KVPackError(f"frame {self.frames}: sequence number {seq}")
                if tag == TAG_DATA:
                    stored = struct.unpack_from("<Q", self._hdr, 32)[0]
                    self._skip = stored + pad_len(stored) + DIGEST_BLOCK
                    self.frames += 1
                elif tag == TAG_END:
                    if seq != self.start.frames:
                        raise KVPackError(f"end frame after {seq} of {self.start.frames} planned frames")
                    self._in_end, self._skip = True, DIGEST_BLOCK
                else:
                    raise KVPackError(f"frame {self.frames}: unknown frame tag {bytes(tag)!r}")
                self._hdr.clear()
                continue
            take = min(self._skip, n - off)
            if self._in_end:
                self._digest += view[off : off + take]
            off += take
            self._skip -= take
            if self._in_end and self._skip == 0:
                self.complete = True
        self.size += n

    def finish(self) -> tuple[int, str]:
        """(payload size, root digest hex) once the end frame is in; KVPackError if the input ended early."""
        if not self.complete or any(self._digest[32:]):
            raise KVPackError(f"input ended after {self.size} bytes without the kvpack's end frame "
                              f"({self.frames} of {self.start.frames} planned frames)")
        return self.size, bytes(self._digest[:32]).hex()


def read_start(read: Callable[[int], bytes], inspector: PayloadInspector) -> bytes:
    """Read (with ``read(n)``, which may return fewer) just the kvpack preamble and header.

    Returns the bytes read; ``inspector.start`` is then set. Raises KVPackError on a
    bad or truncated header.
    """
    got = bytearray()
    while inspector.start is None:
        data = read(inspector.want())
        if not data:
            inspector.finish()  # raises: truncated or empty
            raise DataError("kvpack ended before its header")
        inspector.feed(data)
        got += data
    return bytes(got)


def inspect_stream(stream, *, chunk: int = 1 << 20, sink=None, max_bytes: int | None = None) -> PayloadInfo:
    """Read a whole kvpack from ``stream`` (optionally copying it to ``sink``)."""
    inspector = PayloadInspector(max_bytes=max_bytes)
    while True:
        data = stream.read(chunk)
        if not data:
            break
        inspector.feed(data)
        if sink is not None:
            sink.write(data)
    return inspector.finish()
