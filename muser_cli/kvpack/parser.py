"""The sans-IO streaming kvpack parser: feed bytes, get verified events.

Each frame is verified as it arrives (plan position, sequence, lengths, digest chain,
codec bounds, see :mod:`muser_cli.kvpack.checks`); the pack is complete only when the end
frame's root digest verifies and no byte follows. Memory grows with bytes actually
received, never with sizes a header merely declares. Immutable input (``bytes``,
read-only views such as a memory map) and input the caller hands over (``owned=True``)
are parsed in place; a frame that arrives in pieces is gathered once into a buffer of its
own.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Union

import numpy as np

from muser_cli.errors import DAMAGED_PACK_HINT, KVPackError, TRUNCATED_PACK_HINT
from muser_cli.kvpack.checks import (
    body_len, check_frame_header, check_header, check_magic, check_padding, check_preamble, check_root, decode_frame,
    header_block_len,
)
from muser_cli.kvpack.digest import Chain, Running
from muser_cli.kvpack.format import DIGEST_BLOCK, FRAME_HEADER, MINOR, PREAMBLE, PackHeader, pad_len


@dataclass(frozen=True)
class HeaderEvent:
    header: PackHeader


@dataclass(frozen=True)
class FrameEvent:
    seq: int
    layer: int
    start: int
    count: int
    codec: int
    stored_bytes: int
    keys: np.ndarray  # (kv_heads, count, head_dim), storage dtype; a state layer: its snapshot's bytes (1-D uint8)
    values: np.ndarray  # (kv_heads, count, v_head_dim); a state layer: empty
    # The stored payload exactly as it verified (a read-only view, or a buffer the reader
    # owns) and, for v1.1, p_k = H(stored) as the reader computed it (None for v1.0). A
    # writer that passes this frame on unchanged links p_k into its own chain instead of
    # hashing the same bytes again (PackWriter.write_stored).
    stored: memoryview | None = None
    payload_digest: bytes | None = None


@dataclass(frozen=True)
class EndEvent:
    root_digest: bytes
    total_bytes: int  # bytes of the whole pack as received
    raw_bytes: int  # decoded KV bytes


Event = Union[HeaderEvent, FrameEvent, EndEvent]


class _State(Enum):
    """Where the reader stands in the pack."""
    PREAMBLE = "preamble"
    HEADER = "header"
    FRAME_HEADER = "frame_header"
    FRAME_BODY = "frame_body"  # decode=True: the whole body gathered, then verified
    FRAME_PAYLOAD = "frame_payload"  # decode=False: the payload hashed as it arrives
    FRAME_TAIL = "frame_tail"  # decode=False: padding and digest after the payload
    END_DIGEST = "end_digest"
    DONE = "done"


@dataclass(frozen=True)
class _Frame:
    """The frame being read: its header as received and what the header declared (the
    end frame carries only its header)."""
    head: bytes
    layer: int = 0
    start: int = 0
    count: int = 0
    codec: int = 0
    raw_len: int = 0
    stored_len: int = 0


class PackReader:
    """Feed bytes, get events. ``finish()`` at end of input raises if the pack is incomplete.

    ``decode=False`` checks structure and digests without decoding payloads (fast verify
    for relays); FrameEvent arrays are then empty, and a payload is hashed piece by piece
    as it arrives, never gathered or held: memory stays at a few hundred bytes past the
    header however large a frame is, and nothing fed is kept after ``feed`` returns. ``max_minor`` is the newest minor
    version accepted (a reader limited to 1.0 refuses 1.1 files by version).

    A FrameEvent is emitted only after that frame's own digest (and the chain up to it)
    verified; its arrays may be views of the bytes fed (never of a buffer the caller may
    reuse: writable input is copied unless ``feed(..., owned=True)`` hands it over).
    """

    def __init__(self, *, max_bytes: int | None = None, decode: bool = True, max_minor: int = MINOR) -> None:
        self._pend: np.ndarray | None = None  # a step that arrived in pieces, gathered here
        self._pend_len = 0
        self._pend_need = 0
        self._pos = 0  # bytes consumed
        self._state = _State.PREAMBLE
        self._max_bytes = max_bytes
        self._decode = decode
        self._max_minor = max_minor
        self.header: PackHeader | None = None
        self._plan: list[tuple[int, int, int]] = []
        self._seq = 0
        self._chain: Chain | None = None
        self._raw_total = 0
        self._hlen = 0
        self._minor = 0
        self._pre = b""
        self._frame: _Frame | None = None
        self.root_digest: bytes | None = None
        self._src = memoryview(b"")
        self._off = 0
        self._running: Running | None = None  # decode=False: the digest of the frame arriving
        self._body_seen = 0

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    @property
    def bytes_consumed(self) -> int:
        return self._pos

    @property
    def digest(self) -> str | None:
        """The digest this pack's chain uses (``sha256`` for v1.0), once the header is in."""
        return self._chain.name if self._chain is not None else None

    def _need(self) -> int:
        """Bytes the current step reads in one piece."""
        st = self._state
        if st is _State.PREAMBLE:
            return PREAMBLE.size
        if st is _State.HEADER:
            return header_block_len(self._hlen)
        if st is _State.FRAME_BODY:
            return body_len(self._cur.stored_len)
        if st is _State.FRAME_PAYLOAD:
            return self._cur.stored_len - self._body_seen
        if st is _State.FRAME_TAIL:
            return pad_len(self._cur.stored_len) + DIGEST_BLOCK
        if st in (_State.FRAME_HEADER, _State.END_DIGEST):
            return FRAME_HEADER.size
        return 0

    def want(self) -> int:
        """Bytes still needed to complete the current step (0 when done): a pull-based
        caller that reads exactly this much gets zero-copy parsing."""
        if self._state is _State.DONE:
            return 0
        return max(0, self._need() - self._pend_len)

    def feed(self, data: bytes | bytearray | memoryview, *, owned: bool = False) -> list[Event]:
        """Parse ``data``. ``owned=True``: the caller will never write to this buffer again,
        so frames may be handed out as views of it."""
        n = len(data)
        if n and self._state is _State.DONE:
            raise KVPackError("bytes after the end frame")
        if self._max_bytes is not None and self._pos + self._pend_len + n > self._max_bytes:
            raise KVPackError(f"pack larger than the allowed {self._max_bytes} bytes")
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if not view.readonly and not owned and self._decode:
            # the caller may reuse its buffer: parse our own copy (decode=False keeps no view)
            view = memoryview(bytes(view))
        events: list[Event] = []
        if self._pend is not None:
            view = self._gather(view, events)
            if self._pend is not None:  # still incomplete
                if self._state is _State.PREAMBLE:
                    check_magic(self._pend[: self._pend_len])
                return events
        if len(view):
            self._run(view, events)
        return events

    def _gather(self, view: memoryview, events: list[Event]) -> memoryview:
        """Copy into the pending step; when it completes, parse it. Returns what is left."""
        assert self._pend is not None
        take = min(self._pend_need - self._pend_len, len(view))
        end = self._pend_len + take
        if end > len(self._pend):  # grow with what arrived, never to what was merely declared
            bigger = np.empty(min(self._pend_need, max(2 * len(self._pend), end)), dtype=np.uint8)
            bigger[: self._pend_len] = self._pend[: self._pend_len]
            self._pend = bigger
        self._pend[self._pend_len : end] = np.frombuffer(view[:take], dtype=np.uint8)
        self._pend_len = end
        rest = view[take:]
        if self._pend_len < self._pend_need:
            return rest
        step = memoryview(self._pend)[: self._pend_need]
        self._pend, self._pend_len, self._pend_need = None, 0, 0
        self._run(step, events)  # exactly one step: nothing is left over
        return rest

    def _run(self, view: memoryview, events: list[Event]) -> None:
        self._src, self._off = view, 0
        try:
            while True:
                ev = self._step()
                if ev is None:
                    break
                if ev is not True:
                    events.append(ev)  # type: ignore[arg-type]
        finally:
            rest = self._src[self._off :]
            self._src, self._off = memoryview(b""), 0
        if len(rest):
            if self._state is _State.DONE:
                raise KVPackError("bytes after the end frame")
            need = self._need()
            self._pend_need = need
            self._pend = np.empty(min(need, max(len(rest), 1 << 20)), dtype=np.uint8)
            self._pend[: len(rest)] = np.frombuffer(rest, dtype=np.uint8)
            self._pend_len = len(rest)
            if self._state is _State.PREAMBLE:
                check_magic(rest)

    def finish(self) -> None:
        if self._state is not _State.DONE:
            where = {_State.PREAMBLE: "in the preamble", _State.HEADER: "in the header"}.get(
                self._state, f"after {self._seq} frames")
            if self._pos == 0 and not self._pend_len:
                raise KVPackError("empty input: no kvpack")
            raise KVPackError(f"truncated kvpack: input ended {where}", hint=TRUNCATED_PACK_HINT)

    # -------------------------------------------------------------- internals
    def _take(self, n: int) -> memoryview | None:
        if len(self._src) - self._off < n:
            return None
        out = self._src[self._off : self._off + n]
        self._off += n
        self._pos += n
        return out

    def _step(self) -> Event | bool | None:
        """One step of the state machine: an event, True (progress, no event) or None
        (the input so far does not complete the step)."""
        step = _STEPS.get(self._state)
        return step(self) if step is not None else None

    def _step_preamble(self) -> Event | bool | None:
        check_magic(self._src[self._off :])
        pre = self._take(PREAMBLE.size)
        if pre is None:
            return None
        self._minor, self._hlen = check_preamble(pre, self._max_minor, self._max_bytes)
        self._pre = bytes(pre)
        self._state = _State.HEADER
        return True

    def _step_header(self) -> Event | bool | None:
        block = self._take(header_block_len(self._hlen))
        if block is None:
            return None
        header, d_header = check_header(block, self._pre, self._hlen, self._minor)
        self.header = header
        self._plan = list(header.frame_plan())
        self._chain = Chain(self._minor, header.digest or "sha256", d_header)
        self._state = _State.FRAME_HEADER
        return HeaderEvent(header)

    def _step_frame_header(self) -> Event | bool | None:
        fh = self._take(FRAME_HEADER.size)
        if fh is None:
            return None
        assert self.header is not None
        got = check_frame_header(fh, self._seq, self._plan, self.header, self._raw_total, self._pos,
                                  self._max_bytes)
        if got[0] == "end":
            self._frame = _Frame(bytes(fh))
            self._state = _State.END_DIGEST
            return True
        _, layer, start, count, codec, raw_len, stored_len = got
        self._frame = _Frame(bytes(fh), layer, start, count, codec, raw_len, stored_len)
        if self._decode:
            self._state = _State.FRAME_BODY
        else:  # hash as it arrives
            assert self._chain is not None
            self._running = self._chain.running(self._frame.head)
            self._body_seen = 0
            self._state = _State.FRAME_PAYLOAD
        return True

    def _step_frame_payload(self) -> Event | bool | None:
        stored_len = self._cur.stored_len
        take = min(stored_len - self._body_seen, len(self._src) - self._off)
        if take:
            assert self._running is not None
            self._running.update(self._src[self._off : self._off + take])
            self._off += take
            self._pos += take
            self._body_seen += take
        if self._body_seen < stored_len:
            return None  # all of the input is consumed: nothing is left to gather
        self._state = _State.FRAME_TAIL
        return True

    def _step_frame_tail(self) -> Event | bool | None:
        pad = pad_len(self._cur.stored_len)
        tail = self._take(pad + DIGEST_BLOCK)
        if tail is None:
            return None
        if any(tail[:pad]) or any(tail[-32:]):
            raise KVPackError(f"frame {self._seq}: non-zero padding")
        assert self._running is not None
        digest, p = self._running.finish()
        self._running = None
        return self._frame_verified(digest, tail[pad : pad + 32], None, p)

    def _step_frame_body(self) -> Event | bool | None:
        f = self._cur
        body = self._take(body_len(f.stored_len))
        if body is None:
            return None
        stored = body[: f.stored_len]
        check_padding(body, f.stored_len, self._seq)
        assert self._chain is not None
        p = self._chain.payload((stored,))
        digest = self._chain.compute(f.head, (stored,), p)
        return self._frame_verified(digest, body[-DIGEST_BLOCK:-32], stored, p)

    def _frame_verified(self, digest: bytes, sent: memoryview, stored: memoryview | None,
                        p: bytes | None) -> FrameEvent:
        """The frame's digest against the one sent; on a match, link it and emit the frame
        (``stored`` None: decode=False, the payload was hashed as it arrived)."""
        f = self._cur
        if digest != sent:
            raise KVPackError(f"frame {self._seq} (layer {f.layer}, start {f.start}): digest mismatch (corrupt)",
                              hint=DAMAGED_PACK_HINT)
        assert self._chain is not None and self.header is not None
        self._chain.value = digest
        self._raw_total += f.raw_len
        payload = stored if stored is not None else memoryview(b"")
        keys, values = decode_frame(self.header, f.layer, f.count, f.codec, payload, f.raw_len,
                                    stored is not None and self._decode)
        ev = FrameEvent(self._seq, f.layer, f.start, f.count, f.codec, f.stored_len, keys, values, stored, p)
        self._seq += 1
        self._state = _State.FRAME_HEADER
        return ev

    def _step_end_digest(self) -> Event | bool | None:
        block = self._take(DIGEST_BLOCK)
        if block is None:
            return None
        assert self._chain is not None
        root = self._chain.root(self._cur.head)
        check_root(block, root)
        self.root_digest = root
        self._state = _State.DONE
        return EndEvent(root, self._pos, self._raw_total)

    @property
    def _cur(self) -> _Frame:
        assert self._frame is not None
        return self._frame


# The state machine as a table: each state's step (DONE has none: nothing more is read).
_STEPS = {
    _State.PREAMBLE: PackReader._step_preamble,
    _State.HEADER: PackReader._step_header,
    _State.FRAME_HEADER: PackReader._step_frame_header,
    _State.FRAME_PAYLOAD: PackReader._step_frame_payload,
    _State.FRAME_TAIL: PackReader._step_frame_tail,
    _State.FRAME_BODY: PackReader._step_frame_body,
    _State.END_DIGEST: PackReader._step_end_digest,
}


def frame_ends(data: bytes) -> tuple[int, list[int]]:
    """Where a whole pack's preamble and header end, and the byte offset just after each of
    its data frames (the places a stream cut there leaves only whole frames)."""
    reader, pos, head, ends = PackReader(), 0, 0, []
    while pos < len(data):
        n = max(1, reader.want())
        for ev in reader.feed(data[pos : pos + n]):
            if isinstance(ev, HeaderEvent):
                head = pos + n
            elif isinstance(ev, FrameEvent):
                ends.append(pos + n)
        pos += n
    return head, ends
