"""Producers that fail, for the fallback benchmark (benchmarks/bench_fallback.py): an
address nobody listens on, one that accepts TCP and never speaks, and a reader that notes
when its input ends (the moment decode knows to fall back). Nothing here prints or exits."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator


@contextlib.contextmanager
def failing_producers() -> Iterator[tuple[str, str]]:
    """``(down, hung)`` addresses on 127.0.0.1: connection refused, and accepted but silent."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    down_addr = "127.0.0.1:%d" % closed.getsockname()[1]
    closed.close()  # nobody listens there now: connection refused
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_say_nothing() -> None:
        hung.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(hung.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    try:
        yield down_addr, "127.0.0.1:%d" % hung.getsockname()[1]
    finally:
        stop.set()
        for s in held:
            s.close()
        hung.close()


class EndTimed:
    """A reader, noting when it ends: ``end`` seconds after ``t0`` (None while data flows)."""

    def __init__(self, inner: Any, t0: float) -> None:
        self.inner, self.t0, self.end = inner, t0, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _note(self, data: bytes) -> bytes:
        if not data and self.end is None:
            self.end = time.perf_counter() - self.t0
        return data

    def read(self, *a: Any) -> bytes:
        return self._note(self.inner.read(*a))

    def read1(self, *a: Any) -> bytes:
        return self._note(self.inner.read1(*a))

    def readinto(self, b: Any) -> int:
        n = self.inner.readinto(b)
        self._note(b"" if not n else b"x")
        return n
