"""Read a kvpack while it is still arriving: a reader thread verifies each frame against
the chain and places its rows, so the consumer can load its model meanwhile and decode as
soon as the end frame verifies — or, when the stream is cut, keep what verified.

Rows are placed into one array per layer, allocated when the header arrives (from sizes
the header declares, bounded by the format's limits), so a finished stream needs no
concatenation; with ``spare_rows`` each full layer's array has that much room after its
rows, so an engine can use it as its cache without a copy (the rows are handed out as a
view of it). Nothing is handed out as a whole pack unless the end frame's root digest
verified and no byte followed it; a cut stream hands out only :meth:`StreamedPack.prefix`,
whole chunks whose every frame verified. A state layer (kvpack 1.3) has no rows: each of
its frames is a snapshot superseding the last; at most two are kept (the last whole
chunk's and the arriving one's), so a cut stream resumes with the snapshot of its last
whole chunk (docs/kvpack.md 2.5).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from muser_cli.errors import KVPackError
from muser_cli.kvpack.alloc import slab_arrays
from muser_cli.kvpack.format import PackHeader
from muser_cli.kvpack.layers import DTYPES, LayerKV, StateKV, split_state, state_kv
from muser_cli.kvpack.reader import EndEvent, FrameEvent, HeaderEvent, KVPack, PackReader, read_step


@dataclass
class Cut:
    """A stream that ended before its end frame verified."""

    reason: str  # the reader's one-line account ("truncated kvpack: input ended after 7 frames")
    frames: int  # frames that verified


class StreamedPack:
    """Reads ``src`` on a thread. ``header()`` waits for the header (None: empty input);
    ``result()`` waits for the end: a verified :class:`KVPack`, or a :class:`Cut`.
    A corrupt frame raises :class:`KVPackError` from both (nothing of it is handed out)."""

    def __init__(self, src: BinaryIO, *, max_bytes: int | None = None, spare_rows: int = 0) -> None:
        self._src = src
        self._spare = max(0, int(spare_rows))
        self._reader = PackReader(max_bytes=max_bytes)
        self._header_ready = threading.Event()
        self._done = threading.Event()
        self._ready = threading.Event()  # the end frame verified, or the stream ended
        self._header: PackHeader | None = None
        self._error: KVPackError | None = None
        self._cut: Cut | None = None
        self._end: EndEvent | None = None
        self._keys: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self._got: list[int] = []  # per layer: rows placed, from the layer's first row
        # per state layer: its newest verified snapshots as (position, decoded bytes), at most
        # two: the one of the chunk arriving and the one of the last chunk that arrived whole
        self._snaps: list[list[tuple[int, np.ndarray]]] = []
        self._stored = 0
        self.frames = 0
        self.first_byte_t: float | None = None  # perf_counter of the first byte (None: none came)
        self.last_frame_t: float | None = None  # perf_counter when the last data frame verified
        self.end_t: float | None = None  # perf_counter when the stream ended (end frame or EOF)
        self._thread = threading.Thread(target=self._run, name="kvpack-stream", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ consumer side
    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def header(self) -> PackHeader | None:
        self._header_ready.wait()
        if self._header is None and self._error is not None:
            raise self._error
        return self._header

    def result(self) -> KVPack | Cut:
        """The pack as soon as its end frame (root digest) verified — not when the input
        ends, which in a pipe is when the upstream process exits; :meth:`confirm_end`
        then checks that nothing followed. A Cut when the input ended first."""
        self._ready.wait()
        if self._error is not None:
            raise self._error
        if self._cut is not None:
            return self._cut
        h, end = self._header, self._end
        assert h is not None and end is not None
        # a state layer: its newest snapshot, and the one before it (the numeric gate's checkpoint)
        layers = [state_kv(h, i, self._snaps[i][-1][1] if self._snaps[i] else None, dict(self._snaps[i][:-1]))
                  if k is None
                  else LayerKV(keys=k[:, : h.layer_rows(i)], values=v[:, : h.layer_rows(i)],
                               first_row=h.layer_first_row(i))
                  for i, (k, v) in enumerate(zip(self._keys, self._values))]
        return KVPack(header=h, layers=layers, root_digest=end.root_digest, total_bytes=end.total_bytes,
                      stored_bytes=self._stored)

    def confirm_end(self) -> None:
        """Wait for the end of input and raise :class:`KVPackError` if any byte followed the
        end frame (a pack is whole only if it ends where its end frame says)."""
        self._done.wait()
        if self._error is not None:
            raise self._error

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`result` to be ready (the end frame verified,
        or the stream ended); whether it is."""
        return self._ready.wait(timeout)

    def wait_header(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`header` to be ready; whether it is."""
        return self._header_ready.wait(timeout)

    @property
    def whole(self) -> bool:
        """Whether :meth:`result` is ready with a whole pack (its end frame verified), now."""
        return self._ready.is_set() and self._error is None and self._cut is None and self._end is not None

    def prefix(self, chunk_tokens: int) -> tuple[int, list[LayerKV]]:
        """After a cut: the deepest chunk boundary ``r`` at which every layer's cache as of
        ``r`` positions verified, and those rows (full layers [0, r), sliding layers their
        last window-1 rows before r). (0, []) when nothing usable arrived."""
        self._done.wait()
        return self.verified(chunk_tokens)

    def verified(self, chunk_tokens: int) -> tuple[int, list[LayerKV]]:
        """:meth:`prefix` as of now, while the stream may still be arriving (a hedge's race,
        :mod:`muser_cli.consumer.hedge`): rows below what verified are final, never written
        again, so they are handed out as views; a state layer's snapshots are read once."""
        h = self._header
        got = list(self._got)
        snaps = [list(s) for s in self._snaps]
        best = self._boundary(chunk_tokens, got, snaps)
        if h is None or best == 0:
            return 0, []
        out: list = []
        for i, spec in enumerate(h.layers):
            first = h.layer_first_row(i)
            if spec.kind == "state":  # the snapshot at exactly ``best`` (_covers found it)
                raw = next(raw for p, raw in snaps[i] if p == best)
                out.append(StateKV(tensors=split_state(spec, raw), position=best, first_row=first))
                continue
            lo = best - spec.carried_rows(best) - first
            hi = best - first
            out.append(LayerKV(keys=self._keys[i][:, lo:hi], values=self._values[i][:, lo:hi],
                               first_row=best - spec.carried_rows(best)))
        return best, out

    def boundary(self, chunk_tokens: int) -> int:
        """The row count :meth:`verified` would hand out now, without building the views (a
        race's check after each of its own chunks)."""
        return self._boundary(chunk_tokens, list(self._got), [list(s) for s in self._snaps])

    def _boundary(self, chunk_tokens: int, got: list[int], snaps: list[list[tuple[int, np.ndarray]]]) -> int:
        h = self._header
        if h is None or self._error is not None or h.rows_start != 0 or chunk_tokens < 1:
            return 0
        best = 0
        r = chunk_tokens
        while r < h.rows_end:
            if all(self._covers(i, r, got, snaps) for i in range(len(h.layers))):
                best = r
            r += chunk_tokens
        return best

    def _covers(self, i: int, r: int, got: list[int], snaps: list[list[tuple[int, np.ndarray]]]) -> bool:
        h = self._header
        assert h is not None
        first = h.layer_first_row(i)
        if h.layers[i].kind == "state":
            return any(p == r for p, _ in snaps[i])
        return first <= r - h.layers[i].carried_rows(r) and first + got[i] >= r

    # ------------------------------------------------------------------ reader thread
    def _run(self) -> None:
        reader = self._reader
        try:
            while True:
                # exactly the next step, read into a buffer of its own: parsed in place
                chunk = read_step(self._src, reader)
                if self.first_byte_t is None:
                    self.first_byte_t = time.perf_counter()
                if not len(chunk):
                    break
                for ev in reader.feed(chunk, owned=True):
                    self._on_event(ev)
            if self.end_t is None:
                self.end_t = time.perf_counter()
            if reader.bytes_consumed == 0 and self._header is None:
                self.first_byte_t = None  # empty input: no handoff
                return
            try:
                reader.finish()
            except KVPackError as exc:
                if self._header is None:
                    raise
                self._cut = Cut(str(exc), self.frames)
        except KVPackError as exc:
            self._error = exc
            self.end_t = time.perf_counter()
        except OSError as exc:  # the pipe or file failed under us: a cut, never decodable
            if self._header is None:
                self._error = KVPackError(f"input failed: {exc}")
            else:
                self._cut = Cut(f"input failed: {exc}", self.frames)
            self.end_t = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - this thread never prints: the caller gets one line
            self._error = KVPackError(_unexpected(exc, self._header))
            self.end_t = time.perf_counter()
        finally:
            self._header_ready.set()
            self._ready.set()
            self._done.set()

    def _on_event(self, ev: object) -> None:
        """Place one verified event's rows (the header's: allocate every layer's array)."""
        if isinstance(ev, HeaderEvent):
            h = ev.header
            np_dtype = np.dtype(DTYPES[h.dtype][1])
            shapes, row_layers = [], []
            for i, spec in enumerate(h.layers):
                self._got.append(0)
                self._snaps.append([])
                self._keys.append(None)  # type: ignore[arg-type] - a state layer has no rows
                self._values.append(None)  # type: ignore[arg-type]
                if spec.kind == "state":
                    continue
                rows = h.layer_rows(i) + (self._spare if spec.kind == "full" and h.layer_first_row(i) == 0 else 0)
                shapes += [(spec.kv_heads, rows, spec.head_dim), (spec.kv_heads, rows, spec.v_head_dim)]
                row_layers.append(i)
            carved = slab_arrays(shapes, np_dtype) if shapes else []  # one allocation (kvpack/alloc.py says why)
            for j, i in enumerate(row_layers):
                self._keys[i], self._values[i] = carved[2 * j], carved[2 * j + 1]
            self._header = h
            self._header_ready.set()
        elif isinstance(ev, FrameEvent):
            h = self._header
            assert h is not None
            a = ev.start - h.layer_first_row(ev.layer)
            if h.layers[ev.layer].kind == "state":  # chunk-major: the one before the newest arrived whole
                snaps = self._snaps[ev.layer]
                snaps.append((ev.start + ev.count, ev.keys))
                del snaps[:-2]
                self._got[ev.layer] = a + ev.count
                self._stored += ev.stored_bytes
                self.frames += 1
                self.last_frame_t = time.perf_counter()
                return
            # The plan is contiguous per layer, so rows arrive in order.
            self._keys[ev.layer][:, a : a + ev.count] = ev.keys
            self._values[ev.layer][:, a : a + ev.count] = ev.values
            self._got[ev.layer] = a + ev.count
            self._stored += ev.stored_bytes
            self.frames += 1
            self.last_frame_t = time.perf_counter()
        elif isinstance(ev, EndEvent):
            self._end = ev
            self.end_t = time.perf_counter()
            self._ready.set()


def _unexpected(exc: Exception, header: PackHeader | None) -> str:
    """One line for a failure the reader thread did not expect (the caller raises it)."""
    if isinstance(exc, MemoryError):
        want = "" if header is None else f" (its header declares {header.total_raw_bytes():,} bytes of KV)"
        return f"not enough memory to read this kvpack{want}"
    return f"reading the kvpack failed: {type(exc).__name__}: {exc}"
