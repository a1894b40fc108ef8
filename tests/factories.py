"""Small factories for synced records, with sensible defaults; any field can be overridden.

Defaults: tenant ``org``/``user``, device ``dev-a``, ids from ``uuid7`` and ``hlc`` stamps
from one ``HybridClock`` per client id (so stamps of one device always increase). Pass the
parent ids (``session_id``...) to tie records together; otherwise each gets a fresh one.

    session = make_session(title="plane")
    message = make_message(session_id=session.id, role="assistant")
"""

from __future__ import annotations

from typing import Any

from pleach_client.store.sqlite import IdLayout, SQLiteAdapter
from shared.clock import HybridClock
from shared.ids import uuid7
from shared.records import (
    ArtifactUpdate,
    AuditRow,
    Checkpoint,
    Event,
    Message,
    Outcome,
    Session,
    Usage,
)

__all__ = [
    "CLIENT",
    "ORG",
    "USER",
    "clock_for",
    "log_event",
    "make_artifact_update",
    "make_audit",
    "make_checkpoint",
    "make_event",
    "make_message",
    "make_session",
    "small_id_blocks",
]

ORG = "org"
USER = "user"
CLIENT = "dev-a"

_clocks: dict[str, HybridClock] = {}


def clock_for(client_id: str = CLIENT) -> HybridClock:
    """The shared clock of one device id (created on first use)."""
    clock = _clocks.get(client_id)
    if clock is None:
        clock = _clocks[client_id] = HybridClock(client_id)
    return clock


def _base(overrides: dict[str, Any]) -> dict[str, Any]:
    """Tenant, device and a fresh hlc (from that device's clock) unless overridden."""
    client_id = overrides.get("client_id", CLIENT)
    fields: dict[str, Any] = {"id": uuid7(), "org_id": ORG, "user_id": USER}
    fields["client_id"] = client_id
    fields["hlc"] = overrides["hlc"] if "hlc" in overrides else clock_for(client_id).now()
    return fields


def make_session(**overrides: Any) -> Session:
    fields = _base(overrides)
    fields.update(
        provider="scripted",
        model="scripted-1",
        created_at=fields["hlc"],
        updated_at=fields["hlc"],
        vv={fields["client_id"]: 1},
        title="",
    )
    fields.update(overrides)
    return Session(**fields)


def make_message(**overrides: Any) -> Message:
    fields = _base(overrides)
    fields.update(
        session_id=uuid7(),
        role="user",
        content=[{"type": "text", "text": "hello"}],
    )
    fields.update(overrides)
    return Message(**fields)


def make_checkpoint(**overrides: Any) -> Checkpoint:
    fields = _base(overrides)
    fields.update(session_id=uuid7(), parent_id=None, turn_id=uuid7())
    fields.update(overrides)
    return Checkpoint(**fields)


def log_event(client: str, kind: str, payload: dict[str, Any], n: int = 0) -> Event:
    """An event of session ``s`` written by ``client`` (the pure folds over a session's log:
    interrupts, jobs), its HLC ordered by ``n``."""
    return Event(
        id=uuid7(),
        session_id="s",
        org_id="o",
        user_id="u",
        client_id=client,
        hlc=f"{n:08d}",
        type=kind,
        payload=payload,
    )


def make_event(**overrides: Any) -> Event:
    fields = _base(overrides)
    fields.update(session_id=uuid7(), type="message.added", payload={})
    fields.update(overrides)
    return Event(**fields)


def make_audit(**overrides: Any) -> AuditRow:
    fields = _base(overrides)
    fields.update(
        session_id=uuid7(),
        turn_id=uuid7(),
        stage_id="main",
        seq_within_turn=0,
        provider="scripted",
        model="scripted-1",
        outcome=Outcome(status="ok"),
        usage=Usage(input_tokens=10, output_tokens=5),
        request_id="req_" + fields["id"][-12:],
        latency_ms=12.5,
    )
    fields.update(overrides)
    return AuditRow(**fields)


def make_artifact_update(**overrides: Any) -> ArtifactUpdate:
    fields = _base(overrides)
    fields.update(artifact_id=uuid7(), session_id=uuid7(), update=b"\x00\x00")
    fields.update(overrides)
    return ArtifactUpdate(**fields)


def small_id_blocks(adapter: SQLiteAdapter) -> SQLiteAdapter:
    """``adapter``, keeping every session's message ids in blocks of two ids (schema 7; by
    default only a long session's, in blocks of 128): every read and write of a session row
    takes that path. Before it is opened, for a new file."""
    adapter._id_layout = IdLayout(inline=0, block=2)
    return adapter


def count_hops(conn: Any) -> list[int]:
    """A one-item list counting every call an aiosqlite connection (a store's ``_conn`` or
    ``_writer``) hands to its thread from now on (reset it by assigning to its item)."""
    assert conn is not None
    hops = [0]
    execute = conn._execute

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        hops[0] += 1
        return await execute(fn, *args, **kwargs)

    conn._execute = counted
    return hops
