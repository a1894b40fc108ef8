"""A session's log folded into its transient state, and the fold kept between resumes.

``hydrate`` folds a session's event log into the state a resumed ``SessionHandle`` carries
(``hydrated``: turn and tool tallies, interrupts, jobs, subagents). ``fold_log`` folds a part
of a log on from what the part before it folded to (``LogFold``), which is how a resume avoids
reading a long log again: the store keeps the last fold under the key of the log it was folded
from (``StorageAdapter.keep_hydration``; ``HydrationKey``: the log's size and its last event's
place, whose hash covers every event before it), and ``load_hydration``

- uses it as it is when the log is still that log (a resume after a resume: one row read);
- folds only the events after it when the log still begins with that log, checked by the key
  of the log up to the kept fold's last place (a resume after a few turns);
- folds the whole log otherwise (the first resume after a pull, a rebased log, a fold of
  another version, a kept row that does not read), as a resume always did;

and keeps what it folded, unless the log changed while it was read (then it folds the whole
log again from one read, and keeps nothing). Deciding is ``next_step``, a pure function.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Final, Literal

import msgspec

from shared.errors import StorageError
from shared.records import Event

from .interrupts import INTERRUPT_EVENTS, Interrupt, interrupt_states
from .jobs import JOB_EVENTS, Job, job_states
from .store.base import HydrationKey, KeptHydration, StorageAdapter
from .subagents import SUBAGENT_EVENTS, SubagentRun, subagent_runs

__all__ = [
    "HYDRATED_EVENTS",
    "HYDRATION_VERSION",
    "TALLIED_EVENTS",
    "HydrationStep",
    "LogFold",
    "fold_log",
    "hydrate",
    "hydrated",
    "kept_fold",
    "load_hydration",
    "next_step",
]

log = logging.getLogger("pleach.runtime")


TALLIED_EVENTS: Final = frozenset(
    {
        "turn.complete",
        "error",
        "tool.completed",
        "tool.failed",
        "checkpoint.rollback",
        "sync.conflict",
    }
)
"""The types ``hydrate`` counts by type and payload alone: one a turn at least, so a resume
reads only those two fields of them (``StorageAdapter.hydration_log``)."""
HYDRATED_EVENTS: Final = TALLIED_EVENTS | INTERRUPT_EVENTS | JOB_EVENTS | SUBAGENT_EVENTS
"""The event types ``hydrate`` reads; it skips every other."""


class LogFold(msgspec.Struct, kw_only=True):
    """A session's log folded so far (``fold_log``): what the fold carries from one event to
    the next, so a later part of the log folds on from it. ``hydrated`` gives the state
    ``hydrate`` returns. Kept by the store between resumes (``SessionsFacet.resume``) as
    msgpack, under ``HYDRATION_VERSION``."""

    turns: int = 0
    aborted_turns: int = 0
    errors: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    last_outcome: Any = None
    rollbacks: int = 0
    conflicts: list[Any] = []
    interrupts: dict[str, Interrupt] = {}
    jobs: dict[str, Job] = {}
    subagents: dict[str, SubagentRun] = {}


HYDRATION_VERSION: Final = 1
"""The version of ``LogFold`` a store keeps: bump it when the fold reads the log otherwise
(a new type counted, a field added), and every kept fold is folded again from the log."""


def fold_log(
    events: Iterable[Event],
    tallies: Iterable[tuple[str, dict[str, Any]]] | None = None,
    start: LogFold | None = None,
) -> LogFold:
    """Fold a part of a session's log, in chain order, on from ``start`` (what the log
    before it folded to: taken over and changed) or from nothing.

    ``tallies``: the ``(type, payload)`` of the part's events of ``TALLIED_EVENTS``, in log
    order, when ``events`` leaves those out (as resume reads them); by default they are
    taken from ``events``. Folding a log in two parts gives what folding it whole does.
    """
    fold = LogFold() if start is None else start
    events = list(events)
    if tallies is None:
        tallies = [(ev.type, ev.payload) for ev in events if ev.type in TALLIED_EVENTS]
    for kind, payload in tallies:
        match kind:
            case "turn.complete":
                fold.turns += 1
                fold.last_outcome = payload.get("outcome")
                if payload.get("outcome") == "user-aborted":
                    fold.aborted_turns += 1
            case "error":
                fold.errors += 1
            case "tool.completed":
                fold.tool_calls += 1
            case "tool.failed":
                fold.tool_calls += 1
                fold.tool_failures += 1
            case "checkpoint.rollback":
                fold.rollbacks += 1
            case "sync.conflict":
                fold.conflicts.append(payload.get("conflict_id"))
    fold.interrupts = interrupt_states(events, fold.interrupts)
    fold.jobs = job_states(events, fold.jobs)
    fold.subagents = subagent_runs(events, fold.subagents)
    return fold


def hydrated(fold: LogFold) -> dict[str, Any]:
    """The transient card-lifecycle state of a folded log (``hydrate``)."""
    return {
        "turns": fold.turns,
        "aborted_turns": fold.aborted_turns,
        "errors": fold.errors,
        "tool_calls": fold.tool_calls,
        "tool_failures": fold.tool_failures,
        "last_outcome": fold.last_outcome,
        "rollbacks": fold.rollbacks,
        "conflicts": list(fold.conflicts),
        "interrupts": [msgspec.to_builtins(i) for i in fold.interrupts.values()],
        "jobs": [msgspec.to_builtins(j) for j in fold.jobs.values()],
        "subagents": [msgspec.to_builtins(r) for r in fold.subagents.values()],
    }


def hydrate(
    events: list[Event], tallies: list[tuple[str, dict[str, Any]]] | None = None
) -> dict[str, Any]:
    """Fold the event log into transient card-lifecycle state (never stored on the row).

    ``tallies``: the ``(type, payload)`` of the log's events of ``TALLIED_EVENTS``, in log
    order, when ``events`` leaves those out (as resume reads them); by default they are taken
    from ``events``.

    ``interrupts`` lists the session's interrupts (``Interrupt`` as plain data): the
    resolved ones with their decision, who made it and how, and any still waiting. ``jobs``
    lists its background jobs (``Job``) and ``subagents`` the subagents it started
    (``SubagentRun``), whichever device ran them.
    """
    return hydrated(fold_log(events, tallies))


HydrationStep = Literal["kept", "tail", "whole"]
"""How ``load_hydration`` came to the state: the kept fold as it was, the kept fold and the
events after it, or the whole log."""
_NO_LOG: Final[HydrationKey] = (0, 0, "")
_FOLD_DECODER: Final = msgspec.msgpack.Decoder(LogFold)
_FOLD_ENCODER: Final = msgspec.msgpack.Encoder()


def kept_fold(kept: KeptHydration | None) -> LogFold | None:
    """The fold a store kept, or None: none kept, one of another version, or bytes that do
    not read as one (a corrupt row, which the next fold replaces)."""
    if kept is None or kept.version != HYDRATION_VERSION:
        return None
    try:
        return _FOLD_DECODER.decode(kept.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("the kept fold of a session's log does not read (%s): folding it again", exc)
        return None


def next_step(kept: HydrationKey | None, key: HydrationKey) -> HydrationStep:
    """How to fold the log whose key is ``key``, given a fold kept of the log whose key is
    ``kept`` (None: no fold to use). ``"kept"``: it is that log. ``"tail"``: the kept log may
    be a beginning of it (it holds fewer events and ends at an earlier place), which the
    caller checks with the key of the log up to that place before it folds the rest on.
    ``"whole"``: anything else."""
    if kept is None or kept == _NO_LOG:
        return "whole"
    if kept == key:
        return "kept"
    if kept[0] < key[0] and kept[1] < key[1]:
        return "tail"
    return "whole"


async def load_hydration(
    store: StorageAdapter, session_id: str
) -> tuple[dict[str, Any], HydrationStep]:
    """The session's folded log (``hydrated``) and how it was come to (module docstring);
    what was folded is kept for the next resume. A failure to keep it is logged: the state is
    right either way."""
    kept = await store.kept_hydration(session_id)
    key = await store.hydration_key(session_id)
    start = kept_fold(kept)
    step = next_step(None if kept is None or start is None else kept.key, key)
    if step == "kept" and start is not None:
        return hydrated(start), step
    if (
        step == "tail"
        and kept is not None
        and await store.hydration_key(session_id, upto=kept.key[1]) == kept.key
    ):
        tallies, events = await store.hydration_log(
            session_id,
            TALLIED_EVENTS,
            HYDRATED_EVENTS - TALLIED_EVENTS,
            from_sequence=kept.key[1] + 1,
        )
        fold = fold_log(events, tallies, start)
    else:
        step = "whole"
        tallies, events = await store.hydration_log(
            session_id, TALLIED_EVENTS, HYDRATED_EVENTS - TALLIED_EVENTS
        )
        fold = fold_log(events, tallies)
    if await store.hydration_key(session_id) != key:
        # The log changed while it was read (another writer): one read of it, nothing kept.
        tallies, events = await store.hydration_log(
            session_id, TALLIED_EVENTS, HYDRATED_EVENTS - TALLIED_EVENTS
        )
        return hydrate(events, tallies), "whole"
    state = hydrated(fold)
    try:
        body = _FOLD_ENCODER.encode(fold)
        await store.keep_hydration(session_id, KeptHydration(key, HYDRATION_VERSION, body))
    except StorageError as exc:
        log.warning("the fold of session %s's log was not kept: %s", session_id, exc)
    return state, step
