"""One error tree for pleach, and the 3xxx sync error codes.

::

    PleachError
    ├── InvalidState            an action in the wrong state of a state machine
    ├── NotFound                a session, checkpoint or record that does not exist
    ├── SessionLocked           provider/model of a session cannot change
    ├── StorageError            a local or server store failed (sqlite3, asyncpg translated)
    ├── ProviderError           an LLM provider call failed (anthropic translated)
    │   └── RequestRefused      a safety policy refused the model request (``policy_refused``)
    ├── ToolError               a tool failed or its input was invalid
    │   └── ToolRefused         a safety policy refused the tool call
    ├── ChainError              a hash chain does not verify
    ├── RecordTooLarge          a record over ``MAX_RECORD_BYTES``, refused before it is written
    ├── InvalidInput            a caller's input that cannot be stored (text that is not Unicode)
    └── SyncError               carries a 3xxx ``code`` and ``retryable``
        ├── Unauthorized        3001
        ├── Forbidden           3002
        ├── ProtocolVersion     3003
        ├── MalformedFrame      3004
        ├── FrameTooLarge       3005
        ├── SequenceGap         3006
        ├── InvalidRecord       3007
        ├── RateLimited         3008
        ├── StorageUnavailable  3009 (retryable)
        ├── CursorTooOld        3010 (resync)
        ├── ClockSkew           3011 (retryable: the device's clock)
        └── IdentityReused      3012 (the device takes a new client id and resends)

Foreign errors are translated where they enter: callers only ever catch ``PleachError``.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    UNAUTHORIZED = 3001
    FORBIDDEN = 3002
    PROTOCOL_VERSION = 3003
    MALFORMED_FRAME = 3004
    FRAME_TOO_LARGE = 3005
    SEQUENCE_GAP = 3006
    INVALID_RECORD = 3007
    RATE_LIMITED = 3008
    STORAGE_UNAVAILABLE = 3009
    CURSOR_TOO_OLD = 3010
    CLOCK_SKEW = 3011
    IDENTITY_REUSED = 3012
    CHAIN_BROKEN = 3013


class PleachError(Exception):
    """Root of every error pleach raises on purpose."""


class InvalidState(PleachError):
    """An action was attempted in a state that does not allow it."""


class NotFound(PleachError):
    """The named session, checkpoint or record does not exist (or is deleted)."""


class SessionLocked(PleachError):
    """A session's provider and model are locked at creation; create a new session instead."""


class StorageError(PleachError):
    """A store failed. ``retryable`` says whether trying again may succeed."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class ProviderError(PleachError):
    """A provider call failed; ``code`` is a short stable name such as ``overloaded``."""

    def __init__(
        self,
        message: str,
        *,
        code: str = "provider_error",
        retryable: bool = False,
        status: int | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable
        self.status = status
        self.request_id = request_id


class RequestRefused(ProviderError):
    """A safety policy (``policy``, its id) refused a model request before it was sent; the
    turn reports it as an ``error`` event with code ``policy_refused``."""

    def __init__(self, message: str, *, policy: str, code: str = "policy_refused") -> None:
        super().__init__(message, code=code)
        self.policy = policy


class ToolError(PleachError):
    """A tool failed or was called with invalid input."""


class ToolRefused(ToolError):
    """A safety policy (``policy``, its id) refused a tool call: it did not run, and the model
    gets an error tool result with the reason."""

    def __init__(self, message: str, *, policy: str) -> None:
        super().__init__(message)
        self.policy = policy


class ChainError(PleachError):
    """A hash chain failed to verify; ``index`` is the first bad position."""

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class RecordTooLarge(PleachError):
    """A record too large to sync (over ``shared.messages.MAX_RECORD_BYTES`` encoded): refused
    before anything is written, so it can never hold up the outbox."""


class InvalidInput(PleachError):
    """A caller's input that cannot be stored or synced (text with lone surrogates...):
    refused before anything is written."""


class SyncError(PleachError):
    """A sync failure with a 3xxx code, as sent in an ``Error`` frame."""

    code: ErrorCode = ErrorCode.MALFORMED_FRAME
    retryable: bool = False

    def __init__(self, message: str = "", *, retryable: bool | None = None) -> None:
        super().__init__(message or self.__class__.__name__)
        self.message = message or self.__class__.__name__
        if retryable is not None:
            self.retryable = retryable


class Unauthorized(SyncError):
    code = ErrorCode.UNAUTHORIZED


class Forbidden(SyncError):
    code = ErrorCode.FORBIDDEN


class ProtocolVersion(SyncError):
    code = ErrorCode.PROTOCOL_VERSION


class MalformedFrame(SyncError):
    code = ErrorCode.MALFORMED_FRAME


class FrameTooLarge(SyncError):
    code = ErrorCode.FRAME_TOO_LARGE


class SequenceGap(SyncError):
    code = ErrorCode.SEQUENCE_GAP
    retryable = True


class InvalidRecord(SyncError):
    code = ErrorCode.INVALID_RECORD


class RateLimited(SyncError):
    code = ErrorCode.RATE_LIMITED
    retryable = True


class StorageUnavailable(SyncError):
    code = ErrorCode.STORAGE_UNAVAILABLE
    retryable = True


class CursorTooOld(SyncError):
    code = ErrorCode.CURSOR_TOO_OLD


class ClockSkew(SyncError):
    """A stamp too far ahead of the server's clock: the device's clock is wrong. The change is
    kept and sent again later (retryable), never dead-lettered."""

    code = ErrorCode.CLOCK_SKEW
    retryable = True


class IdentityReused(SyncError):
    """A change arrived under a ``client_seq`` the server already used for a different change
    of that client id: another copy of the device's file (a restored backup, a copied file)
    is writing under the same id. The device takes a new id and resends; nothing is lost."""

    code = ErrorCode.IDENTITY_REUSED
    retryable = True


class ChainBroken(SyncError):
    """An audit row that does not continue its device's chain where the server holds it (its
    ``sequence_number`` and ``prev_hash`` are not the next place after the server's last row
    of that chain): the server did not take it. The answer names the server's last place; the
    device chains its queued rows of that chain on from there and sends them again. Nothing is
    lost (retryable)."""

    code = ErrorCode.CHAIN_BROKEN
    retryable = True


_BY_CODE: dict[int, type[SyncError]] = {
    cls.code: cls
    for cls in (
        Unauthorized,
        Forbidden,
        ProtocolVersion,
        MalformedFrame,
        FrameTooLarge,
        SequenceGap,
        InvalidRecord,
        RateLimited,
        StorageUnavailable,
        CursorTooOld,
        ClockSkew,
        IdentityReused,
        ChainBroken,
    )
}


def sync_error(code: int, message: str, *, retryable: bool | None = None) -> SyncError:
    """Build the ``SyncError`` subclass for a wire ``code`` (unknown codes give ``SyncError``)."""
    cls = _BY_CODE.get(code, SyncError)
    return cls(message, retryable=retryable)
