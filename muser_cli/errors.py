"""One error hierarchy for the whole library.

Only the command layer maps these to exit statuses (sysexits.h, see docs/cli-contract.md).
Every error carries a one-line message and an optional hint.
"""

from __future__ import annotations

from enum import IntEnum


class ExitStatus(IntEnum):
    """The product's exit statuses (docs/cli-contract.md): the only place their numbers are written."""

    OK = 0
    ERROR = 1  # an output could not be written, the OS refused, an internal error
    USAGE = 2  # the command line makes no sense
    DATA = 65  # EX_DATAERR: malformed, corrupt or mismatched data (a pack for another model)
    NO_INPUT = 66  # EX_NOINPUT
    TEMP_FAIL = 75  # EX_TEMPFAIL: fall back to local prefill, or retry later
    PROTOCOL = 76  # EX_PROTOCOL
    NO_PERM = 77  # EX_NOPERM: authentication or replay refused
    CONFIG = 78  # EX_CONFIG
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)


class MuserError(Exception):
    """Base class of every error the library raises on purpose."""

    exit_status: ExitStatus = ExitStatus.ERROR

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # one line, always
        return self.message.replace("\n", " ")


class UsageError(MuserError):
    """The caller asked for something that makes no sense (exit 2)."""

    exit_status = ExitStatus.USAGE


class DataError(MuserError):
    """Input data is malformed, corrupt or mismatched (exit 65, EX_DATAERR)."""

    exit_status = ExitStatus.DATA


class KVPackError(DataError):
    """A kvpack failed a structural or integrity check. The only error the reader raises."""


#: What to do about a pack whose bytes changed after they were written.
DAMAGED_PACK_HINT = ("the pack changed after it was written (disk, copy or link): make or fetch it again, "
                     "or give decode --prompt FILE to prefill locally")
#: What to do about a pack that ends early.
TRUNCATED_PACK_HINT = ("the pack ends early (a cut stream or a partial copy): fetch it again, "
                       "or give decode --prompt FILE to prefill what is missing locally")


class IdentityMismatch(DataError):
    """A kvpack is valid but was made for another model, tokenizer, prompt or position."""


class SpotCheckFailed(DataError):
    """A pack's rows disagree with this engine's recomputation of its last position(s) (exit 65).

    The pack is self-consistent (digests, fingerprints, ids) but numerically wrong: the
    producer's engine wrote wrong rows. A caller with the prompt may prefill locally."""


class GateIncomplete(SpotCheckFailed):
    """The numeric gate could not recompute every layer at every sampled position of a foreign
    pack (exit 65): a sliding-window model past its window whose pack carries no sliding
    history (docs/kvpack.md 1.3). Rows nobody checked are not decoded from; with a prompt the
    pack is set aside for local rows, as for any refusal of the gate."""


class PromptTooShort(DataError):
    """A prompt of under 2 tokens: there is nothing to hand off (exit 65)."""


class PromptTooLong(DataError):
    """A prompt (plus the new tokens asked for) longer than the model's context (exit 65)."""


class CorruptEntry(DataError):
    """A stored pack failed verification (or vanished); it has been removed from the store."""


class OutputError(MuserError):
    """An output could not be written (permission, disk full, I/O error): exit 1, naming the user's path."""


class MissingInput(MuserError):
    """An input file or model does not exist (exit 66, EX_NOINPUT)."""

    exit_status = ExitStatus.NO_INPUT


class TempFailure(MuserError):
    """Peer unreachable or timed out: the caller should fall back to local prefill (exit 75)."""

    exit_status = ExitStatus.TEMP_FAIL


class ProtocolError(MuserError):
    """The remote side broke the handoff protocol (exit 76, EX_PROTOCOL)."""

    exit_status = ExitStatus.PROTOCOL


class AuthError(MuserError):
    """Authentication failed or a replay was refused (exit 77, EX_NOPERM)."""

    exit_status = ExitStatus.NO_PERM


class ConfigError(MuserError):
    """Local configuration is missing or broken (exit 78, EX_CONFIG)."""

    exit_status = ExitStatus.CONFIG
