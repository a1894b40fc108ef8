"""Local stores: the ``StorageAdapter`` protocol, ``MemoryAdapter``, ``SQLiteAdapter`` and
``PostgresAdapter``, and ``from_url`` / ``from_env`` to pick one by URL or environment.

``PostgresAdapter`` (and asyncpg) is imported on first use, so a device on SQLite never loads
it.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .base import CommitReceipt, DeadLetter, OutboxEntry, StorageAdapter, WriteBatch
from .memory import MemoryAdapter
from .sqlite import SQLiteAdapter

if TYPE_CHECKING:
    from .postgres import PostgresAdapter

__all__ = [
    "STORE_ENV",
    "CommitReceipt",
    "DeadLetter",
    "MemoryAdapter",
    "OutboxEntry",
    "PostgresAdapter",
    "SQLiteAdapter",
    "StorageAdapter",
    "WriteBatch",
    "from_env",
    "from_url",
]

STORE_ENV: Final = "PLEACH_STORE"
"""The environment variable ``from_env`` reads: a store URL (see ``from_url``)."""

# A scheme of two letters or more: "C:" is a drive, not a scheme.
_SCHEME: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")
_FORMS = (
    "'memory:', 'sqlite:///relative/path.db', 'sqlite:////absolute/path.db', a plain file "
    "path, or 'postgresql://user@host:port/database?device=KEY'"
)


def from_url(url: str, *, device_key: str | None = None) -> StorageAdapter:
    """A new, unopened store for ``url``; the runtime (or ``async with``) opens it.

    - ``memory:``: a ``MemoryAdapter`` (nothing survives the process).
    - ``sqlite:///device.db`` (relative) or ``sqlite:////var/lib/app/device.db`` (absolute),
      or a plain path with no scheme: a ``SQLiteAdapter`` on that file.
    - ``postgresql://...`` or ``postgres://...``: a ``PostgresAdapter``. Its device key is the
      ``device`` query parameter or ``device_key`` (one of them, required); a ``schema``
      parameter names the schema (default ``pleach_client``). Both are taken out of the URL;
      the other parameters (``sslmode=...``) go to the driver.

    Raises ``ValueError`` naming the accepted forms for anything else.
    """
    found = _SCHEME.match(url)
    scheme = found[1].lower() if found else ""
    if scheme == "memory" and url.lower() in ("memory:", "memory://"):
        return MemoryAdapter()
    if scheme == "sqlite":
        path = url[len("sqlite://") :]
        if not path.startswith("/") or len(path) < 2:
            raise ValueError(f"store URL {url!r}: a SQLite URL needs a path; use {_FORMS}")
        return SQLiteAdapter(path[1:])
    if scheme in ("postgresql", "postgres"):
        return _postgres(url, device_key)
    if scheme or not url:
        raise ValueError(f"store URL {url!r} is not one of {_FORMS}")
    return SQLiteAdapter(url)


def from_env(default: str = "memory:", *, device_key: str | None = None) -> StorageAdapter:
    """``from_url`` of ``$PLEACH_STORE``, or of ``default`` when it is unset or empty."""
    return from_url(os.environ.get(STORE_ENV) or default, device_key=device_key)


def _postgres(url: str, device_key: str | None) -> StorageAdapter:
    from .postgres import DEFAULT_SCHEMA, PostgresAdapter

    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {key: value for key, value in query if key in ("device", "schema")}
    dsn = urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in query if k not in ours])))
    in_url = ours.get("device")
    if in_url is not None and device_key is not None and in_url != device_key:
        raise ValueError(f"store URL names device {in_url!r} but device_key is {device_key!r}")
    key = device_key if device_key is not None else in_url
    if not key:
        raise ValueError(
            "a PostgreSQL store needs a device key: add ?device=KEY to the URL or pass "
            "device_key= (one key per device; each user's runtime is one)"
        )
    return PostgresAdapter(dsn, device_key=key, schema=ours.get("schema") or DEFAULT_SCHEMA)


def __getattr__(name: str) -> Any:
    if name == "PostgresAdapter":
        return importlib.import_module(".postgres", __name__).PostgresAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
