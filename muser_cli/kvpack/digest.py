"""The digests a kvpack chain may use, and the chain itself for each format version.

v1.0: one SHA-256 chain over every frame's header and stored bytes.
v1.1: the header names ``blake3`` (the default) or ``sha256`` as H; each stored payload is
hashed on its own, p_k = H(payload_k), and the chain binds the frame header (with its
sequence number) and p_k: d_k = H(d_{k-1} || frame_header_k || p_k). Payloads can then be
hashed on several threads (both hash libraries release the GIL) while the chain stays a
strict order. docs/kvpack.md 2.3 is the normative text.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable

from muser_cli.errors import KVPackError
from muser_cli.threads import usable_cpus

DIGESTS = ("blake3", "sha256")
DEFAULT_DIGEST = "blake3"
DIGEST_BYTES = 32


def hasher(name: str) -> Callable[..., Any]:
    """A constructor ``H(data=b"")`` for digest ``name`` (hashlib-like objects, 32-byte digests)."""
    if name == "sha256":
        return hashlib.sha256
    if name == "blake3":
        try:
            from blake3 import blake3
        except ImportError:  # a declared dependency; say what is missing rather than fail later
            raise KVPackError("this kvpack's digest is blake3, but the blake3 package is not installed "
                              "(pip install blake3)") from None
        return blake3
    raise KVPackError(f"digest {name!r} is unknown (known: {', '.join(DIGESTS)})")


def payload_digest(h: Callable[..., Any], parts: Iterable[bytes | memoryview]) -> bytes:
    """p = H(part_0 || part_1 || ...): the stored payload may come in pieces (views, no join)."""
    m = h()
    for part in parts:
        m.update(part)
    return m.digest()


def link(h: Callable[..., Any], prev: bytes, frame_header: bytes | memoryview, p: bytes) -> bytes:
    """d_k = H(d_{k-1} || frame_header_k || p_k) (v1.1)."""
    m = h(prev)
    m.update(frame_header)
    m.update(p)
    return m.digest()


def root_of(h: Callable[..., Any], prev: bytes, end_header: bytes | memoryview) -> bytes:
    """root = H(d_last || end_frame_header) (v1.0 with H = SHA-256, and v1.1)."""
    m = h(prev)
    m.update(end_header)
    return m.digest()


# ---------------------------------------------------------------- a small worker pool
_POOL: ThreadPoolExecutor | None = None


def workers() -> int:
    """Threads for hashing and zstd: MUSER_KVPACK_THREADS, else min(4, usable CPUs). A
    process pinned to one core hashes inline: a pool there only adds hand-offs."""
    env = os.environ.get("MUSER_KVPACK_THREADS", "")
    if env.isdigit() and int(env) >= 1:
        return min(int(env), 64)
    return min(4, usable_cpus())


def task_bytes(total: int) -> int:
    """How many bytes of consecutive frames one pool task takes: a few MiB, so that a hand-off
    (a future, a wake-up, the GIL taken back) is paid per run of frames rather than per
    frame, yet small enough that every worker gets several tasks of a pack of ``total`` bytes."""
    return max(256 << 10, min(4 << 20, total // (4 * max(1, workers()))))


def pool() -> ThreadPoolExecutor | None:
    """The shared pool, or None when one thread is all there is (work then runs inline)."""
    global _POOL
    n = workers()
    if n <= 1:
        return None
    if _POOL is None or _POOL._max_workers != n:  # noqa: SLF001 (re-read of the env var in tests)
        _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvpack")
    return _POOL


class Chain:
    """The running chain value of one pack; ``minor`` picks the v1.0 or v1.1 rule.

    ``compute`` returns d_k without moving the chain (a reader compares it first);
    ``value`` is the last accepted digest (d_header at the start).
    """

    def __init__(self, minor: int, name: str, d_header: bytes) -> None:
        self.v1_0 = minor == 0
        self.name = "sha256" if self.v1_0 else name
        self.h = hashlib.sha256 if self.v1_0 else hasher(name)
        self.value = d_header

    @property
    def parallel(self) -> bool:
        """Payload digests do not depend on the chain (v1.1): they may be computed ahead."""
        return not self.v1_0

    def payload(self, parts: Iterable[bytes | memoryview]) -> bytes | None:
        """p_k (v1.1), or None for v1.0 (whose payload is hashed inside the chain)."""
        return None if self.v1_0 else payload_digest(self.h, parts)

    def compute(self, frame_header: bytes | memoryview, parts: Iterable[bytes | memoryview] = (),
                p: bytes | None = None) -> bytes:
        if self.v1_0:
            m = hashlib.sha256(self.value)
            m.update(frame_header)
            for part in parts:
                m.update(part)
            return m.digest()
        return link(self.h, self.value, frame_header, p if p is not None else payload_digest(self.h, parts))

    def root(self, end_header: bytes | memoryview) -> bytes:
        return root_of(self.h, self.value, end_header)

    def running(self, frame_header: bytes) -> "Running":
        """d_k computed as the payload arrives in pieces (``update``), without holding it."""
        return Running(self, frame_header)


class Running:
    """One frame's digest fed piece by piece: v1.0 hashes d_{k-1} || frame header || payload
    in one SHA-256; v1.1 hashes the payload alone (p_k), then links it. Same values as
    :meth:`Chain.compute` over the whole payload."""

    def __init__(self, chain: Chain, frame_header: bytes) -> None:
        self._chain = chain
        self._fh = frame_header
        if chain.v1_0:
            self._m = hashlib.sha256(chain.value)
            self._m.update(frame_header)
        else:
            self._m = chain.h()

    def update(self, piece: bytes | memoryview) -> None:
        self._m.update(piece)

    def finish(self) -> tuple[bytes, bytes | None]:
        """(d_k, p_k); p_k is None for v1.0."""
        if self._chain.v1_0:
            return self._m.digest(), None
        p = self._m.digest()
        return link(self._chain.h, self._chain.value, self._fh, p), p
