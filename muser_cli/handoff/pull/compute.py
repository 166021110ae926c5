"""What the resident producer's :class:`~muser_cli.handoff.pull.server.PullServer` asks of the
engine side (:mod:`muser_cli.pulllane.producer`): the :class:`Compute` contract, and the defaults
of its optional members for a compute that leaves them out."""

from __future__ import annotations

from typing import Any, BinaryIO, Protocol, runtime_checkable

from muser_cli.handoff.wire.pull_protocol import PullRequest


@runtime_checkable
class Compute(Protocol):
    """What the server asks of the engine side (muser_cli.pulllane.producer): every member the
    server reads. ``check`` and ``run`` every compute has; ``max_concurrent`` and
    ``after_stream`` are optional: a compute without them gets :class:`ComputeDefaults`'
    (:class:`PullServer` fills them in), and may subclass that class to say so."""

    #: How many requests ``run`` may be given at once (the server's admission): 1 on torch and
    #: MLX; the batch size on an engine that batches (vLLM). Read once, when the server is made.
    max_concurrent: int
    #: Whether ``run`` takes ``pause``, called between chunks, where the request may give its
    #: turn to a shorter one with an earlier deadline (issue #39; the admission decides).
    preempts: bool

    def check(self, request: PullRequest) -> PullRequest | None:
        """Raise :class:`Refusal` (``model``, ``too_large``, ...) for a request it will not serve.
        May return the request to compute instead (a text request with its token ids filled in)."""

    def run(self, request: PullRequest, out: BinaryIO) -> dict[str, Any]:
        """Write the request's kvpack to ``out``, each frame as its chunk finishes; return stats.
        A compute with ``max_concurrent`` > 1 has ``run`` called from that many threads at once.
        One that ``preempts`` is called with ``pause=`` too: a callable for between two chunks
        (it returns when the request has its turn again)."""

    def after_stream(self, stats: dict[str, Any]) -> None:
        """Called once ``run``'s ``out`` is closed (work the consumer should not wait for, such
        as keeping the rows); it may add to ``stats``. Not called when ``run`` raised."""

    def estimate(self, request: PullRequest) -> float | None:
        """Seconds ``run`` is expected to take for ``request`` (None: no idea yet): the promise."""

    def rates(self) -> dict[str, float]:
        """Its prefill rate by depth, as measured: tokens per second by the end position's
        power-of-two bucket (a string key). Sent in each ``Promise``."""


class ComputeDefaults:
    """The optional members of :class:`Compute`, as a compute without them has them: one
    request at a time, nothing after the stream, no estimate."""

    max_concurrent: int = 1
    preempts: bool = False

    def after_stream(self, stats: dict[str, Any]) -> None:
        return None

    def estimate(self, request: PullRequest) -> float | None:
        return None

    def rates(self) -> dict[str, float]:
        return {}


class WithDefaults(ComputeDefaults):
    """A compute without every member of :class:`Compute`: the members it has answer, the
    others are :class:`ComputeDefaults`'."""

    def __init__(self, compute: Any) -> None:
        self.compute = compute
        self.max_concurrent = getattr(compute, "max_concurrent", ComputeDefaults.max_concurrent)
        self.preempts = bool(getattr(compute, "preempts", ComputeDefaults.preempts))

    def check(self, request: PullRequest) -> PullRequest | None:
        return self.compute.check(request)

    def run(self, request: PullRequest, out: BinaryIO, **kw: Any) -> dict[str, Any]:
        return self.compute.run(request, out, **kw)

    def after_stream(self, stats: dict[str, Any]) -> None:
        after = getattr(self.compute, "after_stream", None)
        if after is not None:
            after(stats)

    def estimate(self, request: PullRequest) -> float | None:
        got = getattr(self.compute, "estimate", None)
        return got(request) if got is not None else None

    def rates(self) -> dict[str, float]:
        got = getattr(self.compute, "rates", None)
        return got() if got is not None else {}


def with_defaults(compute: Any) -> Compute:
    """``compute`` itself when it has every member of :class:`Compute`; else it with the
    missing optional ones :class:`ComputeDefaults`' (``check`` and ``run`` it must have)."""
    return compute if isinstance(compute, Compute) else WithDefaults(compute)


__all__ = ["Compute", "ComputeDefaults", "WithDefaults", "with_defaults"]
