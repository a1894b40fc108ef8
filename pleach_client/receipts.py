"""Receipts: what every mutating call returns, so callers can branch on it, log it, test it.

Every receipt the client returns is defined (or, for the wire's ``ConflictReceipt``,
re-exported) here: ``from pleach_client.receipts import OutboxFlushReceipt``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.messages import ConflictReceipt

from .interrupts import ApprovalDecision, DecisionSource


class SessionDeleteReceipt(msgspec.Struct, kw_only=True):
    deleted: bool
    session_id: str
    removed_from_cache: bool
    checkpoints_removed: int = 0


class RollbackReceipt(msgspec.Struct, kw_only=True):
    session_id: str
    checkpoint_id: str
    new_checkpoint_id: str
    messages_before: int
    messages_after: int


class ForkReceipt(msgspec.Struct, kw_only=True):
    session_id: str
    forked_from: str
    checkpoint_id: str | None
    messages: int


class GdprSoftDeleteReceipt(msgspec.Struct, kw_only=True):
    subject_key: str
    rows_redacted: int
    chain_verified: bool


class TurnRollup(msgspec.Struct, kw_only=True):
    turn_id: str
    calls: int
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    cost_usd: float | None
    outcomes: dict[str, int]


class AuditRollup(msgspec.Struct, kw_only=True):
    """Token and cost totals; ``cost_usd`` is None when any call's model had no price."""

    session_id: str | None
    calls: int
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    cost_usd: float | None
    turns: list[TurnRollup]
    outcomes: dict[str, int]


FlushOutcome = Literal["all-flushed", "partial", "all-stuck", "none-pending"]
Side = Literal["local", "remote"]


class FailedEntry(msgspec.Struct, kw_only=True):
    client_seq: int
    code: int | None
    message: str
    attempts: int


class OutboxFlushReceipt(msgspec.Struct, kw_only=True):
    """What a flush did. ``failed_entries`` were dead-lettered or are stuck (with a reason)."""

    outcome: FlushOutcome
    flushed: int
    failed_entries: list[FailedEntry]
    flushed_at: float
    pending_before: int
    pending_after: int
    conflicts: list[ConflictReceipt] = []


class SyncConflictResolveReceipt(msgspec.Struct, kw_only=True):
    resolved: bool
    session_id: str
    conflict_id: str
    resolution: Side
    resolved_at: str
    swapped: bool = False
    fork_session_id: str | None = None


class InterruptResolveReceipt(msgspec.Struct, kw_only=True):
    """What ``rt.interrupts.resolve`` did.

    ``accepted``: this call's decision is the one in force. ``final``: the device whose turn
    waits has applied the decision in force, so it can no longer change. Accepted but not
    final is a proposal from a device that does not run the turn: the first proposal the
    asking device sees wins, so it may still lose (``resolve(..., wait=seconds)`` waits for
    the final word). When not accepted, ``decision``, ``decided_by`` (a client id) and
    ``source`` (``user``, ``timeout``, ``abort``) say what is in force instead.
    ``event_id`` is the event this call wrote (None when it wrote nothing).
    """

    interrupt_id: str
    session_id: str
    accepted: bool
    final: bool
    decision: ApprovalDecision
    decided_by: str
    source: DecisionSource
    event_id: str | None = None
    resolved_at: str = ""


class ArtifactReceipt(msgspec.Struct, kw_only=True):
    artifact_id: str
    session_id: str
    update_id: str | None
    update_bytes: int
    length: int


class CommitReceipt(msgspec.Struct, kw_only=True):
    """``client_seqs`` are the outbox sequence numbers given to the batch's records, in order."""

    client_seqs: list[int]
    records: int
