"""The synced record kinds, as msgspec Structs, and their registry.

Every record carries its tenant (``org_id``, ``user_id``), its origin ``client_id`` and an
``hlc`` stamp. The six kinds travel in one tagged union, ``Record``; the tag is the class name.
New fields get defaults and go at the end: never reorder fields (old peers must still decode).

``RECORD_KINDS`` says, per kind, how it merges and what it hangs off; code that treats kinds
differently asks it (``kind_of(record)``, ``kind_info(name)``) instead of listing the kinds.
A new kind is a Struct here, a member of ``Record`` and ``RecordKind``, an entry in
``RECORD_KINDS``, and the tables that store it.

Records are plain data (text, numbers, lists and dicts of JSON, other records), never part of
a reference cycle, so their Structs are made with ``gc=False``: the collector does not track
them. A long read makes tens of thousands of them at once (a transcript, a pulled page), and
tracked, each one counted towards the next collection, and in a process holding many objects
each full collection walked them all (catch-up about a tenth faster, resume about 5%).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import msgspec

JSON = Any

OutcomeStatus = Literal["ok", "user-aborted", "provider-error", "tool-error"]
Role = Literal["user", "assistant"]


class SessionState(msgspec.Struct, kw_only=True, gc=False, omit_defaults=True):
    """The durable, synced state of a session (the reference's SessionState)."""

    message_ids: list[str] = []
    pending_tool_calls: list[dict[str, JSON]] = []
    artifacts: list[str] = []
    jobs: list[dict[str, JSON]] = []
    resolved: dict[str, int] = {}
    """Set by a conflict resolution that moved the other side's content into this session:
    ``{resolving device: its vector entry of the session before the resolve}``. A delete that
    never saw the resolve (its vector's entry for that device at or below the number) does not
    take that content: the server keeps the version as a fork. Cleared in every session made
    from another one (a fork's vector counts anew)."""
    kept_from: str | None = None
    """Set by the server on a session it keeps beside a delete
    (``shared.merge.kept_beside_delete``): the deleted session whose content it names by
    id. A device that took it may write a version naming that content after the resolving
    device gave it copies of its own, so while it lives the server keeps all of that
    session's content (and that of the deleted sessions up its line), as for a live conflict
    fork. A conflict fork of it keeps the mark; a user's fork (which holds copies) does not;
    a version that drops it (a device of an older release) is stored with it."""


class Session(msgspec.Struct, kw_only=True, gc=False, tag=True, tag_field="record_kind"):
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
    thinking_budget: int | None = None
    """Tokens the model may think with at each call (extended thinking), None for none."""


class Message(msgspec.Struct, kw_only=True, gc=False, tag=True, tag_field="record_kind"):
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


class Checkpoint(msgspec.Struct, kw_only=True, gc=False, tag=True, tag_field="record_kind"):
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


class Event(msgspec.Struct, kw_only=True, gc=False, tag=True, tag_field="record_kind"):
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


class Usage(msgspec.Struct, kw_only=True, gc=False):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_estimated: bool = False


class Outcome(msgspec.Struct, kw_only=True, gc=False):
    status: OutcomeStatus
    code: str | None = None
    message: str | None = None


class AuditRow(msgspec.Struct, kw_only=True, gc=False, tag=True, tag_field="record_kind"):
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


class ArtifactUpdate(msgspec.Struct, kw_only=True, gc=False, tag=True, tag_field="record_kind"):
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


class Change(msgspec.Struct, kw_only=True, gc=False):
    """One outbox entry on the wire: a record and the device-monotonic ``client_seq``."""

    client_seq: int
    record: Record


class FeedChange(msgspec.Struct, kw_only=True, gc=False):
    """One entry of the server's feed: a record at its ``cursor``."""

    cursor: int
    record: Record


MergeRule = Literal["versioned", "immutable", "append-only"]
"""How copies of one record id meet: ``versioned`` rows are replaced by dominating versions
(version vectors; concurrent ones are settled); ``immutable`` records merge by union of ids;
``append-only`` records also merge by union of ids and are never removed, not even when their
session is deleted."""


@dataclass(frozen=True, slots=True)
class RecordKindInfo:
    """What the stores need to know about one record kind (see ``RECORD_KINDS``)."""

    name: RecordKind
    """The kind's name: its class name and its wire tag (``record_kind`` field)."""
    cls: type[Record]
    merge: MergeRule
    session_field: str | None
    """The field naming the session the record belongs to; None for a session itself."""
    required_ids: tuple[str, ...]
    """String fields that must be non-empty for the record to be valid (``id`` first)."""
    deleted_with_session: bool
    """Removed when its session is deleted (tombstoned): the session's content."""
    server_placed: bool
    """The server gives it its canonical place (``sequence_number``, hash chain) per session."""
    by_reference: bool
    """A device replaces its stored copy in place (a newer version, a canonical place). (A
    device's outbox refers to every kind by id, so a queued row sends the stored copy.)"""

    def session_of(self, record: Record) -> str | None:
        """The id of the session ``record`` belongs to, or None (a session row)."""
        if self.session_field is None:
            return None
        value = getattr(record, self.session_field)
        return value if isinstance(value, str) else None


def _info(
    cls: type[Record],
    merge: MergeRule,
    *,
    session_field: str | None = "session_id",
    extra_ids: tuple[str, ...] = (),
    deleted_with_session: bool = False,
    server_placed: bool = False,
    by_reference: bool = False,
) -> RecordKindInfo:
    name: RecordKind = cls.__name__  # type: ignore[assignment]
    ids = ("id",) + ((session_field,) if session_field else ()) + extra_ids
    return RecordKindInfo(
        name=name,
        cls=cls,
        merge=merge,
        session_field=session_field,
        required_ids=ids,
        deleted_with_session=deleted_with_session,
        server_placed=server_placed,
        by_reference=by_reference,
    )


RECORD_KINDS: Mapping[str, RecordKindInfo] = MappingProxyType(
    {
        info.name: info
        for info in (
            _info(Session, "versioned", session_field=None, by_reference=True),
            _info(Message, "immutable", deleted_with_session=True),
            _info(Checkpoint, "immutable", deleted_with_session=True),
            _info(Event, "append-only", server_placed=True, by_reference=True),
            _info(AuditRow, "append-only"),
            _info(
                ArtifactUpdate,
                "immutable",
                extra_ids=("artifact_id",),
                deleted_with_session=True,
            ),
        )
    }
)
"""Every record kind by name, in the order of the ``Record`` union."""

_BY_CLASS: dict[type, RecordKindInfo] = {info.cls: info for info in RECORD_KINDS.values()}
"""(Private, never changed: a plain dict, read on every record's every rule.)"""

CASCADE_KINDS: tuple[RecordKind, ...] = tuple(
    info.name for info in RECORD_KINDS.values() if info.deleted_with_session
)
"""The kinds a session's deletion removes with it."""


def kind_of(record: Record) -> RecordKindInfo:
    """The registry entry of ``record``'s kind; ``TypeError`` for anything not a record."""
    info = _BY_CLASS.get(type(record))
    if info is None:
        raise TypeError(f"not a record: {type(record).__name__}")
    return info


def kind_info(name: str) -> RecordKindInfo:
    """The registry entry of the kind called ``name``; ``KeyError`` for an unknown name."""
    try:
        return RECORD_KINDS[name]
    except KeyError:
        raise KeyError(f"unknown record kind {name!r}") from None


def record_kind(record: Record) -> RecordKind:
    """The kind name of ``record`` (its tag)."""
    return kind_of(record).name


def session_of(record: Record) -> str | None:
    """The id of the session ``record`` belongs to; None for a session row."""
    return kind_of(record).session_of(record)


_ENCODER = msgspec.msgpack.Encoder()
_RECORD_DECODER: msgspec.msgpack.Decoder[Record] = msgspec.msgpack.Decoder(Record)


def encode_record(record: Record) -> bytes:
    return _ENCODER.encode(record)


def decode_record(data: bytes | memoryview) -> Record:
    """Decode bytes made by ``encode_record``; raises ``msgspec.DecodeError`` when corrupt."""
    return _RECORD_DECODER.decode(data)
