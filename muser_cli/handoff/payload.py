"""What a handoff asserts about its payload, computed by streaming the kvpack through its reader.

Both sides use :class:`PayloadInspector`: the sender to fill the handoff header, the
receiver to check, frame by frame as bytes arrive, that the payload is exactly what the
MAC'd header declared (size, kvpack root digest, model binding).

No separate hash of the payload is needed: the kvpack reader checks that padding and
reserved bytes are zero and chains every frame header and stored byte into the root
digest (docs/kvpack.md), so a verified root digest that equals the MAC'd one
authenticates every byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from muser_cli.errors import DataError, IdentityMismatch, KVPackError
from muser_cli.handoff.header import HandoffHeader


@dataclass(frozen=True)
class PayloadInfo:
    size: int
    root_digest: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    token_digest: str
    rows_start: int


class PayloadInspector:
    """Feed payload bytes in order; :meth:`finish` returns what they are.

    With ``expect`` (the receiver's verified header) every check runs as early as it can:
    the size on each feed, the model binding as soon as the kvpack header is parsed, the
    digests at the end. Errors are :class:`~muser_cli.errors.DataError` subclasses.
    """

    def __init__(self, *, expect: HandoffHeader | None = None, max_bytes: int | None = None) -> None:
        from muser_cli.kvpack import PackReader

        limit = expect.payload_size if expect is not None else max_bytes
        self._reader = PackReader(max_bytes=limit, decode=False)
        self._expect = expect
        self.size = 0
        self._pack_header = None
        self._root: bytes | None = None

    def feed(self, data: bytes | memoryview) -> None:
        from muser_cli.kvpack import EndEvent, HeaderEvent

        self.size += len(data)
        if self._expect is not None and self.size > self._expect.payload_size:
            raise DataError(f"payload exceeds the declared {self._expect.payload_size} bytes")
        for event in self._reader.feed(data):
            if isinstance(event, HeaderEvent):
                self._pack_header = event.header
                if self._expect is not None:
                    self._check_binding(self._expect)
            elif isinstance(event, EndEvent):
                self._root = event.root_digest

    def _check_binding(self, expect: HandoffHeader) -> None:
        h = self._pack_header
        pairs = (
            ("model fingerprint", expect.model_fingerprint, h.model_fingerprint),
            ("tokenizer fingerprint", expect.tokenizer_fingerprint, h.tokenizer_fingerprint),
            ("token digest", expect.token_digest, h.token_digest),
            ("first position", expect.rows_start, h.rows_start),
        )
        for what, declared, actual in pairs:
            if declared != actual:
                raise IdentityMismatch(f"kvpack {what} {actual!r} differs from the handoff header's {declared!r}")

    def finish(self) -> PayloadInfo:
        self._reader.finish()
        if self._pack_header is None or self._root is None:
            raise KVPackError("kvpack ended without a header or an end frame")
        h = self._pack_header
        info = PayloadInfo(
            size=self.size,
            root_digest=self._root.hex(),
            model_fingerprint=h.model_fingerprint,
            tokenizer_fingerprint=h.tokenizer_fingerprint,
            token_digest=h.token_digest,
            rows_start=h.rows_start,
        )
        if self._expect is not None:
            e = self._expect
            if info.size != e.payload_size:
                raise DataError(f"payload is {info.size} bytes, the header declared {e.payload_size}")
            if info.root_digest != e.root_digest:
                raise DataError("kvpack root digest differs from the handoff header's")
        return info


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
