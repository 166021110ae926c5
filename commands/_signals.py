"""SIGTERM and SIGHUP for the resident commands (`receive --listen`, `prefill --serve`).

The first one asks the command to drain: accept nothing new, finish what is in flight,
print one summary line and exit 0. Its handler then restores the default action, so a
second SIGTERM or SIGHUP ends the process at once (143 or 129), as an operator expects.
A signal the process was started ignoring (SIGHUP under `nohup`) stays ignored.
"""

from __future__ import annotations

import signal
import threading

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def drain_on_signals() -> tuple[threading.Event, dict[str, str]]:
    """An event the first SIGTERM or SIGHUP sets; ``got["signal"]`` then names it."""
    stop = threading.Event()
    got: dict[str, str] = {}

    def handler(signum: int, _frame) -> None:
        got.setdefault("signal", signal.Signals(signum).name)
        stop.set()
        for s in DRAIN_SIGNALS:  # a second one: the default action, at once
            signal.signal(s, signal.SIG_DFL)

    for s in DRAIN_SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:  # `nohup muser ...` keeps ignoring SIGHUP
            signal.signal(s, handler)
    return stop, got
