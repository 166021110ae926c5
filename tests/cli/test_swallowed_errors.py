"""Issue 25 item 5: no error is swallowed without a reason; what can be reported is reported."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from muser_cli.errors import DataError
from muser_cli.handoff.wire.pull_protocol import PullConnection, Side
from muser_cli.handoff.pull.server import PullServer
from muser_cli.handoff.push.receiver import Receiver
from muser_cli.handoff.wire.refusal import Refusal


def _listener(fail_on: set[str]):
    heard: list[tuple[str, dict]] = []

    def on_event(kind: str, fields: dict) -> None:
        if kind in fail_on:
            raise KeyError(kind)
        heard.append((kind, fields))

    return heard, on_event


@pytest.mark.parametrize("server", [Receiver, PullServer])
def test_a_raising_event_callback_is_reported_once_as_a_warning_and_the_rest_still_heard(server):
    """The old ``suppress(Exception)`` dropped every failure silently; now the first is told (a
    ``warning`` event, which ``receive`` prints), later ones counted, and no event is lost."""
    heard, on_event = _listener({"accepted"})
    owner = SimpleNamespace(on_event=on_event)
    for kind in ("listening", "accepted", "accepted", "rejected"):
        server._emit(owner, kind, peer="127.0.0.1")  # never raises into a connection thread
    kinds = [k for k, _ in heard]
    assert kinds == ["listening", "warning", "rejected"]
    assert "KeyError" in heard[1][1]["warning"] and "'accepted'" in heard[1][1]["warning"]
    assert owner._events.failures == 2


def test_a_callback_that_fails_on_its_warning_too_is_counted_not_recursed():
    heard, on_event = _listener({"accepted", "warning"})
    owner = SimpleNamespace(on_event=on_event)
    Receiver._emit(owner, "accepted")
    Receiver._emit(owner, "accepted")
    assert heard == [] and owner._events.failures == 3


class _Link:
    def __init__(self, error: BaseException) -> None:
        self.conn = PullConnection(Side.PRODUCER)
        self.error = error
        self.sock = SimpleNamespace(settimeout=lambda s: None, recv=lambda n: b"")

    def send(self, event, during: str) -> None:
        raise self.error


def _server():
    return SimpleNamespace(_lock=threading.Lock(), counters={"refused": 0}, _emit=lambda *a, **k: None)


def test_a_refusal_to_a_peer_that_is_gone_is_quiet_but_a_bug_is_not_hidden():
    """Sending a Reject is best effort (the peer may have gone: the refusal is in the event); the
    AssertionError the handler also swallowed could only hide a bug, and now surfaces."""
    PullServer._refuse(_server(), _Link(BrokenPipeError(32, "gone")), "p", Refusal("busy", "x"), None)
    PullServer._refuse(_server(), _Link(DataError("x")), "p", Refusal("busy", "x"), None)
    with pytest.raises(AssertionError):
        PullServer._refuse(_server(), _Link(AssertionError("a bug")), "p", Refusal("busy", "x"), None)


def test_a_prefetch_that_cannot_start_leaves_the_next_job_to_pull_itself_and_a_bug_fails_the_line():
    from muser_cli.batch.runner import Batch

    def batch(error: BaseException):
        def prefetch(p, *, after, schedule):
            raise error
        return SimpleNamespace(_prefetch=prefetch)

    nxt = SimpleNamespace(job=SimpleNamespace(line=2))
    fetches: dict = {}
    for expected in (DataError("store unreadable"), OSError(5, "I/O error"), RuntimeError("can't start new thread")):
        Batch._start_prefetch(batch(expected), nxt, after=None, schedule=8, fetches=fetches)
        assert fetches == {}  # no prefetch: the job pulls (or computes) itself
    with pytest.raises(TypeError):
        Batch._start_prefetch(batch(TypeError("a bug")), nxt, after=None, schedule=8, fetches=fetches)


def test_closing_ray_workers_that_died_is_best_effort():
    from muser_cli.batch.on_ray import _close_workers

    killed: list = []

    class Dead:
        def __init__(self) -> None:
            self.close = SimpleNamespace(remote=lambda: "ref")

    def kill(actor) -> None:
        killed.append(actor)
        raise RuntimeError("actor died")

    def get(refs, timeout):
        raise TimeoutError("GetTimeoutError")

    actors = [Dead(), Dead()]
    _close_workers(SimpleNamespace(get=get, kill=kill), actors)  # neither raises
    assert killed == actors  # every worker is still ended after one failed


def test_a_connection_error_or_warning_event_is_a_line_on_stderr_not_dropped(capsys):
    """``receive`` and ``prefill --serve`` rendered neither ``error`` (a connection thread that
    failed) nor, for prefill, ``warning``: the event reached the command and went unread."""
    from muser_cli.commands import receive
    from muser_cli.commands._common import trouble_line

    receive._render("error", {"peer": "127.0.0.1:5", "error": "ValueError: boom"})
    receive._render("warning", {"warning": "the event callback failed"})
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["receive: error: a connection from 127.0.0.1:5 failed: ValueError: boom",
                     "receive: warning: the event callback failed"]
    assert trouble_line("prefill", "error", {"error": "x"}) == "prefill: error: a connection from ? failed: x"
    assert trouble_line("prefill", "request", {}) is None
