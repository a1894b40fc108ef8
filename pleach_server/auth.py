"""Signed bearer tokens that name a ``Tenant``.

A token is ``base64url(JSON claims) + "." + base64url(HMAC-SHA256(secret, first part))``,
unpadded. Claims are ``{"org", "user", "exp", "iat"}`` (seconds since the epoch; ``exp`` is
``null`` for a token that never expires). Tokens are checked before the WebSocket upgrade:
``verify_token`` raises ``Unauthorized`` (3001) for anything but a valid, unexpired token
signed with the server's secret.

The secret comes from ``PLEACH_SECRET`` or, for the embedded database, a file kept beside it
(``<db>.secret``, mode 0600, created on first run): see ``load_or_create_secret``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

import msgspec

from shared.errors import Unauthorized

from .store.base import Tenant

__all__ = [
    "SECRET_ENV",
    "Tenant",
    "issue_token",
    "load_or_create_secret",
    "parse_bearer",
    "secret_path",
    "verify_token",
]

SECRET_ENV = "PLEACH_SECRET"
_SECRET_BYTES = 32
# A token is a few hundred bytes; refuse to even decode anything much larger.
_MAX_TOKEN_CHARS = 4096


class _Claims(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    org: str
    user: str
    exp: int | None
    iat: int


_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[_Claims] = msgspec.json.Decoder(_Claims)


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    """Strict unpadded base64url: only its canonical text decodes (no junk characters, no
    trailing bits), so one token has exactly one spelling."""
    padded = text + "=" * (-len(text) % 4)
    data = base64.b64decode(padded.encode("ascii"), altchars=b"-_", validate=True)
    if _b64encode(data) != text:
        raise ValueError("not canonical base64url")
    return data


def _sign(secret: bytes, payload: str) -> bytes:
    return hmac.new(secret, payload.encode("ascii"), hashlib.sha256).digest()


def issue_token(secret: bytes, tenant: Tenant, ttl_s: int | None, now: float | None = None) -> str:
    """A token for ``tenant``, valid for ``ttl_s`` seconds (``None``: never expires).

    Hand it to the device, which sends it as ``Authorization: Bearer <token>``.
    """
    if not secret:
        raise ValueError("the signing secret is empty")
    if not tenant.org_id or not tenant.user_id:
        raise ValueError("a token needs a non-empty org and user")
    if ttl_s is not None and ttl_s <= 0:
        raise ValueError(f"ttl must be positive, got {ttl_s}")
    issued = int(time.time() if now is None else now)
    claims = _Claims(
        org=tenant.org_id,
        user=tenant.user_id,
        exp=None if ttl_s is None else issued + ttl_s,
        iat=issued,
    )
    payload = _b64encode(_encoder.encode(claims))
    return f"{payload}.{_b64encode(_sign(secret, payload))}"


def verify_token(secret: bytes, token: str | None, now: float | None = None) -> Tenant:
    """The tenant a token names; raises ``Unauthorized`` unless it is valid now.

    Missing, malformed, forged (bad signature) and expired tokens are all refused; the
    message says which, so logs can tell them apart (it never echoes the token).
    """
    return verify_token_expiry(secret, token, now)[0]


def verify_token_expiry(
    secret: bytes, token: str | None, now: float | None = None
) -> tuple[Tenant, int | None]:
    """``verify_token``, with the token's ``exp`` (None: it never expires)."""
    if not token:
        raise Unauthorized("missing bearer token")
    if len(token) > _MAX_TOKEN_CHARS:
        raise Unauthorized("malformed token: too long")
    payload, sep, signature = token.partition(".")
    if not sep or not payload or not signature or "." in signature:
        raise Unauthorized("malformed token")
    try:
        given = _b64decode(signature)
        raw_claims = _b64decode(payload)
    except (binascii.Error, ValueError) as exc:
        raise Unauthorized("malformed token: bad base64") from exc
    # Check the signature before looking at the claims: never parse forged input further.
    if not hmac.compare_digest(given, _sign(secret, payload)):
        raise Unauthorized("invalid token signature")
    try:
        claims = _decoder.decode(raw_claims)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise Unauthorized("malformed token claims") from exc
    if not claims.org or not claims.user:
        raise Unauthorized("malformed token claims: empty org or user")
    current = time.time() if now is None else now
    if claims.exp is not None and current >= claims.exp:
        raise Unauthorized("token expired")
    return Tenant(org_id=claims.org, user_id=claims.user), claims.exp


def parse_bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, or ``None``."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def secret_path(db_path: str | os.PathLike[str]) -> Path:
    """Where the secret for a database file lives: ``<db>.secret`` beside it."""
    path = Path(db_path)
    return path.with_name(path.name + ".secret")


def load_or_create_secret(db_path: str | os.PathLike[str]) -> bytes:
    """The token signing secret for the server whose database is ``db_path``.

    ``PLEACH_SECRET`` wins when set. Otherwise the secret file beside the database is read,
    or created (0600, 32 random bytes, hex) on first run. Raises ``ValueError`` for a database
    URL with no ``PLEACH_SECRET`` (there is no file to keep it beside) or an empty secret file.
    """
    env = os.environ.get(SECRET_ENV)
    if env:
        return env.encode("utf-8")
    if "://" in os.fspath(db_path):
        raise ValueError(f"set {SECRET_ENV}: a database URL has no place for a secret file")
    path = secret_path(db_path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        fd = -1
    if fd < 0:
        value = path.read_text("ascii").strip()
        if not value:
            raise ValueError(f"secret file {path} is empty; remove it or set {SECRET_ENV}")
        return value.encode("ascii")
    value = secrets.token_hex(_SECRET_BYTES)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(value + "\n")
    return value.encode("ascii")
