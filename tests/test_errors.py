"""The error tree and the 3xxx sync codes. No event loop."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

from shared import errors
from shared.errors import (
    ChainBroken,
    ChainError,
    ClockSkew,
    CursorTooOld,
    ErrorCode,
    Forbidden,
    FrameTooLarge,
    IdentityReused,
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
    3011: (ClockSkew, True),
    3012: (IdentityReused, True),
    3013: (ChainBroken, True),
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


@pytest.mark.parametrize("code", [0, 1000, 2999, 3000, 3014, 3999, 4000, -1])
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


# -- codes are named, never bare -----------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
_CODE_BLOCK = range(3000, 3100)  # the sync error codes' block


def bare_codes(source: str) -> list[tuple[int, str]]:
    """``(line, token)`` of every number or string literal in the 30xx block of ``source``.

    Prose in comments and docstrings may mention codes; a literal the code computes with may
    not (use ``ErrorCode``).
    """
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.NUMBER, tokenize.STRING):
            continue
        try:
            value = ast.literal_eval(tok.string)
        except (ValueError, SyntaxError):
            continue  # f-strings and the like
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value in _CODE_BLOCK:
            found.append((tok.start[0], tok.string))
    return found


def test_the_scanner_finds_bare_codes() -> None:
    sample = (
        '"""Docstrings may say 3004."""\n'
        "x = 3004  # comments may say 3009\n"
        'label = "3009"\n'
        "ok = ErrorCode.MALFORMED_FRAME, 300, 30041, 4004, 0xBBC\n"
    )
    assert bare_codes(sample) == [(2, "3004"), (3, '"3009"'), (4, "0xBBC")]


def test_no_bare_error_code_literals_in_shared_or_the_server() -> None:
    offenders = []
    for package in ("shared", "pleach_server"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "shared" / "errors.py":
                continue  # where the codes are defined
            for line, token in bare_codes(path.read_text(encoding="utf-8")):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {token}")
    assert not offenders, "use ErrorCode.<NAME>, not a bare code:\n" + "\n".join(offenders)
