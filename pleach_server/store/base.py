"""The ``ServerStore`` protocol: what the sync server needs from its database.

Two implementations pass one conformance suite: ``SQLiteServerStore`` (embedded default) and
``PostgresServerStore`` (asyncpg). A push batch commits in ONE transaction together with the
device's ``last_seq``; every applied record is appended to the tenant's feed under a
monotonic ``cursor``. A pull never skips a change that commits later under a lower cursor.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Sequence
from types import TracebackType
from typing import Final, NamedTuple, Protocol, Self, runtime_checkable

import msgspec

from shared import compact
from shared.clock import HybridClock
from shared.errors import StorageError
from shared.idrefs import ID_LAYOUT, IdLayout, id_blocks, ids_apart, ids_joined
from shared.messages import ChangeResult, FeedBody
from shared.records import Change, FeedChange, Record, Session


class Tenant(msgspec.Struct, frozen=True, kw_only=True):
    """Who a connection acts for, from its bearer token."""

    org_id: str
    user_id: str


def packed_tenant(tenant: Tenant) -> bytes:
    """The tenant's org and user as a compact body holds them, one after the other: what a
    store's short body of the tenant's rows leaves out (``compact.short_body``'s ``tenant``),
    and what its reads are given to put back (the SQLite store keeps it in
    ``tenants.packed``; the PostgreSQL store binds it)."""
    return compact.packed(tenant.org_id) + compact.packed(tenant.user_id)


@functools.lru_cache(maxsize=1024)
def device_node(client_id: str) -> bytes:
    """``compact.stamp_node`` of a pushing device's id (kept for the devices seen lately): what
    a store's short body of that device's own records leaves out of its stamp
    (``compact.short_body``'s ``node``), and what its reads are given to put back (each
    store numbers it in a table ``nodes``, and a row that left it out names its number);
    ``b""`` for an id no stamp names so."""
    return compact.stamp_node(client_id)


class PushResult(msgspec.Struct, kw_only=True):
    """``cursors`` are the feed cursors this push wrote (empty when nothing was applied).

    ``previous_head`` is the tenant's feed head just before this push's rows, read under its
    lock, and ``feed`` those rows as a pull would return them; both are left out (None, [])
    when the push wrote no feed row or deleted a session (whose cascade may remove some of
    them again before the commit). ``as_pushed``: the push wrote feed rows and every one is an
    ``applied`` change as the device pushed it (an event at the pushed place and hashes, only
    marked canonical). With ``previous_head``, which says where those rows start, the device
    may take its cursor past them without reading them back (protocol 5's
    ``PushAck.as_pushed_from``); without it, it says nothing.
    """

    results: list[ChangeResult]
    last_seq: int
    head_cursor: int
    cursors: list[int] = []
    feed: list[FeedChange] = []
    previous_head: int | None = None
    as_pushed: bool = False
    bodies: list[bytes] = []
    """The stored bytes of each of ``feed``'s records, in order (empty when ``feed`` is):
    what a live page to a device at protocol 6 carries, and what its size is counted by."""


class PullResult(msgspec.Struct, kw_only=True):
    """A page of the feed: its entries as records (``changes``), or, from ``pull(raw=True)``,
    as their stored bytes (``bodies``, with ``changes`` empty)."""

    changes: list[FeedChange]
    to_cursor: int
    more: bool
    bodies: list[FeedBody] = []

    def entries(self) -> list[FeedChange]:
        """The page's entries as records, decoded from ``bodies`` when it holds them."""
        return feed_changes(self.bodies) if self.bodies else self.changes


class DeviceHealth(msgspec.Struct, kw_only=True):
    """The latest ``Health`` a device sent, as the server keeps it (``health`` is the frame's
    msgpack encoding; ``seen_at`` the server's clock when it arrived)."""

    org_id: str
    user_id: str
    client_id: str
    seen_at: float
    health: bytes

    @classmethod
    def of(cls, tenant: Tenant, client_id: str, health: bytes, seen_at: float) -> DeviceHealth:
        """The report ``health`` of ``tenant``'s device ``client_id``, seen at ``seen_at``."""
        return cls(
            org_id=tenant.org_id,
            user_id=tenant.user_id,
            client_id=client_id,
            seen_at=seen_at,
            health=health,
        )


MAX_DEVICES_PER_TENANT = 64
"""How many devices' health a store keeps per tenant; the least recently seen go first."""

DEFAULT_PULL_BYTES = 1024 * 1024
"""The byte budget of a pull or live page (a quarter of the default frame limit)."""


@runtime_checkable
class ServerStore(Protocol):
    """A server database. Use as ``async with``; ``open()`` applies migrations."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def __aenter__(self) -> Self: ...
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
    async def healthy(self) -> bool:
        """True when the database answers a trivial query now."""
        ...

    async def client_state(self, tenant: Tenant, client_id: str) -> tuple[int, int]:
        """``(last_seq, head_cursor)`` for a device, for ``Welcome``."""
        ...

    async def push(
        self,
        tenant: Tenant,
        client_id: str,
        changes: list[Change],
        clock: HybridClock,
        *,
        aliases: Collection[str] = (),
        chains: bool = True,
        skipped: Collection[int] = (),
        bodies: Collection[bytes] = (),
    ) -> PushResult:
        """Apply a batch idempotently in one transaction; see ``store/apply.py`` for rules.

        ``clock`` is the server's HLC; ``clock.client_id`` is the server id whose version-vector
        entry is bumped when a conflict is settled. Raises ``StorageUnavailable`` (3009,
        retryable) when the database is unreachable; nothing of the batch is then committed.
        ``aliases`` are the device's earlier client ids (``Hello.previous_client_ids``).
        ``chains``: check that audit rows continue their chains (protocol 3 and later).
        ``skipped``: numbers in sequence with ``changes`` that carry no record (protocol 4).
        ``bodies``: the bytes each change's record arrived in, in order (protocol 6; empty:
        none): a record stored as pushed is stored in them (``Bodies``).
        """
        ...

    async def pull(
        self,
        tenant: Tenant,
        cursor: int,
        limit: int,
        max_bytes: int | None = None,
        *,
        raw: bool = False,
    ) -> PullResult:
        """Feed entries with ``cursor > cursor``, at most ``limit``, in cursor order.

        ``raw``: the entries as their stored bytes (``PullResult.bodies``), not decoded.

        ``max_bytes`` bounds the page by the stored size of its records as well: entries are
        taken while their sizes add up to at most it, and the first entry always (a record
        larger than the budget travels alone); ``more`` says the page was cut. Bodies past the
        cut are not read. Raises ``CursorTooOld`` (3010) when ``0 < cursor`` predates the
        retained feed; a pull from 0 is always served (a full resync).
        """
        ...

    async def head_cursor(self, tenant: Tenant) -> int: ...

    async def put_health(self, reports: Sequence[DeviceHealth]) -> None:
        """Keep each of ``reports`` as its device's latest, in one transaction (a server
        writes the reports of a second together: ``pleach_server.health``). A report older
        than the one kept (``seen_at``: another server process wrote a newer one) is not
        kept. At most ``MAX_DEVICES_PER_TENANT`` devices are kept per tenant: the least
        recently seen go."""
        ...

    async def list_health(self, limit: int = 1000) -> list[DeviceHealth]:
        """The latest health of every device, most recently seen first, at most ``limit``."""
        ...

    async def compact_feed(self, tenant: Tenant, keep_after_cursor: int) -> int:
        """Compact the tenant's feed up to ``keep_after_cursor``; return entries dropped.

        Log compaction: an entry goes only when a later entry of the same record exists (an
        older version of a session); the latest version of every record stays, so a pull from
        cursor 0 is always a complete resync. Records the tenant's feed floor (it never moves
        back, nor past the head): a ``pull`` from a cursor ``0 < cursor < floor`` raises
        ``CursorTooOld`` (3010), and the device resyncs from 0.
        """
        ...


def decode_body(body: bytes | memoryview) -> Record:
    """A stored body: the compact form (``shared.compact``, what protocol 6 carries), or the
    map form (``encode_record``) that servers before the compact form wrote. Raises
    ``msgspec.DecodeError`` when it is corrupt."""
    return compact.decode(body)


_RAW = msgspec.msgpack.Decoder(msgspec.Raw)


def _missing(cursor: int) -> StorageError:
    return StorageError(f"the feed entry at cursor {cursor} refers to a missing record")


def _corrupt(cursor: int) -> StorageError:
    return StorageError(f"corrupt feed entry at cursor {cursor}")


def feed_change(cursor: int, body: bytes | memoryview | None) -> FeedChange:
    """A stored feed entry as a record; ``StorageError`` when its record is missing or
    corrupt."""
    if body is None:
        raise _missing(cursor)
    try:
        return FeedChange(cursor=cursor, record=decode_body(body))
    except msgspec.DecodeError as exc:
        raise _corrupt(cursor) from exc


def feed_body(cursor: int, body: bytes | None) -> FeedBody:
    """A stored feed entry as it travels (protocol 6): its bytes, checked to be one whole
    msgpack value (a corrupt row is a ``StorageError`` here, not a page the device cannot
    read), and not decoded."""
    if body is None:
        raise _missing(cursor)
    try:
        return FeedBody(cursor, _RAW.decode(body))
    except msgspec.DecodeError as exc:
        raise _corrupt(cursor) from exc


def feed_changes(bodies: Iterable[FeedBody]) -> list[FeedChange]:
    """Feed entries in stored bytes as records (for a device before protocol 6)."""
    return [feed_change(entry.cursor, memoryview(entry.body)) for entry in bodies]


def feed_page(
    taken: list[tuple[int, bytes | None]], cursor: int, more: bool, *, raw: bool
) -> PullResult:
    """A pull's page of the stored entries ``taken`` (cursor and body, in cursor order): as
    records, or with ``raw`` as their stored bytes. Its ``to_cursor`` is the last entry's
    (``cursor``, where the pull started, when there is none)."""
    return PullResult(
        changes=[] if raw else [feed_change(c, b) for c, b in taken],
        bodies=[feed_body(c, b) for c, b in taken] if raw else [],
        to_cursor=taken[-1][0] if taken else cursor,
        more=more,
    )


def decode_session(session_id: str, body: bytes) -> Session:
    """A stored session row; ``StorageError`` when it is corrupt."""
    try:
        session = decode_body(body)
    except msgspec.DecodeError as exc:
        raise StorageError(f"corrupt session row {session_id!r}") from exc
    if not isinstance(session, Session):
        raise StorageError(f"corrupt session row {session_id!r}: holds a {type(session).__name__}")
    return session


def decode_stored(kind: str, record_id: str, body: bytes) -> Record:
    """A stored record of ``kind``; ``StorageError`` when it is corrupt."""
    try:
        return decode_body(body)
    except msgspec.DecodeError as exc:
        raise StorageError(f"corrupt {kind} row {record_id!r}") from exc


# -- a long session's message ids in blocks -------------------------------------------------
# A session of more message ids than ``IdLayout.inline`` keeps them in blocks of
# ``IdLayout.block`` ids beside its row (``session_ids``), so that a turn writes the block it
# appended to, not every id the session has: the row was rewritten whole at each turn
# (320 KB at 20,000 ids). A pull puts the list back in its place, byte for byte.


APART: Final = b"\xc1"
"""The first byte of a session row's body whose ids are in blocks, before the body kept
apart from them: msgpack never uses it, so a reader that knows nothing of blocks (a server
process of the build before schema 9 and 12) finds the row corrupt, a coded error its
device retries, and never serves or merges the session as if it named no message. A body
without it is whole, whatever ``ids_count`` says (such a process wrote the version)."""


class SessionRow(NamedTuple):
    """How a session's new version is written (``session_row``)."""

    body: bytes
    """The row's body: the version's, or, when its ids are in blocks, ``APART`` and the
    version's with an empty list in their place."""
    ids_count: int | None
    """How many ids its blocks hold; None: they are in the body."""
    puts: list[tuple[int, bytes]]
    """The blocks ``(part, ids)`` to write (insert or replace)."""
    drop_from: int | None
    """Drop the session's blocks from this part on (None: none to drop)."""
    held: bytes = b""
    """The ids its blocks hold once written (16 bytes an id; ``b""``: none)."""


def session_row(body: bytes, stored: bytes | None, layout: IdLayout = ID_LAYOUT) -> SessionRow:
    """How a session's version ``body`` is stored, where its blocks hold ``stored`` (16 bytes
    an id; ``b""``: it has none; None: not read in this transaction, then every block is
    written and any past them dropped). Pure."""
    inline, block = layout
    apart = ids_apart(body, inline + 1)
    if apart is None:
        return SessionRow(body, None, [], None if stored == b"" else 0)
    rest, data = apart
    size = 16 * block
    parts = -(-len(data) // size)
    # Unknown blocks: every block is written, and any past them dropped.
    drop = stored is None or -(-len(stored) // size) > parts
    puts = id_blocks(data, stored or b"", block)
    return SessionRow(APART + rest, len(data) // 16, puts, parts if drop else None, data)


def stored_session(session_id: str, body: bytes, count: int | None, ids: bytes | None) -> Session:
    """A stored session row, its message ids from its blocks (``ids``, joined) when ``count``
    says it has them; ``StorageError`` when it is corrupt."""
    if count is None or body[:1] != APART:
        return decode_session(session_id, body)
    session = decode_session(session_id, body[1:])
    if ids is None or len(ids) != 16 * count or session.state.message_ids:
        held = 0 if ids is None else len(ids) // 16
        raise StorageError(
            f"corrupt session row {session_id!r}: its id blocks hold {held} ids, not {count}"
        )
    session.state.message_ids = compact.id_list_texts(ids)
    return session


def stored_body(
    cursor: int, body: bytes | None, count: int | None, ids: bytes | None
) -> bytes | None:
    """A feed entry's body as it travels: a session row's with its blocks' ids (``ids``)
    back in place when ``count`` says it has them and the body is kept apart (``APART``);
    ``StorageError`` when they do not fit."""
    if body is None or count is None or body[:1] != APART:
        return body
    whole = None if ids is None or len(ids) != 16 * count else ids_joined(body[1:], ids)
    if whole is None:
        raise _corrupt(cursor)
    return whole
