"""Builders for server-store tests: a ``Device`` makes well-formed records and numbered changes.

Every record carries the device's tenant and ``client_id`` and a fresh stamp from the device's
own ``HybridClock``, exactly as a real device would write it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from pleach_server.store.base import PullResult, PushResult, Tenant, feed_changes
from shared import compact
from shared.clock import HybridClock, vv_bump, wall_clock_ms
from shared.hashchain import GENESIS, chain_audit
from shared.ids import uuid7
from shared.messages import FeedBody
from shared.records import (
    ArtifactUpdate,
    AuditRow,
    Change,
    Checkpoint,
    Event,
    Message,
    Outcome,
    Record,
    Session,
    SessionState,
)

DAY_MS = 24 * 60 * 60 * 1000


def rewrite_page(result: PullResult, change: Callable[[Record], Record]) -> PullResult:
    """``result`` (changed in place) with each record replaced by ``change(record)``, in the
    form it holds them: as records, or as stored bytes (``pull(raw=True)``, protocol 6)."""
    for entry in result.changes:
        entry.record = change(entry.record)
    result.bodies = [
        FeedBody(c.cursor, msgspec.Raw(compact.encode(change(c.record))))
        for c in feed_changes(result.bodies)
    ]
    return result


def rewrite_push(result: PushResult, change: Callable[[Record], Record]) -> PushResult:
    """``result`` (changed in place) with each record of its live page replaced by
    ``change(record)``, both as records and as the stored bytes a live page carries."""
    for entry in result.feed:
        entry.record = change(entry.record)
    if result.bodies:
        result.bodies = [compact.encode(entry.record) for entry in result.feed]
    return result


def new_tenant() -> Tenant:
    """A tenant no other test uses (stores on a shared database stay independent)."""
    return Tenant(org_id=f"org-{uuid7()}", user_id=f"user-{uuid7()}")


class Device:
    """One device of a tenant: its clock, its ``client_seq`` counter and record builders."""

    def __init__(
        self,
        tenant: Tenant,
        client_id: str | None = None,
        *,
        wall: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self.tenant = tenant
        self.client_id = client_id or f"dev-{uuid7()}"
        self.clock = HybridClock(self.client_id, wall=wall)
        self.next_seq = 1
        self.audit_head: tuple[int, str] = (0, GENESIS)
        """The place of the last audit row made here: the next one is chained on from it."""

    # -- changes -------------------------------------------------------------------------------

    def changes(self, *records: Record) -> list[Change]:
        """Number ``records`` with the device's next ``client_seq`` values."""
        out = []
        for record in records:
            out.append(Change(client_seq=self.next_seq, record=record))
            self.next_seq += 1
        return out

    # -- records -------------------------------------------------------------------------------

    def _base(self) -> dict[str, Any]:
        return {
            "org_id": self.tenant.org_id,
            "user_id": self.tenant.user_id,
            "client_id": self.client_id,
            "hlc": self.clock.now(),
        }

    def session(
        self, *, title: str = "", message_ids: Iterable[str] = (), id: str | None = None
    ) -> Session:
        base = self._base()
        return Session(
            id=id or uuid7(),
            provider="scripted",
            model="scripted-1",
            created_at=base["hlc"],
            updated_at=base["hlc"],
            vv={self.client_id: 1},
            title=title,
            state=SessionState(message_ids=list(message_ids)),
            **base,
        )

    def edit(self, session: Session, **fields: Any) -> Session:
        """A new version of ``session`` written here: own vv entry bumped, fresh stamps.

        ``message_ids`` (if given) replaces the state's list; other fields are set as given.
        """
        self.clock.observe(session.updated_at)
        now = self.clock.now()
        message_ids = fields.pop("message_ids", None)
        state = session.state
        if message_ids is not None:
            state = msgspec.structs.replace(state, message_ids=list(message_ids))
        return msgspec.structs.replace(
            session,
            client_id=self.client_id,
            hlc=now,
            updated_at=now,
            vv=vv_bump(session.vv, self.client_id),
            state=state,
            **fields,
        )

    def message(self, session_id: str, text: str = "hello", *, id: str | None = None) -> Message:
        return Message(
            id=id or uuid7(),
            session_id=session_id,
            role="user",
            content=[{"type": "text", "text": text}],
            **self._base(),
        )

    def checkpoint(
        self, session_id: str, *, parent_id: str | None = None, appended: Iterable[str] = ()
    ) -> Checkpoint:
        return Checkpoint(
            id=uuid7(),
            session_id=session_id,
            parent_id=parent_id,
            turn_id=uuid7(),
            appended=list(appended),
            **self._base(),
        )

    def event(self, session_id: str, type: str = "message.added", **payload: Any) -> Event:
        """An event as a device writes it: a provisional place the server will replace."""
        return Event(
            id=uuid7(),
            session_id=session_id,
            type=type,
            payload=payload,
            sequence_number=99,
            prev_hash="provisional",
            row_hash="provisional",
            **self._base(),
        )

    def audit(self, session_id: str) -> AuditRow:
        """An audit row on this device's chain, after the last one made here."""
        draft = AuditRow(
            id=uuid7(),
            session_id=session_id,
            turn_id=uuid7(),
            stage_id="main",
            seq_within_turn=0,
            provider="scripted",
            model="scripted-1",
            outcome=Outcome(status="ok"),
            **self._base(),
        )
        seq, prev = self.audit_head
        row = chain_audit(draft, prev, seq + 1)
        self.audit_head = (row.sequence_number, row.row_hash)
        return row

    def artifact(self, session_id: str, update: bytes = b"\x00\x01") -> ArtifactUpdate:
        return ArtifactUpdate(
            id=uuid7(),
            artifact_id=uuid7(),
            session_id=session_id,
            update=update,
            **self._base(),
        )

    def one_of_each(self, title: str = "t") -> list[Record]:
        """A new session, then one record of every other kind in it, in push order."""
        session = self.session(title=title)
        return [
            session,
            self.message(session.id),
            self.checkpoint(session.id),
            self.event(session.id),
            self.audit(session.id),
            self.artifact(session.id),
        ]
