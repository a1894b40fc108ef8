"""Receipts: what every mutating call returns, so callers can branch on it, log it, test it.

Every receipt the client returns is defined (or, for the wire's ``ConflictReceipt``,
re-exported) here: ``from pleach_client.receipts import OutboxFlushReceipt``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.messages import ConflictReceipt

from .interrupts import ApprovalDecision, DecisionSource
from .jobs import Job, JobStatus, Runner


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
    subagent_calls: int = 0
    """Of ``calls``, those its subagents made (rows with a ``subagent_depth``)."""
    subagent_cost_usd: float | None = 0.0


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
    subagent_calls: int = 0
    """Of ``calls``, those subagents made; a session's rollup includes its subagents' rows
    (each under the top-level turn it was spent for)."""
    subagent_cost_usd: float | None = 0.0


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


class ObserverUnregisterReceipt(msgspec.Struct, kw_only=True):
    """What ``rt.observer_router.unregister`` did: ``removed`` the observer now, and whether
    the registration ``was_registered`` at all (False for an id this router never gave)."""

    registration_id: str
    removed: bool
    was_registered: bool


class CommitReceipt(msgspec.Struct, kw_only=True):
    """``client_seqs`` are the outbox sequence numbers given to the batch's records, in order."""

    client_seqs: list[int]
    records: int


class JobReceipt(msgspec.Struct, kw_only=True):
    """What ``rt.tasks.start_job`` did: the job is queued (committed, syncing) and runs on
    this device (``runner``: ``local`` handler or the host's ``endpoint``)."""

    job_id: str
    session_id: str
    name: str
    runner: Runner
    status: JobStatus
    deadline_ms: int | None
    event_id: str


class JobUpdateReceipt(msgspec.Struct, kw_only=True):
    """What a lifecycle call (``complete_job``, ``fail_job``, ``report_progress``,
    ``cancel_job``) did. ``accepted``: this call's word is in force (it wrote
    ``event_ids``). ``final``: the job is over (``status``). On a device that does not run
    the job, ``cancel_job`` writes a request (``accepted``, not yet final): the owner
    applies it unless the job finished first. A call on a job that was already over is not
    accepted and writes nothing."""

    job_id: str
    session_id: str
    accepted: bool
    final: bool
    status: JobStatus
    event_ids: list[str] = []
    job: Job | None = None


class JobsWaitReceipt(msgspec.Struct, kw_only=True):
    """What ``rt.tasks.wait_for_jobs`` saw: the jobs waited on as they stand, and whether
    they are all over (``done``) or the wait ended first (``timed_out``, ``aborted``)."""

    session_id: str
    jobs: list[Job]
    done: bool
    timed_out: bool = False
    aborted: bool = False


class SubagentResult(msgspec.Struct, kw_only=True):
    """What a subagent did: its session (``subagent_id``), its turn and outcome, its final
    ``text`` (what the parent turn's tool result says), and its tokens and cost."""

    subagent_id: str
    parent_session_id: str
    parent_turn_id: str | None
    depth: int
    turn_id: str
    outcome: str
    text: str
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = 0.0
    provider_calls: int = 0
