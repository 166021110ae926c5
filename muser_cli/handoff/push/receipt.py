"""What a receiver is given and what it reports: its settings (:class:`ReceiveConfig`), the
record of one accepted handoff (:class:`Accepted`), and the error that ends a receiver
whose forwarded stream a failed handoff cut (:func:`stream_failure`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from muser_cli.errors import MuserError, TempFailure
from muser_cli.handoff.wire.header import DEFAULT_WINDOW_S
from muser_cli.handoff.link import DEFAULT_IDLE_S
from muser_cli.handoff.wire.refusal import Refusal, error_class

DEFAULT_MAX_PAYLOAD = 64 << 30


@dataclass
class ReceiveConfig:
    host: str = "127.0.0.1"
    port: int = 0
    once: bool = True
    timeout: float | None = None  # stop then; TempFailure if nothing was accepted by then
    max_payload: int = DEFAULT_MAX_PAYLOAD
    window_s: float = DEFAULT_WINDOW_S
    handshake_s: float = 10.0
    idle_s: float = DEFAULT_IDLE_S
    session_s: float = 3600.0
    queue: int = 16
    queue_s: float = 30.0
    max_pending: int = 256
    probe_max_s: float = 10.0


@dataclass
class Accepted:
    handoff_id: str
    key_id: str
    sender: str
    peer: str
    payload_bytes: int
    root_digest: str
    model_fingerprint: str
    path: str
    ledger_commit_ms: float
    elapsed_s: float
    frames: int = 0  # kvpack data frames verified
    first_byte_s: float | None = None  # first payload byte received, seconds since process start
    last_byte_s: float | None = None  # last payload byte received
    first_byte_unix: float | None = None  # the same instants as Unix times
    last_byte_unix: float | None = None
    acked: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def stream_failure(exc: BaseException, frames: int) -> BaseException:
    """What ends a receiver whose forwarded stream a failed handoff cut (no end frame went out)."""
    if isinstance(exc, Refusal):
        if exc.fatal is not None:
            return exc.fatal
        cls: type[MuserError] = error_class(exc.code)
        text = f"{exc.code}: {exc.message}"
    elif isinstance(exc, MuserError):
        cls, text = type(exc), str(exc)
    else:
        cls, text = TempFailure, f"{type(exc).__name__}: {exc}"
    err = cls(f"handoff failed after {frames} verified frames were forwarded ({text}); no end frame was forwarded")
    err.hint = "decode with --prompt to keep the verified chunks and prefill the rest locally"
    return err
