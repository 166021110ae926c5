"""A pool of resident producers (``prefill --serve``): each request goes to the least busy
healthy one; one that failed is skipped for a while (doubling back-off) and tried again
later; one that refused us for good (authentication, another model) is dropped for the
rest of the batch. With none left, jobs prefill locally and still complete."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from muser_cli.errors import (
    DataError, IdentityMismatch, MissingInput, MuserError, OutputError, SpotCheckFailed, TempFailure, UsageError,
)
from muser_cli.handoff.link import parse_hostport
from muser_cli.handoff.wire.refusal import NotInTime, ProducerBusy


@dataclass
class ProducerState:
    address: str
    busy: int = 0  # requests in flight
    served: int = 0
    failures: int = 0  # in a row
    down_until: float = 0.0
    gone: str | None = None  # why it is dropped for good
    last_error: str = ""  # the last failure (unreachable, cut, refused us): says it may be down
    last_declined: str = ""  # the last request it declined on its own merits (late, too large): it is up
    declined: int = 0

    def up(self, now: float) -> bool:
        """Reachable and serving as far as this consumer knows (a ``late`` is not down)."""
        return self.gone is None and self.down_until <= now

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        return {"address": self.address, "up": self.up(now), "served": self.served, "declined": self.declined,
                "failures": self.failures, "gone": self.gone, "last_error": self.last_error,
                "last_declined": self.last_declined}


def read_producers(path: Path) -> list[str]:
    """``--producers-file``: one HOST:PORT per line, ``#`` comments and blank lines ignored."""
    if not path.is_file():
        raise MissingInput(f"no such producers file: {path}")
    out = []
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def temporary(exc: BaseException) -> bool:
    """Worth trying that producer again later (busy, down, timed out, cut), or not (refused us)."""
    if isinstance(exc, MuserError):
        return isinstance(exc, TempFailure)
    return isinstance(exc, OSError)


def about_the_job(exc: BaseException) -> bool:
    """A refusal of this one request (a prompt too long, a have it would not serve) or a local
    failure (our disk): says nothing against the producer."""

    # a producer of another model (Reject(model): IdentityMismatch) refuses every job: not about this one
    if isinstance(exc, (NotInTime, ProducerBusy)):  # "not in time" or "queue full" now: the producer is up (#39, #47)
        return True
    return isinstance(exc, (DataError, OutputError)) and not isinstance(exc, (SpotCheckFailed, IdentityMismatch))


class ProducerPool:
    def __init__(self, addresses: Sequence[str], *, backoff_s: float = 2.0, max_backoff_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:

        seen: list[str] = []
        for a in addresses:
            parse_hostport(a)  # a bad address is a usage error before any job runs
            if a in seen:
                raise UsageError(f"--producer {a} is given twice")
            seen.append(a)
        self.states = [ProducerState(a) for a in seen]
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.states)

    def pick(self, exclude: Sequence[str] = ()) -> str | None:
        """The least busy producer that is up (and not in ``exclude``); None: none is. Counts it busy."""
        now = self._clock()
        with self._lock:
            up = [s for s in self.states if s.gone is None and s.down_until <= now and s.address not in exclude]
            if not up:
                return None
            best = min(up, key=lambda s: (s.busy, s.failures, s.served))
            best.busy += 1
            return best.address

    def done(self, address: str, error: BaseException | None = None) -> None:
        with self._lock:
            s = next(s for s in self.states if s.address == address)
            s.busy -= 1
            if error is None:
                s.served += 1
                s.failures = 0
                s.down_until = 0.0
                return
            said = " ".join(str(error).split())[:300]
            if about_the_job(error):
                s.last_declined, s.declined = said, s.declined + 1
                return
            s.last_error = said
            if temporary(error):
                s.failures += 1
                s.down_until = self._clock() + min(self.max_backoff_s, self.backoff_s * 2 ** (s.failures - 1))
            else:
                s.gone = s.last_error

    def release(self, address: str) -> None:
        """A producer :meth:`pick` counted busy that was not asked after all (the route chose local)."""
        with self._lock:
            s = next(s for s in self.states if s.address == address)
            s.busy -= 1

    def blame(self, address: str, error: BaseException) -> None:
        """A pack from ``address`` failed the consumer's checks: it writes wrong KV; dropped."""
        with self._lock:
            s = next(s for s in self.states if s.address == address)
            s.gone = s.last_error = " ".join(f"its pack was refused: {error}".split())[:300]

    def any_left(self) -> bool:
        with self._lock:
            return any(s.gone is None for s in self.states)

    def to_json(self) -> list[dict[str, Any]]:
        now = self._clock()
        with self._lock:
            return [s.to_json(now) for s in self.states]
