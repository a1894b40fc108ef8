"""The synced record kinds, as msgspec Structs.

Every record carries its tenant (``org_id``, ``user_id``), its origin ``client_id`` and an
``hlc`` stamp. The six kinds travel in one tagged union, ``Record``; the tag is the class name.
New fields get defaults and go at the end: never reorder fields (old peers must still decode).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

JSON = Any

OutcomeStatus = Literal["ok", "user-aborted", "provider-error", "tool-error"]
Role = Literal["user", "assistant"]


class SessionState(msgspec.Struct, kw_only=True):
    """The durable, synced state of a session (the reference's SessionState)."""

    message_ids: list[str] = []
    pending_tool_calls: list[dict[str, JSON]] = []
    artifacts: list[str] = []
    jobs: list[dict[str, JSON]] = []


class Session(msgspec.Struct, kw_only=True, tag=True, tag_field="record_kind"):
    """A mutable session row. ``updated_at`` is an HLC stamp; ``vv`` its version vector."""

    id: str
    org_id: str
    user_id: str
    client_id: str
    hlc: str
    provider: str
    model: str
    created_at: str
    updated_at: str
    vv: dict[str, int]
    title: str = ""
    state: SessionState = msgspec.field(default_factory=SessionState)
    tools: list[str] = []
    head_checkpoint_id: str | None = None
    forked_from: str | None = None
    forked_at_checkpoint: str | None = None
    conflict_id: str | None = None
    conflict_loser_side: Literal["local", "remote"] | None = None
    deleted: bool = False


class Message(msgspec.Struct, kw_only=True, tag=True, tag_field="record_kind"):
    """One chat message, immutable, stored once and referred to by id."""

    id: str
    session_id: str
    org_id: str
    user_id: str
    client_id: str
    hlc: str
    role: Role
    content: list[dict[str, JSON]]
    turn_id: str | None = None
    aborted: bool = False
    synthetic: bool = False


class Checkpoint(msgspec.Struct, kw_only=True, tag=True, tag_field="record_kind"):
    """What one turn (or rollback, fork) changed: a parent pointer and a delta.

    ``appended`` are message ids added after the parent's list; ``truncate_to`` (when set)
    first cuts the parent's list to that length (rollback). ``snapshot`` holds the whole
    message id list every so often, so rebuilding never walks far.
    """

    id: str
    session_id: str
    org_id: str
    user_id: str
    client_id: str
    hlc: str
    parent_id: str | None
    turn_id: str | None
    kind: Literal["turn", "aborted", "rollback", "fork", "resolve"] = "turn"
    appended: list[str] = []
    truncate_to: int | None = None
    state_set: dict[str, JSON] = {}
    snapshot: list[str] | None = None
    depth: int = 0


class Event(msgspec.Struct, kw_only=True, tag=True, tag_field="record_kind"):
    """An append-only event-log row, hash-chained per session.

    ``canonical`` rows carry the server's ``sequence_number``; the rest are a provisional tail
    chained on from the last canonical row, rebased when the server places them.
    """

    id: str
    session_id: str
    org_id: str
    user_id: str
    client_id: str
    hlc: str
    type: str
    payload: dict[str, JSON] = {}
    sequence_number: int = 0
    prev_hash: str = ""
    row_hash: str = ""
    canonical: bool = False


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_estimated: bool = False


class Outcome(msgspec.Struct, kw_only=True):
    status: OutcomeStatus
    code: str | None = None
    message: str | None = None


class AuditRow(msgspec.Struct, kw_only=True, tag=True, tag_field="record_kind"):
    """One provider call in the append-only ledger, chained per (tenant, origin device).

    ``payload_digest`` covers the row's content (see ``shared.hashchain``); a GDPR soft delete
    clears the identifying fields (``subject_key``, ``request_id``, ``detail``) and sets
    ``redacted``; ``identity_digest`` keeps what they hashed to, so the chain still verifies
    and the rest of the row stays tamper-evident.
    """

    id: str
    org_id: str
    user_id: str
    client_id: str
    hlc: str
    session_id: str
    turn_id: str
    stage_id: str
    seq_within_turn: int
    provider: str
    model: str
    outcome: Outcome
    usage: Usage = msgspec.field(default_factory=Usage)
    parent_turn_id: str | None = None
    subagent_depth: int = 0
    request_id: str | None = None
    latency_ms: float = 0.0
    cost_usd: float | None = None
    subject_key: str | None = None
    detail: dict[str, JSON] = {}
    sequence_number: int = 0
    payload_digest: str = ""
    prev_hash: str = ""
    row_hash: str = ""
    redacted: bool = False
    identity_digest: str = ""


class ArtifactUpdate(msgspec.Struct, kw_only=True, tag=True, tag_field="record_kind"):
    """One pycrdt (Yjs) update to a collaborative artifact document; merge is union."""

    id: str
    artifact_id: str
    session_id: str
    org_id: str
    user_id: str
    client_id: str
    hlc: str
    update: bytes


Record = Session | Message | Checkpoint | Event | AuditRow | ArtifactUpdate
RecordKind = Literal["Session", "Message", "Checkpoint", "Event", "AuditRow", "ArtifactUpdate"]


class Change(msgspec.Struct, kw_only=True):
    """One outbox entry on the wire: a record and the device-monotonic ``client_seq``."""

    client_seq: int
    record: Record


class FeedChange(msgspec.Struct, kw_only=True):
    """One entry of the server's feed: a record at its ``cursor``."""

    cursor: int
    record: Record


def record_kind(record: Record) -> RecordKind:
    kind: RecordKind = type(record).__name__  # type: ignore[assignment]
    return kind


_ENCODER = msgspec.msgpack.Encoder()
_RECORD_DECODER: msgspec.msgpack.Decoder[Record] = msgspec.msgpack.Decoder(Record)


def encode_record(record: Record) -> bytes:
    return _ENCODER.encode(record)


def decode_record(data: bytes) -> Record:
    """Decode bytes made by ``encode_record``; raises ``msgspec.DecodeError`` when corrupt."""
    return _RECORD_DECODER.decode(data)
