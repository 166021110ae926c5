"""A refusal: the wire's Reject codes and the one table that says which error each one is.

Either side refuses a handoff or a pull by raising :class:`Refusal` with a Reject code
(``protocol.REJECT_CODES``); the side that receives the ``Reject`` (or that refused on its
own, as a consumer refusing a pack) turns the code into an error with :func:`error_class`.
``model`` is mismatched data (65, :class:`IdentityMismatch`): a pack, or a producer, for
another model or tokenizer, on both lanes (docs/cli-contract.md).
"""

from __future__ import annotations

from muser_cli.errors import AuthError, DataError, IdentityMismatch, MuserError, ProtocolError, TempFailure
from muser_cli.handoff.wire.protocol import REJECT_CODES

class NotInTime(TempFailure):
    """A producer's ``Reject(late)``: it cannot finish this request within the budget the request
    carried (``budget_ms``). About this request only (the producer is up): fall back at once."""


class ProducerBusy(TempFailure):
    """A producer's ``Reject(busy)``: its queue for this consumer is full (``--max-queue``) or it
    is stopping. About this moment (the producer is up): fall back at once, ask again later."""


REJECT_ERRORS: dict[str, type[MuserError]] = {
    "late": NotInTime,
    "busy": ProducerBusy, "timeout": TempFailure, "storage": TempFailure, "aborted": TempFailure,
    "auth": AuthError, "replay": AuthError, "stale": AuthError,
    "data": DataError, "too_large": DataError, "model": IdentityMismatch,
    "protocol": ProtocolError,
}
assert set(REJECT_ERRORS) == set(REJECT_CODES), "every Reject code has one error class"


class Refusal(Exception):
    """Refuse this handoff with a Reject code; ``fatal`` stops the receiver afterwards."""

    def __init__(self, code: str, message: str, *, fatal: BaseException | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fatal = fatal


def error_class(code: str) -> type[MuserError]:
    """The error a refusal with ``code`` is (a code outside the protocol: the peer broke it)."""
    return REJECT_ERRORS.get(code, ProtocolError)


def refusal_error(exc: Refusal, text: str | None = None) -> BaseException:
    """The error a :class:`Refusal` raised on this side ends it with: its ``fatal`` error if it
    carries one, else its code's error with ``text`` (default ``"code: message"``)."""
    if exc.fatal is not None:
        return exc.fatal
    return error_class(exc.code)(text or f"{exc.code}: {exc.message}")
