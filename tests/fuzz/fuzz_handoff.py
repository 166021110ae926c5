"""Coverage-guided fuzzing of what a handoff peer parses from the network (atheris):
the V3 header and trailer, the pull lane's request, and both sans-IO connection cores
(frames of every type, in any order, fed in odd-sized pieces).

Contract: every input either parses or raises a MuserError (one line, a documented exit
status); no other exception, no hang. Run (docs/benchmarks.md states the counts):

    python tests/fuzz/fuzz_handoff.py -atheris_runs=1000000 -timeout=10 -max_len=4096
    python tests/fuzz/fuzz_handoff.py --only=request -atheris_runs=1000000 ...   # one surface

``--only=header|trailer|request|v3|pull`` fuzzes one surface alone (every input goes to
it), so each gets its own count of executions.

tests/handoff/test_fuzz_handoff.py drives :func:`one_input` on mutated valid inputs without atheris.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

try:
    import atheris
except ImportError:  # the pytest drive needs none of it
    atheris = None

import json  # noqa: E402,F401  (imported first: only muser's own code is instrumented)
import re  # noqa: E402,F401

if atheris is not None:
    with atheris.instrument_imports(include=["muser_cli"]):
        from muser_cli.errors import MuserError
        from muser_cli.handoff.wire import pull_protocol as pull
        from muser_cli.handoff.wire.header import parse_header, parse_trailer
        from muser_cli.handoff.wire.protocol import Connection, ConnectionClosed, Role
else:
    from muser_cli.errors import MuserError
    from muser_cli.handoff.wire import pull_protocol as pull
    from muser_cli.handoff.wire.header import parse_header, parse_trailer
    from muser_cli.handoff.wire.protocol import Connection, ConnectionClosed, Role

MAX_EVENTS = 10_000


def _drain(conn, data: bytes) -> None:
    """Feed ``data`` in pieces whose sizes the data itself picks, then EOF; pull every event."""
    pos, step = 0, (data[0] % 7 + 1) if data else 1
    events = 0
    for piece_end in list(range(step, len(data), step)) + [len(data)]:
        conn.receive_data(data[pos:piece_end])
        pos = piece_end
        while events < MAX_EVENTS:
            ev = conn.next_event()
            events += 1
            if isinstance(ev, ConnectionClosed) or type(ev).__name__ == "_NeedData":
                break
    conn.receive_data(b"")
    while events < MAX_EVENTS:
        ev = conn.next_event()
        events += 1
        if isinstance(ev, ConnectionClosed) or type(ev).__name__ == "_NeedData":
            return


SURFACES = ("header", "trailer", "request", "v3", "pull")
ONLY: int | None = None  # --only=NAME: the index of the one surface fuzzed


def one_input(data: bytes) -> None:
    if not data:
        return
    if ONLY is not None:
        target, body = ONLY, data
    else:
        target, body = data[0] % 5, data[1:]
    try:
        if target == 0:
            parse_header(body)
        elif target == 1:
            parse_trailer(body)
        elif target == 2:
            pull.parse_request(body)
        elif target == 3:
            _drain(Connection(Role.RECEIVER if len(body) % 2 else Role.SENDER), body)
        else:
            _drain(pull.PullConnection(pull.Side.PRODUCER if len(body) % 2 else pull.Side.CONSUMER), body)
    except MuserError as exc:
        assert "\n" not in str(exc), repr(str(exc))


if __name__ == "__main__":
    assert atheris is not None, "pip install atheris"
    for arg in list(sys.argv[1:]):
        if arg.startswith("--only="):
            ONLY = SURFACES.index(arg.split("=", 1)[1])
            sys.argv.remove(arg)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
