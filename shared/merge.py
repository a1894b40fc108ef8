"""Merge rules for synced records, pure.

Sessions merge by version vector; concurrent versions are settled by last-writer-wins on the
HLC ``updated_at`` (ties broken by ``client_id``), and the caller keeps the loser as a fork.
Immutable kinds (messages, checkpoints, events, audit rows, artifact updates) merge by union.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from .clock import Order, vv_compare, vv_merge
from .records import Session, SessionState

Side = Literal["local", "remote"]

# The fields of a session whose divergence is reported, as dotted paths.
_COMPARED_PATHS = (
    "title",
    "provider",
    "model",
    "tools",
    "head_checkpoint_id",
    "deleted",
    "state.message_ids",
    "state.pending_tool_calls",
    "state.artifacts",
    "state.jobs",
    "thinking_budget",
)


class ConflictedPath(msgspec.Struct, kw_only=True):
    path: str
    local_value: Any
    remote_value: Any
    chosen_side: Side


class Resolution(msgspec.Struct, kw_only=True):
    """The outcome of comparing two versions of one session.

    ``order`` is how local relates to remote. ``winner`` is the side to keep on the session id;
    when ``concurrent`` is true the other side must be kept as a fork. ``merged_vv`` dominates
    or equals both inputs.
    """

    order: Order
    winner: Side
    concurrent: bool
    merged_vv: dict[str, int]
    conflicted_paths: list[ConflictedPath] = []


def _get(session: Session, path: str) -> Any:
    value: Any = session
    for part in path.split("."):
        value = getattr(value, part)
    return msgspec.to_builtins(value)


def diverged_paths(local: Session, remote: Session, chosen: Side) -> list[ConflictedPath]:
    """Every compared field whose values differ, with the side that was kept."""
    out = []
    for path in _COMPARED_PATHS:
        lv, rv = _get(local, path), _get(remote, path)
        if lv != rv:
            out.append(
                ConflictedPath(path=path, local_value=lv, remote_value=rv, chosen_side=chosen)
            )
    return out


def lww_key(session: Session) -> tuple[str, str]:
    return (session.updated_at, session.client_id)


def resolve_conflicts(local: Session, remote: Session) -> Resolution:
    """Decide which version of a session wins; pure, so both sides reach the same answer."""
    if local.id != remote.id:
        raise ValueError("resolve_conflicts compares two versions of the same session")
    order = vv_compare(local.vv, remote.vv)
    merged = vv_merge(local.vv, remote.vv)
    if order is Order.CONCURRENT:
        winner: Side = "local" if lww_key(local) > lww_key(remote) else "remote"
        return Resolution(
            order=order,
            winner=winner,
            concurrent=True,
            merged_vv=merged,
            conflicted_paths=diverged_paths(local, remote, winner),
        )
    # Ordered versions: the dominating side wins outright; equal vectors keep the remote.
    winner = "local" if order is Order.DOMINATES else "remote"
    return Resolution(order=order, winner=winner, concurrent=False, merged_vv=merged)


def kept_beside_delete(live: Session, tombstone: Session) -> bool:
    """Whether ``live``, a version of a session that loses to ``tombstone``, is kept as a fork.

    The server keeps it as a new session (``pleach_server.store.apply``); a device that holds
    it does not take that tombstone over it, so that its push reaches the server and the
    tombstone the server writes then (one that includes it) comes back with the kept session
    (``pleach_client.syncplan.decide_session``).

    Delete wins over a concurrent edit, whose content goes with the session. But a conflict
    resolution moves content between a session and its fork (each takes copies of the other's
    messages, ``SessionState.resolved`` marks the version): a delete that never saw the resolve
    would take messages that, as the deleting device knew them, were in another, live session.
    So a marked live version is kept when the tombstone's vector is at or below the resolving
    device's number before the resolve, and the two are concurrent (a version built on the
    delete is a revival: never kept).
    """
    return (
        tombstone.deleted
        and not live.deleted
        and any(tombstone.vv.get(device, 0) <= n for device, n in live.state.resolved.items())
        and vv_compare(live.vv, tombstone.vv) is Order.CONCURRENT
    )


def unmarked(state: SessionState) -> SessionState:
    """``state`` for a session made from another one (a fork of any kind): a resolve's mark
    counts in the vector of the session it was written in, not in the new one's."""
    return msgspec.structs.replace(state, resolved={}) if state.resolved else state
