"""The error tree and the 3xxx sync codes. No event loop."""

from __future__ import annotations

import pytest

from shared import errors
from shared.errors import (
    ChainError,
    ClockSkew,
    CursorTooOld,
    ErrorCode,
    Forbidden,
    FrameTooLarge,
    InvalidRecord,
    InvalidState,
    MalformedFrame,
    NotFound,
    PleachError,
    ProtocolVersion,
    ProviderError,
    RateLimited,
    SequenceGap,
    SessionLocked,
    StorageError,
    StorageUnavailable,
    SyncError,
    ToolError,
    Unauthorized,
    sync_error,
)

BY_CODE: dict[int, tuple[type[SyncError], bool]] = {
    3001: (Unauthorized, False),
    3002: (Forbidden, False),
    3003: (ProtocolVersion, False),
    3004: (MalformedFrame, False),
    3005: (FrameTooLarge, False),
    3006: (SequenceGap, True),
    3007: (InvalidRecord, False),
    3008: (RateLimited, True),
    3009: (StorageUnavailable, True),
    3010: (CursorTooOld, False),
    3011: (ClockSkew, False),
}


def test_table_covers_every_code() -> None:
    assert set(BY_CODE) == {int(code) for code in ErrorCode}


@pytest.mark.parametrize("code", sorted(BY_CODE))
def test_sync_error_maps_code_to_class(code: int) -> None:
    cls, retryable = BY_CODE[code]
    err = sync_error(code, "went wrong")
    assert type(err) is cls
    assert err.code == code
    assert int(err.code) == code
    assert err.retryable is retryable
    assert err.message == "went wrong"
    assert str(err) == "went wrong"
    assert isinstance(err, SyncError)
    assert isinstance(err, PleachError)


@pytest.mark.parametrize("code", sorted(BY_CODE))
@pytest.mark.parametrize("override", [True, False])
def test_sync_error_retryable_override(code: int, override: bool) -> None:
    err = sync_error(code, "x", retryable=override)
    assert err.retryable is override
    # The override is per instance: the class default is untouched.
    assert BY_CODE[code][0]("y").retryable is BY_CODE[code][1]


@pytest.mark.parametrize("code", [0, 1000, 2999, 3000, 3012, 3999, 4000, -1])
def test_unknown_code_gives_plain_sync_error(code: int) -> None:
    err = sync_error(code, "from the future")
    assert type(err) is SyncError
    assert err.message == "from the future"
    assert err.retryable is False
    assert sync_error(code, "x", retryable=True).retryable is True


def test_empty_message_falls_back_to_class_name() -> None:
    assert RateLimited().message == "RateLimited"
    assert str(sync_error(3005, "")) == "FrameTooLarge"


def test_every_error_class_is_a_pleach_error() -> None:
    classes = [
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, BaseException)
    ]
    assert len(classes) >= 19
    for cls in classes:
        assert issubclass(cls, PleachError), cls
    for cls in (
        InvalidState,
        NotFound,
        SessionLocked,
        StorageError,
        ProviderError,
        ToolError,
        ChainError,
        SyncError,
    ):
        assert cls.__bases__ == (PleachError,)
    for cls, _ in BY_CODE.values():
        assert cls.__bases__ == (SyncError,)


def test_error_attributes() -> None:
    assert StorageError("disk", retryable=True).retryable is True
    assert StorageError("disk").retryable is False
    perr = ProviderError("busy", code="overloaded", retryable=True, status=529, request_id="r1")
    assert (perr.code, perr.retryable, perr.status, perr.request_id) == (
        "overloaded",
        True,
        529,
        "r1",
    )
    assert ChainError("bad", index=3).index == 3
