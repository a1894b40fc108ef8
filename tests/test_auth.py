"""Bearer tokens: pure, no event loop."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest

from pleach_server.auth import (
    Tenant,
    issue_token,
    load_or_create_secret,
    parse_bearer,
    secret_path,
    verify_token,
)
from shared.errors import ErrorCode, Unauthorized

SECRET = b"s3cret-for-tests"
ALICE = Tenant(org_id="acme", user_id="alice")
NOW = 1_700_000_000.0


def test_round_trip() -> None:
    token = issue_token(SECRET, ALICE, ttl_s=60, now=NOW)
    assert verify_token(SECRET, token, now=NOW + 59) == ALICE


def test_no_expiry() -> None:
    token = issue_token(SECRET, ALICE, ttl_s=None, now=NOW)
    assert verify_token(SECRET, token, now=NOW + 10 * 365 * 86400) == ALICE


def test_expired() -> None:
    token = issue_token(SECRET, ALICE, ttl_s=60, now=NOW)
    with pytest.raises(Unauthorized, match="expired") as info:
        verify_token(SECRET, token, now=NOW + 60)
    assert info.value.code is ErrorCode.UNAUTHORIZED


def test_wrong_secret_is_forged() -> None:
    token = issue_token(b"another secret", ALICE, ttl_s=60, now=NOW)
    with pytest.raises(Unauthorized, match="signature"):
        verify_token(SECRET, token, now=NOW)


def test_tampered_claims_are_forged() -> None:
    token = issue_token(SECRET, ALICE, ttl_s=60, now=NOW)
    payload, sig = token.split(".")
    claims = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    evil = claims.replace(b'"alice"', b'"mallory"')
    evil_payload = base64.urlsafe_b64encode(evil).rstrip(b"=").decode()
    with pytest.raises(Unauthorized, match="signature"):
        verify_token(SECRET, f"{evil_payload}.{sig}", now=NOW)


@pytest.mark.parametrize(
    "token",
    [None, "", "abc", "a.b.c", ".", "abc.", ".abc", "!!!.???", "x" * 5000],
)
def test_malformed(token: str | None) -> None:
    with pytest.raises(Unauthorized):
        verify_token(SECRET, token, now=NOW)


def test_signed_garbage_claims_are_malformed() -> None:
    import hashlib
    import hmac

    payload = base64.urlsafe_b64encode(b'{"org": 1}').rstrip(b"=").decode()
    sig = hmac.new(SECRET, payload.encode(), hashlib.sha256).digest()
    token = f"{payload}.{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}"
    with pytest.raises(Unauthorized, match="malformed"):
        verify_token(SECRET, token, now=NOW)


def test_issue_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        issue_token(b"", ALICE, ttl_s=60)
    with pytest.raises(ValueError):
        issue_token(SECRET, ALICE, ttl_s=0)
    with pytest.raises(ValueError):
        issue_token(SECRET, Tenant(org_id="", user_id="x"), ttl_s=60)


def test_parse_bearer() -> None:
    assert parse_bearer("Bearer abc") == "abc"
    assert parse_bearer("bearer  abc ") == "abc"
    assert parse_bearer("Basic abc") is None
    assert parse_bearer("Bearer") is None
    assert parse_bearer(None) is None


def test_secret_file_created_once_with_0600(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PLEACH_SECRET", raising=False)
    db = tmp_path / "server.db"
    first = load_or_create_secret(db)
    path = secret_path(db)
    assert path == tmp_path / "server.db.secret"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(first) >= 32
    assert load_or_create_secret(db) == first


def test_secret_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLEACH_SECRET", "from-env")
    assert load_or_create_secret(tmp_path / "server.db") == b"from-env"
    assert not secret_path(tmp_path / "server.db").exists()


def test_secret_for_a_url_needs_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLEACH_SECRET", raising=False)
    with pytest.raises(ValueError, match="PLEACH_SECRET"):
        load_or_create_secret("postgresql://db/pleach")


@pytest.mark.parametrize("junk", ["!", " ", "==", "A", "\n", "%", "AA"])
def test_a_signature_with_trailing_junk_is_refused(junk: str) -> None:
    """One token, one spelling: characters appended to a valid token make it invalid."""
    token = issue_token(SECRET, ALICE, ttl_s=60, now=NOW)
    assert verify_token(SECRET, token, now=NOW) == ALICE
    with pytest.raises(Unauthorized):
        verify_token(SECRET, token + junk, now=NOW)
