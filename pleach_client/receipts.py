"""Receipts: what every mutating call returns, so callers can branch on it, log it, test it."""

from __future__ import annotations

from typing import Literal

import msgspec


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
